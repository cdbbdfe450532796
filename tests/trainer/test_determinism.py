"""Bit-exact determinism of the trainer: what `astraflow replay` relies on."""
import torch

from trainer.checkpoint import load_latest, save_checkpoint
from trainer.config import TrainerConfig
from trainer.loop import Trainer
from weights.codec import state_sha256


def test_a_restored_trainer_steps_exactly_like_an_uninterrupted_one(tiny_model_dir, make_group, tmp_path):
    torch.set_num_threads(1)
    # Two epochs of shuffled mini-batches: the shuffle order must survive the restart.
    cfg = TrainerConfig(lr=1e-3, param_dtype="float32", ppo_epochs=2, mini_batch_size=2, seed=3)
    batches = [[make_group([1.0, 0.0, 0.5], gen_len=2, seed=s)] for s in (1, 2)]
    straight = Trainer(cfg, tiny_model_dir)
    first = Trainer(cfg, tiny_model_dir)
    shas = []
    for batch in batches:
        straight.train_step(batch)
        shas.append(state_sha256(straight.publish_state()))
    first.train_step(batches[0])
    assert state_sha256(first.publish_state()) == shas[0]
    save_checkpoint(tmp_path, version=first.version, model=first.model, optimizer=first.optimizer, offsets={})
    resumed = Trainer(cfg, tiny_model_dir)
    resumed.restore(load_latest(tmp_path))
    resumed.train_step(batches[1])
    assert state_sha256(resumed.publish_state()) == shas[1]
