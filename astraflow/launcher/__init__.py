"""The single-machine launcher behind ``astraflow run``, one concept per module.

It starts each component as its own process (acquisition, N RaaS workers, one
filter processor and one trainer per policy, a vLLM server per policy whose
``engine: vllm`` names no ``vllm.url``, and the search tool's server ``search`` when
``tools.search`` names no ``url``: the others start once it answers ``/health``), each
with a log file in ``<run_dir>/logs``. It never calls them: they meet on the bus and the store.
A live view shows step, version, reward, KL, throughput, lag and staleness.

The run ends when every trainer has produced its ``steps`` versions (or after
``max_wall_s``, or on Ctrl-C). Components are then stopped with SIGTERM, which
they handle by finishing their current unit of work and committing, so nothing
is lost. The summary's ``complete`` says whether every trainer reached its steps;
``astraflow run`` exits non-zero when not.

- :mod:`~astraflow.launcher.plan`: the processes of a run and their command lines.
- :mod:`~astraflow.launcher.supervision`: starting, stopping and restarting them (a back-off like
  Kubernetes' CrashLoopBackOff).
- :mod:`~astraflow.launcher.view`: the live view's thread and its console alerts.
- :mod:`~astraflow.launcher.watchdog`: stalled trainers, and a run whose data ran out.
- :mod:`~astraflow.launcher.scaling`: RaaS workers scaled to the controller's target (actuator ``local``).
- :mod:`~astraflow.launcher.outputs`: ``components.json``, ``metrics.jsonl``, ``reward_curve.png``, the summary.
- :mod:`~astraflow.launcher.preflight`: what the config names, checked before any process starts.
- :mod:`~astraflow.launcher.run`: :class:`~astraflow.launcher.run.Launcher`, which puts them together.

What a launched component needs from this contract is in :mod:`astraflow.launched`, which does not import
this package.
"""
