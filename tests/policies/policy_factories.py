"""Builders for the policy tests: small real TrajectoryGroups, Prompts and RolloutOutcomes."""
from __future__ import annotations

import itertools
import uuid

import numpy as np

from topics.schemas import Prompt, RolloutOutcome, Sample, TrajectoryGroup

_ids = itertools.count()


def make_group(rewards, *, prompt_id=None, version=0, source="gsm8k", finish_reasons=None,
               gen_tokens=3, policy="solver") -> TrajectoryGroup:
    """A real group of len(rewards) samples: 2 prompt tokens + ``gen_tokens`` generated at ``version``."""
    samples = []
    for i, r in enumerate(rewards):
        n = 2 + gen_tokens
        samples.append(Sample(
            input_ids=np.arange(n, dtype=np.int32) + i,
            loss_mask=np.array([0, 0] + [1] * gen_tokens, dtype=np.uint8),
            behavior_logprobs=np.array([0, 0] + [-0.5] * gen_tokens, dtype=np.float32),
            versions=np.array([-1, -1] + [version] * gen_tokens, dtype=np.int32),
            reward=float(r),
            finish_reason=(finish_reasons[i] if finish_reasons else "stop"),
        ))
    k = next(_ids)
    return TrajectoryGroup.build(samples=samples, prompt_id=prompt_id or f"p{k}",
                                 group_id=f"g{k}-{uuid.uuid4().hex[:6]}", policy=policy, source=source,
                                 task_type="math")


def make_prompt(pid: str) -> Prompt:
    return Prompt(prompt_id=pid, source="test", task_type="math", text=f"what is {pid}?", answer="1")


def make_outcome(pid: str, rewards, version=0) -> RolloutOutcome:
    rewards = [float(r) for r in rewards]
    return RolloutOutcome(prompt_id=pid, group_id=f"{pid}-{uuid.uuid4().hex[:6]}", policy="solver",
                          rewards=rewards, zero_adv=len(set(rewards)) == 1, version=version)



def read_all(bus, topic: str, expect_at_least: int, timeout_s: float = 60.0, settle_s: float = 1.0,
             read_committed: bool = True):
    """Every record of ``topic`` from the beginning (a group-less reader), waiting until at least
    ``expect_at_least`` arrived (or ``timeout_s`` passed), then ``settle_s`` more for stragglers."""
    import time

    from topics.bus import TopicPartition

    parts = sorted(bus.admin().end_offsets(topic))
    reader = bus.consumer(None, read_committed=read_committed)
    reader.seek_to_beginning()  # before assign: the assignment then starts at the beginning
    reader.assign([TopicPartition(topic, p) for p in parts])
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and len(out) < expect_at_least:
            out += reader.poll(500, 0.5)
        settle = time.monotonic() + settle_s
        while time.monotonic() < settle:
            out += reader.poll(500, 0.2)
    finally:
        reader.close()
    return out
