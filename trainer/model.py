"""Model loading and teacher-forced token logprobs."""
from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` picks ``cuda`` when available, else ``cpu``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_causal_lm(path: str | Path, dtype: str = "bfloat16", device: str | torch.device = "cpu",
                   trainable: bool = True) -> torch.nn.Module:
    """Load an HF model directory with ``AutoModelForCausalLM`` (local files only, no download).

    Args:
        path: a ``save_pretrained`` directory.
        dtype: ``bfloat16`` or ``float32`` parameter dtype.
        trainable: False freezes it and puts it in eval mode (a reference model).

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``.
        ValueError: unknown ``dtype``.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json (expected a save_pretrained layout)")
    if dtype not in DTYPES:
        raise ValueError(f"model dtype {dtype!r} is not one of {sorted(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True)
    model.to(device)
    # Dropout would make the recomputed logprobs differ from the rollout's.
    model.eval()
    if not trainable:
        model.requires_grad_(False)
    return model


#: Bytes of one float32 chunk of logits that :func:`token_logprobs` works on at a time (64 MiB: 110 positions
#: of Qwen3's 151,936-token vocabulary).
CHUNK_BYTES = 64 << 20


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Log-softmax at the target token, and the entropy, of logits [N, V], a chunk of positions at a time.

    Nothing of size [N, V] is made but the gradient (in the logits' dtype, as autograd's own would be): each
    chunk is upcast to float32, reduced and dropped, and the backward pass recomputes the chunk's softmax from
    the saved logits and ``logz``. The entropy's gradient term is computed only when the entropy is used.
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, chunk):
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        logz = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        for s in range(0, n, chunk):
            z = logits[s: s + chunk].to(torch.float32, copy=True)  # a copy even of float32 logits: edited in place
            if temperature != 1.0:
                z.div_(temperature)
            lz = torch.logsumexp(z, dim=-1)
            logz[s: s + chunk] = lz
            logp[s: s + chunk] = z.gather(-1, targets[s: s + chunk, None]).squeeze(-1) - lz
            if with_entropy:
                z.sub_(lz[:, None])  # log p
                ent[s: s + chunk] = -(z.exp() * z).sum(-1)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, targets, logz, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, logz, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            log_p = logits[s: s + ctx.chunk].to(torch.float32, copy=True)
            if ctx.temperature != 1.0:
                log_p.div_(ctx.temperature)
            log_p.sub_(logz[s: s + ctx.chunk, None])
            p = log_p.exp()
            g = torch.zeros_like(p)
            if g_logp is not None:  # d logp_y / d z_j = [j = y] - p_j
                gl = g_logp[s: s + ctx.chunk, None]
                g.sub_(p * gl).scatter_add_(-1, targets[s: s + ctx.chunk, None], gl)
            if g_ent is not None:  # d H / d z_j = -p_j (log p_j + H)
                g.sub_(p * (log_p + ent[s: s + ctx.chunk, None]) * g_ent[s: s + ctx.chunk, None])
            grad[s: s + ctx.chunk] = g.div_(ctx.temperature)
        return grad, None, None, None, None


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher-forced log-probability of each token given its prefix.

    ``logp[b, t] = log softmax(logits[b, t-1] / temperature)[input_ids[b, t]]``;
    position 0 has no prefix and gets 0. Computed in float32, :data:`CHUNK_BYTES` of positions at a time:
    no float32 [B, T, V] copy of the logits is made (the model's own logits, in its compute dtype, are the
    one [B, T, V] tensor; with grad, so is their gradient).

    Args:
        input_ids: int64[B, T]; attention_mask: {0,1}[B, T] (right padding).
        temperature: the sampling temperature the behaviour logprobs were recorded at.
        with_entropy: also return the entropy (nats) of each position's distribution. It costs one more pass
            over each chunk and no memory; its gradient is computed only if a loss uses it.

    Returns:
        (logp float32[B, T], entropy float32[B, T] or None), aligned with ``input_ids``.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    b, t, v = logits.shape
    # position t predicts token t+1; the last position predicts nothing (a dummy target, dropped below)
    targets = torch.nn.functional.pad(input_ids[:, 1:], (0, 1)).reshape(-1)
    chunk = max(1, CHUNK_BYTES // (4 * v))
    logp, ent = _ChunkedTokenLogprobs.apply(logits.reshape(b * t, v), targets, float(temperature), with_entropy,
                                            chunk)
    logp = torch.nn.functional.pad(logp.view(b, t)[:, :-1], (1, 0))
    if ent is None:
        return logp, None
    return logp, torch.nn.functional.pad(ent.view(b, t)[:, :-1], (1, 0))
