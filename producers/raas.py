"""The RaaS worker (Rollout-as-a-Service): prompts in, scored trajectory groups out.

A worker is a plain member of the consumer group ``raas.<workflow>`` on
``prompts``: starting one more is scaling out, and a crash is a redelivery, not
a lost prompt. For each prompt it runs the configured workflow on one engine
per policy, writes one TrajectoryGroup per policy to ``trajectories.<policy>``
and a RolloutOutcome to ``outcomes``, and commits the prompt offsets only after
those writes are acknowledged.

The workflow derives each ``group_id`` from (prompt_id, epoch, policy, role)
(:func:`producers.workflows.group_id_for`), so a prompt that is redelivered after
a crash yields groups with the same ids, which the serving stage de-duplicates.

New weights are pulled through the Weight Manager's puller in a thread of its own, beside the rollout,
and handed to the engine between batches (:meth:`RaasWorker.sync_weights`).
Backpressure: it pauses its ``prompts`` partitions while the in-flight groups
(filter and trainer lag on ``trajectories.<policy>`` and ``samples.<policy>``)
exceed ``raas.max_inflight_groups`` (see :meth:`RaasWorker.inflight_groups`) or cannot be counted (the bus does not
answer), or while its weights are more than ``max_staleness`` versions behind the newest announcement. Commands on
``control`` hold it too: ``pause`` / ``resume`` and ``throttle`` (prompts per minute), for every worker of the
workflow or for one (:meth:`RaasWorker.commanded`; ``astraflow control``).

A prompt that does not fit a policy's model (its tokens plus ``sampling.max_new_tokens`` over the model's
``max_position_embeddings``, see :meth:`RaasWorker.oversize`) is not rolled out: it goes to ``deadletter``
with the reason (counted as ``too_long_total`` on ``metrics``), and its offset is committed with the batch. So
does a prompt whose rollout fails, by an error of the workflow or of a tool it calls (a poison prompt: delivered
again, it would fail again): the dead letter names the prompt and the error, it is counted as
``rollout_errors_total``, and the worker goes on. A failed engine call
(:class:`~producers.engine_batcher.EngineCallFailed`) is the engine's failure, not the prompt's: it is raised;
so is an environment server that cannot be reached (:class:`~producers.workflows.ServiceUnavailable`).

Episodes: the worker is an episode scheduler on an asyncio loop. Each polled prompt starts a rollout task
(its G samples are episodes of their own, coroutines of the workflow, :mod:`producers.workflows`), and up
to ``raas.max_episodes`` samples are in flight at once. Engine calls of all episodes are batched
(:class:`~producers.engine_batcher.EngineBatcher`: the HF engine runs one call over every request pending
when it is free; vLLM gets concurrent requests), tool calls (:mod:`producers.search_tool`) and rewards run
beside them, and new weights are loaded between two engine calls without draining the episodes in flight
(each token keeps the version that sampled it). A prompt's groups are written as soon as its samples are
done, in any order; per partition, offsets are committed only up to the lowest prompt still open
(:class:`~producers.prompt_ledger.PromptLedger`), after the writes are flushed.

Stopping (SIGTERM): :meth:`RaasWorker.run` stops within a decode step. The stop event is every engine's
:attr:`~producers.engines.Engine.interrupt`, so a generation in progress is dropped
(:class:`~producers.engines.GenerationInterrupted`; vLLM requests run to their end); the episodes in flight
are cancelled and nothing is written for them; what finished is flushed and per partition only the
offsets below the first prompt not finished are committed: the rest is delivered again, to this group's
next owner.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

from policies.staleness import staleness, too_stale
from producers.config import RaasSection, RolloutPolicyConfig, ToolsConfig
from producers.engine_batcher import EngineBatcher, EngineCallFailed
from producers.engine_sync import EngineSync
from producers.engines import Engine, EngineUpdateError, GenerationInterrupted, SamplingParams
from producers.environments import environment_errors
from producers.hf_engine import HFEngine
from producers.prompt_ledger import PromptLedger
from producers.rewards import reward_errors
from producers.workflows import ServiceUnavailable, Tool, episode_ended, get_workflow, prompt_ids
from topics.bus import Bus, BusError, Record, TopicPartition, connect
from topics.patience import patiently
from topics.codec import encode, headers_for
from topics.deadletter import ValidatingConsumer, send_to_deadletter
from topics.follow import LatestByKey
from topics.liveness import ProgressWatch
from topics.names import TopicNames
from topics.schemas import Control, Metric, Prompt, RolloutOutcome, TrainerProgress, TrajectoryGroup
from weights.models import resolve_model
from weights.puller import Puller, WeightsUnavailable
from weights.store import WeightStore

log = logging.getLogger(__name__)

#: Seconds between two warnings that a policy's groups in flight cannot be counted (the bus does not answer).
UNCOUNTED_WARN_EVERY_S = 30.0
#: While backpressure holds a worker (its rollout is ahead of its trainer), an engine call waits up to this many
#: seconds for every episode of its policy in flight to ask (:meth:`~producers.engine_batcher.EngineBatcher.hold`).
HELD_CALL_WAIT_S = 0.5


def make_engine(policy: str, pc: RolloutPolicyConfig, vllm_url: str | None = None) -> Engine:
    """The inference engine of ``policy`` (its config ``pc``): HFEngine (CPU default); SGLangEngine, which attaches
    to ``sglang.url`` or launches a server on ``sglang.port`` (None: a free port) with ``sglang.launch_args``;
    or VLLMEngine, a client of the server at ``vllm.url``, else at ``vllm_url`` (the one ``astraflow run`` started).

    Raises:
        ValueError: ``engine: vllm`` with neither ``vllm.url`` nor ``vllm_url``.
    """
    if pc.engine == "sglang":
        from producers.sglang_engine import SGLangEngine

        sc = pc.sglang
        return SGLangEngine(resolve_model(pc.model), url=sc.url, port=sc.port, launch_args=tuple(sc.launch_args),
                            startup_timeout_s=sc.startup_timeout_s, timeout_s=sc.timeout_s,
                            bucket_bytes=sc.bucket_bytes, attempts=sc.attempts, pause_mode=sc.pause_mode)
    if pc.engine == "vllm":
        from producers.vllm_engine import VLLMEngine

        url = pc.vllm.url or vllm_url
        if url is None:
            raise ValueError(f"policies.{policy}.vllm.url is not set: a RaaS worker started by hand needs the URL of "
                             "a running server (`astraflow run` starts one and tells its workers)")
        return VLLMEngine(url, resolve_model(pc.model), startup_timeout_s=pc.vllm.startup_timeout_s)
    return HFEngine(resolve_model(pc.model))


@contextlib.contextmanager
def standalone_engine(policy: str, pc: RolloutPolicyConfig, dtype: str, log_dir: Path) -> Iterator[Engine]:
    """The engine of ``policy`` (its config ``pc``) for a process outside ``astraflow run`` (``astraflow eval``):
    :func:`make_engine`'s; for ``engine: vllm`` without ``vllm.url``, a vLLM server of its own as ``astraflow run``
    would start it (the policy's ``vllm`` settings, in ``dtype``, the one its trainer publishes, its log
    ``log_dir/eval-vllm.<policy>.log``), waited for up to ``vllm.startup_timeout_s``. Closed (a started server
    stopped) on exit.

    Raises:
        RuntimeError: the started server did not become healthy (the message carries its log's tail).
    """
    with contextlib.ExitStack() as stack:
        url = None
        if pc.engine == "vllm" and pc.vllm.url is None:
            from producers.vllm_server import VLLMServer

            log_dir.mkdir(parents=True, exist_ok=True)
            server = stack.enter_context(VLLMServer(
                resolve_model(pc.model), log_dir / f"eval-vllm.{policy}.log", dtype=dtype,
                max_model_len=pc.vllm.max_model_len, extra=pc.vllm.args, python=pc.vllm.python,
                port=pc.vllm.port, kv_cache_gib=pc.vllm.kv_cache_gib))
            log.info("started a vLLM server for %s at %s (log %s)", policy, server.url, server.log_path)
            server.wait_healthy(pc.vllm.startup_timeout_s)
            url = server.url
        engine = make_engine(policy, pc, vllm_url=url)
        stack.callback(getattr(engine, "close", lambda: None))  # a launched SGLang server is stopped too
        yield engine


def make_tools(tools: ToolsConfig, search_url: str | None = None) -> dict[str, Tool]:
    """The tools the run's episodes call, by name: the user's own (``Class(**params)`` of each
    :class:`~producers.config.CustomToolConfig`), and ``search`` (:class:`producers.search_tool.SearchTool`) when
    ``tools.search`` is configured, at its ``url``, else at ``search_url`` (the server ``astraflow run`` started).

    Raises:
        ValueError: ``tools.search`` with neither ``url`` nor ``search_url``; a user's tool class refusing its
            options.
    """
    built: dict[str, Tool] = {name: spec.tool_class()(**spec.params()) for name, spec in tools.custom().items()}
    search = tools.search
    if search is None:
        return built
    url = search.url or search_url
    if url is None:
        raise ValueError("tools.search.url is not set: a RaaS worker started by hand needs the URL of a running "
                         "search server (`astraflow run` starts one and tells its workers)")
    from producers.search_tool import SearchTool

    return {**built, "search": SearchTool(url, timeout_s=search.timeout_s, top_k=search.top_k)}


def context_length(model_dir: str | Path) -> int | None:
    """The most positions (prompt plus generated tokens) the model in ``model_dir`` takes: its config's
    ``max_position_embeddings`` (of the text model, for a multimodal config); None when it has none."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_dir).get_text_config(), "max_position_embeddings", None)


def _caused_by(error: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    """Whether ``error``, or an error it was raised from or while handling (its ``__cause__`` / ``__context__``
    chain), is one of ``kinds``."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kinds):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def fresh_per_version(cfg: RaasSection, policy: str) -> int:
    """The fresh groups ``policy``'s trainer takes a version, given RaaS's config section ``cfg``:
    ``round(batch_groups x fresh_fraction)``, at least 1 (the rest of a batch is replayed)."""
    return max(1, round(cfg.policies[policy].batch_groups * cfg.fresh_fraction.get(policy, 1.0)))


class RaasWorker:
    """One rollout worker.

    Args:
        cfg: the worker's section of the run config (:meth:`astraflow.config.RunConfig.raas_section`).
        worker_id: unique among this run's workers, a number or a name (names the producer and the static group member).
        bus: the bus (default: ``connect(cfg.bus, cfg.kafka)``).
        vllm_urls: policy -> the URL of the vLLM server ``astraflow run`` started for it (a policy with
            ``vllm.url`` set uses that).
        search_url: the URL of the search server ``astraflow run`` started (``tools.search.url`` wins).

    Raises:
        KeyError: the workflow or one of its policies is unknown.
        ValueError: an engine or tool whose server has no URL, or ``sampling.max_new_tokens`` that leaves no room
            for a prompt in a policy's context.
    """

    def __init__(self, cfg: RaasSection, worker_id: int | str = 0, bus: Bus | None = None, *,
                 vllm_urls: Mapping[str, str] | None = None, search_url: str | None = None):
        self.cfg, self.id = cfg, f"raas-{worker_id}"
        self.bus = bus or connect(cfg.bus, cfg.kafka)
        self.names = TopicNames(cfg.run)
        self.workflow = get_workflow(cfg.workflow.name, policies=cfg.workflow.roles or None,
                                     **cfg.workflow.options)
        for name in sorted(set(self.workflow.tools) - cfg.tools.names()):  # an environment's own, known once built
            raise ValueError(f"tools.{name}: workflow {cfg.workflow.name!r} calls the tool {name!r}, and the config "
                             f"does not configure it (configured tools: {sorted(cfg.tools.names()) or 'none'})")
        self.policies = sorted(set(self.workflow.policies.values()))
        missing = set(self.policies) - set(cfg.policies)
        if missing:
            raise KeyError(f"workflow {cfg.workflow.name!r} needs policies {sorted(missing)} that the config "
                           f"does not define (policies: {sorted(cfg.policies)})")
        self.engines = {p: make_engine(p, cfg.policies[p], (vllm_urls or {}).get(p)) for p in self.policies}
        self.context = {p: context_length(resolve_model(cfg.policies[p].model)) for p in self.policies}
        for p, positions in self.context.items():
            if positions is not None and cfg.sampling.max_new_tokens >= positions:
                raise ValueError(f"sampling.max_new_tokens={cfg.sampling.max_new_tokens}: policy {p}'s model takes "
                                 f"{positions} positions (prompt plus generated tokens), so no prompt would fit")
        store = WeightStore(cfg.store, cfg.run)
        self.pullers = {p: Puller(store, self.bus, self.names, p) for p in self.policies}
        self.syncs = {p: EngineSync(self.engines[p], self.pullers[p]) for p in self.policies}  # sync_weights uses
        self._pulls: dict[str, threading.Thread] = {}  # policy -> the thread bringing its puller's copy forward
        self._pull_errors: dict[str, Exception] = {}  # policy -> why its last pull failed
        self._sync_failures: dict[str, int] = {}  # policy -> pulls or loads failed in a row (the first one warns)
        self.sampling = SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens,
                                       temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p)
        self.admin = self.bus.admin()
        self.progress = LatestByKey(self.bus, self.names.control, TrainerProgress, client_id=f"{self.id}-progress")
        self.commands = LatestByKey(self.bus, self.names.control, Control, client_id=f"{self.id}-commands")
        self._commands_read = False
        self._last_batch = (0.0, 0)  # (monotonic start, prompts) of the newest batch rolled out, for a throttle
        self.producer = self.bus.producer()
        self.consumer = self.bus.consumer(self.names.raas_group(cfg.workflow.name),
                                          session_timeout_s=cfg.raas.session_timeout_s, client_id=self.id,
                                          instance_id=self.id)
        self.consumer.subscribe([self.names.prompts])
        self.prompts = ValidatingConsumer(self.consumer, self.producer, self.names.deadletter, Prompt)
        #: the liveness rule: a worker that reads no prompt while prompts wait for it, not held, is stalled
        self.liveness = ProgressWatch(self.consumer, self.admin, self.names.prompts,
                                      self.names.raas_group(cfg.workflow.name), self.id, log)
        self.paused_reason = ""
        self.held_by_control = ""  # "pause" or "throttle" while a command on control holds this worker
        self.totals = {"prompts": 0, "groups": 0, "tokens": 0, "too_long": 0, "rollout_errors": 0}
        self._last_metric = 0.0
        self._backpressure_s = 0.0  # seconds held by backpressure since the last metric
        self._uncounted: dict[str, tuple[float, float]] = {}  # policy -> (since, last warned): its in-flight unknown
        self._state_since = time.monotonic()  # when paused_reason / held_by_control were last set
        # the episode scheduler: its loop runs while step() does; tools and rewards block on its own threads
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=64,
                                                                             thread_name_prefix=f"{self.id}-io"))
        self.batchers = {p: EngineBatcher(e, name=f"{self.id}-{p}") for p, e in self.engines.items()}
        self.tools: dict[str, Tool] = make_tools(cfg.tools, search_url)
        self.ledger = PromptLedger()
        # rollout task -> [its prompt's record, its episodes still running (workflows.episode_ended)]
        self.episodes: dict[asyncio.Task, list] = {}
        self._loads: dict[str, tuple[concurrent.futures.Future, int]] = {}  # policy -> (a load on its engine, version)
        self._consumer_paused = False

    # -- weights and backpressure ---------------------------------------------------------
    def sync_weights(self) -> None:
        """Bring each policy's engine towards its newest durable version (announced and in the store),
        without holding rollout up for the transfer, through the policy's
        :class:`~producers.engine_sync.EngineSync` (the contract every engine is updated by).

        A policy's host copy is brought forward (:meth:`~producers.engine_sync.EngineSync.fetch`: download,
        decode, verify) in a thread of its own while this worker rolls out with the weights its engine has; a
        later call hands the changed tensors to the engine (:meth:`~producers.engine_sync.EngineSync.load`) on
        the engine's thread (:meth:`~producers.engine_batcher.EngineBatcher.submit`), so they are loaded between
        two engine calls, under the episodes in flight, and the next fetch starts once they are loaded. An engine
        whose server reads the store itself (vLLM) is told to pull on the engine's thread the same way. Over a
        slow link (a worker in another region) a pull takes seconds of round trips that generation now
        overlaps; the staleness rules (:meth:`pause_reason`) still judge the engine's version, the one rolled
        out. Nothing here waits on the store: the listing that finds the newest durable version waits at most
        a second (:meth:`~weights.puller.Puller.newest_durable`), so a store that hangs leaves rollout
        going on the weights it has, with a warning within
        :attr:`~weights.puller.Puller.STORE_PATIENCE_S` seconds.

        Failures are logged and retried at a later call: the store could not serve the version
        (:class:`WeightsUnavailable`), or the engine could not load it (:class:`EngineUpdateError`; the
        host copy has moved on, and the next call hands its changed tensors to the engine again).
        """
        for p, sync in self.syncs.items():
            sync.puller.poll()
            engine = sync.engine
            if p in self._loads:
                loading, version = self._loads[p]
                if not loading.done():
                    continue  # the engine takes the copy between two calls: the host copy must hold still
                del self._loads[p]
                try:
                    loading.result()
                    failed = self._sync_failures.pop(p, 0)
                    log.info("%s: policy %s now at version %d%s", self.id, p, engine.version,
                             f" (after {failed} failed attempt(s))" if failed else "")
                except (WeightsUnavailable, EngineUpdateError) as e:
                    self._sync_failed(p, e)
            pulling = self._pulls.get(p)
            if pulling is not None:
                if pulling.is_alive():
                    continue  # the host copy is being brought forward: the engine keeps its weights
                del self._pulls[p]
                if p in self._pull_errors:
                    self._sync_failed(p, self._pull_errors.pop(p))
            ready = sync.loadable()
            if ready is not None:
                self._loads[p] = (self.batchers[p].submit(sync.load, ready), ready)
                continue
            newest = sync.newest()
            if newest is None or newest <= max(engine.version, sync.puller.version or 0):
                continue
            if sync.pulls_itself:  # the server reads the store itself, on the engine's thread
                self._loads[p] = (self.batchers[p].submit(sync.load, newest), newest)
                continue
            self._pulls[p] = threading.Thread(target=self._fetch, args=(p, newest), daemon=True,
                                              name=f"{self.id}-pull-{p}")
            self._pulls[p].start()

    def _sync_failed(self, policy: str, error: Exception) -> None:
        """Log that ``policy``'s engine keeps its version because of ``error``: a warning at the first failure of a
        run of them, the retries that fail the same way at debug level (a store outage of a minute made some 20
        identical warnings), and :meth:`sync_weights` says at info level how many failed once a version loads."""
        failed = self._sync_failures[policy] = self._sync_failures.get(policy, 0) + 1
        log.log(logging.WARNING if failed == 1 else logging.DEBUG, "%s: keeping version %d of %s: %s%s", self.id,
                self.syncs[policy].engine.version, policy, error,
                "; retrying, further failures at debug level" if failed == 1 else f" (failure {failed} in a row)")

    def _fetch(self, policy: str, version: int) -> None:
        """The body of a pull thread: bring ``policy``'s host copy to ``version``; a failure is kept for
        :meth:`sync_weights` to log."""
        try:
            self.syncs[policy].fetch(version)
        except Exception as e:  # WeightsUnavailable, or anything unexpected: logged by sync_weights, retried
            self._pull_errors[policy] = e

    def inflight_limit(self, policy: str) -> int:
        """Groups of ``policy`` allowed in flight: ``raas.max_inflight_groups`` when set, else the fresh groups its
        trainer takes in ``max(max_staleness, 1)`` versions, ``round(batch_groups x fresh_fraction)`` a version
        (the rest of a batch is replayed), after which a group produced now would be too stale to train (so that
        groups are not produced only to be dropped)."""
        pc = self.cfg.policies[policy]
        return self.cfg.raas.max_inflight_groups or fresh_per_version(self.cfg, policy) * max(pc.max_staleness, 1)

    def inflight_groups(self, policy: str) -> tuple[int, int | None] | None:
        """Groups of ``policy`` produced but not yet taken by its filters and trainer (records), with the version
        its trainer trains the first of them at (None: not known yet); None when its trainer has finished or waits
        at a barrier for its peers (it holds no rollout back).

        Both shares are committed lags, durable state that every reader sees alike: the filters' on
        ``trajectories.<policy>`` (they commit every transaction) and the trainer's on ``samples.<policy>`` (it
        commits its position after every step; the whole topic while it has committed nothing, a trainer still
        starting). While its trainer reports it is starving (its :class:`TrainerProgress`: its last wait for a batch
        found nothing to train) its share is 0, so offsets it will never read (aborted transactions, transaction
        markers) cannot hold the worker at its limit while the trainer waits for data: backpressure never decides
        progress. The version is the newer of the trainer's progress report and its newest durable weight version.

        Raises:
            BusError: the bus did not answer, or the topics do not exist.
        """
        progress = self.progress.latest.get(f"trainer.{policy}")
        if progress is not None and (progress.finished or progress.at_barrier):
            return None
        total = sum(self.admin.group_lag(self.names.filter_group(policy), self.names.trajectories(policy)).values())
        # a version announced but not stored (a ghost) is not the trainer's: the newest durable one is
        versions = [v for v in (progress.version if progress is not None else None,
                                self.pullers[policy].newest_durable()) if v is not None]
        version = max(versions) if versions else None
        if progress is not None and progress.starving:  # it found nothing to train: nothing of it is in flight
            return total, version
        trainer = sum(self.admin.group_lag(self.names.trainer_group(policy), self.names.samples(policy)).values())
        return total + trainer, version

    def commanded(self) -> tuple[str, str, int | None]:
        """What the operators' and controllers' commands on ``control`` (:class:`~topics.schemas.Control`)
        allow this worker now: ``(the command that holds it: "pause", "throttle" or ''; why, '' when
        nothing holds it; how many prompts it may roll out now, None when no throttle applies)``.

        The commands for every worker of the workflow (component ``raas.<workflow>``) and for this one
        (``raas.<workflow>/<id>``) both apply: a ``pause`` on either holds it; of two throttles the lower
        rate holds. A throttle of N prompts a minute spaces batches: after a batch of k prompts the next
        starts ``k x 60 / N`` seconds after it did (at the rate in force then), and a batch has at most N.

        Raises:
            topics.bus.BusError: the bus failed.
        """
        if not self._commands_read:  # a worker starting obeys the commands given before it started
            patiently(f"{self.id}: read control", self.commands.read_to_end, log=log)
            self._commands_read = True
        latest = self.commands.poll(0.0)
        scopes = (f"raas.{self.cfg.workflow.name}", f"raas.{self.cfg.workflow.name}/{self.id}")
        for scope in scopes:
            msg = latest.get(f"{scope}:pause")
            if msg is not None and msg.action == "pause":
                return "pause", f"paused by control ({scope}: {msg.reason or 'no reason given'})", 0
        rates = [m.value for s in scopes if (m := latest.get(f"{s}:throttle")) is not None and m.value]
        if not rates:
            return "", "", None
        rate = min(rates)
        start, k = self._last_batch
        if time.monotonic() < start + k * 60.0 / rate:
            return "throttle", f"throttled by control to {rate} prompts a minute", 0
        return "", "", rate

    def pause_reason(self) -> str:
        """Why this worker should not roll out now ('' when it should).

        Per policy: its engine is more than ``max_staleness`` versions behind the newest durable
        version or its trainer's reported version (what is rolled out now would be dropped as stale);
        at the trainer's pace of ``round(batch_groups x fresh_fraction)`` fresh groups per version, a batch
        rolled out now would start being trained more than ``max_staleness`` versions after its engine's
        version (the groups in flight are trained first); or a batch (``raas.batch_prompts`` groups) on top
        of the groups in flight would pass :meth:`inflight_limit` (a worker with nothing in flight always rolls
        out). The groups in flight count those this worker is rolling out now (its prompts in flight). A policy
        whose trainer has finished, or waits at a barrier for its peers, holds nothing back. Groups in flight that
        cannot be counted (:meth:`inflight_groups` raised a bus error) are as many as the limit: the worker stays
        paused until the bus answers (see :meth:`_uncounted_reason` for what is logged).
        The staleness rule is :func:`policies.staleness.too_stale`, the serving stage's.
        """
        self.progress.poll()
        for p, puller in self.pullers.items():
            newest, engine = puller.newest_durable(), self.engines[p].version
            if newest is not None and too_stale(engine, newest, self.cfg.policies[p].max_staleness):
                return f"{p} weights {staleness(engine, newest)} versions behind"
        batch = self.cfg.raas.batch_prompts
        for p in self.policies:
            try:
                counted = self.inflight_groups(p)
            except BusError as e:
                # the next count opens new readers: a broker restart can leave a reader's metadata stale ('Unknown
                # partition' for as long as it lives)
                self.admin.close()
                return self._uncounted_reason(p, e)
            uncounted = self._uncounted.pop(p, None)
            if uncounted is not None:
                log.info("%s: the groups of %s in flight are counted again, after %.0f s", self.id, p,
                         time.monotonic() - uncounted[0])
            if counted is None:
                continue  # its trainer finished or waits at a barrier: it holds nothing back
            inflight, version = counted
            # and the groups this worker is rolling out now, one per role the policy plays per prompt
            inflight += len(self.episodes) * sum(1 for q in self.workflow.policies.values() if q == p)
            progress, pc = self.progress.latest.get(f"trainer.{p}"), self.cfg.policies[p]
            engine = self.engines[p].version
            if progress is not None and too_stale(engine, progress.version, pc.max_staleness):
                return f"{p} weights {staleness(engine, progress.version)} versions behind its trainer"
            if version is not None:
                # the trainer takes the groups in flight first, in order, a version's fresh groups at a time: a
                # batch rolled out now starts being trained at version + inflight // that (at max_staleness 0: wait
                # for each new version). Its first group, not its last: waiting until the whole batch would be
                # trained in time left the bottleneck trainer without data (0.5 s in 10 in the solver-verifier
                # pipeline), for a few groups dropped now and then
                trained_at = version + inflight // fresh_per_version(self.cfg, p)
                if too_stale(engine, trained_at, pc.max_staleness):
                    return (f"a batch of {p} rolled out now would be trained about {staleness(engine, trained_at)} "
                            f"versions stale ({inflight} groups in flight ahead of it; max_staleness "
                            f"{pc.max_staleness})")
            if inflight and inflight + batch > self.inflight_limit(p):
                return (f"{inflight} groups of {p} in flight, and a batch of {batch} more would pass its limit "
                        f"{self.inflight_limit(p)}")
        return ""

    def _uncounted_reason(self, policy: str, error: BusError) -> str:
        """The pause reason while ``policy``'s groups in flight cannot be counted because of ``error``; warns
        when that starts and then at most every :data:`UNCOUNTED_WARN_EVERY_S` seconds while it lasts."""
        now = time.monotonic()
        since, warned = self._uncounted.get(policy, (now, None))
        if warned is None or now - warned >= UNCOUNTED_WARN_EVERY_S:
            log.warning("%s: paused: cannot count the groups of %s in flight for %.0f s (%s); waiting for the bus",
                        self.id, policy, now - since, error)
            warned = now
        self._uncounted[policy] = (since, warned)
        return f"the groups of {policy} in flight cannot be counted: the bus does not answer"

    # -- rollout ---------------------------------------------------------------------------
    def oversize(self, prompt: Prompt) -> str:
        """Why ``prompt`` does not fit a policy's model ('' when it fits everywhere): its token count
        (:func:`producers.workflows.prompt_ids` with that policy's tokenizer) plus ``sampling.max_new_tokens``
        is over the model's context (:attr:`context`, tokens; a model without one is not checked)."""
        for p in self.policies:
            limit = self.context[p]
            if limit is None:
                continue
            n = len(prompt_ids(self.engines[p].tokenizer, prompt))
            if n + self.sampling.max_new_tokens > limit:
                return (f"prompt {prompt.prompt_id} ({prompt.source}) is {n} tokens: with sampling.max_new_tokens="
                        f"{self.sampling.max_new_tokens} it does not fit policy {p}'s context of {limit} tokens "
                        "(max_position_embeddings)")
        return ""

    def write(self, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        """Send one prompt's ``groups`` (stamped with this worker's ``producer_id``) and their outcomes (not
        flushed); the groups as sent."""
        out = []
        for g in groups:
            g = g.model_copy(update={"producer_id": self.id})
            self.producer.send(self.names.trajectories(g.policy), encode(g), key=g.prompt_id,
                               headers=headers_for(g))
            outcome = RolloutOutcome(prompt_id=g.prompt_id, group_id=g.group_id, policy=g.policy,
                                     rewards=[s.reward for s in g.samples], zero_adv=g.zero_adv,
                                     version=g.max_version, source=g.source, task_type=g.task_type,
                                     producer_id=self.id)
            self.producer.send(self.names.outcomes, encode(outcome), key=g.prompt_id, headers=headers_for(outcome))
            self.totals["groups"] += 1
            self.totals["tokens"] += int(sum(int(s.loss_mask.sum()) for s in g.samples))
            out.append(g)
        return out

    def _dead_letter(self, record: Record, reason: str, kind: str) -> None:
        """Send ``record`` (a prompt too long for a policy, or whose rollout failed) to ``deadletter`` with
        ``reason`` (not flushed), and count it in :attr:`totals` under ``kind`` (``too_long``, ``rollout_errors``)."""
        log.warning("%s: dead-lettering %s[%d]@%d: %s", self.id, record.topic, record.partition, record.offset, reason)
        send_to_deadletter(self.producer, self.names.deadletter, record, reason, self.consumer.group)
        self.totals[kind] += 1

    @property
    def episodes_inflight(self) -> int:
        """Samples (episodes) being rolled out now, over every prompt in flight: a sample that ended while its
        group's others run does not count (it holds no engine or tool time)."""
        return sum(running for _, running in self.episodes.values())

    def step(self, stop: threading.Event | None = None) -> int:
        """One tick of the episode scheduler: sync weights, apply backpressure and commands, start the
        rollout of newly polled prompts, let the episodes run until one prompt finishes (or a short
        tick passes), write what finished, flush, commit.

        New prompts are polled (at most ``raas.batch_prompts`` a tick) while fewer than ``raas.max_episodes``
        samples are in flight and nothing holds the worker. A prompt too long for a model (:meth:`oversize`),
        or whose rollout raised (the workflow's error or a tool's, not an engine call's), is dead-lettered, at
        once when nothing below it in its partition is open, else once everything below it is done (so that a
        rewound partition does not dead-letter it twice).

        Args:
            stop: the worker's stop event (also every engine's ``interrupt``). When an engine call is
                interrupted, every episode in flight is cancelled: nothing is written for them, what
                finished is flushed, and per partition the commit stops at the first prompt not finished,
                where this consumer is also seeked back (so it, or the partition's next owner, reads that
                prompt again).

        Returns:
            Prompts whose groups were written in this tick (dead-lettered ones are not counted).

        Raises:
            EngineCallFailed: an engine call failed (the engine's error is its cause).
        """
        return self.loop.run_until_complete(self._tick(stop))

    async def _tick(self, stop: threading.Event | None) -> int:
        self.sync_weights()
        now = time.monotonic()
        if self.paused_reason and not self.held_by_control:
            self._backpressure_s += now - self._state_since
        self._state_since = now
        self.held_by_control, reason, room = self.commanded()
        reason = reason or self.pause_reason()
        free = self.cfg.raas.max_episodes - self.episodes_inflight
        stopping = stop is not None and stop.is_set()
        if reason != self.paused_reason:
            log.info("%s: %s", self.id, f"pausing: {reason}" if reason else "resuming")
            self.paused_reason = reason
        # held by backpressure, the worker's engine time is not what the run waits for: fewer, fuller engine calls
        # leave the cores to the trainer
        rows = self.episodes_inflight // len(self.batchers) if reason and not self.held_by_control else 0
        for batcher in self.batchers.values():
            batcher.hold(rows, HELD_CALL_WAIT_S)
        # the prompts partitions are paused while backpressure or a command holds the worker, or while it is
        # full (max_episodes in flight); it still polls every tick, to stay in its group and take rebalances
        assignment = self.consumer.assignment()
        if reason or free <= 0 or stopping:
            self.consumer.pause(assignment)  # each tick: partitions assigned since the pause too
            self._consumer_paused = True
        elif self._consumer_paused:
            self.consumer.resume(assignment)
            self._consumer_paused = False
        if reason and not self.episodes:  # a pause usually ends with a new weight version: wait for one, briefly
            for puller in self.pullers.values():
                puller.poll(timeout_s=0.1 / len(self.pullers))
        per_prompt = max(1, self.cfg.n_samples)
        n = min(self.cfg.raas.batch_prompts, room or self.cfg.raas.batch_prompts, max(1, free // per_prompt))
        self._admit(self.prompts.poll(n, 0.0 if reason or self.episodes else 0.5))
        self.ledger.polled(self.prompts.last_offsets)  # dead-lettered undecodable records included
        rolled = 0
        if self.episodes:
            done, _ = await asyncio.wait(self.episodes, timeout=0.2 if free > 0 else 1.0,
                                         return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(0)  # the episodes resumed by the same engine call finish too
            rolled = self._settle()
        for record, reason, kind in self.ledger.releasable():
            self._dead_letter(record, reason, kind)
            self.ledger.done(record)
        self._commit_ready()
        self.totals["prompts"] += rolled
        self._maybe_metrics()
        return rolled

    def _admit(self, batch: list[tuple[Record, Prompt]]) -> None:
        """Start a rollout task for each prompt of ``batch`` that fits, dead-letter (or hold) the others."""
        started = 0
        for record, prompt in batch:
            too_long = self.oversize(prompt)
            if not too_long:
                self.ledger.add(record)
                task = self.loop.create_task(self._rollout(record, prompt), name=f"rollout {prompt.prompt_id}")
                self.episodes[task] = [record, prompt.n_samples]
                started += 1
            elif self.ledger.blocked(record):
                self.ledger.hold(record, too_long, "too_long")
            else:  # dead-lettered, flushed before the commit
                self._dead_letter(record, too_long, "too_long")
        if started:
            self._last_batch = (time.monotonic(), started)

    async def _rollout(self, record: Record, prompt: Prompt) -> bool:
        """Roll ``prompt`` out (its G episodes concurrently) and write its groups (not flushed): True. When the
        workflow or a tool raises, the prompt is held in the ledger for ``deadletter`` instead, with the error:
        False. An interrupted or failed engine call is raised."""
        entry = self.episodes[asyncio.current_task()]

        def ended() -> None:
            entry[1] = max(0, entry[1] - 1)

        episode_ended.set(ended)  # in this task's context: its episodes' tasks inherit it
        try:
            groups = await self.workflow.rollout(prompt, self.batchers, self.sampling, self.tools)
        except Exception as error:
            if _caused_by(error, (GenerationInterrupted, EngineCallFailed, ServiceUnavailable)):
                raise
            reason = (f"prompt {prompt.prompt_id} ({prompt.source}): the rollout of workflow "
                      f"{self.cfg.workflow.name!r} failed: {type(error).__name__}: {error}")
            log.warning("%s: %s", self.id, reason, exc_info=error)
            self.ledger.fail(record, reason, "rollout_errors")
            return False
        self.write(groups)
        self.ledger.done(record)
        return True

    def _settle(self) -> int:
        """Collect the rollout tasks that ended: the prompts written. An interrupted engine call (a stop)
        cancels every episode in flight and rewinds the ledger (:meth:`step`); any other error (a failed engine
        call, a failed write: a prompt's own failure is not raised, :meth:`_rollout`) is raised."""
        rolled, interrupted = 0, False
        for task in [t for t in self.episodes if t.done()]:
            del self.episodes[task]
            if task.cancelled():
                continue
            error = task.exception()
            if error is None:
                rolled += task.result()
            elif isinstance(error, GenerationInterrupted):
                interrupted = True
            else:
                raise error
        if interrupted:
            self._abandon()
        return rolled

    def _abandon(self) -> None:
        """Cancel every episode in flight (nothing is written for them) and seek each partition back to its
        first prompt not finished; the commit then stops there."""
        for task in self.episodes:
            task.cancel()
        self.episodes.clear()
        left = len(self.ledger)
        for tp, offset in self.ledger.rewind().items():
            self.consumer.seek(tp, offset)
        log.info("%s: stopped mid-batch: %d prompts left for redelivery", self.id, left)

    def _commit_ready(self) -> None:
        """Flush what was written, then commit each partition up to its lowest prompt still open. A
        failing broker is waited out here (records are idempotent; a redelivered prompt would get the
        same group ids anyway)."""
        self.ledger.forget(set(self.consumer.assignment()))
        offsets = self.ledger.commit_offsets()
        if offsets:
            patiently(f"{self.id}: flush", self.producer.flush, log=log)
            patiently(f"{self.id}: commit", lambda: self._commit_owned(offsets), log=log)

    def _commit_owned(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit ``offsets`` (prompts) on the partitions this worker still owns (a partition that
        moved in a rebalance is re-read by its new owner from the last committed offset)."""
        owned = set(self.consumer.assignment())
        offsets = {tp: off for tp, off in offsets.items() if tp in owned}
        if offsets:
            self.consumer.commit(offsets)

    def _maybe_metrics(self, every_s: float = 2.0, stopped: bool = False) -> None:
        now = time.monotonic()
        if now - self._last_metric < every_s:
            return
        values = {f"{k}_total": float(v) for k, v in self.totals.items()}
        values["stopped"] = 1.0 if stopped else 0.0  # the last report of a worker that stopped (not one that died)
        # paused: held back by backpressure now; paused_frac: the share of the time since the last metric it
        # was (what a scaling controller reads: a worker paused between batches flips paused every step);
        # commands count apart
        values["paused"] = 1.0 if self.paused_reason and not self.held_by_control else 0.0
        held = self._backpressure_s + (now - self._state_since if values["paused"] else 0.0)
        if self._last_metric:
            values["paused_frac"] = min(1.0, held / (now - self._last_metric))
        self._backpressure_s, self._state_since, self._last_metric = 0.0, now, now
        values["paused_by_control"] = 1.0 if self.held_by_control == "pause" else 0.0
        values["throttled"] = 1.0 if self.held_by_control == "throttle" else 0.0
        values.update({f"version.{p}": float(e.version) for p, e in self.engines.items()})
        values["episodes_inflight"] = float(self.episodes_inflight)
        values["prompts_inflight"] = float(len(self.episodes))
        for p, b in self.batchers.items():  # requests per engine call: how much the episodes share the engine
            values[f"engine_batch.{p}"] = b.rows / b.calls if b.calls else 0.0
        for name, tool in self.tools.items():  # each tool's latency percentiles (seconds) and failures, if it counts
            if hasattr(tool, "percentiles"):
                values.update({f"tool.{name}.{q}_s": v for q, v in tool.percentiles().items()})
            if hasattr(tool, "calls"):
                values[f"tool.{name}.calls_total"] = float(tool.calls)
            if hasattr(tool, "errors"):
                values[f"tool.{name}.errors_total"] = float(sum(tool.errors.values()))
        # items whose reward raised or timed out (scored 0.0), in this process (producers.rewards.reward_errors)
        values["reward_errors_total"] = float(sum(reward_errors().values()))
        # malformed tool calls and failed calls of environments' tools, in this process (producers.environments)
        errors = environment_errors()
        values["tool_parse_errors_total"] = float(errors["tool_parse_errors"])
        values["tool_call_errors_total"] = float(errors["tool_call_errors"])
        metric = Metric(component=self.id, kind="raas", values=values)
        self.producer.send(self.names.metrics, encode(metric), key=self.id, headers=headers_for(metric))

    def run(self, stop: threading.Event) -> None:
        """Roll out until ``stop`` is set; then leave the group. ``stop`` becomes every engine's
        ``interrupt``, so it takes effect mid-batch, within a decode step (see :meth:`step`).

        Raises:
            topics.liveness.Stalled: the worker read no prompt for the liveness rule's ``stall_s`` while prompts
                waited for it and nothing held it (:class:`topics.liveness.ProgressWatch`).
        """
        for engine in self.engines.values():
            engine.interrupt = stop
        log.info("%s: joined %s on %s (policies %s)", self.id, self.names.raas_group(self.cfg.workflow.name),
                 self.names.prompts, self.policies)
        last_busy = time.monotonic()
        try:
            while not stop.is_set():
                if self.step(stop) or self.episodes or self.paused_reason:
                    last_busy = time.monotonic()  # progress, episodes in flight, or held by backpressure or control
                else:
                    self.liveness.check(last_busy)
        finally:
            self.close()

    def close(self) -> None:
        """Give up the episodes in flight (their prompts are not committed: :meth:`step`), flush, commit
        what finished, leave the group, stop following weights and close the tools and engines (a
        launched SGLang server is stopped).

        A tool's ``close`` may be synchronous or a coroutine function. A tool, engine or client whose close
        raises is logged (with its traceback) and the rest are still closed; nothing of that is raised here.
        """
        try:
            if self.episodes:
                self._abandon()
                self._commit_ready()
            self._last_metric = 0.0
            self._maybe_metrics(stopped=True)
            self.producer.flush()
        finally:
            pending = asyncio.all_tasks(self.loop)  # cancelled episodes, engine calls whose results nobody awaits
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.wait(pending))
            closes: list[tuple[str, Callable[[], object] | None]] = [
                ("workflow", self.workflow.close),
                *((f"tool {name}", getattr(tool, "close", None)) for name, tool in self.tools.items()),
                *((f"engine batcher {p}", b.close) for p, b in self.batchers.items()),
                ("event loop", self.loop.close), ("consumer", self.consumer.close),
                ("progress follower", self.progress.close), ("command follower", self.commands.close),
                ("admin client", self.admin.close),
                *((f"weight puller {p}", puller.close) for p, puller in self.pullers.items()),
                *((f"engine {p}", getattr(e, "close", None)) for p, e in self.engines.items())]
            for what, close in closes:
                if close is not None:
                    self._close_one(what, close)

    def _close_one(self, what: str, close: Callable[[], object]) -> None:
        """Call ``close`` and, when it returns an awaitable (an async ``close``), run that on the worker's
        loop; log what it raises (``what`` names it) instead of raising."""
        try:
            result = close()
            if inspect.isawaitable(result):
                self.loop.run_until_complete(result)
        except Exception:
            log.exception("%s: closing %s failed; closing the rest", self.id, what)
