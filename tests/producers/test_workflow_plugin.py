"""A workflow plugin is one class and one config entry: ``workflow.module`` names the user's module, imported when
the config is read (from the working directory too), and the class it registers runs as a built-in does; a module
that is missing or registers no such workflow is refused at load, naming ``workflow.module``."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astraflow.config import ConfigError, load_config
from producers.engines import SamplingParams
from producers.hf_engine import HFEngine
from producers.rewards import score
from producers.workflows import get_workflow
from topics.schemas import Prompt

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples" / "arith-tiny.yaml")
ENTRY = "workflow={name: short_answer, module: examples.plugins.short_answer, options: {penalty: 0.05}}"


def test_the_config_entry_imports_the_workflow_and_it_rolls_out(tiny_model_dir, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(CONFIG, [ENTRY])
    workflow = get_workflow(cfg.workflow.name, policies=cfg.workflow.roles or None, **cfg.workflow.options)
    engine = HFEngine(tiny_model_dir, dtype=torch.float32)
    prompt = Prompt(prompt_id="p", source="test", task_type="arith", text="3+4=", answer="7",
                    workflow="short_answer", n_samples=4)
    (group,) = workflow.run(prompt, {"actor": engine}, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
    assert (group.policy, group.workflow, len(group.samples)) == ("actor", "short_answer", 4)
    for s in group.samples:
        text = engine.tokenizer.decode(list(s.input_ids[s.loss_mask == 1]), skip_special_tokens=True)
        assert s.reward == pytest.approx(score(prompt, text) - 0.05 * int(s.loss_mask.sum()))


@pytest.mark.parametrize("entry, message", [
    ("workflow={name: short_answer, module: examples.plugins.no_such_module}",
     "workflow.module: cannot import 'examples.plugins.no_such_module'"),
    ("workflow={name: shortest_answer, module: examples.plugins.short_answer}",
     "workflow.module 'examples.plugins.short_answer' registers no workflow 'shortest_answer'"),
])
def test_a_module_that_does_not_register_the_workflow_is_refused_at_load(entry, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIG, [entry])


def test_astraflow_run_checks_the_workflows_options_before_anything_starts(tmp_path):
    """From the repository root, with the ``astraflow`` script (no working directory on ``sys.path``): a bad option
    value is refused by the class before any process starts."""
    script = Path(sys.executable).with_name("astraflow")
    bad = "workflow={name: short_answer, module: examples.plugins.short_answer, options: {penalty: -1}}"
    run = subprocess.run([str(script), "run", CONFIG, f"run_dir={tmp_path}", bad], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2 and "penalty must be >= 0, got -1" in run.stderr, run.stderr[-2000:]
    assert not any(tmp_path.iterdir())
