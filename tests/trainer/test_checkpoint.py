"""Atomic checkpoints: round trip, pruning, a crashed write leaves the previous one."""
import pytest
import torch

from topics.bus import TopicPartition
from trainer.checkpoint import LATEST, load_latest, save_checkpoint
from trainer.config import TrainerConfig
from trainer.loop import Trainer


def test_round_trip_prune_and_crash(tiny_model_dir, make_group, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    assert load_latest(root) is None
    t = Trainer(TrainerConfig(lr=1e-3, param_dtype="float32"), tiny_model_dir)
    t.train_step([make_group([1.0, 0.0], gen_len=2)])
    offsets = {TopicPartition("r.samples.p", 0): 5, TopicPartition("r.samples.p", 1): 2}
    save_checkpoint(root, version=t.version, model=t.model, optimizer=t.optimizer, offsets=offsets,
                    serving={"served_ids": ["a"]}, policies={"replay": {"pool": [b"x"]}}, extra={"n": 1}, keep=1)
    ck = load_latest(root)
    assert (ck.version, ck.offsets, ck.serving, ck.policies, ck.extra) == (
        1, offsets, {"served_ids": ["a"]}, {"replay": {"pool": [b"x"]}}, {"n": 1})

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


def test_latest_naming_a_missing_checkpoint_is_an_error(tmp_path):
    (tmp_path / LATEST).write_text("ckpt-00000009")
    with pytest.raises(ValueError, match="unreadable"):
        load_latest(tmp_path)
