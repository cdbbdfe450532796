"""Run config: YAML, overrides, defaults and field-naming errors."""
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_yaml_with_overrides_and_defaults(tmp_path):
    p = write(tmp_path, "run: t1\npolicies:\n  actor:\n    model: tiny\n    trainer: {lr: 1.0e-4}\n")
    cfg = load_config(p, ["policies.actor.steps=7", "sampling.temperature=0.5", f"run_dir={tmp_path}/r"])
    assert cfg.policies["actor"].steps == 7 and cfg.policies["actor"].trainer.lr == 1e-4
    assert cfg.trainer_config("actor").policy == "actor" and cfg.policies["actor"].trainer.policy == "policy"
    assert cfg.sampling.temperature == 0.5 and cfg.trainer_config("actor").temperature == 0.5
    assert cfg.bus == f"local://{tmp_path}/r/bus" and cfg.store == f"file://{tmp_path}/r/weights"


def test_a_trainer_temperature_or_name_that_disagrees_is_refused(tmp_path):
    p = write(tmp_path, "run: t1\npolicies:\n  actor:\n    model: tiny\n    trainer: {temperature: 1.8}\n")
    assert load_config(p, ["sampling.temperature=1.8"]).trainer_config("actor").temperature == 1.8
    with pytest.raises(ConfigError, match=r"policies.actor.trainer.temperature \(1.8\) differs from "
                                          r"sampling.temperature \(1.0\)"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"policies.actor.trainer.policy='critic'"):
        load_config(p, ["sampling.temperature=1.8", "policies.actor.trainer.policy=critic"])


def test_loading_a_config_does_not_import_torch():
    code = "import sys, astraflow.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("example", ["arith-tiny", "arith-tiny-vllm", "gsm8k-tiny", "solver-verifier-tiny",
                                     "plan-execute-critique-tiny"])
def test_checking_a_run_config_does_not_import_torch(example):
    """``astraflow run`` checks its config (``preflight``) before it starts any component: importing torch and
    transformers there cost ~2 s of every run's start-up."""
    code = ("import sys; from astraflow.config import load_config; "
            "from astraflow.launcher.preflight import preflight; preflight(load_config(sys.argv[1])); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, f"examples/{example}.yaml"], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]


def test_errors_name_the_field_and_reason(tmp_path):
    p = write(tmp_path, "policies:\n  actor:\n    model: tiny\n    steps: 0\n    tainer: {}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "policies.actor.steps: Input should be greater than or equal to 1" in msg
    assert "policies.actor.tainer: Extra inputs are not permitted" in msg
    # a field an override set, or set a mapping around, names that override; the file's own fields do not
    with pytest.raises(ConfigError) as e:
        load_config(p, ["policies.actor.tainer=null", "sampling.temperature=-1", "foo.bar=1",
                        "data={sources: [{name: arith}], epochs: 0}"])
    lines = str(e.value).splitlines()
    assert "  sampling.temperature: Input should be greater than 0 (the override sampling.temperature=-1)" in lines
    assert "  foo: Extra inputs are not permitted (the override foo.bar=1)" in lines
    assert "  data.epochs: Input should be greater than or equal to 1 (the override data={sources: [{name: arith}], " \
           "epochs: 0})" in lines
    assert "  policies.actor.steps: Input should be greater than or equal to 1" in lines, lines
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_config(p, ["steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory; give a YAML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"override 'policies.actor.steps=\[1': the value is not valid YAML"):
        load_config(p, ["policies.actor.steps=[1"])
    with pytest.raises(ConfigError, match=r"override policies.actr.steps: no policy 'actr' \(the config has actor\)"):
        load_config(p, ["policies.actr.steps=3"])  # a typo, not a new policy with only steps ("model: required")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["policies.actor.model=tiny", "workflow.roles.critic=critic"])
    # a whole-config check names its fields itself, without pydantic's "Value error," prefix
    assert str(e.value).splitlines()[1].startswith("  workflow.roles names policies ['critic']"), str(e.value)


def test_each_component_gets_its_own_section():
    cfg = load_config(ROOT / "examples/arith-tiny.yaml", ["curators=[{name: greso, p_easy: 0.3}]"])
    raas = cfg.raas_section()
    assert set(raas.policies["actor"].model_dump()) == {"model", "engine", "sglang", "vllm", "batch_groups",
                                                        "max_staleness", "checkpoint_every"}
    assert (raas.run, raas.store, raas.n_samples, raas.workflow.name) == (cfg.run, cfg.store, cfg.data.n_samples,
                                                                          cfg.workflow.name)
    acquisition = cfg.acquisition_section()
    assert [(c.name, c.p_easy) for c in acquisition.curators] == [("greso", 0.3)]
    assert (acquisition.curated_policy, acquisition.workflow, "store" in type(acquisition).model_fields) == \
        ("actor", cfg.workflow.name, False)
    replay = cfg.replay_section("actor")
    assert (replay.policy, replay.model, replay.trainer, replay.steps) == ("actor", cfg.policies["actor"].model,
                                                                          cfg.trainer_config("actor"),
                                                                          cfg.policies["actor"].steps)
    controller = cfg.controller_section()
    assert (controller.policies, controller.workers, controller.workflow) == (["actor"], cfg.raas.workers,
                                                                              cfg.workflow.name)


def test_raas_keeps_in_flight_the_fresh_groups_a_trainer_takes_within_the_bound():
    """With half of each batch replayed, the trainer takes 8 fresh groups of 16 a version: RaaS keeps 8 x 4 in
    flight at max_staleness 4, not 16 x 4 (a group produced behind 64 would be 8 versions old when trained, and
    dropped as stale); an explicit raas.max_inflight_groups still wins."""
    from types import SimpleNamespace

    from producers.raas import RaasWorker

    def limit(*overrides):
        cfg = load_config(ROOT / "examples/arith-tiny.yaml", ["policies.actor.max_staleness=4", *overrides])
        return RaasWorker.inflight_limit(SimpleNamespace(cfg=cfg.raas_section()), "actor")

    assert limit() == 16 * 4
    assert limit("policies.actor.serving=[{name: replay, ratio: 0.5}]") == 8 * 4
    assert limit("policies.actor.serving=[{name: replay}]") == 12 * 4  # the default ratio, 0.25
    assert limit("policies.actor.serving=[{name: replay, ratio: 0.5}]", "raas.max_inflight_groups=40") == 40
