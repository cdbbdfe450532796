"""Training one policy on several ranks with FSDP2 (``trainer.ranks > 1``), on CPU (gloo) or CUDA (nccl).

Start the trainer under ``torchrun --standalone --nproc_per_node N -m astraflow trainer ...``
(the launcher does so when ``trainer.ranks`` is N > 1). Every rank loads the model, then
:class:`FSDPBackend` shards it with ``fully_shard`` per decoder layer and on the root. All ranks
train on the same batch: rank ``r`` of ``N`` runs micro-batches ``r, r+N, r+2N, ...`` of each
mini-batch, and FSDP's reduce-scatter sums the gradients across ranks (each micro-batch loss is already
normalised for its whole mini-batch, see :func:`trainer.losses.aggregate`; the loss is scaled by N to
undo FSDP's average).

The process group is device-aware (:func:`collective_backend`): gloo for CPU tensors on every device, and
nccl for CUDA tensors on CUDA. Collectives carry tensors on the training device (:func:`all_reduce_floats`), so
the metric reduction takes the same path on CPU (gloo) and CUDA (nccl); pickled objects
(:func:`broadcast_object`) and the checkpoints' CPU collectives go through gloo on both.

With ``param_dtype: bfloat16`` and fp32 master weights (``master_dtype: float32``, the default) FSDP2 keeps the
fp32 shards and all-gathers them in bf16 for the forward/backward, reducing gradients in fp32
(``MixedPrecisionPolicy``).

Only rank 0 talks to the bus: it serves the batch and :func:`broadcast_object` hands it to the
others, it publishes (the full state dict is gathered, a collective every rank joins), commits
offsets and writes metrics. Checkpoints go through ``torch.distributed.checkpoint`` (DCP) so a
resume on N ranks reloads the sharded model and optimizer (see :mod:`trainer.checkpoint`).

Numerics: the per-rank partial gradients are summed in a different order than one process would
sum them, so N ranks match one rank up to float32 rounding, not bit for bit.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from trainer.backend import TorchBackend
from trainer.config import TrainerConfig

#: How long a rank waits in one collective (e.g. a follower waiting for rank 0's next command while it
#: waits for data) before the process group gives up.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=6)


def is_distributed() -> bool:
    """True once a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def collective_backend(device: torch.device) -> str:
    """The ``init_process_group`` backend for a trainer on ``device``: one backend per device type that collectives
    carry tensors of, ``cpu:gloo`` always (pickled objects, checkpoints) and ``cuda:nccl`` on CUDA."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "cpu:gloo"


def all_reduce_floats(values: list[float], device: torch.device,
                      op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
    """``values`` reduced element-wise with ``op`` over all ranks (a collective every rank must call), as float64
    on ``device``, the training device: on CUDA through nccl, on CPU through gloo (:func:`collective_backend`)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def init(config: TrainerConfig) -> torch.device:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``)
    and return this rank's device: ``cuda:LOCAL_RANK`` when CUDA is used, else ``cpu``.

    The backend is :func:`collective_backend`'s. A process group already initialised is reused. One rank
    started without torchrun (the DeepSpeed backend needs a process group even alone) gets a group of
    its own, in memory.

    Raises:
        RuntimeError: ``WORLD_SIZE`` is not ``config.ranks`` (e.g. started without torchrun).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != config.ranks:
        raise RuntimeError(f"trainer.ranks is {config.ranks} but WORLD_SIZE is {world}: start the trainer with "
                           f"`torchrun --standalone --nproc_per_node {config.ranks} -m astraflow trainer ...`")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if world == 1 and "MASTER_ADDR" not in os.environ:
            for key in ("RANK", "LOCAL_RANK"):
                os.environ.setdefault(key, "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            dist.init_process_group(collective_backend(device), store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group(collective_backend(device), timeout=COLLECTIVE_TIMEOUT)
    return device


def leave() -> None:
    """Leave the process group after a run every rank finished: a barrier (no rank still has a collective in
    flight), then ``destroy_process_group``. A process that exits with gloo's worker threads still holding work can
    abort in interpreter teardown (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291),
    which the launcher would take for a crash. Call it only when every rank got to the end: after a failure the
    barrier would wait for a dead rank. Nothing without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """``obj`` as rank ``src`` holds it, on every rank (pickled; a collective every rank must call).
    Without a process group, ``obj`` itself."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (``model.model.layers`` for Llama/Qwen-style models,
    else every ``ModuleList``'s children).

    Raises:
        ValueError: the model has no recognisable layer list.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return list(layers)
    found = [m for ml in model.modules() if isinstance(ml, torch.nn.ModuleList) for m in ml]
    if not found:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return found


class FSDPBackend(TorchBackend):
    """FSDP2 sharding over the process group: :class:`trainer.backend.TorchBackend` (AdamW, clipping by the
    global L2 norm) over sharded parameters, with cross-rank gradients, norms and state.

    Args:
        model: the HF model, already on this rank's device (identical weights on every rank). It is
            sharded in place: its parameters become ``DTensor`` shards (dim 0 over the ranks).
        config: the trainer config (lr, betas, weight decay, ``max_grad_norm``; ``param_dtype`` bfloat16 over fp32
            master weights: a ``MixedPrecisionPolicy`` computing in bf16, reducing gradients in fp32).

    Attributes:
        forward_model: the sharded model (call it for forward passes; every rank must call it the
            same number of times, since each forward/backward all-gathers/reduce-scatters).
        optimizer: AdamW over the sharded parameters (its state is sharded too).
    """

    #: the checkpoint subdirectory its sharded state goes to (:func:`trainer.checkpoint.save_distributed_checkpoint`)
    CHECKPOINT_DIR = "dcp"

    def __init__(self, model: torch.nn.Module, config: TrainerConfig):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mixed = config.param_dtype != config.master_dtype
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else \
            MixedPrecisionPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        #: the mixed-precision policy the model was sharded with (float32 compute unless param_dtype is bfloat16)
        self.mp_policy = policy
        self.world = dist.get_world_size()
        super().__init__(model, config)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss``; FSDP reduce-scatters it across ranks.

        FSDP averages over the ranks, and each rank's micro-batch losses are already normalised for the
        whole mini-batch, so the loss is scaled by the number of ranks: the average becomes the sum
        (gloo has no pre-multiplied sum, so ``set_gradient_divide_factor(1)`` is not an option)."""
        (loss * self.world).backward()

    def step(self) -> float:
        """Clip to ``max_grad_norm`` by the global L2 norm over all shards and apply AdamW; returns the
        pre-clip global norm (the same on every rank)."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        return float(norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The complete parameters gathered to CPU on rank 0 (name -> tensor); an empty dict on the other
        ranks. A collective: every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # -- DCP checkpoints (collectives) ----------------------------------
    def save_sharded(self, path: str | os.PathLike) -> None:
        """Write model and optimizer state under directory ``path`` with ``torch.distributed.checkpoint``
        (every rank writes its shards; a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))

    def load_sharded(self, path: str | os.PathLike) -> None:
        """Load what :meth:`save_sharded` wrote (on any number of ranks; a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
