"""Policy-gradient losses for LLM RL: advantages, PPO clip, off-policy correction, KL, entropy.

Every function here is a pure tensor function. Conventions, for a batch of B
sequences padded to length T:

- ``logp`` float32[B, T]: per-token log-probabilities of the sequence's own
  tokens under the current policy π_θ (with grad).
- ``old_logp`` float32[B, T]: the same under π_old, the trainer's weights at the
  start of this training step (no grad).
- ``behavior_logp`` float32[B, T]: the same under π_behaviour, the weights that
  sampled the token at rollout (recorded in ``Sample.behavior_logprobs``).
- ``mask`` bool or {0,1}[B, T]: 1 on tokens the policy generated (the loss mask),
  0 on prompt, tool output and padding.
- ``advantages`` float32[B] (one per sequence) or float32[B, T].

Off-policy correction (:func:`policy_loss`) is one of:

- ``"none"``: PPO-clip with the behaviour policy as π_old (plain on-policy GRPO/PPO;
  verl's ``bypass_mode`` with ``loss_type=ppo_clip``, where old_log_prob = rollout_log_prob).
- ``"tis"``: decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy
  optimization") — PPO-clip of π_θ/π_old, times the truncated importance weight
  ``min(π_old/π_behaviour, C)`` (Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training"; truncation as in IMPALA's V-trace,
  Espeholt et al. 2018, eq. 1 with ρ̄ = C). π_old is the proximal policy, the
  trainer's weights before this step's update (not the behaviour policy). This is
  verl's ``vanilla`` loss with token-level ``rollout_is_weights`` and AReaL's
  ``ppo_actor_loss_fn`` with ``use_decoupled_loss`` and token-level clamp-mode
  rejection sampling.
- ``"m2po"``: M2PO (Zheng et al. 2025, "Prosperity before Collapse: How Far Can
  Off-Policy RL Reach with Stale Data on LLMs?", arXiv:2510.01161), as the authors'
  code implements it (Infini-AI-Lab/M2PO ``compute_m2po_policy_loss``): the
  surrogate ``r·A`` with ``r = π_θ/π_behaviour`` and no ε-clip; only the "harmful"
  tokens (A>0 with r>1, A<0 with r<1) beyond an adaptive log-ratio bound τ get the
  clipped, zero-gradient branch, τ chosen so that the second moment of the
  harmful tokens' log-ratios, capped at τ, is at most ``m2po_tau`` (:func:`m2po_clip`).

The ratios of ``"none"`` and ``"tis"`` and the TIS weight are computed from the
log-ratio clamped to ±:data:`LOG_RATIO_BOUND` (verl's ``SAFETY_BOUND``); M2PO's is
not clamped (the authors' code does not clamp it). Log-ratios on masked positions
are zeroed before any ``exp``, so padding never turns into inf/NaN.

Each correction is checked against a transcription of its reference on identical
tensors, values and gradients, in ``tests/trainer/test_losses_reference.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer.config import AggMode, Correction


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"tensor shapes differ: {shapes}")


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *,
                     scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages of GRPO, or Dr. GRPO's unscaled ones.

    GRPO (Shao et al. 2024, "DeepSeekMath", §4.1.2, outcome supervision):
    ``Â_i = (r_i - mean(r_group)) / (std(r_group) + eps)``.
    Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective", eq. 3/§3.2): ``Â_i = r_i - mean(r_group)`` (``scale_by_std=False``),
    which removes the question-difficulty bias of the std division.
    The std is the population std (ddof=0), as in ``TrajectoryGroup.reward_std``.

    Args:
        rewards: float[N], one reward per sample.
        group_index: int64[N], the group each sample belongs to (any integer labels).
        scale_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: added to the std, dimensionless.

    Returns:
        float32[N] advantages, zero for every sample of a group whose rewards are all equal.

    Raises:
        ValueError: ``rewards`` and ``group_index`` are not 1-D of the same length.
    """
    if rewards.ndim != 1 or rewards.shape != group_index.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} "
                         "must be 1-D of the same length")
    r = rewards.to(torch.float32)
    _, inv = torch.unique(group_index, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(n_groups).index_add_(0, inv, r) / count
    centred = r - mean[inv]
    if not scale_by_std:
        return centred
    var = torch.zeros(n_groups).index_add_(0, inv, centred.square()) / count
    return centred / (var.sqrt()[inv] + eps)


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, mode: AggMode = "token-mean", *,
              n_tokens: float | None = None, n_seqs: float | None = None,
              norm_len: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    - ``"token-mean"``: Σ loss·mask / Σ mask over the whole batch, every token
      weighted equally (DAPO, Yu et al. 2025, eq. 8 "token-level policy gradient loss").
    - ``"seq-mean"``: mean over sequences of each sequence's token mean (the
      original GRPO objective, Shao et al. 2024, eq. 3: ``1/G Σ_i 1/|o_i| Σ_t``).
    - ``"seq-sum-norm"``: Σ loss·mask / (n_seqs · norm_len), a constant normaliser
      instead of the sequence length (Dr. GRPO, Liu et al. 2025, eq. 3/§3.2).

    For gradient accumulation over micro-batches, pass the mini-batch's totals
    (``n_tokens``: generated tokens; ``n_seqs``: sequences) so that the micro-batch
    losses add up to the mini-batch loss; by default they are this batch's own.

    Args:
        token_loss: float[B, T].
        mask: {0,1}[B, T].
        norm_len: tokens, required for ``"seq-sum-norm"`` (e.g. the max generation length).

    Raises:
        ValueError: unknown mode, shape mismatch, or ``norm_len`` missing for seq-sum-norm.
    """
    _check_same_shape(token_loss=token_loss, mask=mask)
    m = mask.to(token_loss.dtype)
    if mode == "token-mean":
        denom = n_tokens if n_tokens is not None else m.sum().clamp(min=1.0)
        return (token_loss * m).sum() / denom
    n = n_seqs if n_seqs is not None else token_loss.shape[0]
    if mode == "seq-mean":
        per_seq = (token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(n, 1)
    if mode == "seq-sum-norm":
        if not norm_len:
            raise ValueError("aggregation 'seq-sum-norm' needs norm_len (tokens), e.g. the max generation length")
        return (token_loss * m).sum() / (max(n, 1) * norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; use token-mean, seq-mean or seq-sum-norm")


#: Bound on |log r| before ``exp`` for PPO ratios and TIS weights (verl's ``SAFETY_BOUND``: exp(20) ≈ 4.9e8).
LOG_RATIO_BOUND = 20.0


def ppo_clip(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float = 0.2,
             clip_high: float | None = None, dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, per token (Schulman et al. 2017, eq. 7), as a loss to minimise.

    ``loss_t = -min(r_t·A_t, clip(r_t, 1-ε_low, 1+ε_high)·A_t)``. With ``clip_high``
    above ``clip_low`` this is DAPO's asymmetric "clip-higher" (Yu et al. 2025, eq. 10).
    With ``dual_clip`` = c > 1, tokens with A < 0 are further bounded by ``-c·A``
    (dual-clip PPO, Ye et al. 2020, arXiv:1912.09729, eq. 5), as verl's ``vanilla``
    loss (``clip_ratio_c``, default 3 there) and AReaL's ``c_clip`` (default off) do.

    Args:
        ratio: float[B, T], the importance ratio r_t.
        advantages: float[B, T] or float[B] (broadcast over tokens).
        clip_low, clip_high: ε_low and ε_high (``clip_high=None``: ε_high = ε_low).
        dual_clip: c > 1, or None for no dual clip.

    Returns:
        (loss float[B, T], clipped bool[B, T]): ``clipped`` marks tokens where a
        clipped branch is taken and has zero gradient (the clip fraction's numerator).

    Raises:
        ValueError: ``dual_clip`` is not > 1.
    """
    adv = advantages.unsqueeze(-1) if advantages.ndim == ratio.ndim - 1 else advantages
    high = clip_low if clip_high is None else clip_high
    unclipped = ratio * adv
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + high)
    clipped = clipped_ratio * adv
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).detach()
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound = -adv * dual_clip
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
        was_clipped = was_clipped | dual.detach()
    return loss, was_clipped


def truncated_is_weight(old_logp: torch.Tensor, behavior_logp: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """Truncated importance weight ``min(π_old/π_behaviour, C)`` per token, no grad.

    Yao et al. 2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy
    RL Training", TIS); the truncation at C is IMPALA's ρ̄ (Espeholt et al. 2018, eq. 1).
    As verl's token-level ``compute_rollout_correction_weights``: the log-ratio is
    clamped to ±:data:`LOG_RATIO_BOUND` before ``exp``. π_old is the proximal policy
    (the trainer's weights before the update), not π_θ: the weight carries no gradient.

    Args:
        old_logp, behavior_logp: float[B, T].
        cap: C > 0.

    Raises:
        ValueError: ``cap`` is not positive or shapes differ.
    """
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    _check_same_shape(old_logp=old_logp, behavior_logp=behavior_logp)
    log_w = (old_logp.detach() - behavior_logp.detach()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(log_w).clamp(max=cap)


def m2po_clip(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              tau: float = 0.04) -> tuple[torch.Tensor, float]:
    """M2PO's second-moment trust region: which tokens to clip, and the log-ratio bound.

    As the authors' code (Infini-AI-Lab/M2PO, ``verl/trainer/ppo/core_algos.py``:
    ``_get_trust_region_tokens_delta_sq``, ``kpo_clip_harmful_tokens``,
    ``_solve_tau_from_sorted_delta2``), which realises the paper's Algorithm 1
    (Zheng et al. 2025, arXiv:2510.01161, §5: "mask tokens until the M2 of the
    trust-region tokens is ≤ τ_M2", τ_M2 = 0.04 in all their runs):

    1. The candidates are the *harmful* valid tokens, whose ratio ``r = π_θ/π_behaviour``
       moved the way the advantage pushes it (A>0 and r>1, or A<0 and r<1); tokens
       the policy moved against the advantage are never constrained.
    2. ``v_i = (log r_i)^2`` over the n harmful tokens; if ``mean(v) ≤ tau``, nothing is clipped.
    3. Otherwise, with v sorted ascending and S_k its prefix sums, k is the first
       index with ``v_k·(n-k-1) + S_k ≥ n·tau`` (capping every v at v_k would reach
       the budget); the bound is ``δ = sqrt(v_{k-1})`` (``δ = 0`` when k = 0), the
       largest breakpoint at which the *capped* second moment ``mean(min(v, δ²))``
       stays under the budget.
    4. The harmful tokens with ``v > δ²`` are clipped: the authors clamp r to
       ``[e^-δ, e^δ]`` in the PPO min, which for exactly these tokens gives the
       constant branch (zero gradient) and leaves every other token unclipped.

    The statistics are per call (the authors compute them per micro-batch).
    The authors' ``miniclip_low/high`` floors are not implemented: their training
    scripts leave them unset (None). Where the reference's float rounding decides
    the fate of the one boundary token (``v = v_{k-1}``, its ratio equals the bound
    to within an ulp), it is kept here, as the capping rule intends.

    Args:
        log_ratio: float[B, T], log π_θ - log π_behaviour (detached inside).
        advantages: float[B, T] or float[B].
        mask: {0,1}[B, T], valid tokens.
        tau: the bound on the second moment (the paper's τ_M2; 0.04 in all their runs).

    Returns:
        (clip bool[B, T], delta): the tokens to clip, and δ (``inf`` when nothing is clipped).

    Raises:
        ValueError: ``tau`` is negative or shapes differ.
    """
    if tau < 0:
        raise ValueError(f"M2PO tau must be >= 0, got {tau}")
    _check_same_shape(log_ratio=log_ratio, mask=mask)
    adv = (advantages.unsqueeze(-1) if advantages.ndim == log_ratio.ndim - 1 else advantages).detach()
    lr = log_ratio.detach().float()
    ratio = torch.exp(lr)
    harmful = mask.bool() & (((adv > 0) & (ratio > 1.0)) | ((adv < 0) & (ratio < 1.0)))
    v2 = lr.square()
    values = v2[harmful].double()
    n = values.numel()
    none = torch.zeros_like(harmful)
    if n == 0 or float(values.sum()) / n <= tau + 1e-12:
        return none, math.inf
    v = torch.sort(values).values
    prefix = v.cumsum(0)
    rest = torch.arange(n - 1, -1, -1, dtype=v.dtype)
    reached = ((v - 1e-12) * rest + prefix) >= tau * n - 1e-12
    k = int(reached.nonzero()[0]) if bool(reached.any()) else n
    if k == 0:
        return harmful, 0.0
    threshold = float(v[k - 1])
    return harmful & (v2.double() > threshold), math.sqrt(threshold)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π_θ ‖ π_ref) (Schulman 2020, "Approximating KL Divergence").

    ``k3 = exp(ref - logp) - (ref - logp) - 1``: unbiased, always ≥ 0, low variance.
    Used as the KL penalty in GRPO (Shao et al. 2024, eq. 4).

    Args:
        logp, ref_logp: float[B, T]. Returns float[B, T].
    """
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


@dataclass
class LossOutput:
    """The scalar loss to minimise and the diagnostics of one (micro-)batch.

    ``loss``, ``pg_loss``, ``kl`` and ``entropy`` are aggregated like the loss (0-dim
    float tensors; only ``loss`` carries grad). ``clipped`` bool[B, T] marks tokens
    whose gradient a clip removed (PPO's clip or dual clip, or M2PO's trust region);
    ``is_weight`` float[B, T] is the importance weight the token's gradient was scaled
    by (TIS weight, or r for M2PO; 1 for "none").
    """

    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    clipped: torch.Tensor
    is_weight: torch.Tensor


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, behavior_logp: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, *,
                correction: Correction = "none", clip_low: float = 0.2, clip_high: float | None = None,
                dual_clip: float | None = None, tis_cap: float = 2.0, m2po_tau: float = 0.04,
                ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                agg: AggMode = "token-mean", n_tokens: float | None = None,
                n_seqs: float | None = None, norm_len: float | None = None) -> LossOutput:
    """The full per-batch policy loss: pg + kl_coef·KL - entropy_coef·H.

    The pg term depends on ``correction`` (module docstring); ``clip_low`` and ``clip_high``
    (:func:`ppo_clip`) apply to ``"none"`` and ``"tis"``, ``tis_cap`` to ``"tis"``, ``m2po_tau`` to ``"m2po"``;
    ``dual_clip`` c to all three: a token with A < 0 contributes at most ``-c·A`` (zero gradient beyond), which
    for M2PO bounds the tokens its trust region never constrains (A < 0 with r > c: the policy raised a token
    the advantage pushes down; Ye et al. 2020's dual clip, applied to M2PO's surrogate ``r·A``). KL is :func:`k3_kl`
    against ``ref_logp`` (GRPO, Shao et al. 2024, eq. 3); the entropy bonus
    subtracts ``entropy_coef`` times the mean token entropy (Schulman et al. 2017, eq. 9).

    Args:
        logp: float32[B, T], with grad. old_logp, behavior_logp: float32[B, T].
        advantages: float32[B] or float32[B, T].
        mask: {0,1}[B, T].
        entropy: float32[B, T], per-token entropy of π_θ (nats), required when entropy_coef > 0.
        ref_logp: float32[B, T], required when kl_coef > 0.
        agg, n_tokens, n_seqs, norm_len: see :func:`aggregate`.

    Raises:
        ValueError: unknown correction, shape mismatch, or a coefficient set without its input.
    """
    _check_same_shape(logp=logp, old_logp=old_logp, behavior_logp=behavior_logp, mask=mask)
    adv = advantages.unsqueeze(-1).expand_as(logp) if advantages.ndim == 1 else advantages
    agg_kw = dict(n_tokens=n_tokens, n_seqs=n_seqs, norm_len=norm_len)
    valid = mask.bool()
    zeros = torch.zeros_like(logp)

    def log_ratio(base: torch.Tensor) -> torch.Tensor:  # zero off the mask: padding never reaches exp
        return torch.where(valid, logp - base.detach(), zeros)

    if correction == "none":
        ratio = torch.exp(log_ratio(behavior_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        token_pg, clipped = ppo_clip(ratio, adv, clip_low, clip_high, dual_clip)
        weight = torch.ones_like(logp)
    elif correction == "tis":
        ratio = torch.exp(log_ratio(old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        weight = torch.where(valid, truncated_is_weight(old_logp, behavior_logp, tis_cap), zeros)
        token_pg, clipped = ppo_clip(ratio, adv, clip_low, clip_high, dual_clip)
        token_pg = token_pg * weight
    elif correction == "m2po":
        lr = log_ratio(behavior_logp)
        ratio = torch.exp(lr)
        clipped, delta = m2po_clip(lr, adv, mask, m2po_tau)
        # The clipped tokens take the authors' clamped branch: the constant -A·e^{±δ}
        # (zero gradient); every other token the unclipped -r·A. ε-clipping does not apply.
        bound = torch.exp(torch.where(lr > 0, delta, -delta)) if math.isfinite(delta) else ratio.detach()
        token_pg = -adv * torch.where(clipped, bound.detach(), ratio)
        if dual_clip is not None:  # the dual clip of ppo_clip on the tokens M2PO leaves unbounded: A<0, r>1
            if dual_clip <= 1.0:
                raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
            dual = (adv < 0) & (ratio.detach() > dual_clip) & valid
            token_pg = torch.where(dual, -adv * dual_clip, token_pg)
            clipped = clipped | dual
        weight = ratio.detach()
    else:
        raise ValueError(f"unknown off-policy correction {correction!r}; use none, tis or m2po")
    pg = aggregate(token_pg, mask, agg, **agg_kw)
    loss = pg
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    kl = zero
    if kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (a reference model)")
        kl = aggregate(k3_kl(logp, ref_logp), mask, agg, **agg_kw)
        loss = loss + kl_coef * kl
    elif ref_logp is not None:
        kl = aggregate(k3_kl(logp.detach(), ref_logp), mask, agg, **agg_kw)
    ent = zero
    if entropy is not None:
        ent = aggregate(entropy, mask, agg, **agg_kw)
        if entropy_coef:
            loss = loss - entropy_coef * ent
    elif entropy_coef:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")
    return LossOutput(loss=loss, pg_loss=pg.detach(), kl=kl.detach(), entropy=ent.detach(),
                      clipped=clipped & valid, is_weight=weight.detach())
