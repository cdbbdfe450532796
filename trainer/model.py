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


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher-forced log-probability of each token given its prefix.

    ``logp[b, t] = log softmax(logits[b, t-1] / temperature)[input_ids[b, t]]``;
    position 0 has no prefix and gets 0. Computed in float32.

    Args:
        input_ids: int64[B, T]; attention_mask: {0,1}[B, T] (right padding).
        temperature: the sampling temperature the behaviour logprobs were recorded at.
        with_entropy: also return the entropy (nats) of each position's distribution.

    Returns:
        (logp float32[B, T], entropy float32[B, T] or None), aligned with ``input_ids``.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    logits = logits.float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    tok = torch.gather(logits, -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - logz
    logp = torch.nn.functional.pad(tok, (1, 0))
    if not with_entropy:
        return logp, None
    log_probs = logits - logz.unsqueeze(-1)
    ent = -(log_probs.exp() * log_probs).sum(-1)
    return logp, torch.nn.functional.pad(ent, (1, 0))
