"""What a run leaves in its run directory: ``components.json`` (each component's pid, exit code and restarts, kept
current while the run goes), ``metrics.jsonl`` (every Metric record), ``reward_curve.png``; and the summary that
``astraflow run`` prints."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from rich.console import Console

from astraflow.config import RunConfig
from topics.atomic_write import atomic_write
from astraflow.launcher.plan import Component
from astraflow.monitor import RunMonitor
from topics.bus import BusError, connect
from topics.follow import LatestByKey
from topics.names import TopicNames
from topics.schemas import TrainerProgress


def write_components(components: list[Component], run_dir: Path) -> None:
    """``components.json`` in ``run_dir``: per component its ``pid`` (the live or last process), ``exit_code``
    (None while it runs) and ``restarts``; rewritten atomically at each start, each exit and at the end, so
    operators and fault tools can find the live processes."""
    codes = {c.name: {"pid": c.proc.pid if c.proc else None,
                      "exit_code": c.proc.poll() if c.proc else None, "restarts": c.restarts}
             for c in components}
    atomic_write(run_dir / "components.json", json.dumps(codes, indent=1))


def reward_summary(history: list[tuple[int, float]]) -> tuple[float | None, float | None, float | None]:
    """Mean training reward over the first and the last 20% of ``history``'s (step, reward) steps (k steps, at least
    one), and the best mean of any k consecutive steps (a run that learned and then fell back shows it in its best
    window, not in its last); a step that appears more than once counts once, with its newest reward."""
    if not history:
        return None, None, None
    rewards = [r for _, r in sorted(dict(history).items())]  # one per step: the newest, if a step was redone
    k = max(1, len(rewards) // 5)
    sums = [sum(rewards[:k])]
    for i in range(k, len(rewards)):  # the sliding window's sum, one step on
        sums.append(sums[-1] + rewards[i] - rewards[i - k])
    return sums[0] / k, sums[-1] / k, max(sums) / k


def plot_rewards(views: dict, path: Path) -> None:
    """Write a reward-curve PNG: training reward mean per step, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, v in views.items():
        if v.history:
            steps, rewards = zip(*sorted(v.history))
            ax.plot(steps, rewards, label=policy)
    ax.set_xlabel("trainer step (version)")
    ax.set_ylabel("training reward (group mean)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def trainer_versions(cfg: RunConfig, names: TopicNames, console: Console) -> dict[str, int]:
    """Each trainer's last reported version (its :class:`TrainerProgress` on ``control``); empty, with a console
    line, when the bus does not answer within 30 s."""
    follower = LatestByKey(connect(cfg.bus, cfg.kafka), names.control, TrainerProgress, client_id="launcher")
    try:
        latest = follower.read_to_end(timeout_s=30.0)
    except BusError as e:
        console.print(f"[yellow]cannot read the trainers' progress: {e}[/]")
        return {}
    finally:
        follower.close()
    return {m.policy: m.version for m in latest.values()}


def resumption(cfg: RunConfig, versions: Mapping[str, int]) -> str | None:
    """The launcher's line for a run whose bus already holds its trainers' progress (an earlier launch of the same
    ``run`` on the same bus, e.g. the same command again): where each trainer resumes (``versions``: each one's
    last reported version, :func:`trainer_versions`), and, when every one has reached its ``steps``, that nothing
    is left to train, so the summary will be the earlier launch's. None for a new run (no progress)."""
    if not versions:
        return None
    at = ", ".join(f"trainer.{p} at version {versions.get(p, 0)} of {pc.steps} steps" for p, pc in cfg.policies.items())
    line = f"resuming run {cfg.run} from what its bus and {cfg.run_dir} hold: {at}"
    if all(versions.get(p, 0) >= pc.steps for p, pc in cfg.policies.items()):
        line += ("; every trainer has reached its steps, so nothing is trained (a new run: another run= or run_dir=; "
                 "more training: raise policies.<policy>.steps)")
    return line


def write_outputs(cfg: RunConfig, names: TopicNames, components: list[Component], monitor: RunMonitor,
                  wall_s: float, console: Console) -> dict:
    """Write the run directory's outputs (module docstring) and return the summary: ``run``, ``complete`` (every
    trainer exited 0 and reported its ``steps`` versions), ``restarts`` (of all components), ``steps``,
    ``versions`` (per policy), ``reward_first`` / ``reward_last`` / ``reward_best`` (:func:`reward_summary` of the
    config's first policy, rounded to 4 places), ``final_over_best`` (reward_last / reward_best: 1 for a run that
    ended at its peak; None when reward_best is None or 0), ``collapses`` (per policy, its newest collapse alert:
    :mod:`trainer.collapse`), ``dead_letters`` and ``wall_s`` (seconds, rounded to 0.1)."""
    run_dir = cfg.run_dir
    write_components(components, run_dir)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for m in monitor.records:
            f.write(json.dumps(m.model_dump(mode="json")) + "\n")
    plot_rewards(monitor.views, run_dir / "reward_curve.png")
    # the rewards follow the first policy of the config (the solver, the actor, ...).
    first, last, best = reward_summary(next(iter(monitor.views.values())).history)
    trainers_done = all(c.proc is not None and c.proc.returncode == 0 for c in components if c.kind == "trainer")
    versions = trainer_versions(cfg, names, console)
    versions_done = all(versions.get(p, 0) >= pc.steps for p, pc in cfg.policies.items())
    return {
        "run": cfg.run,
        "complete": trainers_done and versions_done,
        "restarts": sum(c.restarts for c in components),
        "steps": max((v.step for v in monitor.views.values()), default=0),
        "versions": {p: versions.get(p, v.version) for p, v in monitor.views.items()},
        "reward_first": None if first is None else round(first, 4),
        "reward_last": None if last is None else round(last, 4),
        "reward_best": None if best is None else round(best, 4),
        "final_over_best": round(last / best, 4) if last is not None and best is not None and best > 0 else None,
        "collapses": {p: v.collapse for p, v in monitor.views.items() if v.collapse},
        "dead_letters": monitor.dead_letters,
        "wall_s": round(wall_s, 1),
    }
