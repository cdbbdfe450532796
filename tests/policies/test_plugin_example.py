"""The plugin example of docs/guides/plugins.md (examples/plugins/): its config loads, a misspelled option is refused when the config
is read (exit 2, the field named), and the plugins run on real groups and outcomes on the embedded bus."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from astraflow.cli import app
from astraflow.config import ConfigError, load_config
from policies.base import Curator, Filter
from policies.processor import CuratorGate, FilterProcessor
from policies.registry import build_chain
from policy_factories import make_group, make_outcome, make_prompt, read_all
from topics.bus import connect
from topics.codec import decode, encode, headers_for
from topics.layout import ensure_run_topics
from topics.names import TopicNames

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "examples" / "plugins" / "arith-tiny-plugins.yaml")
MODULE = "examples.plugins.reward_band"


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch):
    """The plugins' module is importable from the repository root, where the guide runs it."""
    monkeypatch.syspath_prepend(str(REPO))


def test_the_config_names_the_plugins_with_their_options():
    cfg = load_config(CONFIG)
    (band,) = build_chain(cfg.policies["actor"].filters, Filter)
    (budget,) = build_chain(cfg.curators, Curator)
    assert (type(band).__name__, band.min_mean, band.max_mean) == ("RewardBand", 0.05, 0.95)
    assert (type(budget).__name__, budget.max_rollouts) == ("RolloutBudget", 4)


@pytest.mark.parametrize("override, message", [
    (f"policies.actor.filters=[{{name: '{MODULE}:RewardBand', max_maen: 0.9}}]",
     f"policies.actor.filters.0.custom: {MODULE}:RewardBand: got an unexpected keyword argument 'max_maen'; "
     "accepted parameters: min_mean, max_mean"),
    (f"curators=[{{name: '{MODULE}:RolloutBudget', max_rolouts: 2}}]",
     f"curators.0.custom: {MODULE}:RolloutBudget: got an unexpected keyword argument 'max_rolouts'; "
     "accepted parameters: max_rollouts"),
])
def test_a_misspelled_option_is_refused_when_the_config_is_read(tmp_path, override, message):
    with pytest.raises(ConfigError) as refused:
        load_config(CONFIG, [override])
    assert message in str(refused.value)
    result = CliRunner().invoke(app, ["run", CONFIG, f"run_dir={tmp_path}", override])
    assert result.exit_code == 2 and message in result.output
    assert not any(tmp_path.iterdir())  # nothing was started or written


def test_the_astraflow_script_finds_a_plugin_in_the_working_directory(tmp_path):
    """The ``astraflow`` console script does not put the working directory on ``sys.path`` (``python -m`` does); a
    user's ``module:Class`` there is found all the same: the refusal names the misspelled option, not the import."""
    script = Path(sys.executable).with_name("astraflow")
    override = f"curators=[{{name: '{MODULE}:RolloutBudget', max_rolouts: 2}}]"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(script), "run", CONFIG, f"run_dir={tmp_path}", override], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "got an unexpected keyword argument 'max_rolouts'" in result.stderr, \
        result.stderr[-2000:]


def test_a_bad_value_is_refused_by_the_class_before_the_run_starts(tmp_path):
    override = f"policies.actor.filters=[{{name: '{MODULE}:RewardBand', min_mean: 0.9, max_mean: 0.1}}]"
    result = CliRunner().invoke(app, ["run", CONFIG, f"run_dir={tmp_path}", override])
    assert result.exit_code == 2
    assert ("policy 'RewardBand', parameter 'max_mean': must be >= min_mean (0.9), got 0.1 (policies.actor.filters)"
            in result.output)
    assert not any(tmp_path.iterdir())


def test_the_filter_runs_in_the_filter_processor(tmp_path):
    bus, run = connect(f"local://{tmp_path / 'bus'}"), "plugin-filter"
    names = TopicNames(run)
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=1)
    groups = [make_group(r, policy="actor") for r in ([0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 1], [1, 1, 1, 1])]
    producer = bus.producer()
    for g in groups:
        producer.send(names.trajectories("actor"), encode(g), key=g.prompt_id, headers=headers_for(g))
    producer.flush()
    producer.close()

    proc = FilterProcessor(bus, run, "actor", build_chain(load_config(CONFIG).policies["actor"].filters, Filter),
                           poll_timeout_s=0.2, metrics_interval_s=0.0)
    deadline = time.monotonic() + 30
    while proc.totals["consumed"] < len(groups) and time.monotonic() < deadline:
        proc.step()
    proc.close()

    assert {k: v for k, v in proc.totals.items() if k.startswith(("kept", "dropped."))} == \
           {"kept": 2, "dropped.too_hard": 1, "dropped.too_easy": 1}
    kept = {decode(r.value).group_id for r in read_all(bus, names.samples("actor"), 2, settle_s=0.2)}
    assert kept == {groups[1].group_id, groups[2].group_id}


def test_the_curator_learns_from_outcomes_and_keeps_its_state_over_a_restart(tmp_path):
    bus, run = connect(f"local://{tmp_path / 'bus'}"), "plugin-curator"
    names = TopicNames(run)
    ensure_run_topics(bus.admin(), names, ["solver"], partitions=1)  # make_outcome's policy
    curators = build_chain(load_config(CONFIG, [f"curators=[{{name: '{MODULE}:RolloutBudget', max_rollouts: 2}}]"])
                           .curators, Curator)
    gate = CuratorGate(bus, run, curators, policy="solver", metrics_interval_s=0.0)
    assert gate.submit(make_prompt("a")) and gate.submit(make_prompt("b"))
    producer = bus.producer()
    for o in (make_outcome("a", [0, 1]), make_outcome("a", [1, 1]), make_outcome("b", [0, 0])):
        producer.send(names.outcomes, encode(o), key=o.prompt_id, headers=headers_for(o))
    producer.flush()
    producer.close()
    applied, deadline = 0, time.monotonic() + 30
    while applied < 3 and time.monotonic() < deadline:
        applied += gate.pump(timeout_s=0.2)
    assert applied == 3
    assert not gate.submit(make_prompt("a")) and gate.submit(make_prompt("b"))  # a: 2 rollouts of 2; b: 1
    gate.close()
    assert gate.totals == {"submitted": 3, "skipped": 1, "skipped.RolloutBudget": 1}

    again = CuratorGate(bus, run, build_chain(load_config(CONFIG).curators, Curator), policy="solver")
    assert again.curators[0].rollouts == {"a": 2, "b": 1}  # restored from the state topic
    again.close()
