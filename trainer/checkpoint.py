"""Atomic trainer checkpoints: model, optimizer, version, consumed offsets, policy and serving state.

Layout under a checkpoint root::

    ckpt-00000012/        (a later save of the same version: ckpt-00000012.1, .2, ...)
        model/            save_pretrained directory (safetensors), loadable by AutoModelForCausalLM
        optimizer.pt      torch.save of the optimizer state_dict
        state.pt          torch.save of {"serving": ..., "policies": ...}
        meta.json         {"version", "offsets": [[topic, partition, offset], ...], "renumbered": [[c, r], ...],
                          "created_ts"}
    LATEST                the name of the newest complete checkpoint

A checkpoint of a multi-rank (FSDP2) or DeepSpeed trainer (:func:`save_distributed_checkpoint`) has no
``optimizer.pt``: model and optimizer state are in ``dcp/``, written by every rank with
``torch.distributed.checkpoint`` (loadable on any number of ranks), or in ``deepspeed/``, written by
every rank with DeepSpeed's ``save_checkpoint`` (loadable on the same number of ranks and ZeRO stage);
``model/`` holds the gathered full weights (for inspection and replays), written by rank 0.

A checkpoint is written into a temporary directory and renamed into place under
a name no earlier save used, then ``LATEST`` is replaced atomically, and only then
are older checkpoints pruned; nothing ``LATEST`` names is ever removed or
overwritten, so a crash at any point leaves a complete checkpoint named by ``LATEST``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from topics.atomic_write import atomic_write
from topics.bus import TopicPartition

LATEST = "LATEST"
#: the subdirectories a backend writes its own model and optimizer state to (``CHECKPOINT_DIR`` of
#: :class:`trainer.distributed.FSDPBackend` and :class:`trainer.deepspeed_backend.DeepSpeedBackend`)
SHARDED_DIRS = ("dcp", "deepspeed")


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    ``model_dir`` is the ``save_pretrained`` directory; ``optimizer`` the optimizer
    state_dict; ``offsets`` the next offset to consume per partition; ``serving`` and
    ``policies`` the state dicts saved with it; ``renumbered`` the resumes that skipped versions, oldest
    first: ``(c, r)`` says version ``r`` holds the weights of checkpoint ``c`` and versions ``c + 1 .. r - 1``
    are off this lineage (:meth:`trainer.service.TrainerService.checkpoint`).
    """

    path: Path
    version: int
    model_dir: Path
    optimizer: dict[str, Any]
    offsets: dict[TopicPartition, int]
    serving: dict[str, Any] = field(default_factory=dict)
    policies: dict[str, Any] = field(default_factory=dict)
    renumbered: list[tuple[int, int]] = field(default_factory=list)
    #: the directory of the model and optimizer state the backend wrote itself (``dcp`` for FSDP2, ``deepspeed``
    #: for DeepSpeed), else None; with one, ``optimizer`` is {}
    sharded_dir: Path | None = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: str | Path, *, version: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    offsets: dict[TopicPartition, int], serving: dict[str, Any] | None = None,
                    policies: dict[str, Any] | None = None, renumbered: list[tuple[int, int]] | None = None,
                    keep: int = 2) -> Path:
    """Write a checkpoint of ``version`` under ``root`` atomically and prune all but the newest ``keep``.

    Args:
        model: an HF model (``save_pretrained`` is used).
        offsets: per partition, the next offset to consume (records).
        serving, policies: state dicts (anything ``torch.save`` can pickle).
        renumbered: :attr:`Checkpoint.renumbered` (versions).
        keep: complete checkpoints kept (>= 1).

    Returns:
        The checkpoint directory.

    Raises:
        OSError: the write failed; the previous checkpoint stays the latest.
    """
    root = Path(root)
    name, tmp = _new_tmp(root, version)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp / "model")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")

    return _complete(root, name, tmp, write, version=version, offsets=offsets, serving=serving,
                     policies=policies, renumbered=renumbered, keep=keep)


def prepare_save(model: torch.nn.Module) -> None:
    """Pay now the one-time imports of the first :func:`save_checkpoint`.

    ``save_pretrained`` unwraps the model through accelerate, which imports deepspeed where it is installed: 0.3
    CPU-seconds with bytecode, 0.9 without, on this project's 2-core machine, against ~10 ms for each later
    checkpoint of the tiny model. The trainer calls this at start, while it waits for its first batch, so that its
    first checkpoint does not cost a step in the run's steady state that much.
    """
    from transformers.modeling_utils import unwrap_model

    unwrap_model(model)


def _new_tmp(root: Path, version: int) -> tuple[str, Path]:
    """(the checkpoint's final name, a fresh temporary directory for it) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for orphan in root.glob(".ckpt-*"):  # a save killed before its rename (one writer per root)
        shutil.rmtree(orphan, ignore_errors=True)
    base = f"ckpt-{version:08d}"
    resaves = [_order(p)[1] for p in root.glob(f"{base}*") if p.is_dir()]
    name = base if not resaves else f"{base}.{max(resaves) + 1}"  # never overwrite: LATEST may name it
    return name, Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))


def _complete(root: Path, name: str, tmp: Path, write, *, version: int, offsets: dict[TopicPartition, int],
              serving: dict[str, Any] | None, policies: dict[str, Any] | None,
              renumbered: list[tuple[int, int]] | None, keep: int) -> Path:
    """Run ``write(tmp)``, add state and meta, fsync, rename ``tmp`` to ``root/name``, point LATEST at it
    and prune; on any error ``tmp`` is removed and the error re-raised."""
    try:
        write(tmp)
        torch.save({"serving": serving or {}, "policies": policies or {}}, tmp / "state.pt")
        meta = {"version": version, "created_ts": time.time(),
                "offsets": [[tp.topic, tp.partition, off] for tp, off in sorted(offsets.items())],
                "renumbered": [list(pair) for pair in renumbered or ()]}
        (tmp / "meta.json").write_text(json.dumps(meta))
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        final = root / name
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write(root / LATEST, name)
    _fsync_dir(root)
    complete = sorted((p for p in root.glob("ckpt-*") if p.is_dir()), key=_order)
    for old in complete[:-max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_distributed_checkpoint(root: str | Path, *, version: int, backend: Any, model: torch.nn.Module,
                                offsets: dict[TopicPartition, int], serving: dict[str, Any] | None = None,
                                policies: dict[str, Any] | None = None,
                                renumbered: list[tuple[int, int]] | None = None, keep: int = 2) -> Path:
    """:func:`save_checkpoint` for a multi-rank trainer: a collective, called by every rank with the same
    ``root`` (a file system all ranks share) and ``version``.

    Every rank writes its shards of the model and optimizer to ``backend.CHECKPOINT_DIR`` through
    ``backend.save_sharded`` (:meth:`trainer.distributed.FSDPBackend.save_sharded`,
    :meth:`trainer.deepspeed_backend.DeepSpeedBackend.save_sharded`); rank 0 also
    writes ``model/`` from the gathered full weights, ``state.pt`` and ``meta.json``, and publishes
    the checkpoint atomically as :func:`save_checkpoint` does. ``offsets``, ``serving``,
    ``policies`` and ``renumbered`` are rank 0's (ignored elsewhere).

    Returns:
        The checkpoint directory (on every rank).

    Raises:
        OSError: rank 0's write failed (raised on every rank); the previous checkpoint stays the latest.
    """
    from trainer.distributed import broadcast_object, rank

    root = Path(root)
    first = rank() == 0
    name, tmp = broadcast_object(_new_tmp(root, version) if first else None)
    try:
        backend.save_sharded(tmp / backend.CHECKPOINT_DIR)
        full = backend.full_state_dict()
    except BaseException:
        if first:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    result: Path | str = root / name
    if first:
        try:
            result = _complete(root, name, tmp, lambda t: model.save_pretrained(t / "model", state_dict=full),
                               version=version, offsets=offsets, serving=serving, policies=policies,
                               renumbered=renumbered, keep=keep)
        except OSError as e:
            result = f"checkpoint {root / name} not written: {e}"
    result = broadcast_object(result)
    if isinstance(result, str):
        raise OSError(result)
    return result


def _order(path: Path) -> tuple[int, int]:
    """(version, re-save number) of a checkpoint directory ``ckpt-VVVVVVVV[.K]``."""
    version, _, resave = path.name.removeprefix("ckpt-").partition(".")
    return int(version), int(resave or 0)


def load_latest(root: str | Path) -> Checkpoint | None:
    """The checkpoint ``LATEST`` names under ``root``, or None when there is none.

    Raises:
        ValueError: ``LATEST`` names a checkpoint that is missing or incomplete.
    """
    root = Path(root)
    latest = root / LATEST
    if not latest.is_file():
        return None
    return load_checkpoint(root / latest.read_text().strip(), named_by=latest)


def load_checkpoint(path: str | Path, named_by: Path | None = None) -> Checkpoint:
    """The complete checkpoint directory ``path`` (see :func:`load_latest`).

    Raises:
        ValueError: it is missing or incomplete.
    """
    path = Path(path)
    latest = named_by or path
    try:
        meta = json.loads((path / "meta.json").read_text())
        state = torch.load(path / "state.pt", weights_only=False)
        sharded_dir = next((path / d for d in SHARDED_DIRS if (path / d).is_dir()), None)
        optimizer = {} if sharded_dir is not None else torch.load(path / "optimizer.pt", weights_only=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {path} named by {latest} is unreadable: {e}") from e
    return Checkpoint(
        path=path, version=int(meta["version"]), model_dir=path / "model", optimizer=optimizer,
        offsets={TopicPartition(t, int(p)): int(o) for t, p, o in meta["offsets"]},
        serving=state["serving"], policies=state["policies"], sharded_dir=sharded_dir,
        renumbered=[(int(c), int(r)) for c, r in meta.get("renumbered", ())],
    )
