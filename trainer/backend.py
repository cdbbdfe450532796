"""The optimisation backend of the :class:`~trainer.loop.Trainer`: plain torch (the default, one process).

A backend owns the optimizer. The trainer calls, per optimiser step, ``begin_micro_batch`` before each
micro-batch's forward pass (``boundary=True`` on the last one) and ``backward`` on its loss, then ``step``.
The FSDP2 (:class:`trainer.distributed.FSDPBackend`) and DeepSpeed (:mod:`trainer.deepspeed_backend`) backends
have the same methods, and write their checkpoints' model and optimizer state themselves
(``save_sharded``/``load_sharded`` into the subdirectory ``CHECKPOINT_DIR`` names).
"""
from __future__ import annotations

import torch

from trainer.config import TrainerConfig


class TorchBackend:
    """AdamW on the model's parameters, gradient clipping by global L2 norm.

    Attributes:
        forward_model: the module to call for forward passes (the model itself).
        optimizer: the ``torch.optim.AdamW`` instance (checkpointed).
    """

    #: None: checkpoints hold ``model/`` and ``optimizer.pt`` (:func:`trainer.checkpoint.save_checkpoint`)
    CHECKPOINT_DIR: str | None = None

    def __init__(self, model: torch.nn.Module, config: TrainerConfig):
        self.model = self.forward_model = model
        self.max_grad_norm = config.max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay)

    def zero_grad(self) -> None:
        """Clear the gradients before a new optimiser step."""
        self.optimizer.zero_grad(set_to_none=True)

    def begin_micro_batch(self, boundary: bool) -> None:
        """Nothing to prepare: one process, or FSDP2, whose every backward reduce-scatters."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss`` (already normalised for accumulation)."""
        loss.backward()

    def step(self) -> float:
        """Clip the gradients to ``max_grad_norm`` and apply AdamW; returns the pre-clip global norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return float(norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The complete parameters (name -> tensor, on the model's device)."""
        return self.model.state_dict()
