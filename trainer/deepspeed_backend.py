"""DeepSpeed ZeRO-2/3 backend for the :class:`~trainer.loop.Trainer` (several GPUs, through its launcher).

:class:`DeepSpeedBackend` imports ``deepspeed`` (a GPU-only dependency, extra ``gpu``)
when it is built; :func:`deepspeed_config` needs neither deepspeed nor a GPU. Start the trainer with the
DeepSpeed launcher, e.g. ``deepspeed --num_gpus 8 -m astraflow trainer CONFIG --policy P``.

Gradient accumulation is driven by the trainer: each micro-batch loss is
already normalised for the mini-batch (:func:`trainer.losses.aggregate`), so it is
passed to ``engine.backward`` with ``scale_wrt_gas=False``, and the accumulation
boundary is set explicitly on the last micro-batch. Clipping uses DeepSpeed's
``gradient_clipping``; the optimizer is DeepSpeed's AdamW.
"""
from __future__ import annotations

from typing import Any

import torch

from trainer.config import TrainerConfig


def deepspeed_config(config: TrainerConfig, zero_stage: int, overrides: dict[str, Any] | None = None) -> dict:
    """The DeepSpeed config dict for ``config``: ZeRO ``zero_stage`` (2 or 3), bf16, AdamW, clipping.

    Raises:
        ValueError: ``zero_stage`` is not 2 or 3.
    """
    if zero_stage not in (2, 3):
        raise ValueError(f"deepspeed backend supports ZeRO stage 2 or 3, got {zero_stage}")
    ds = {
        "train_micro_batch_size_per_gpu": 1,  # the trainer feeds its own micro-batches
        "gradient_accumulation_steps": 1,
        "gradient_clipping": config.max_grad_norm,
        "bf16": {"enabled": config.param_dtype == "bfloat16"},
        "zero_optimization": {"stage": zero_stage, "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": config.lr, "betas": list(config.betas),
                                                  "weight_decay": config.weight_decay}},
    }
    ds.update(overrides or {})
    return ds


class DeepSpeedBackend:
    """A DeepSpeed engine around the model; same methods as :class:`trainer.backend.TorchBackend`.

    Args:
        model: the HF model (fp32 or bf16 parameters; DeepSpeed keeps fp32 master weights under bf16).
        config: the trainer config (``zero_stage`` and ``deepspeed`` overrides are read from it).

    Attributes:
        forward_model: the engine (call it for forward passes).
        optimizer: the engine's optimizer.
    """

    def __init__(self, model: torch.nn.Module, config: TrainerConfig):
        if not torch.cuda.is_available():
            raise RuntimeError("the deepspeed backend needs CUDA devices; use backend 'torch' on CPU")
        import deepspeed

        ds = deepspeed_config(config, config.zero_stage, config.deepspeed)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                 config=ds)
        self.model, self.forward_model = model, self.engine
        self.zero_stage = config.zero_stage

    def zero_grad(self) -> None:
        """Gradients are zeroed by the engine after each step."""

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """Accumulate ``loss``'s gradient; reduction across ranks happens on the boundary."""
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        """Apply the optimizer (clipping included); returns the global gradient norm."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The complete parameters; under ZeRO-3 gathered (a collective: call on every rank).

        Returns the full dict on rank 0 and an empty dict on other ranks under ZeRO-3.
        """
        if self.zero_stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict() or {}
        return self.engine.module.state_dict()
