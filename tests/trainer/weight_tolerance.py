"""How close two trainings of the same batches must end: a multi-rank backend (or DeepSpeed) against one plain
process, in float32 after 3 steps at lr 1e-3.

The ranks' partial gradients are summed in another order than one process sums them (and the global grad norm
is reduced over shards), so the runs agree to float32 rounding amplified by Adam, not bit for bit. Measured:
FSDP2 2.2e-6 (relative to the tensor's largest weight: 1.6e-5); :data:`WEIGHT_ATOL` is 10x that.

Attention key biases have a zero gradient in exact arithmetic (softmax over keys is invariant to the constant
q.b_k they add), so what they get is rounding noise (~1e-9), below Adam's eps (1e-8): each step moves them by
at most lr x |g| / eps ~ 0.1 lr, in a direction the summation order decides. They are held to that bound over
3 steps, :data:`NOISE_ATOL` (DeepSpeed measured 6.4e-5 on 2 ranks, 3.3e-5 on one).

After 6 steps with a SIGKILL and a resume in between the rounding has grown further, and by how much depends on
the machine: within 2e-5 on one, up to 8.9e-5 (layer 1's ``q_proj``/``k_proj`` weights, DeepSpeed; FSDP2 3.8e-5)
on another, deterministically. What the resume tests look for moves every tensor by ~lr: one group trained twice
or skipped, 2.5e-3 (median over tensors of the largest change), a lost optimizer state 4.1e-3 (one process,
the same 6 groups). :data:`RESUME_ATOL` sits between: a fifth of the first, 5.6x the largest rounding seen.
"""
import torch

WEIGHT_ATOL = 2e-5
NOISE_ONLY = ".self_attn.k_proj.bias"
NOISE_ATOL = 3 * 0.1 * 1e-3
RESUME_ATOL = 5e-4


def weight_gaps(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = WEIGHT_ATOL) -> dict[str, float]:
    """Per tensor of ``b``, max |a - b| where it is beyond its tolerance (empty: all within): the larger of
    :data:`NOISE_ATOL` and ``atol`` for names ending in :data:`NOISE_ONLY`, else ``atol``."""
    gaps = {k: float((a[k].float() - b[k].float()).abs().max()) for k in b}
    return {k: g for k, g in gaps.items() if g > (max(NOISE_ATOL, atol) if k.endswith(NOISE_ONLY) else atol)}
