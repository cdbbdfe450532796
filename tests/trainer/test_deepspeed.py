"""The DeepSpeed backend: its config everywhere; ZeRO-2/3 on one GPU (marked gpu: skipped without CUDA)."""
import socket

import pytest
import torch

from trainer.config import TrainerConfig
from trainer.deepspeed_backend import deepspeed_config


def test_deepspeed_config_names_bad_stage():
    with pytest.raises(ValueError, match="ZeRO stage 2 or 3"):
        deepspeed_config(TrainerConfig(), 1)
    ds = deepspeed_config(TrainerConfig(lr=1e-5, max_grad_norm=0.5), 3, {"steps_per_print": 1000})
    assert ds["zero_optimization"]["stage"] == 3 and ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"]["lr"] == 1e-5 and ds["steps_per_print"] == 1000


@pytest.fixture
def single_rank_env(monkeypatch):
    pytest.importorskip("deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                     WORLD_SIZE="1").items():
        monkeypatch.setenv(k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_step_trains_and_publishes_full_weights(single_rank_env, tiny_model_dir, make_group, stage):
    from trainer.loop import Trainer

    groups = [make_group([1.0, 0.0], seed=s, gen_len=1) for s in range(3)]
    trainer = Trainer(TrainerConfig(backend="deepspeed", zero_stage=stage, device="cuda", lr=1e-4,
                                    param_dtype="float32"), tiny_model_dir)
    metrics = trainer.train_step(groups)
    assert trainer.version == 1 and metrics["grad_norm"] > 0
    state = trainer.publish_state()
    assert state and all(v.dtype == torch.bfloat16 for v in state.values())
    cfg = trainer.model.config  # full, not partitioned, tensors even under ZeRO-3
    assert tuple(state["model.embed_tokens.weight"].shape) == (cfg.vocab_size, cfg.hidden_size)
