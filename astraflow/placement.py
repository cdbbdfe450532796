"""Placing components on this machine's CPUs: ``astraflow run`` gives each kind of component its own cores and
thread count (``placement:`` in the run config, :class:`~astraflow.config.PlacementConfig`), as one gives
processes GPUs.

The launcher passes a component its placement in its environment (:func:`placement_env`: the CPU ids in
``ASTRAFLOW_CPUS``, the thread count as ``OMP_NUM_THREADS``, which torch reads when it starts), and the
component pins itself before it loads anything (:func:`apply_placement`, from each command's setup), so every
thread it ever starts inherits the affinity. A ``torchrun`` trainer's ranks inherit the environment: each pins
itself to the same CPUs.
"""
from __future__ import annotations

import os

from astraflow.config import ConfigError, Placement, RunConfig

CPUS_ENV = "ASTRAFLOW_CPUS"


def check_placement(cfg: RunConfig) -> None:
    """Refuse a placement this machine cannot honour.

    Raises:
        astraflow.config.ConfigError: ``placement.<kind>.cpus`` names a CPU this process may not run on
            (absent, offline, or outside its own affinity), naming the field and the CPUs there are.
    """
    available = os.sched_getaffinity(0)
    for kind, placement in cfg.placement:
        missing = sorted(set(placement.cpus or ()) - available)
        if missing:
            raise ConfigError(f"placement.{kind}.cpus: CPUs {missing} are not available here "
                              f"(this machine offers {sorted(available)})")


def placement_env(placement: Placement) -> dict[str, str]:
    """The environment variables that carry ``placement`` to a component: ``ASTRAFLOW_CPUS`` (comma-separated
    CPU ids) and ``OMP_NUM_THREADS``; only those set."""
    env = {}
    if placement.cpus:
        env[CPUS_ENV] = ",".join(str(c) for c in placement.cpus)
    if placement.threads:
        env["OMP_NUM_THREADS"] = str(placement.threads)
    return env


def apply_placement() -> str:
    """In a component: pin this process to the CPUs in ``ASTRAFLOW_CPUS`` (if set), before it starts threads.

    Returns:
        Where it runs, for its log: e.g. ``"cpus [0], 1 thread(s)"``.

    Raises:
        ValueError: ``ASTRAFLOW_CPUS`` is not a comma-separated list of CPU ids.
        OSError: the CPUs are not available to this process.
    """
    cpus = os.environ.get(CPUS_ENV)
    if cpus:
        try:
            ids = {int(c) for c in cpus.split(",")}
        except ValueError:
            raise ValueError(f"{CPUS_ENV}={cpus!r}: expected comma-separated CPU ids, e.g. 0,1") from None
        os.sched_setaffinity(0, ids)
    return f"cpus {sorted(os.sched_getaffinity(0))}, {os.environ.get('OMP_NUM_THREADS', 'default')} thread(s)"


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
