"""The DeepSpeed backend: its config (deep-merged overrides), the DeepSpeed launcher's ``--local_rank``, one CPU
rank; ZeRO-2/3 on one GPU (marked gpu: skipped without CUDA). Two CPU ranks: tests/trainer/test_distributed.py."""
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import TrainerConfig
from trainer.deepspeed_backend import deep_merge, deepspeed_config
from weight_tolerance import weight_gaps


def test_deepspeed_config_names_bad_stage():
    with pytest.raises(ValueError, match="ZeRO stage 2 or 3"):
        deepspeed_config(TrainerConfig(), 1)
    ds = deepspeed_config(TrainerConfig(lr=1e-5, max_grad_norm=0.5), 3, {"steps_per_print": 1000})
    assert ds["zero_optimization"]["stage"] == 3 and ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"]["lr"] == 1e-5 and ds["steps_per_print"] == 1000


def test_overrides_are_deep_merged_and_cannot_change_the_stage_behind_zero_stage():
    ds = deepspeed_config(TrainerConfig(), 2, {"zero_optimization": {"reduce_bucket_size": 1000},
                                               "optimizer": {"params": {"eps": 1e-6}}})
    zero = ds["zero_optimization"]
    assert zero["stage"] == 2 and zero["reduce_bucket_size"] == 1000 and zero["contiguous_gradients"] is True
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["eps"] == 1e-6
    assert ds["optimizer"]["params"]["lr"] == TrainerConfig().lr
    with pytest.raises(ValueError, match="zero_optimization.stage to 3; set trainer.zero_stage"):
        deepspeed_config(TrainerConfig(), 2, {"zero_optimization": {"stage": 3}})
    # off CUDA: torch's AdamW (DeepSpeed's fused one is a CUDA kernel), no comm/compute overlap
    cpu = deepspeed_config(TrainerConfig(), 2, cuda=False)
    assert cpu["optimizer"]["params"]["torch_adam"] is True and cpu["zero_optimization"]["overlap_comm"] is False
    base = {"a": {"b": 1, "c": [1]}}
    assert deep_merge(base, {"a": {"c": [2]}, "d": 3}) == {"a": {"b": 1, "c": [2]}, "d": 3}
    assert base == {"a": {"b": 1, "c": [1]}}  # not changed


def test_deepspeed_settings_without_the_deepspeed_backend_are_refused():
    with pytest.raises(ValueError, match="deepspeed, zero_stage configure the deepspeed backend, but backend is 'torch'"):
        TrainerConfig(zero_stage=3, deepspeed={"zero_optimization": {"overlap_comm": False}})
    assert TrainerConfig(backend="deepspeed", zero_stage=3).zero_stage == 3


def test_the_trainer_command_accepts_the_deepspeed_launchers_local_rank(tmp_path):
    """``deepspeed --num_gpus N -m astraflow trainer ...`` appends ``--local_rank=N``: it is accepted (here the
    command then stops at the unknown policy, exit 2, not at the argument)."""
    config = tmp_path / "run.yaml"
    config.write_text(f"run: lr\nrun_dir: {tmp_path}\npolicies: {{actor: {{model: tiny}}}}\n")
    done = subprocess.run([sys.executable, "-m", "astraflow", "trainer", str(config), "--policy", "nope",
                           "--local_rank=1"], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "unknown policy 'nope'" in done.stderr, done.stderr[-2000:]


def test_one_cpu_rank_trains_like_the_torch_backend(tiny_model_dir, make_group):
    """``backend: deepspeed`` on one CPU process (its own in-memory process group, DeepSpeed's cpu accelerator,
    torch's AdamW, ZeRO-2 clipping) takes the steps the plain torch backend takes on the same groups."""
    pytest.importorskip("deepspeed")
    from trainer.loop import Trainer

    groups = [[make_group([1.0, 0.0], seed=s + 3 * v, gen_len=2) for s in range(3)] for v in range(2)]
    config = dict(lr=1e-3, param_dtype="float32", device="cpu")
    torch.manual_seed(0)
    plain = Trainer(TrainerConfig(**config), tiny_model_dir)
    ds = Trainer(TrainerConfig(backend="deepspeed", **config), tiny_model_dir)
    for batch in groups:
        a, b = plain.train_step(batch).metrics, ds.train_step(batch).metrics
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5) and b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    ref, got = plain.publish_state(), ds.publish_state()
    assert set(ref) == set(got) and ds.version == 2
    assert not weight_gaps(ref, got)


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
    metrics = trainer.train_step(groups).metrics
    assert trainer.version == 1 and metrics["grad_norm"] > 0
    state = trainer.publish_state()
    assert state and all(v.dtype == torch.bfloat16 for v in state.values())
    cfg = trainer.model.config  # full, not partitioned, tensors even under ZeRO-3
    assert tuple(state["model.embed_tokens.weight"].shape) == (cfg.vocab_size, cfg.hidden_size)
