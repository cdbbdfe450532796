"""Padded tensor batches from TrajectoryGroups."""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from topics.schemas import TrajectoryGroup


@dataclass
class PackedBatch:
    """B samples right-padded to T tokens.

    - ``input_ids`` int64[B, T] (pad id after the end), ``attention_mask`` int64[B, T];
    - ``loss_mask`` float32[B, T]: 1 on generated tokens (never position 0);
    - ``behavior_logp`` float32[B, T]: ``Sample.behavior_logprobs`` (0 off the mask);
    - ``rewards`` float32[B], ``group_index`` int64[B] (index into the groups list),
      ``min_version`` int64[B] (the sample's group's ``min_version``).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    behavior_logp: torch.Tensor
    rewards: torch.Tensor
    group_index: torch.Tensor
    min_version: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> "PackedBatch":
        """The rows ``index`` (int64[b]), trimmed to their longest sequence."""
        rows = {f.name: getattr(self, f.name)[index] for f in fields(self)}
        width = max(int(rows["attention_mask"].sum(-1).max()), 1)
        for name in ("input_ids", "attention_mask", "loss_mask", "behavior_logp"):
            rows[name] = rows[name][:, :width]
        return PackedBatch(**rows)

    def to(self, device: torch.device) -> "PackedBatch":
        return PackedBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def pack_groups(groups: list[TrajectoryGroup], pad_token_id: int = 0) -> PackedBatch:
    """Pack every sample of ``groups`` into one right-padded :class:`PackedBatch`.

    Raises:
        ValueError: ``groups`` is empty or holds an empty sample.
    """
    samples = [(gi, g, s) for gi, g in enumerate(groups) for s in g.samples]
    if not samples:
        raise ValueError("cannot pack an empty list of groups")
    if any(len(s.input_ids) == 0 for _, _, s in samples):
        bad = next(g.group_id for _, g, s in samples if len(s.input_ids) == 0)
        raise ValueError(f"group {bad} holds a sample with no tokens")
    width = max(len(s.input_ids) for _, _, s in samples)
    n = len(samples)
    ids = np.full((n, width), pad_token_id, dtype=np.int64)
    attn = np.zeros((n, width), dtype=np.int64)
    mask = np.zeros((n, width), dtype=np.float32)
    beh = np.zeros((n, width), dtype=np.float32)
    for i, (_, _, s) in enumerate(samples):
        length = len(s.input_ids)
        ids[i, :length] = s.input_ids
        attn[i, :length] = 1
        mask[i, :length] = s.loss_mask
        beh[i, :length] = np.where(s.loss_mask > 0, s.behavior_logprobs, 0.0)
    mask[:, 0] = 0.0
    return PackedBatch(
        input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(attn),
        loss_mask=torch.from_numpy(mask), behavior_logp=torch.from_numpy(beh),
        rewards=torch.tensor([s.reward for _, _, s in samples], dtype=torch.float32),
        group_index=torch.tensor([gi for gi, _, _ in samples], dtype=torch.int64),
        min_version=torch.tensor([g.min_version for _, g, _ in samples], dtype=torch.int64),
    )
