"""Trainer test fixtures: a random tiny Qwen2 model directory and on-policy groups built from it."""
import uuid

import numpy as np
import pytest
import torch

from topics.schemas import Sample, TrajectoryGroup
from trainer.model import load_causal_lm, token_logprobs

VOCAB = 32


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    """A randomly initialised 2-layer Qwen2 (hidden 64, vocab 32, float32) saved with save_pretrained."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                      tie_word_embeddings=True, pad_token_id=0)
    out = tmp_path_factory.mktemp("tiny-qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def _make_group(model_dir, rewards, *, prompt_len=4, gen_len=6, version=0, seed=0, policy="p",
               temperature=1.0, group_id=None) -> TrajectoryGroup:
    """A group of len(rewards) samples whose behaviour logprobs are the model's own (on-policy)."""
    rng = np.random.default_rng(seed)
    model = load_causal_lm(model_dir, "float32")
    prompt = rng.integers(1, VOCAB, prompt_len)
    samples = []
    for reward in rewards:
        ids = np.concatenate([prompt, rng.integers(1, VOCAB, gen_len)]).astype(np.int32)
        mask = np.r_[np.zeros(prompt_len), np.ones(gen_len)].astype(np.uint8)
        with torch.no_grad():
            t = torch.from_numpy(ids).long()[None]
            logp, _ = token_logprobs(model, t, torch.ones_like(t), temperature)
        beh = np.where(mask > 0, logp[0].numpy(), 0.0).astype(np.float32)
        vers = np.where(mask > 0, version, -1).astype(np.int32)
        samples.append(Sample(input_ids=ids, loss_mask=mask, behavior_logprobs=beh, versions=vers, reward=reward))
    return TrajectoryGroup.build(samples=samples, prompt_id=f"q{seed}", group_id=group_id or uuid.uuid4().hex,
                                 policy=policy)


@pytest.fixture(scope="session")
def make_group(random_model_dir):
    """``make_group(rewards, *, prompt_len, gen_len, version, seed, temperature, group_id)``: an on-policy group."""
    return lambda rewards, **kw: _make_group(random_model_dir, rewards, **kw)
