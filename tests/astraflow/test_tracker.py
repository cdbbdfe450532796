"""The TensorBoard/W&B tracker: its own consumer group on `metrics`, every figure of every component written at its
step, offsets committed only after the write is on disk (a restart, clean or not, writes nothing twice and loses
nothing), W&B offline; the config and the missing packages refused with the field named.

The sinks' packages are in the `tracking` install profile, not in `dev`: the tests that write need them and are
skipped, with the reason, where they are not installed."""
import json
import os
import struct
import subprocess
import sys
import time
import uuid
from importlib.util import find_spec
from pathlib import Path

import pytest
from typer.testing import CliRunner

from astraflow.cli import app
from astraflow.config import ConfigError, TrackingConfig, load_config
from astraflow.launcher.plan import plan_components
from astraflow.tracker import MetricsTracker, record_step
from topics.bus import connect
from topics.codec import encode, headers_for
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import Metric

ROOT = Path(__file__).resolve().parents[2]
NO_PROFILE = "not installed here: it is in the tracking profile (scripts/install.sh tracking), not in dev"
needs_tensorboard = pytest.mark.skipif(find_spec("tensorboard") is None, reason=f"tensorboard is {NO_PROFILE}")
needs_wandb = pytest.mark.skipif(find_spec("wandb") is None, reason=f"wandb is {NO_PROFILE}")

T0 = 1_790_000_000.0  # the timestamps of the records sent (seconds since the epoch)


def send(bus, names: TopicNames, *records: Metric) -> None:
    producer = bus.producer()
    for m in records:
        producer.send(names.metrics, encode(m), key=m.component, headers=headers_for(m))
    producer.close()


def trainer_step(step: int, reward: float) -> Metric:
    return Metric(component="trainer.actor", kind="trainer", policy="actor", step=step, ts=T0 + step,
                  values={"reward_mean": reward, "kl": step / 100, f"staleness_hist/{step % 2}": 16.0})


def scalars(logdir: Path, tag: str) -> list[tuple[int, float, float]]:
    """(step, value, wall time) of every ``tag`` scalar in the event files of ``logdir``, as written: nothing
    purged, nothing sampled away."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    return [(e.step, round(e.value, 6), e.wall_time) for e in acc.Scalars(tag)]


def read_until(tracker: MetricsTracker, n: int, timeout_s: float = 30.0) -> None:
    """Poll until ``n`` records were read (``flush_every_s`` is long: nothing is flushed meanwhile)."""
    got, deadline = 0, time.monotonic() + timeout_s
    while got < n:
        got += tracker.poll(0.5)
        assert time.monotonic() < deadline, f"read {got} of {n} records"


def committed(bus, group: str, topic: str) -> int:
    return sum(o or 0 for o in bus.admin().group_offsets(group, topic).values())


@needs_tensorboard
def test_every_figure_is_written_at_its_step_and_restarts_write_nothing_twice(bus_url, tmp_path):
    names = TopicNames(f"trk{uuid.uuid4().hex[:8]}")
    bus = connect(bus_url)
    ensure_run_topics(bus.admin(), names, ["actor"])
    tracking = TrackingConfig(tensorboard_dir=tmp_path / "tb", flush_every_s=3600)
    group, tb = f"{names.run}.tracker", tmp_path / "tb" / names.run
    send(bus, names, trainer_step(1, 0.25), trainer_step(2, 0.5),
         Metric(component="raas-0", kind="raas", ts=T0 + 0.7, values={"groups_total": 32.0, "version.actor": 1.0}),
         Metric(component="filter.actor.0", kind="policy", policy="actor", ts=T0 + 3.2, values={"kept": 8.0}),
         Metric(component="trainer.actor", kind="trainer", policy="actor", ts=T0 + 3.5,
                values={"publish_errors": 1.0, "durable_version": 1.0, "version": 2.0, "publish_failing": 1.0}))

    tracker = MetricsTracker(bus, names, ["actor"], "single_turn", tracking, tmp_path)
    read_until(tracker, 5)
    assert committed(bus, group, names.metrics) == 0  # read, not yet written: not committed
    assert not (tb / "trainer.actor").exists()
    tracker.flush()
    assert committed(bus, group, names.metrics) == 5
    assert scalars(tb / "trainer.actor", "reward_mean") == [(1, 0.25, T0 + 1), (2, 0.5, T0 + 2)]
    assert scalars(tb / "trainer.actor", "staleness_hist/0") == [(2, 16.0, T0 + 2)]
    assert scalars(tb / "trainer.actor", "publish_errors") == [(2, 1.0, T0 + 3.5)]  # at the version it names
    assert scalars(tb / "raas-0", "version.actor") == [(int(T0), 1.0, T0 + 0.7)]  # no step: its time
    assert scalars(tb / "filter.actor.0", "kept") == [(int(T0 + 3.2), 8.0, T0 + 3.2)]
    tracker.close()  # a clean stop

    send(bus, names, trainer_step(3, 0.75))
    tracker = MetricsTracker(bus, names, ["actor"], "single_turn", tracking, tmp_path)
    read_until(tracker, 1)  # only the new record: the rest was committed
    tracker.poll(0.5)
    tracker.flush()
    assert tracker.written == 1
    send(bus, names, trainer_step(4, 1.0))
    read_until(tracker, 1)
    tracker.monitor.close()  # dies after reading step 4, before writing it: nothing of it was committed

    tracker = MetricsTracker(bus, names, ["actor"], "single_turn", tracking, tmp_path)
    tracker.drain()
    tracker.close()
    assert tracker.written == 1
    assert [s[:2] for s in scalars(tb / "trainer.actor", "reward_mean")] == [(1, 0.25), (2, 0.5), (3, 0.75),
                                                                             (4, 1.0)]
    assert committed(bus, group, names.metrics) == 7


@needs_wandb
def test_wandb_offline_gets_every_figure_on_its_components_axis_and_a_restart_resumes_the_run(tmp_path,
                                                                                              monkeypatch):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    names = TopicNames(f"trk{uuid.uuid4().hex[:8]}")
    bus = connect(f"local://{tmp_path / 'bus'}")
    ensure_run_topics(bus.admin(), names, ["actor"])
    tracking = TrackingConfig(wandb_project="astraflow-test", wandb_mode="offline", flush_every_s=3600)
    send(bus, names, trainer_step(1, 0.25), trainer_step(2, 0.5),
         Metric(component="raas-0", kind="raas", ts=T0 + 0.7, values={"groups_total": 32.0}))
    for _ in range(2):  # the second tracker reads nothing new, and resumes the same W&B run
        tracker = MetricsTracker(bus, names, ["actor"], "single_turn", tracking, tmp_path)
        tracker.drain()
        tracker.close()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    run_id = (tmp_path / "tracker" / "wandb_run_id").read_text()
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), runs
    rows = [row for r in runs for row in wandb_history(next(r.glob("run-*.wandb")))]
    assert [(row["trainer.actor/step"], row["trainer.actor/reward_mean"]) for row in rows
            if "trainer.actor/step" in row] == [(1, 0.25), (2, 0.5)]
    assert [(row["raas-0/step"], row["raas-0/groups_total"]) for row in rows if "raas-0/step" in row] == \
           [(int(T0), 32.0)]


def wandb_history(path: Path) -> list[dict]:
    """The rows ``run.log`` wrote to an offline W&B run's ``.wandb`` file (W&B's LevelDB-log framing: a 7-byte
    file header, 32 KiB blocks of chunks with a 7-byte header each: crc32, length, type; each record a protobuf
    ``Record``; a key is in ``key`` or, as W&B writes it, in ``nested_key``), without W&B's ``_`` keys."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunks, rows = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if room < 7 or (length, kind) == (0, 0):
            pos += room  # the rest of the block is padding
            continue
        chunks, pos = chunks + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                row = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def test_a_record_is_placed_at_its_step_else_its_version_else_its_time():
    assert record_step(Metric(component="c", step=7, values={"version": 3.0}, ts=T0)) == 7
    assert record_step(Metric(component="c", values={"version": 3.0}, ts=T0)) == 3
    assert record_step(Metric(component="c", values={"x": 1.0}, ts=T0 + 0.9)) == int(T0)


def test_the_tracking_section_is_checked_and_makes_astraflow_run_start_the_tracker(tmp_path):
    with pytest.raises(ConfigError, match=r"tracking.wandb_mode=offline applies to W&B: set tracking.wandb_project"):
        load_config(None, ["policies.actor.model=tiny", "tracking.wandb_mode=offline"])
    with pytest.raises(ConfigError, match=r"tracking.flush_every_s: Input should be greater than 0"):
        load_config(None, ["policies.actor.model=tiny", "tracking.flush_every_s=0"])
    plain = load_config(None, ["policies.actor.model=tiny", f"run_dir={tmp_path}"])
    assert "tracker" not in [c.name for c in plan_components(plain, tmp_path / "run.yaml", [])]
    cfg = load_config(None, ["policies.actor.model=tiny", f"run_dir={tmp_path}",
                             f"tracking.tensorboard_dir={tmp_path}"])
    tracker = next(c for c in plan_components(cfg, tmp_path / "run.yaml", ["x=1"]) if c.name == "tracker")
    assert tracker.argv[1:5] == ["-m", "astraflow", "tracker", str(tmp_path / "run.yaml")] and tracker.argv[5] == "x=1"


def test_a_sink_whose_package_is_missing_is_refused_naming_the_field_and_the_profile(tmp_path, monkeypatch):
    """Before anything starts: `astraflow tracker` and `astraflow run` exit 2."""
    for package in ("tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, package, None)  # `import` raises ImportError, as where not installed
    config = tmp_path / "run.yaml"
    config.write_text(f"run_dir: {tmp_path}\npolicies: {{actor: {{model: tiny}}}}\n")
    for field, package in (("tensorboard_dir", "tensorboard"), ("wandb_project", "wandb")):
        overrides = [f"tracking.{field}={tmp_path / 'x'}"]
        done = CliRunner().invoke(app, ["tracker", str(config), *overrides])
        assert done.exit_code == 2, done.output
        assert f"tracking.{field} needs the '{package}' package" in done.output
        assert "scripts/install.sh tracking" in done.output
        done = CliRunner().invoke(app, ["run", str(config), *overrides])
        assert done.exit_code == 2 and f"invalid run config {config}: tracking.{field} needs the '{package}' " \
            "package" in done.output, done.output
    assert not (tmp_path / "bus").exists()  # refused before the run's topics were made
    done = CliRunner().invoke(app, ["tracker", str(config)])
    assert done.exit_code == 2 and "nothing to track: set tracking.tensorboard_dir or tracking.wandb_project" \
        in done.output


@needs_tensorboard
@pytest.mark.slow
def test_a_run_with_tensorboard_has_every_trainer_step_after_it_ends(tmp_path):
    """`astraflow run` with `tracking.tensorboard_dir`: the tracker is a component, stopped with the run after it
    drained `metrics`, so TensorBoard has the reward at every trainer step, once."""
    run = f"trkrun{uuid.uuid4().hex[:8]}"
    done = subprocess.run([sys.executable, "-m", "astraflow", "run", "examples/arith-tiny.yaml", f"run={run}",
                           f"run_dir={tmp_path}", "policies.actor.steps=4", "policies.actor.batch_groups=4",
                           f"tracking.tensorboard_dir={tmp_path / 'tb'}", "tracking.flush_every_s=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    components = json.loads((tmp_path / "components.json").read_text())
    assert components["tracker"]["exit_code"] == 0 and components["tracker"]["restarts"] == 0, components
    assert [s[0] for s in scalars(tmp_path / "tb" / run / "trainer.actor", "reward_mean")] == [1, 2, 3, 4]
    assert (tmp_path / "tb" / run / "raas-0").is_dir()
