"""Teacher-forced logprobs (trainer.model.token_logprobs) in float32 chunks: the values and gradients of the plain
log-softmax, without keeping a float32 [B, T, V] copy of the logits."""
import pytest
import torch

import trainer.model
from trainer.model import load_causal_lm, token_logprobs

torch.set_num_threads(1)


def _plain(model, ids, temperature):
    """The textbook computation: float32 log-softmax over the whole [B, T-1, V] logits, entropy from it."""
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[:, :-1].float()
    log_p = torch.log_softmax(logits / temperature, -1)
    tok = log_p.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    return torch.nn.functional.pad(tok, (1, 0)), torch.nn.functional.pad(ent, (1, 0))


@pytest.mark.parametrize("entropy_coef", [0.0, 0.3])
def test_chunked_logprobs_and_gradients_are_the_plain_log_softmax(tiny_model_dir, monkeypatch, entropy_coef):
    model = load_causal_lm(tiny_model_dir, "float32")
    vocab = model.config.vocab_size
    monkeypatch.setattr(trainer.model, "CHUNK_BYTES", 4 * vocab * 3)  # 3 positions a chunk: 2x9 cross boundaries
    ids = torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, 9, generator=torch.Generator().manual_seed(1))
    results = []
    for compute in (lambda: token_logprobs(model, ids, torch.ones_like(ids), 0.7, with_entropy=True),
                    lambda: _plain(model, ids, 0.7)):
        model.zero_grad()
        logp, ent = compute()
        ((logp * weights).sum() + entropy_coef * (ent * weights).sum()).backward()
        results.append((logp.detach(), ent.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (logp, ent, grads), (ref_logp, ref_ent, ref_grads) = results
    assert float(logp[:, 0].abs().max()) == 0.0 and float(ent[:, 0].abs().max()) == 0.0  # no prefix at position 0
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    assert float(ent[:, 1:].mean()) > 0.2  # real distributions, not one-hot ones
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-3, atol=1e-5)  # float32, summed in another order


def test_no_float32_copy_of_the_logits_is_kept_for_backward(tiny_model_dir):
    """Under bf16 autocast (fp32 master weights) the logits are bf16; nothing the size of the logits is saved
    for backward in float32 (the plain log-softmax keeps three such copies: at Qwen3's vocabulary and 8 x 2048
    tokens, ~10 GB each)."""
    model = load_causal_lm(tiny_model_dir, "float32")
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (4, 40), generator=torch.Generator().manual_seed(0))
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = token_logprobs(model, ids, torch.ones_like(ids), with_entropy=True)
    positions = 4 * 39
    big = [s for s in saved if s[1] and s[1][-1] == vocab and torch.Size(s[1]).numel() >= positions * vocab]
    assert big and all(dtype == torch.bfloat16 for dtype, _ in big), big  # the model's own bf16 logits only
    (logp.sum() + ent.sum()).backward()
    assert model.lm_head.weight.grad is not None and bool(model.lm_head.weight.grad.abs().sum() > 0)
