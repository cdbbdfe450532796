"""The launcher's first line for a run its bus already holds progress of (the same command again: the run
resumes, and a complete one trains nothing and prints the earlier launch's summary): where each trainer resumes,
and that nothing is left to train. A real (embedded) bus."""
from rich.console import Console

from astraflow.config import load_config
from astraflow.launcher.outputs import resumption, trainer_versions
from topics.bus import connect
from topics.codec import encode, headers_for
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import TrainerProgress


def progress_of(tmp_path, cfg, versions: dict[str, int]) -> dict[str, int]:
    """Each trainer's version as the launcher reads it from a bus whose control topic holds ``versions``."""
    bus, names = connect(cfg.bus), TopicNames(cfg.run)
    ensure_run_topics(bus.admin(), names, list(cfg.policies))
    producer = bus.producer()
    for policy, version in versions.items():
        progress = TrainerProgress(policy=policy, version=version, consumed=16 * version, finished=True)
        producer.send(names.control, encode(progress), key=f"trainer.{policy}", headers=headers_for(progress))
    producer.flush()
    return trainer_versions(cfg, names, Console(record=True))


def test_a_new_run_has_no_line_a_resumed_one_says_where_and_a_complete_one_that_nothing_is_trained(tmp_path):
    cfg = load_config("examples/solver-verifier-tiny.yaml", ["run=again", f"run_dir={tmp_path / 'run'}"])
    assert resumption(cfg, progress_of(tmp_path, cfg, {})) is None

    line = resumption(cfg, progress_of(tmp_path, cfg, {"solver": 3}))
    assert line.startswith(f"resuming run again from what its bus and {cfg.run_dir} hold: trainer.solver at "
                           "version 3 of 5 steps, trainer.verifier at version 0 of 5 steps"), line
    assert "nothing is trained" not in line

    line = resumption(cfg, progress_of(tmp_path, cfg, {"solver": 5, "verifier": 5}))
    assert "trainer.solver at version 5 of 5 steps, trainer.verifier at version 5 of 5 steps; every trainer has " \
           "reached its steps, so nothing is trained (a new run: another run= or run_dir=" in line, line
