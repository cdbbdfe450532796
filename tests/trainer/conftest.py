"""Trainer test fixtures: on-policy groups sampled from the shared tiny model (``tiny_model_dir``)."""
import uuid

import numpy as np
import pytest
import torch

from topics.schemas import Sample, TrajectoryGroup
from trainer.model import load_causal_lm, token_logprobs

def _make_group(model_dir, rewards, *, gen_len=3, version=0, seed=0, policy="p",
                temperature=1.0, group_id=None) -> TrajectoryGroup:
    """A group of len(rewards) distinct samples drawn from the model for an ``a+b=`` prompt,
    with the model's own (on-policy) behaviour logprobs at ``temperature``."""
    from transformers import AutoTokenizer

    model = load_causal_lm(model_dir, "float32")
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = np.random.default_rng(seed)
    prompt = tok.encode(f"{rng.integers(0, 20)}+{rng.integers(0, 20)}=")
    gen = torch.Generator().manual_seed(seed)
    seen, samples = set(), []
    for reward in rewards:
        for _ in range(100):  # distinct sequences, so that their advantages do not cancel
            ids = torch.tensor([prompt])
            with torch.no_grad():
                for _ in range(gen_len):
                    logits = model(input_ids=ids).logits[:, -1].float() / temperature
                    ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)], 1)
            if tuple(ids[0].tolist()) not in seen:
                break
        seen.add(tuple(ids[0].tolist()))
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature)
        mask = np.r_[np.zeros(len(prompt)), np.ones(gen_len)].astype(np.uint8)
        beh = np.where(mask > 0, logp[0].numpy(), 0.0).astype(np.float32)
        vers = np.where(mask > 0, version, -1).astype(np.int32)
        samples.append(Sample(input_ids=ids[0].numpy().astype(np.int32), loss_mask=mask, behavior_logprobs=beh,
                              versions=vers, reward=reward))
    return TrajectoryGroup.build(samples=samples, prompt_id=f"q{seed}", group_id=group_id or uuid.uuid4().hex,
                                 policy=policy)


@pytest.fixture(scope="session")
def make_group(tiny_model_dir):
    """``make_group(rewards, *, gen_len, version, seed, temperature, group_id)``: an on-policy group."""
    return lambda rewards, **kw: _make_group(tiny_model_dir, rewards, **kw)
