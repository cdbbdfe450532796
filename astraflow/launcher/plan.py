"""The process plan of a run: which components ``astraflow run`` starts, in which order, with which command
lines (each ``python -m astraflow <command> CONFIG [overrides]``; the servers with their own)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from astraflow.config import ConfigError, RunConfig
from astraflow.launched import policy_component


@dataclass
class Component:
    """One launched process: its name, command line, log file and exit state."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    reported: bool = field(default=False)
    restarts: int = 0        # in all
    backoff_step: int = 0    # restarts since a process of it last ran HEALTHY_S seconds: its next delay doubles with it
    got_going: bool = False  # a process of it ran STARTED_S seconds
    start_failures: int = 0  # exits of its own (not a signal from outside) before it got going
    started_at: float = 0.0  # monotonic
    restart_at: float | None = None  # monotonic time of a scheduled restart
    retired: bool = False  # stopped on purpose (scaled down): not restarted, not a failure
    env: dict[str, str] | None = None  # its whole environment (None: the launcher's, see Supervisor.start)
    #: a server's URL: the components after it start once ``GET <ready_url>/health`` answers (Launcher.run)
    ready_url: str | None = None

    @property
    def kind(self) -> str:
        """Its kind, the name up to the first ``.`` or ``-`` (``trainer``, ``policy``, ``raas``, ``vllm``, ...):
        placement and supervision go by it."""
        return self.name.split(".")[0].split("-")[0]


def component_argv(command: str, config_path: Path, overrides: list[str], *extra: str) -> list[str]:
    """The command line of one component: ``python -m astraflow <command> CONFIG [overrides] [extra]``."""
    return [sys.executable, "-m", "astraflow", command, str(config_path), *overrides, *extra]


def trainer_argv(ranks: int, config_path: Path, overrides: list[str], policy: str) -> list[str]:
    """The command line of policy ``policy``'s trainer: ``python -m astraflow trainer CONFIG [overrides]
    --policy P`` on one rank; under ``python -m torch.distributed.run --standalone --nproc_per_node
    ranks`` (torchrun: one process per rank, ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set) when
    ``ranks`` > 1."""
    argv = component_argv("trainer", config_path, overrides, "--policy", policy)
    if ranks <= 1:
        return argv
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            *argv[1:]]


def vllm_components(cfg: RunConfig, logs: Path) -> tuple[list[Component], list[str]]:
    """A vLLM server component per policy with ``engine: vllm`` and no ``vllm.url``, on ``vllm.port`` (None: a
    free port), in the dtype its trainer publishes; and the RaaS options that point the workers at them
    (``--vllm-url <p>=http://127.0.0.1:<port>``)."""
    from producers.ports import free_port
    from producers.vllm_server import server_argv, server_env
    from weights.models import resolve_model

    comps, urls = [], []
    for p, pc in cfg.policies.items():
        if pc.engine != "vllm" or pc.vllm.url is not None:
            continue
        port = pc.vllm.port or free_port()
        argv = [str(pc.vllm.python), "-m", "producers.vllm_server",
                *server_argv(pc.vllm.python, resolve_model(pc.model), port, pc.trainer.param_dtype,
                             pc.vllm.max_model_len, pc.vllm.args)]
        comps.append(Component(f"vllm.{p}", argv, logs / f"vllm.{p}.log",
                               env=server_env(dict(os.environ), pc.vllm.kv_cache_gib)))
        urls += ["--vllm-url", f"{p}=http://127.0.0.1:{port}"]
    return comps, urls


def search_components(cfg: RunConfig, logs: Path) -> tuple[list[Component], list[str]]:
    """The search tool's server, component ``search`` (``astraflow search-server``), when ``tools.search`` is set
    with no ``url``, on ``tools.search.port`` (None: a free port); and the RaaS options that point the workers at it
    (``--search-url http://127.0.0.1:<port>``)."""
    s = cfg.tools.search
    if s is None or s.url is not None:
        return [], []
    from producers.ports import free_port

    port = s.port or free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "astraflow", "search-server", "--port", str(port),
            "--median-s", repr(s.latency.median_s), "--p99-s", repr(s.latency.p99_s),
            "--hang", repr(s.faults.hang), "--error", repr(s.faults.error), "--garbage", repr(s.faults.garbage),
            "--hang-s", repr(s.faults.hang_s), "--seed", str(s.seed),
            *(["--corpus", str(s.corpus)] if s.corpus is not None else [])]
    return [Component("search", argv, logs / "search.log", ready_url=url)], ["--search-url", url]


def openenv_components(cfg: RunConfig, logs: Path) -> tuple[list[Component], list[str]]:
    """The OpenEnv environment server, component ``openenv``, when the workflow is ``openenv`` with
    ``options.command`` (its command line, ``{port}`` replaced by a free port); and the override that gives the RaaS
    workers its URL (``workflow.options.url=http://127.0.0.1:<port>``).

    Raises:
        astraflow.config.ConfigError: both ``options.command`` and ``options.url``, or a command that does not
            split (shlex) or has no ``{port}``.
    """
    options = cfg.workflow.options
    if cfg.workflow.name != "openenv" or options.get("command") is None:
        return [], []
    if options.get("url") is not None:
        raise ConfigError("workflow.options: give the OpenEnv server's url or the command that starts it, not both")
    command = str(options["command"])
    if "{port}" not in command:
        raise ConfigError(f"workflow.options.command {command!r} has no {{port}}: the server must listen where the "
                          "workers are told it is")
    from producers.ports import free_port

    port = free_port()
    try:
        argv = [a.replace("{port}", str(port)) for a in shlex.split(command)]
    except ValueError as e:
        raise ConfigError(f"workflow.options.command {command!r}: {e}") from None
    url = f"http://127.0.0.1:{port}"
    return [Component("openenv", argv, logs / "openenv.log", ready_url=url)], [f"workflow.options.url={url}"]


def plan_components(cfg: RunConfig, config_path: Path, overrides: list[str]) -> list[Component]:
    """The processes of a run, in start order: the search server when ``tools.search`` is set without a ``url``,
    the OpenEnv server when the ``openenv`` workflow has a ``command``, vLLM servers, trainers and filters, then
    RaaS, then acquisition, then the scaling controller when ``controller.enabled``, then the Prometheus exporter
    when ``exporter.port`` is set, then the TensorBoard/W&B tracker when ``tracking.tensorboard_dir`` or
    ``tracking.wandb_project`` is set."""
    logs = cfg.run_dir / "logs"
    comps, server_urls = search_components(cfg, logs)
    openenv, openenv_url = openenv_components(cfg, logs)
    comps += openenv
    vllm, vllm_urls = vllm_components(cfg, logs)
    comps += vllm
    server_urls += vllm_urls
    for p in cfg.policies:
        comps.append(Component(f"trainer.{p}", trainer_argv(cfg.policies[p].trainer.ranks, config_path, overrides, p),
                               logs / f"trainer.{p}.log"))
        for i in range(cfg.policies[p].filter_processor.instances):
            name = policy_component(p, i)
            comps.append(Component(name, component_argv("policy", config_path, overrides, "--policy", p,
                                                         "--instance", str(i)), logs / f"{name}.log"))
    for i in range(cfg.raas.workers):
        comps.append(Component(f"raas-{i}", component_argv("raas", config_path, overrides + openenv_url,
                                                            "--worker-id", str(i),
                                                            *server_urls), logs / f"raas-{i}.log"))
    comps.append(Component("acquire", component_argv("acquire", config_path, overrides), logs / "acquire.log"))
    if cfg.controller.enabled:
        comps.append(Component("controller", component_argv("controller", config_path, overrides),
                               logs / "controller.log"))
    if cfg.exporter.port is not None:
        comps.append(Component("exporter", component_argv("exporter", config_path, overrides), logs / "exporter.log"))
    if cfg.tracking.enabled:
        comps.append(Component("tracker", component_argv("tracker", config_path, overrides), logs / "tracker.log"))
    return comps
