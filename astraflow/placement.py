"""Placing components on this machine's CPUs: ``astraflow run`` gives each kind of component its own cores, thread
count and niceness (``placement:`` in the run config, :class:`~astraflow.config.PlacementConfig`), as one gives
processes GPUs; a policy's trainer can be placed apart (``policies.<p>.trainer_placement``, field by field over
``placement.trainer``).

The launcher passes a component its placement in its environment (:func:`placement_env`: the CPU ids in
``ASTRAFLOW_CPUS``, the thread count as ``OMP_NUM_THREADS``, which torch reads when it starts, the niceness in
``ASTRAFLOW_NICE``), and the component places itself before it loads anything (:func:`apply_placement`, from each
command's setup), so every thread it ever starts inherits the affinity and the niceness (per thread on Linux). A
``torchrun`` trainer's ranks inherit the environment: each places itself the same way.

Niceness lets the busiest stage have its core when more components are runnable than there are cores: with three
busy processes on two cores, the OS gives each two thirds of a core, and a stage that needs more than that sets the
pace of the whole pipeline (``scripts/bench_multipolicy.py``).
"""
from __future__ import annotations

import os

from astraflow.config import ConfigError, Placement, RunConfig

CPUS_ENV = "ASTRAFLOW_CPUS"
NICE_ENV = "ASTRAFLOW_NICE"


def component_placement(cfg: RunConfig, name: str, kind: str) -> Placement | None:
    """The placement of component ``name`` of ``kind``: ``placement.<kind>``, and for a policy's trainer
    (``trainer.<policy>``) each field its ``trainer_placement`` sets in place of that; None for a kind that
    ``placement`` does not name (vLLM servers are placed by their own options)."""
    placement = getattr(cfg.placement, kind, None)
    policy = cfg.policies.get(name.split(".", 1)[1]) if kind == "trainer" and "." in name else None
    if placement is None or policy is None:
        return placement
    return placement.model_copy(update=policy.trainer_placement.model_dump(exclude_unset=True))


def check_placement(cfg: RunConfig) -> None:
    """Refuse a placement this machine cannot honour.

    Raises:
        astraflow.config.ConfigError: ``placement.<kind>.cpus`` (or a policy's ``trainer_placement.cpus``) names a
            CPU this process may not run on (absent, offline, or outside its own affinity), naming the field and
            the CPUs there are; or a ``nice`` is below this process's own niceness (a placement only yields the
            CPU: raising a priority needs privileges a component may lack).
    """
    available = os.sched_getaffinity(0)
    own_nice = os.getpriority(os.PRIO_PROCESS, 0)
    fields = [(f"placement.{kind}", p) for kind, p in cfg.placement] + \
        [(f"policies.{name}.trainer_placement", p.trainer_placement) for name, p in cfg.policies.items()]
    for field, placement in fields:
        missing = sorted(set(placement.cpus or ()) - available)
        if missing:
            raise ConfigError(f"{field}.cpus: CPUs {missing} are not available here "
                              f"(this machine offers {sorted(available)})")
        if placement.nice is not None and placement.nice < own_nice:
            raise ConfigError(f"{field}.nice: {placement.nice} is below the launcher's own niceness {own_nice}; a "
                              "placement only yields the CPU (use at least that, or start the launcher at it)")


def placement_env(placement: Placement) -> dict[str, str]:
    """The environment variables that carry ``placement`` to a component: ``ASTRAFLOW_CPUS`` (comma-separated
    CPU ids), ``OMP_NUM_THREADS`` and ``ASTRAFLOW_NICE``; only those set."""
    env = {}
    if placement.cpus:
        env[CPUS_ENV] = ",".join(str(c) for c in placement.cpus)
    if placement.threads:
        env["OMP_NUM_THREADS"] = str(placement.threads)
    if placement.nice is not None:
        env[NICE_ENV] = str(placement.nice)
    return env


def apply_placement() -> str:
    """In a component: pin this process to the CPUs in ``ASTRAFLOW_CPUS`` and set its niceness to
    ``ASTRAFLOW_NICE`` (each if set), before it starts threads.

    Returns:
        Where it runs, for its log: e.g. ``"cpus [0], 1 thread(s), nice 10"``.

    Raises:
        ValueError: ``ASTRAFLOW_CPUS`` is not a comma-separated list of CPU ids, or ``ASTRAFLOW_NICE`` not an
            integer.
        OSError: the CPUs are not available to this process, or the niceness is below its own without privilege.
    """
    cpus = os.environ.get(CPUS_ENV)
    if cpus:
        try:
            ids = {int(c) for c in cpus.split(",")}
        except ValueError:
            raise ValueError(f"{CPUS_ENV}={cpus!r}: expected comma-separated CPU ids, e.g. 0,1") from None
        os.sched_setaffinity(0, ids)
    nice = os.environ.get(NICE_ENV)
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, int(nice))
        except ValueError:
            raise ValueError(f"{NICE_ENV}={nice!r}: expected an integer niceness, e.g. 10") from None
    where = f"cpus {sorted(os.sched_getaffinity(0))}, {os.environ.get('OMP_NUM_THREADS', 'default')} thread(s)"
    return where + (f", nice {os.getpriority(os.PRIO_PROCESS, 0)}" if nice else "")


def placement_overrides(specs: list[str]) -> list[str]:
    """Run-config overrides from a bench's ``--place KIND=CPUS[:THREADS]`` arguments, e.g. ``trainer=0:1``
    (the trainer on CPU 0 with 1 thread) or ``raas=1`` (RaaS workers on CPU 1); CPUs comma-separated.

    Raises:
        ValueError: a spec not of that form (the config then checks the kind and the CPUs).
    """
    out = []
    for spec in specs:
        kind, sep, where = spec.partition("=")
        cpus, _, threads = where.partition(":")
        if not sep or not kind or not cpus or not all(c.strip().isdigit() for c in cpus.split(",")) \
                or (threads and not threads.isdigit()):
            raise ValueError(f"--place {spec!r}: expected KIND=CPUS[:THREADS], e.g. trainer=0:1 or raas=1,2")
        out.append(f"placement.{kind}.cpus=[{cpus}]")
        if threads:
            out.append(f"placement.{kind}.threads={threads}")
    return out
