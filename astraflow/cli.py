"""The ``astraflow`` command line: each command parses its options, calls the function that does its work, and
renders the result.

``astraflow run CONFIG`` starts a whole run on this machine. The component commands (``acquire``, ``raas``,
``policy``, ``trainer``) start one part each, for multi-machine deployments: each takes the same CONFIG plus
``key=value`` overrides (e.g. ``bus=kafka://broker:9092 store=s3://bucket/runs``).
"""
import gc
import importlib.metadata
import json
import logging
import os
import re
from pathlib import Path
from typing import Optional

import typer

from astraflow.command_setup import bus_admin, check_store, load, load_policy, setup_component

app = typer.Typer(help="AstraFlow: dataflow-oriented RL for agentic LLMs.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)

CONFIG = typer.Argument(..., exists=False, help="run config YAML (see examples/)")
OVERRIDES = typer.Argument(None, help="key=value overrides, e.g. policies.actor.steps=20 bus=kafka://host:9092")


@app.command()
def run(config: Path = CONFIG, overrides: Optional[list[str]] = OVERRIDES) -> None:
    """Run a whole RL run on this machine: acquisition, RaaS workers, filter processors and trainers
    as separate processes, with a live view. Ends with a JSON summary line
    {"run", "complete", "restarts", "steps", "versions", "reward_first", "reward_last", "reward_best",
    "final_over_best", "collapses", "dead_letters", "wall_s"} ("interrupted" too after Ctrl-C or SIGTERM,
    "stopped_on_collapse" after a trainer's stop_on_collapse, "failed" with the reason after a component failed or
    the data ran out), where reward_first and reward_last are the mean
    training reward over the first and the last 20% of trainer steps, reward_best the best such window,
    final_over_best reward_last / reward_best, and collapses each policy's collapse alert; metrics.jsonl and
    reward_curve.png are written to the run directory. Exits 1 when the run did not complete, 2 when its config
    is refused or its bus or weight store does not answer at the start."""
    from astraflow.launcher.preflight import ConfigRefused, check_run_config
    from astraflow.launcher.run import Launcher, RunFailed
    from astraflow.launcher.run_dir_lock import hold_run_dir
    from topics.bus import BusError

    cfg = load(config, overrides)
    try:
        check_run_config(cfg)
        bus_admin(cfg)  # after the checks above, so a refused config leaves nothing behind (a local bus is a folder)
        check_store(cfg)
        hold_run_dir(cfg.run_dir)  # one launcher per run_dir: held until this process ends
    except ConfigRefused as e:
        typer.echo(f"invalid run config {config}: {e}", err=True)
        raise typer.Exit(2)
    try:
        summary = Launcher(cfg, config.absolute(), list(overrides or [])).run()
    except RunFailed as e:
        print(json.dumps(e.summary), flush=True)
        typer.echo(f"run failed: {e}", err=True)
        raise typer.Exit(1)
    except (RuntimeError, BusError) as e:
        typer.echo(f"run failed: {e}", err=True)
        raise typer.Exit(1)
    print(json.dumps(summary), flush=True)
    if summary.get("stopped_on_collapse"):
        typer.echo(f"run stopped: the reward collapsed ({', '.join(summary['stopped_on_collapse'])}, "
                   "stop_on_collapse); the best window's checkpoint is in <run_dir>/trainer.<policy>/best-checkpoint",
                   err=True)
        raise typer.Exit(1)
    if not summary["complete"]:
        typer.echo("run incomplete: not every trainer reached its steps", err=True)
        raise typer.Exit(1)


@app.command()
def acquire(config: Path = CONFIG, overrides: Optional[list[str]] = OVERRIDES) -> None:
    """Write the config's prompt sources to the run's `prompts` topic (through the curators, if any).
    Remembers how far it got: a restart does not resend. A bad record is logged (path:line and why),
    written to `deadletter` and skipped; with `data.strict=true` it exits 3 (EXIT_BAD_INPUT) with that message
    instead, and `astraflow run` does not restart it (it would stop at the same record)."""
    from astraflow.launched import EXIT_BAD_INPUT
    from producers.acquisition import acquire_run
    from producers.sources import SourceError

    cfg = load(config, overrides)
    try:
        sent = acquire_run(cfg.acquisition_section(), setup_component("acquire", cfg))
    except SourceError as e:
        typer.echo(f"acquisition stopped: {e}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    logging.getLogger("astraflow").info("acquisition done: %d prompts sent", sent)


@app.command()
def raas(config: Path = CONFIG, overrides: Optional[list[str]] = OVERRIDES,
         worker_id: str = typer.Option("0", "--worker-id",
                                       help="unique id of this worker within the run (letters, digits, . _ -), "
                                            "e.g. a number or the container's hostname"),
         vllm_url: Optional[list[str]] = typer.Option(None, "--vllm-url", help="POLICY=URL: the vLLM server of a "
                                                      "policy with engine: vllm and no vllm.url (astraflow run "
                                                      "gives the one it started)"),
         search_url: Optional[str] = typer.Option(None, "--search-url", help="the search server, when tools.search "
                                                  "has no url (astraflow run gives the one it started)")) -> None:
    """Run one rollout worker: join the `raas.<workflow>` consumer group on `prompts`, roll out,
    write groups to `trajectories.<policy>`. Start more to scale out; SIGTERM stops it cleanly."""
    from astraflow.launched import EXIT_BAD_INPUT
    from astraflow.worker_commands import WORKER_ID

    if not re.fullmatch(WORKER_ID, worker_id):
        typer.echo(f"--worker-id {worker_id!r}: use 1-64 letters, digits, '.', '_' or '-'", err=True)
        raise typer.Exit(2)
    cfg = load(config, overrides)
    vllm_urls = dict(u.partition("=")[::2] for u in vllm_url or [])
    bad = [u for u in vllm_url or [] if "=" not in u or u.partition("=")[0] not in cfg.policies]
    if bad:
        typer.echo(f"--vllm-url {bad[0]!r}: give POLICY=URL, POLICY one of {sorted(cfg.policies)}", err=True)
        raise typer.Exit(2)
    stop = setup_component(f"raas-{worker_id}", cfg)
    from producers.raas import RaasWorker  # after the setup: a SIGTERM while torch loads stops it cleanly

    try:
        worker = RaasWorker(cfg.raas_section(), worker_id, vllm_urls=vllm_urls, search_url=search_url)
    except (KeyError, ValueError) as e:  # the config: a restart would meet it again
        typer.echo(f"raas-{worker_id}: {e.args[0] if isinstance(e, KeyError) else e}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    gc.freeze()  # its engines and tokenizers live as long as the process: out of the collector's sight (trainer.main)
    worker.run(stop)


@app.command()
def policy(config: Path = CONFIG, overrides: Optional[list[str]] = OVERRIDES,
           policy: str = typer.Option(..., "--policy", help="the trained policy whose filter chain to run"),
           instance: int = typer.Option(0, "--instance", min=0,
                                        help="this processor's number, below policies.<policy>.filter_processor"
                                             ".instances")) -> None:
    """Run a policy's filter chain as a stream processor: `trajectories.<policy>` -> `samples.<policy>`
    (exactly-once on Kafka, at-least-once on the embedded bus). Start instances 0..N-1 to scale out:
    they share the partitions of consumer group `filter.<policy>`; SIGTERM stops one after its batch."""
    from astraflow.launched import policy_component

    cfg, policy = load_policy(config, overrides, policy)
    section = cfg.filter_section(policy)
    if instance >= section.processor.instances:
        typer.echo(f"--instance {instance} is not below policies.{policy}.filter_processor.instances "
                   f"({section.processor.instances})", err=True)
        raise typer.Exit(2)
    stop = setup_component(policy_component(policy, instance), cfg)
    from policies.processor import main  # after the setup: a SIGTERM while torch loads stops it cleanly

    main(section, instance, stop)


@app.command()
def trainer(config: Path = CONFIG, overrides: Optional[list[str]] = OVERRIDES,
            policy: str = typer.Option(..., "--policy", help="the policy to train"),
            local_rank: Optional[int] = typer.Option(None, "--local_rank", "--local-rank", hidden=True,
                                                     help="set by the DeepSpeed launcher (LOCAL_RANK)")) -> None:
    """Run one policy's trainer: consume `samples.<policy>` (group `trainer.<policy>`), train with
    GRPO/PPO, publish weights to the store and `weights`. Resumes from its last checkpoint;
    SIGTERM checkpoints and stops. With `coupling: barrier` it starts step v+1 only once every
    other policy of the config has announced version v. With `trainer.ranks` N > 1 run it under
    `torchrun --standalone --nproc_per_node N -m astraflow trainer ...` (as `astraflow run` does) or,
    with `trainer.backend: deepspeed`, the DeepSpeed launcher (`deepspeed --num_gpus N -m astraflow
    trainer ...`): rank 0 reads the bus, publishes and checkpoints, all ranks train (FSDP2 or ZeRO)."""
    if local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    cfg, policy = load_policy(config, overrides, policy)
    section = cfg.trainer_section(policy)
    stop = setup_component(f"trainer.{policy}", cfg)
    from trainer.main import InvalidServing, main  # after the setup: a SIGTERM while torch loads stops it cleanly

    try:
        summary = main(section, stop)
    except InvalidServing as e:
        typer.echo(f"invalid policies.{policy}.serving: {e}", err=True)
        raise typer.Exit(2)
    if summary is not None:  # rank 0's; a follower rank logged its own
        print(json.dumps(summary), flush=True)
        if "collapsed" in summary:
            from astraflow.launched import EXIT_COLLAPSED

            typer.echo(f"trainer.{policy}: {summary['collapsed']}; stopped (stop_on_collapse)", err=True)
            raise typer.Exit(EXIT_COLLAPSED)


@app.command()
def controller(config: Path = CONFIG, overrides: Optional[list[str]] = OVERRIDES) -> None:
    """Scale the run's RaaS workers to its trainers: from the trainers' wait fraction and the workers'
    backpressure pauses on `metrics` (its own consumer group `<run>.controller`), with hysteresis, a cooldown,
    a one-worker rate limit and `controller.min_workers..max_workers` bounds, write each decision and its
    reason to `control` (`target_replicas`, key `raas.<workflow>`). `astraflow run` starts it and carries the
    decisions out when `controller.enabled` is set; with `controller.actuator` compose or kubernetes this command
    carries them out itself (docker compose --scale, the Deployment's scale). Runs until SIGTERM."""
    from astraflow.actuators import ActuatorError, build_actuator
    from astraflow.controller import run_controller
    from topics.bus import connect

    cfg = load(config, overrides)
    try:  # the actuator's credentials or compose file, before anything starts (run_controller builds its own)
        build_actuator(cfg.controller)
    except (ActuatorError, ValueError) as e:
        typer.echo(f"invalid controller config {config}: {e}", err=True)
        raise typer.Exit(2)
    stop = setup_component("controller", cfg)
    run_controller(cfg.controller_section(), connect(cfg.bus, cfg.kafka), stop)


#: the highest ``astraflow control throttle --per-minute``: far above any rollout rate, and small enough to encode
MAX_PER_MINUTE = 1_000_000


@app.command()
def control(action: str = typer.Argument(..., help="pause, resume or throttle"),
            config: Path = CONFIG, overrides: Optional[list[str]] = OVERRIDES,
            worker: Optional[str] = typer.Option(None, "--worker", help="one RaaS worker (its --worker-id); "
                                                 "default: every worker of the run's workflow"),
            per_minute: Optional[int] = typer.Option(None, "--per-minute", min=1, max=MAX_PER_MINUTE,
                                                     help="throttle: prompts a minute per worker, its batches "
                                                          "spaced to that rate (omitted: lift the throttle)"),
            reason: Optional[str] = typer.Option(None, "--reason", help="why, kept with the command")) -> None:
    """Command the run's RaaS workers through `control`: `pause` (they stop taking prompts after the batch in
    hand), `resume`, or `throttle --per-minute N`. The command is kept (compacted topic): a worker started or
    restarted later obeys it too. A pause for the workflow holds every worker whatever their own commands say."""
    from pydantic import ValidationError

    from astraflow.worker_commands import CommandRefused, check_options, send_command, worker_command
    from topics.bus import BusError

    try:
        check_options(action, worker, per_minute)
        cfg = load(config, overrides)
        msg = worker_command(cfg.workflow.name, action, worker, per_minute, reason)
    except (CommandRefused, ValidationError) as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2)
    try:
        sent = send_command(cfg, msg, worker)
    except BusError as e:
        typer.echo(f"cannot send the command on bus {cfg.bus}: {e}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{msg.component}: {action}" + (f" {per_minute} prompts/min" if per_minute
                                               else " lifted" if action == "throttle" else ""))
    for warning in sent.warnings():
        typer.echo(warning, err=True)


@app.command()
def exporter(config: Path = CONFIG, overrides: Optional[list[str]] = OVERRIDES) -> None:
    """Serve the run's metrics to Prometheus at http://<exporter.host>:<exporter.port>/metrics (port default
    9400): every figure on the `metrics` topic (its own consumer group `<run>.exporter`), the consumer
    groups' lag and the components' restarts. Runs until SIGTERM; `astraflow run` starts it when
    `exporter.port` is set."""
    from astraflow.exporter import CannotServe, main

    cfg = load(config, overrides)
    try:
        main(cfg.metrics_section(), setup_component("exporter", cfg))
    except CannotServe as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2)


@app.command()
def tracker(config: Path = CONFIG, overrides: Optional[list[str]] = OVERRIDES) -> None:
    """Write every figure on the run's `metrics` topic to TensorBoard (`tracking.tensorboard_dir`, a TensorBoard
    run per component under <dir>/<run>/) and W&B (`tracking.wandb_project`, `tracking.wandb_mode`), as its own
    consumer group `<run>.tracker`; offsets are committed after each flush (`tracking.flush_every_s`), so a
    restart resumes after what was written. Runs until SIGTERM; `astraflow run` starts it when a sink is set.
    Needs the tracking profile (scripts/install.sh tracking)."""
    from astraflow.tracker import TrackingRefused, TrackingUnavailable, main, require_sinks

    cfg = load(config, overrides)
    try:
        require_sinks(cfg.tracking)
        main(cfg.metrics_section(), setup_component("tracker", cfg))
    except (TrackingRefused, TrackingUnavailable) as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2)


@app.command("search-server")
def search_server(
    port: int = typer.Option(0, "--port", min=0, max=65535, help="the port; 0: a free one"),
    host: str = typer.Option("127.0.0.1", "--host", help="the address to bind"),
    corpus: Optional[Path] = typer.Option(None, "--corpus", help="JSONL corpus, {doc_id, text} a line "
                                                                 "(default: producers/data/search_kb.jsonl)"),
    median_s: float = typer.Option(0.0, "--median-s", help="median latency per request, seconds (0: none)"),
    p99_s: float = typer.Option(0.0, "--p99-s", help="99th percentile latency, seconds (log-normal)"),
    hang: float = typer.Option(0.0, "--hang", help="probability a request never answers in time"),
    error: float = typer.Option(0.0, "--error", help="probability of an HTTP 500"),
    garbage: float = typer.Option(0.0, "--garbage", help="probability of an HTTP 200 whose body is not JSON"),
    hang_s: float = typer.Option(3600.0, "--hang-s", help="seconds a hung request sleeps"),
    seed: int = typer.Option(0, "--seed", help="seed of the latency and fault draws"),
) -> None:
    """Serve the search tool (producers/search_server.py): GET /search?q=TEXT&k=N (BM25 over the corpus, in SQLite
    FTS5) and GET /health, with seeded latency and faults. Prints `search server: serving URL (N documents)` once
    ready; runs until SIGTERM. `astraflow run` starts it as the component `search` when `tools.search` is set
    without a url. Exits 2 on a bad option, 3 on a bad corpus, 1 when the port cannot be bound."""
    from astraflow.launched import EXIT_BAD_INPUT, stacks_on_sigusr1, stop_on_signals, watch_launcher
    from astraflow.placement import apply_placement
    from producers.search_server import DEFAULT_CORPUS, Behaviour, SearchServer, serve

    apply_placement()  # where `astraflow run` placed it (placement.search), before the server starts threads

    try:
        behaviour = Behaviour(median_s, p99_s, hang, error, garbage, seed, hang_s)
    except ValueError as e:
        typer.echo(f"search-server: {e}", err=True)
        raise typer.Exit(2)
    try:
        server = SearchServer(corpus or DEFAULT_CORPUS, behaviour, host, port)
    except (FileNotFoundError, ValueError) as e:
        typer.echo(f"search-server: {e}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s search %(name)s %(levelname)s %(message)s")
    stop = stop_on_signals()
    stacks_on_sigusr1()
    watch_launcher("search", stop)
    try:
        serve(server, stop)
    except OSError as e:
        typer.echo(f"search-server: cannot serve on {host}:{port}: {e}", err=True)
        raise typer.Exit(1)


@app.command()
def replay(config: Path = CONFIG, overrides: Optional[list[str]] = OVERRIDES,
           policy: str = typer.Option(..., "--policy", help="the policy to retrain"),
           publish_as: Optional[str] = typer.Option(None, "--publish-as",
                                                    help="also publish the replayed weights as this new run name"),
           threads: Optional[int] = typer.Option(None, "--threads",
                                                 help="torch CPU threads (default: $OMP_NUM_THREADS, else 1, "
                                                      "as `astraflow run` gives its trainers)")) -> None:
    """Retrain a policy from the run's recorded `samples.<policy>` as a new consumer group
    `replay.<policy>.<id>`, and compare each version's weight sha256 with the original's.
    With the batches the trainer recorded on `trained`, each version trains on exactly those groups
    (bit-exact on CPU); without them, the serving stage re-serves the topic (not bit-exact).
    Prints a table and a JSON line {"metric": "replay", "versions", "matched", "mismatched", ...};
    exits 1 when an exact replay mismatches or cannot find its groups."""
    from rich.console import Console
    from rich.table import Table

    from astraflow.replay import ReplayError, replay_run

    cfg, policy = load_policy(config, overrides, policy)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    err = Console(stderr=True).print
    try:
        result = replay_run(cfg.replay_section(policy), publish_as=publish_as, threads=threads,
                            on_version=lambda v, sha: err(f"replayed {policy} v{v}: sha256 {sha[:16]}"))
    except ValueError as e:  # a bad --threads or --publish-as, no such run
        typer.echo(str(e), err=True)
        raise typer.Exit(2)
    except ReplayError as e:
        typer.echo(f"replay failed: {e}", err=True)
        raise typer.Exit(1)
    table = Table("version", "groups", "replayed sha256", "original sha256", "",
                  title=f"replay of {cfg.run}/{policy} ({result.mode}, group {result.group})")
    for c in result.checks:
        table.add_row(str(c.version), str(c.groups), c.sha256[:16], (c.recorded or "-")[:16], c.status)
    Console().print(table)
    print(json.dumps(result.summary()), flush=True)
    if result.mode == "exact" and not result.ok:
        raise typer.Exit(1)


@app.command()
def status(config: Path = CONFIG, overrides: Optional[list[str]] = OVERRIDES,
           watch: bool = typer.Option(False, "--watch", help="refresh until Ctrl-C"),
           seconds: float = typer.Option(3.0, "--seconds", help="seconds of metrics to read before printing"),
           as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of tables")) -> None:
    """Show a run's state: per consumer group the lag, per policy the version and reward, the throughput. Reads
    `metrics` as its own consumer group, never disturbs the run; exits 1 when the run has no topics (--watch waits)."""
    from rich.console import Console

    from astraflow.monitor import observe_run

    bus_admin(cfg := load(config, overrides))
    if (monitor := observe_run(cfg.metrics_section(), seconds, wait=watch)) is None:
        raise typer.Exit(1)
    try:
        if as_json:
            print(json.dumps(monitor.snapshot()), flush=True)
        elif watch:
            monitor.show_live()
        else:
            Console().print(monitor.table())
    finally:
        monitor.close()


@app.command("eval")
def eval_(config: Path = CONFIG, overrides: Optional[list[str]] = OVERRIDES,
          policy: Optional[str] = typer.Option(None, "--policy", help="the policy to evaluate (default: the only one)"),
          benchmark: Optional[list[str]] = typer.Option(None, "--benchmark",
                                                        help="a built-in source or dataset path; repeatable "
                                                             "(default: eval.benchmarks, else gsm8k math500 humaneval mbpp)"),
          k: Optional[int] = typer.Option(None, "--k", help="samples per prompt (default: eval.k)"),
          temperature: Optional[float] = typer.Option(None, "--temperature", help="default: eval.temperature"),
          limit: Optional[int] = typer.Option(None, "--limit", help="first N prompts per benchmark (default: eval.limit)"),
          max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens",
                                                       help="default: sampling.max_new_tokens"),
          live: bool = typer.Option(False, "--live", help="follow `weights`: evaluate each new version and publish "
                                                          "an eval Metric, until SIGTERM / Ctrl-C")) -> None:
    """pass@1 as avg@k (k samples per prompt at temperature T) of a policy on benchmarks.
    Offline: the newest version in the store (else the base model); prints a table and a JSON line
    {"policy", "version", "results": {bench: {"pass@1", "stderr", "n", "k"}}}. With --live it runs as its
    own component `eval.<policy>` and publishes Metric(kind="eval") to the run's `metrics` topic."""
    from rich.console import Console
    from rich.table import Table

    from consumers.evaluation_run import EvalRefused, WeightsNotLoaded, main, plan

    cfg, policy = load_policy(config, overrides, policy)
    try:
        evaluation = plan(cfg.eval_section(policy), benchmarks=benchmark, k=k, temperature=temperature, limit=limit,
                          max_new_tokens=max_new_tokens)
    except EvalRefused as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2)
    try:
        result = main(evaluation, setup_component(f"eval.{policy}", cfg) if live else None)
    except WeightsNotLoaded as e:
        typer.echo(f"cannot load the newest weights of {policy!r}: {e}", err=True)
        raise typer.Exit(1)
    if result is None:  # live: its results went to `metrics`
        return
    table = Table("benchmark", "n", "k", "pass@1 (avg@k)", "± stderr",
                  title=f"{policy} v{result.version}, T={evaluation.section.temperature}")
    for name, b in result.benchmarks.items():
        table.add_row(name, str(b.n), str(b.k), f"{b.pass_at_1:.4f}", f"{b.stderr:.4f}")
    Console().print(table)
    print(json.dumps({"policy": policy, "version": result.version, "results": result.summary()}), flush=True)


@app.command()
def version() -> None:
    """Print the AstraFlow version."""
    typer.echo(importlib.metadata.version("astraflow"))


@app.command("verify-rewards")
def verify_rewards(
    dataset: str = typer.Option(..., "--dataset", help="a built-in source (gsm8k, math500, humaneval, mbpp, ...) or a JSONL/parquet file"),
    answer_field: str = typer.Option(None, "--answer-field", help="read the gold answer from this field (a list: "
                                                                   "its first element)"),
    limit: int = typer.Option(0, "--limit", help="check only the first N prompts (0: all)"),
    timeout_s: float = typer.Option(10.0, "--timeout", help="per-item reward timeout, seconds"),
) -> None:
    """Score each gold answer and a perturbed wrong one; print disagreements, then a JSON line
    {"gold_accept", "wrong_reject", "n"}. Records that cannot be made a prompt are skipped, with their
    count and the first one's path:line and reason (e.g. the missing field and the fields it has) on
    stderr. Exits 1 when there is any disagreement (a gold answer rejected or a wrong one accepted), 2 when
    no record is left, else 0."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from producers.rewards import check_rewards
    from producers.sources import SourceError, load_source

    try:
        source = load_source(dataset, answer_field=answer_field)
    except SourceError as e:
        typer.echo(f"--dataset {dataset!r}: {e}", err=True)
        raise typer.Exit(2)
    prompts, errors = source.head(limit)
    if errors:
        typer.echo(f"skipped {len(errors)} of {len(prompts) + len(errors)} record(s) that cannot be made a prompt; "
                   f"the first: {errors[0]}", err=True)
    if not prompts:
        hint = "" if answer_field else " (--answer-field names the gold answer's field)"
        typer.echo(f"--dataset {dataset!r}: no record to score{hint}", err=True)
        raise typer.Exit(2)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"scoring {source.name}", total=2 * len(prompts))
        result = check_rewards(prompts, timeout_s=timeout_s, on_done=lambda: progress.advance(task))
    if result.disagreements:
        table = Table("index", "kind", "gold", "completion", "score", title="disagreements")
        for p, kind, completion, score in result.disagreements:
            gold = p.answer if p.answer is not None else str(p.metadata.get("task_id", ""))
            table.add_row(str(p.metadata.get("index")), kind, gold[:40], completion.strip()[:60], f"{score:g}")
        Console().print(table)
    print(json.dumps(result.summary()), flush=True)
    if result.disagreements:
        raise typer.Exit(1)
