"""Evaluation: pass@1 as avg@k on the shipped benchmarks, offline or live.

For each prompt we draw k samples at temperature T (0.6 by default) and score
each with the prompt's reward (:func:`producers.rewards.score_pairs`); a sample
is *correct* when its reward is > 0.5. Then

    pass@1 (avg@k) = 1/n * sum_i  c_i / k

where ``c_i`` is the number of correct samples of prompt i (DeepSeek-AI 2025,
"DeepSeek-R1", section 3.1 "Evaluation Setup": pass@1 = 1/k sum_i p_i with
k samples per question at temperature 0.6; it is the k = 1 case of the
unbiased pass@k estimator of Chen et al. 2021, "Evaluating Large Language
Models Trained on Code", eq. 1). Its standard error treats the prompts as the
independent units: ``std(c_i / k, ddof=1) / sqrt(n)`` (Miller 2024, "Adding
Error Bars to Evals", arXiv:2411.00640, section 2.2, clustered on the question
when several samples are drawn per question).

:func:`evaluate` scores an engine on a list of prompts. :func:`load_benchmark`
opens a benchmark by source name. :func:`pull_newest` brings an engine to the
newest version in the weight store. :class:`LiveEvaluator` follows the run's
``weights`` topic and publishes a ``Metric(kind="eval")`` for every version it
evaluates (``astraflow eval --live``).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from producers.engines import Engine, SamplingParams
from topics.bus import Bus
from topics.schemas import Prompt

log = logging.getLogger(__name__)

DEFAULT_BENCHMARKS = ("gsm8k", "math500", "humaneval", "mbpp")
"""Benchmarks evaluated when neither the config's ``eval.benchmarks`` nor ``--benchmark`` names any."""

CORRECT_ABOVE = 0.5
"""A sample is correct when its reward is greater than this."""


@dataclass
class BenchmarkScore:
    """pass@1 (avg@k) of one benchmark.

    Attributes:
        benchmark: the benchmark (prompt source) name.
        k: samples per prompt.
        prompt_ids: the n prompts evaluated, in order.
        rewards: float64[n, k] reward of each sample.
    """

    benchmark: str
    k: int
    prompt_ids: list[str]
    rewards: np.ndarray

    @property
    def n(self) -> int:
        """Number of prompts."""
        return len(self.prompt_ids)

    @property
    def per_prompt(self) -> np.ndarray:
        """float64[n]: fraction of each prompt's k samples that are correct (reward > :data:`CORRECT_ABOVE`)."""
        return (self.rewards > CORRECT_ABOVE).mean(axis=1)

    @property
    def pass_at_1(self) -> float:
        """Mean over prompts of :attr:`per_prompt` (module docstring); NaN for n = 0."""
        return float(self.per_prompt.mean()) if self.n else float("nan")

    @property
    def stderr(self) -> float:
        """Standard error of :attr:`pass_at_1` over prompts (module docstring); 0 for n < 2."""
        return float(self.per_prompt.std(ddof=1) / np.sqrt(self.n)) if self.n > 1 else 0.0

    def summary(self) -> dict[str, float | int]:
        """``{"pass@1", "stderr", "n", "k"}`` (pass@1 and stderr rounded to 4 decimals)."""
        return {"pass@1": round(self.pass_at_1, 4), "stderr": round(self.stderr, 4), "n": self.n, "k": self.k}


@dataclass
class EvalResult:
    """One evaluation of one weight version.

    Attributes:
        version: the engine's weight version during the evaluation.
        temperature: the sampling temperature.
        benchmarks: benchmark name (the prompts' ``source``) -> its score, in first-seen order.
    """

    version: int
    temperature: float
    benchmarks: dict[str, BenchmarkScore] = field(default_factory=dict)

    def summary(self) -> dict[str, dict[str, float | int]]:
        """``{benchmark: {"pass@1", "stderr", "n", "k"}}``."""
        return {name: b.summary() for name, b in self.benchmarks.items()}

    def metric_values(self) -> dict[str, float]:
        """Flat values for a :class:`~topics.schemas.Metric`: ``pass@1.<bench>`` and ``stderr.<bench>``."""
        out: dict[str, float] = {}
        for name, b in self.benchmarks.items():
            out[f"pass@1.{name}"] = b.pass_at_1
            out[f"stderr.{name}"] = b.stderr
        return out


def evaluate(engine: Engine, prompts: Sequence[Prompt], k: int = 4, temperature: float = 0.6,
             max_new_tokens: int = 1024, top_p: float = 1.0, seed: int | None = 0,
             batch_prompts: int = 32, timeout_s: float = 10.0, progress: bool = True) -> EvalResult:
    """pass@1 as avg@k of ``engine`` on ``prompts``, per benchmark (the prompts' ``source``).

    Prompts are taken ``batch_prompts`` at a time; each batch is generated k
    times (one ``engine.generate`` call per sample index j, seeded with
    ``seed + batch * k + j`` so that the k samples of a prompt use different
    seeds on every engine, SGLang included) and scored in parallel.

    Args:
        engine: the policy's engine, at the version to evaluate.
        prompts: the prompts (any mix of sources).
        k: samples per prompt (>= 1).
        temperature: sampling temperature (> 0).
        max_new_tokens: the most tokens per sample.
        top_p: nucleus mass in (0, 1].
        seed: base sampling seed; ``None`` uses the engine's own random stream.
        batch_prompts: prompts per generate call.
        timeout_s: per-sample reward limit, seconds (see :func:`producers.rewards.score_pairs`).
        progress: show a rich progress bar on stderr (samples scored).

    Returns:
        The :class:`EvalResult` at ``engine.version``.

    Raises:
        ValueError: ``k`` < 1, ``temperature`` <= 0 or ``batch_prompts`` < 1.
        producers.rewards.RewardError: a prompt names an unregistered reward.
    """
    from rich.console import Console
    from rich.progress import Progress

    from producers.rewards import score_pairs
    from producers.workflows import prompt_ids

    if k < 1:
        raise ValueError(f"evaluate: k must be >= 1, got {k}")
    if temperature <= 0:
        raise ValueError(f"evaluate: temperature must be > 0 for avg@k sampling, got {temperature}")
    if batch_prompts < 1:
        raise ValueError(f"evaluate: batch_prompts must be >= 1, got {batch_prompts}")
    version = engine.version
    rewards = np.zeros((len(prompts), k), dtype=np.float64)
    with Progress(console=Console(stderr=True), transient=True, disable=not progress) as bar:
        task = bar.add_task(f"eval v{version} (k={k}, T={temperature})", total=len(prompts) * k)
        for b, start in enumerate(range(0, len(prompts), batch_prompts)):
            chunk = prompts[start:start + batch_prompts]
            ids = [prompt_ids(engine.tokenizer, p) for p in chunk]
            pairs = []
            for j in range(k):
                sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                          seed=None if seed is None else seed + b * k + j)
                gens = engine.generate(ids, sampling)
                pairs += [(p, engine.tokenizer.decode(g.output_ids.tolist(), skip_special_tokens=True))
                          for p, g in zip(chunk, gens)]
            scores = score_pairs(pairs, timeout_s=timeout_s, on_done=lambda: bar.advance(task))
            rewards[start:start + len(chunk)] = np.asarray(scores).reshape(k, len(chunk)).T
    result = EvalResult(version=version, temperature=temperature)
    by_source: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_source.setdefault(p.source, []).append(i)
    for name, rows in by_source.items():
        result.benchmarks[name] = BenchmarkScore(benchmark=name, k=k, prompt_ids=[prompts[i].prompt_id for i in rows],
                                                 rewards=rewards[rows])
    return result


def load_benchmark(name: str, limit: int | None = None) -> list[Prompt]:
    """The first ``limit`` (default: all) well-formed prompts of a benchmark.

    Args:
        name: a built-in source (:data:`producers.sources.SOURCES`) or a dataset path.
        limit: the most prompts to return (>= 1), or None for all.

    Raises:
        producers.sources.SourceError: unknown name, unreadable path or empty source.
    """
    from producers.sources import load_source

    source = load_source(name)
    prompts = []
    for i in range(len(source)):
        if limit is not None and len(prompts) >= limit:
            break
        p = source.get(i)
        if p is not None:
            prompts.append(p)
    return prompts


def pull_newest(engine: Engine, store_uri: str, run: str, policy: str) -> int:
    """Load the newest version of ``policy`` found in the weight store into ``engine``
    (:meth:`producers.engine_sync.EngineSync.update`, as RaaS updates its engines: changed tensors from a
    verified host copy, or a server-side pull for vLLM).

    The store listing decides (no bus needed); each object is verified on the way. With nothing published the
    engine keeps its weights.

    Returns:
        The engine's version afterwards (0: the base model).

    Raises:
        weights.puller.WeightsUnavailable: the newest version cannot be reconstructed.
        weights.store.StoreError: the store cannot be listed.
        producers.engines.EngineUpdateError: the engine could not load it.
    """
    from producers.engine_sync import EngineSync
    from topics.names import TopicNames
    from weights.puller import Puller
    from weights.store import WeightStore

    return EngineSync(engine, Puller(WeightStore(store_uri, run), None, TopicNames(run), policy)).update()


class LiveEvaluator:
    """Evaluates every new weight version of one policy as it lands, and publishes the result.

    Follows ``<run>.weights`` with a :class:`weights.puller.Puller` (partition 0,
    from the beginning). Each loop: read announcements, pull the newest version,
    evaluate it if it has not been evaluated yet (the base model counts as
    version 0), and publish ``Metric(component="eval.<policy>", kind="eval",
    policy, step=version, values=EvalResult.metric_values())`` to
    ``<run>.metrics``. Versions that land during an evaluation are coalesced:
    only the newest is evaluated next.

    Args:
        bus: the run's bus.
        store_uri, run, policy: where the weights are and whose.
        engine: the policy's engine (its current version is evaluated first).
        prompts: the benchmark prompts.
        on_result: called with each :class:`EvalResult` after it is published.
        **eval_kwargs: passed to :func:`evaluate` (k, temperature, max_new_tokens, ...).
    """

    def __init__(self, bus: Bus, store_uri: str, run: str, policy: str, engine: Engine, prompts: Sequence[Prompt],
                 on_result: Callable[[EvalResult], None] | None = None, **eval_kwargs) -> None:
        from producers.engine_sync import EngineSync
        from topics.layout import ensure_run_topics
        from topics.names import TopicNames
        from weights.puller import Puller
        from weights.store import WeightStore

        self.names, self.policy, self.engine, self.prompts = TopicNames(run), policy, engine, list(prompts)
        ensure_run_topics(bus.admin(), self.names, [policy])  # idempotent; eval may start before the run
        self.component = f"eval.{policy}"
        self.on_result, self.eval_kwargs = on_result, eval_kwargs
        self.puller = Puller(WeightStore(store_uri, run), bus, self.names, policy)
        self.sync = EngineSync(engine, self.puller)
        self.producer = bus.producer()
        self.evaluated: set[int] = set()

    def step(self, poll_s: float = 1.0) -> EvalResult | None:
        """One loop: pull the newest version and evaluate it if new; returns the result or None."""
        from producers.engines import EngineUpdateError
        from weights.puller import WeightsUnavailable

        self.puller.poll(timeout_s=poll_s)
        try:
            self.sync.update()  # the newest announced version that is in the store
        except (WeightsUnavailable, EngineUpdateError) as e:
            log.warning("%s: %s", self.component, e)
        if self.engine.version in self.evaluated:
            return None
        result = evaluate(self.engine, self.prompts, progress=False, **self.eval_kwargs)
        self.publish(result)
        self.evaluated.add(result.version)
        if self.on_result is not None:
            self.on_result(result)
        return result

    def publish(self, result: EvalResult) -> None:
        """Send ``result`` as an eval Metric to the run's ``metrics`` topic and flush."""
        from topics.codec import encode, headers_for
        from topics.schemas import Metric

        metric = Metric(component=self.component, kind="eval", policy=self.policy, step=result.version,
                        values=result.metric_values())
        self.producer.send(self.names.metrics, encode(metric), key=self.component, headers=headers_for(metric))
        self.producer.flush()
        log.info("%s: version %d %s", self.component, result.version, result.summary())

    def run(self, stop: threading.Event) -> None:
        """Loop :meth:`step` until ``stop`` is set (an evaluation in progress is finished first), then close."""
        try:
            while not stop.is_set():
                self.step()
        finally:
            self.close()

    def close(self) -> None:
        """Flush and stop following weights."""
        try:
            self.producer.flush()
        finally:
            self.puller.close()
