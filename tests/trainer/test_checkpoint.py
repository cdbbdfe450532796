"""Atomic checkpoints: round trip, pruning, a crashed or killed write leaves a complete one."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from topics.bus import TopicPartition
from trainer.checkpoint import LATEST, load_latest, save_checkpoint
from trainer.config import TrainerConfig
from trainer.loop import Trainer
from trainer.model import load_causal_lm

KILLER = Path(__file__).with_name("checkpoint_killer.py")
REPO = Path(__file__).resolve().parents[2]


def test_round_trip_prune_and_crash(tiny_model_dir, make_group, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    assert load_latest(root) is None
    t = Trainer(TrainerConfig(lr=1e-3, param_dtype="float32"), tiny_model_dir)
    t.train_step([make_group([1.0, 0.0], gen_len=2)])
    offsets = {TopicPartition("r.samples.p", 0): 5, TopicPartition("r.samples.p", 1): 2}
    save_checkpoint(root, version=t.version, model=t.model, optimizer=t.optimizer, offsets=offsets,
                    serving={"served_ids": ["a"]}, policies={"replay": {"pool": [b"x"]}}, keep=1)
    ck = load_latest(root)
    assert (ck.version, ck.offsets, ck.serving, ck.policies) == (
        1, offsets, {"served_ids": ["a"]}, {"replay": {"pool": [b"x"]}})

    t2 = Trainer(TrainerConfig(lr=1e-3, param_dtype="float32"), tiny_model_dir)
    t2.restore(ck)
    assert t2.version == 1
    for a, b in zip(t.model.parameters(), t2.model.parameters()):
        assert torch.equal(a, b)
    assert t2.optimizer.state_dict()["state"][0]["step"].item() == 1

    # a write that dies half-way leaves the previous checkpoint as the latest
    t.train_step([make_group([1.0, 0.0], gen_len=2)])
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(root, version=t.version, model=t.model, optimizer=t.optimizer, offsets={})
    monkeypatch.undo()
    assert load_latest(root).version == 1
    assert sorted(p.name for p in root.iterdir()) == [LATEST, "ckpt-00000001"]

    save_checkpoint(root, version=t.version, model=t.model, optimizer=t.optimizer, offsets={}, keep=1)
    assert load_latest(root).version == 2 and not (root / "ckpt-00000001").exists()

    # a re-save of the same version gets a new name, so the one LATEST names is never overwritten
    save_checkpoint(root, version=t.version, model=t.model, optimizer=t.optimizer, offsets=offsets, keep=1)
    assert sorted(p.name for p in root.iterdir()) == [LATEST, "ckpt-00000002.1"]
    assert load_latest(root).offsets == offsets


def test_latest_naming_a_missing_checkpoint_is_an_error(tmp_path):
    (tmp_path / LATEST).write_text("ckpt-00000009")
    with pytest.raises(ValueError, match="unreadable"):
        load_latest(tmp_path)


@pytest.mark.parametrize("call", ["rename", "replace", "rmtree"])
def test_a_resave_killed_at_any_step_leaves_a_complete_latest(tiny_model_dir, tmp_path, call):
    # A restarted trainer re-saves the version it resumed at; SIGKILL it inside that save.
    root = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(KILLER), str(root), str(tiny_model_dir), call],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    ck = load_latest(root)
    assert ck is not None and ck.version == 1
    # before LATEST moved: the first save; after it: the re-save
    assert ck.offsets == {TopicPartition("t", 0): 5 if call in ("rename", "replace") else 9}
    assert sum(p.numel() for p in load_causal_lm(ck.model_dir, "float32").parameters()) > 0


def test_prepare_save_pays_the_first_checkpoints_imports(tiny_model_dir, tmp_path):
    """The first save_pretrained imports deepspeed through accelerate (0.3-0.9 CPU-s, once per process): without
    prepare_save a fresh interpreter's first checkpoint imports it; after it, nothing of deepspeed, accelerate or
    transformers (a few small torch and numpy modules are left, milliseconds)."""
    def first_checkpoint_imports(prepare: bool, root: Path) -> set[str]:
        script = f"""
import sys
import torch
from trainer.checkpoint import prepare_save, save_checkpoint
from trainer.model import load_causal_lm
model = load_causal_lm({str(tiny_model_dir)!r}, "float32")
optimizer = torch.optim.Adam(model.parameters())
if {prepare}:
    prepare_save(model)
before = set(sys.modules)
save_checkpoint({str(root)!r}, version=1, model=model, optimizer=optimizer, offsets={{}})
print(sorted(set(sys.modules) - before))
"""
        out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert load_latest(root).version == 1
        return {m.split(".")[0] for m in eval(out.stdout.strip().splitlines()[-1])}

    heavy = {"deepspeed", "accelerate", "transformers"}
    assert "deepspeed" in first_checkpoint_imports(False, tmp_path / "cold")
    assert not heavy & first_checkpoint_imports(True, tmp_path / "warm")
