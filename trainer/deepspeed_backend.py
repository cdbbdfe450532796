"""DeepSpeed ZeRO-2/3 backend for the :class:`~trainer.loop.Trainer` (``trainer.backend: deepspeed``).

It trains one policy on ``trainer.ranks`` processes like the FSDP2 backend (:mod:`trainer.distributed`):
the launcher starts them under torchrun (the DeepSpeed launcher works too: its ``--local_rank`` argument is
accepted), rank 0 alone reads the bus and hands each batch to the others, rank r runs micro-batches r, r+N,
... of each mini-batch, and rank 0 publishes. On the CPU (no CUDA device) DeepSpeed's ``cpu`` accelerator is
selected (``DS_ACCELERATOR=cpu``) and the ranks talk over gloo (DeepSpeed's shared-memory allreduce, a C++
op it would compile at start-up, is not used).

What this backend leaves to DeepSpeed: the ZeRO partitioning of optimizer state and gradients (stage 2)
and of the parameters (stage 3, where the model is built inside ``deepspeed.zero.Init`` through
transformers' :class:`~transformers.integrations.HfDeepSpeedConfig`, so no rank holds the whole model),
gradient clipping (``gradient_clipping``), the optimizer (``AdamW``; torch's implementation off CUDA, where
DeepSpeed's fused one cannot be built), and checkpoints (``engine.save_checkpoint`` /
``engine.load_checkpoint``: every rank writes and reads its own partitions).

Gradient accumulation is driven by the trainer: each micro-batch loss is already normalised for the whole
mini-batch (:func:`trainer.losses.aggregate`), so it is passed to ``engine.backward`` with
``scale_wrt_gas=False``; DeepSpeed averages gradients over the ranks, so the loss is scaled by the number
of ranks (the average becomes the sum), as the FSDP2 backend does. The accumulation boundary is set
before each micro-batch's forward pass, as ``set_gradient_accumulation_boundary`` requires.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from trainer.config import TrainerConfig


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in, recursively for nested dicts (a new dict; neither is changed):
    ``{"zero_optimization": {"overlap_comm": False}}`` keeps the stage and changes only that key."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def deepspeed_config(config: TrainerConfig, zero_stage: int, overrides: dict[str, Any] | None = None,
                     cuda: bool = True) -> dict:
    """The DeepSpeed config dict for ``config``: ZeRO ``zero_stage`` (2 or 3), bf16 when ``param_dtype`` is
    bfloat16, AdamW (lr, betas, weight decay from ``config``; torch's implementation unless ``cuda``),
    clipping at ``max_grad_norm``; ``overrides`` (``trainer.deepspeed``) deep-merged on top.

    Raises:
        ValueError: ``zero_stage`` is not 2 or 3, or the overrides change the stage to another value.
    """
    if zero_stage not in (2, 3):
        raise ValueError(f"deepspeed backend supports ZeRO stage 2 or 3, got {zero_stage}")
    params: dict[str, Any] = {"lr": config.lr, "betas": list(config.betas), "weight_decay": config.weight_decay}
    if not cuda:
        params["torch_adam"] = True  # DeepSpeed's FusedAdam is a CUDA kernel
    ds = {
        "train_micro_batch_size_per_gpu": 1,  # the trainer feeds its own micro-batches
        "gradient_accumulation_steps": 1,
        "gradient_clipping": config.max_grad_norm,
        "bf16": {"enabled": config.param_dtype == "bfloat16"},
        "zero_optimization": {"stage": zero_stage, "overlap_comm": cuda, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": params},
        "steps_per_print": 1 << 30,  # the trainer logs its own metrics
    }
    merged = deep_merge(ds, overrides or {})
    if merged["zero_optimization"].get("stage") != zero_stage:
        raise ValueError(f"trainer.deepspeed sets zero_optimization.stage to {merged['zero_optimization'].get('stage')}"
                         f"; set trainer.zero_stage instead (it is {zero_stage})")
    return merged


class DeepSpeedBackend:
    """A DeepSpeed engine around the model; same methods as :class:`trainer.backend.TorchBackend`.

    Build it with :meth:`load`, which loads the model too (inside ``zero.Init`` under ZeRO-3).

    Attributes:
        model: the HF module (its parameters partitioned under ZeRO-3).
        forward_model: the engine (call it for forward passes; every rank must run as many as the others).
        optimizer: the engine's (ZeRO) optimizer.
        world: the number of ranks.
    """

    #: the checkpoint subdirectory its sharded state goes to (:func:`trainer.checkpoint.save_distributed_checkpoint`)
    CHECKPOINT_DIR = "deepspeed"
    #: DeepSpeed's tag of the one state each checkpoint directory holds
    TAG = "state"

    def __init__(self, model: torch.nn.Module, config: TrainerConfig, ds_config: dict[str, Any], hf_config: Any = None):
        import deepspeed

        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                 config=ds_config)
        self.model, self.forward_model = model, self.engine
        self.zero_stage = config.zero_stage
        self.world = self.engine.world_size
        self._hf_config = hf_config  # transformers sees ZeRO-3 only while this object is alive

    @classmethod
    def load(cls, model_dir: str | Path, dtype: str, device: torch.device, config: TrainerConfig) -> "DeepSpeedBackend":
        """Load the model from ``model_dir`` in ``dtype`` on ``device`` and wrap it in a DeepSpeed engine; under
        ZeRO-3 the model is created partitioned (transformers' ``zero.Init`` integration).

        Raises:
            ImportError: deepspeed is not installed.
            ValueError: a bad ``zero_stage`` or ``trainer.deepspeed`` override (see :func:`deepspeed_config`).
        """
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            import deepspeed.ops

            # DeepSpeed would JIT-compile its shared-memory allreduce (a C++ build of ~50 s into a cache shared
            # by every venv, behind a lock file that a killed build leaves behind, hanging the next start);
            # marked incompatible (DeepSpeed keeps edits to this dict), collectives go through gloo.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        from trainer.model import load_causal_lm

        ds = deepspeed_config(config, config.zero_stage, config.deepspeed, cuda=device.type == "cuda")
        hf_config = None
        if config.zero_stage == 3:
            from transformers.integrations import HfDeepSpeedConfig

            hf_config = HfDeepSpeedConfig(ds)  # from_pretrained now loads inside deepspeed.zero.Init
        model = load_causal_lm(model_dir, dtype, device)
        return cls(model, config, ds, hf_config)

    def zero_grad(self) -> None:
        """Gradients are zeroed by the engine after each step."""

    def begin_micro_batch(self, boundary: bool) -> None:
        """Before a micro-batch's forward pass: tell the engine whether it ends the optimiser step (gradients
        are reduced across ranks on the boundary)."""
        self.engine.set_gradient_accumulation_boundary(boundary)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss`` (scaled by the number of ranks: DeepSpeed averages over them)."""
        self.engine.backward(loss * self.world, scale_wrt_gas=False)

    def step(self) -> float:
        """Apply the optimizer (clipping included); returns the pre-clip global gradient norm."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The complete parameters on rank 0 (name -> tensor), an empty dict on the other ranks; under ZeRO-3
        gathered, a collective every rank must join."""
        if self.zero_stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict() or {}
        return self.engine.module.state_dict() if self.engine.global_rank == 0 else {}

    def save_sharded(self, path: str | os.PathLike) -> None:
        """Write model, optimizer and engine state under directory ``path`` with ``engine.save_checkpoint`` (every
        rank writes its partitions; a collective)."""
        self.engine.save_checkpoint(str(path), tag=self.TAG, save_latest=False)

    def load_sharded(self, path: str | os.PathLike) -> None:
        """Load what :meth:`save_sharded` wrote (the same number of ranks and ZeRO stage; a collective).

        Raises:
            ValueError: DeepSpeed found no state under ``path``.
        """
        loaded, _ = self.engine.load_checkpoint(str(path), tag=self.TAG)
        if loaded is None:
            raise ValueError(f"DeepSpeed could not load the checkpoint in {path}")
