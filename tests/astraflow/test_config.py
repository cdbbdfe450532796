"""Run config: YAML, overrides, defaults and field-naming errors."""
import pytest

from astraflow.config import ConfigError, load_config


def write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_yaml_with_overrides_and_defaults(tmp_path):
    p = write(tmp_path, "run: t1\npolicies:\n  actor:\n    model: tiny\n    trainer: {lr: 1.0e-4}\n")
    cfg = load_config(p, ["policies.actor.steps=7", "sampling.temperature=0.5", f"run_dir={tmp_path}/r"])
    assert cfg.policies["actor"].steps == 7 and cfg.policies["actor"].trainer.lr == 1e-4
    assert cfg.policies["actor"].trainer.policy == "actor"
    assert cfg.sampling.temperature == 0.5
    assert cfg.bus == f"local://{tmp_path}/r/bus" and cfg.store == f"file://{tmp_path}/r/weights"


def test_errors_name_the_field_and_reason(tmp_path):
    p = write(tmp_path, "policies:\n  actor:\n    model: tiny\n    steps: 0\n    tainer: {}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "policies.actor.steps: Input should be greater than or equal to 1" in msg
    assert "policies.actor.tainer: Extra inputs are not permitted" in msg
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_config(p, ["steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory; give a YAML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"override 'policies.actor.steps=\[1': the value is not valid YAML"):
        load_config(p, ["policies.actor.steps=[1"])
    with pytest.raises(ConfigError) as e:
        load_config(None, ["policies.actor.model=tiny", "workflow.roles.critic=critic"])
    # a whole-config check names its fields itself, without pydantic's "Value error," prefix
    assert str(e.value).splitlines()[1].startswith("  workflow.roles names policies ['critic']"), str(e.value)
