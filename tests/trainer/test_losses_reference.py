"""trainer.losses against transcriptions of the reference implementations, on identical tensors.

Each reference below is a plain-torch transcription (distributed reductions, metrics and
config plumbing dropped; the arithmetic kept op for op) of:

- verl, volcengine/verl @ b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29):
  ``verl/trainer/ppo/core_algos.py``: ``agg_loss``, ``compute_policy_loss_vanilla``
  (registered as "vanilla"; "bypass_mode" with ``loss_type=ppo_clip`` calls it with
  old_log_prob = rollout_log_prob and no IS weights), and
  ``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_correction_weights``
  (token level, the decoupled/TIS weights min(π_old/π_rollout, C)). verl has no
  registered "m2po" policy loss at that commit.
- M2PO authors, Infini-AI-Lab/M2PO @ af54a3e8feffb7a66a8258003aebefa37759cec0 (2025-10-08),
  ``verl/trainer/ppo/core_algos.py``: ``_solve_tau_from_sorted_delta2``,
  ``_get_trust_region_tokens_delta_sq``, ``kpo_clip_harmful_tokens``,
  ``compute_m2po_policy_loss`` and that fork's ``agg_loss``; ``M2_budget=0.04`` and
  ``miniclip_low/high`` unset (None) as in ``train-scripts/m2po-qwen-math-7b-s*.sh``.
  There ``old_log_prob`` is the actor's recompute at rollout time, before the batch
  waits ``stale_iteration`` steps in ``stale_data_queue`` (``ray_trainer.py``): the
  behaviour policy.
- AReaL, inclusionAI/AReaL @ 4aef98d8d818af55b43621aaadba047ae10f4e77 (2026-05-21):
  ``areal/utils/functional/functional.py``: ``ppo_actor_loss_fn`` and
  ``apply_rejection_sampling`` (token level), and ``areal/trainer/ppo/actor.py``:
  ``_apply_m2po_masking`` / ``_get_m2po_loss_mask`` (AReaL's own M2PO port).

Values and gradients w.r.t. the current logprobs must agree to 1e-6 (float64 inputs).
"""
from __future__ import annotations

import math

import pytest
import torch

from trainer import losses

ATOL = 1e-6


# ----------------------------------------------------------------------------- references: verl
def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                  loss_scale_factor=None):
    """verl core_algos.agg_loss @ b178a3c."""
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = (loss_mat * loss_mask).sum() / batch_num_tokens * dp_size
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = (seq_losses * seq_mask).sum() / global_batch_size * dp_size
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        loss = torch.sum(seq_losses) / loss_scale_factor
    else:
        raise ValueError(loss_agg_mode)
    return loss


def verl_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *,
                             clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                             rollout_is_weights=None, **agg_kw):
    """verl core_algos.compute_policy_loss_vanilla @ b178a3c (dual-clip always on, c = clip_ratio_c)."""
    cliprange_low = clip_ratio_low if clip_ratio_low is not None else clip_ratio
    cliprange_high = clip_ratio_high if clip_ratio_high is not None else clip_ratio
    assert clip_ratio_c > 1.0
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return verl_agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kw)


def verl_rollout_is_weights_token(old_log_prob, rollout_log_prob, response_mask, rollout_is_threshold=2.0):
    """verl rollout_corr_helper: log_ratio = old - rollout (compute_rollout_correction_and_rejection_mask),
    then compute_rollout_correction_weights(rollout_is="token", batch_normalize=False) @ b178a3c."""
    log_ratio = old_log_prob - rollout_log_prob
    log_ratio_safe = torch.clamp(log_ratio, min=-20.0, max=20.0)
    rollout_is_weights = torch.exp(log_ratio_safe)
    rollout_is_weights = rollout_is_weights * response_mask
    rollout_is_weights = rollout_is_weights.clamp(max=rollout_is_threshold)
    return rollout_is_weights.detach()


# ----------------------------------------------------------------------------- references: M2PO authors
def m2po_solve_tau_from_sorted_delta2(sorted_delta2, target_sum):
    """Infini-AI-Lab/M2PO _solve_tau_from_sorted_delta2 @ af54a3e."""
    if sorted_delta2.numel() == 0:
        return 100000
    total = float(sorted_delta2.sum().item())
    if target_sum >= total - 1e-12:
        return 100000
    if target_sum <= 1e-12:
        return 0.0
    csum = torch.cumsum(sorted_delta2, dim=0)
    n = sorted_delta2.numel()
    for k in range(0, n):
        left_sum = float(csum[k].item())
        rest = n - k - 1
        m2 = sorted_delta2[k].item() - 1e-12
        if m2 * rest + left_sum >= target_sum - 1e-12:
            if k == 0:
                return 0.0, csum[-1].item() / n
            else:
                M2_after = (sorted_delta2[k - 1].item() * (rest + 1) + float(csum[k - 1].item())) / n
                return float(sorted_delta2[k - 1].item() - 1e-12) ** 0.5, M2_after
    return 100000


def m2po_trust_region_tokens_delta_sq(old_log_prob, log_prob, advantages, response_mask):
    """Infini-AI-Lab/M2PO _get_trust_region_tokens_delta_sq @ af54a3e."""
    mask = response_mask.bool()
    adv_example = advantages[:, 0]
    pos_adv_mask = adv_example > 1e-12
    neg_adv_mask = adv_example < -1e-12
    delta = old_log_prob - log_prob
    ratio = torch.exp(-delta)
    pos_adv_response_mask = mask[pos_adv_mask]
    neg_adv_response_mask = mask[neg_adv_mask]
    pos_adv_ratio = ratio[pos_adv_mask]
    neg_adv_ratio = ratio[neg_adv_mask]
    pos_adv_r_gt_1_mask = pos_adv_ratio > 1.0 + 1e-12
    neg_adv_r_lt_1_mask = neg_adv_ratio < 1.0 - 1e-12
    delta_sq = delta.pow(2)
    pos = delta_sq[pos_adv_mask][pos_adv_r_gt_1_mask & pos_adv_response_mask]
    neg = delta_sq[neg_adv_mask][neg_adv_r_lt_1_mask & neg_adv_response_mask]
    return torch.cat([pos, neg])


def m2po_kpo_clip_harmful_tokens(old_log_prob, log_prob, advantages, response_mask, KL2_budget):
    """Infini-AI-Lab/M2PO kpo_clip_harmful_tokens @ af54a3e (prints dropped)."""
    tr = m2po_trust_region_tokens_delta_sq(old_log_prob, log_prob, advantages, response_mask)
    token_num = tr.numel()
    if token_num == 0:
        return 0.0, 100000, 0.0, 0.0
    target_total = KL2_budget * float(token_num)
    M2_now = float(tr.sum().detach().item() / token_num)
    if M2_now <= KL2_budget + 1e-12:
        return 0.0, 100000, M2_now, M2_now
    sorted_delta2, _ = torch.sort(tr)
    tau, M2_after = m2po_solve_tau_from_sorted_delta2(sorted_delta2, target_total)
    clip_low = float(torch.exp(torch.tensor(-tau)).item())
    clip_high = float(torch.exp(torch.tensor(+tau)).item())
    return clip_low, clip_high, M2_now, M2_after


def m2po_authors_policy_loss(old_log_prob, log_prob, advantages, response_mask, M2_budget=0.04,
                             miniclip_low=None, miniclip_high=None, loss_agg_mode="token-mean"):
    """Infini-AI-Lab/M2PO compute_m2po_policy_loss @ af54a3e, with that fork's agg_loss (token-mean:
    masked_mean). Returns (loss, clip_low, clip_high) where clip_* are the ε's it used."""
    clip_low, clip_high, _, _ = m2po_kpo_clip_harmful_tokens(old_log_prob, log_prob, advantages, response_mask,
                                                             M2_budget)
    clip_low = 1 - clip_low
    clip_high = clip_high - 1
    if miniclip_low is not None and clip_low < miniclip_low:
        clip_low = miniclip_low
    if miniclip_high is not None and clip_high < miniclip_high:
        clip_high = miniclip_high
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    assert loss_agg_mode == "token-mean"
    pg_loss = (clip_pg_losses1 * response_mask).sum() / response_mask.sum()
    return pg_loss, clip_low, clip_high


# ----------------------------------------------------------------------------- references: AReaL
def areal_rejection_sampling_token(proximal_logprobs, old_logprobs, loss_mask, *, action, upper, lower=None):
    """AReaL apply_rejection_sampling @ 4aef98d, level='token', metric='ratio'. Returns (loss_mask, weight)."""
    log_ratio = proximal_logprobs.detach().float() - old_logprobs.detach().float()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    metric = torch.exp(log_ratio)
    behave_imp_weight = torch.exp(log_ratio)
    if action == "mask":
        in_bounds = (metric >= lower) & (metric <= upper) if lower is not None else metric <= upper
        updated_mask = (loss_mask.bool() & in_bounds).to(loss_mask.dtype)
    else:
        behave_imp_weight = behave_imp_weight.clamp(min=lower if lower is not None else 0.0, max=upper)
        updated_mask = loss_mask
    behave_imp_weight = torch.where(updated_mask.bool(), behave_imp_weight, 0.0)
    return updated_mask, behave_imp_weight


def areal_ppo_actor_loss_fn(logprobs, proximal_logprobs, old_logprobs, advantages, eps_clip, loss_mask,
                            eps_clip_higher=None, c_clip=None, rejection_sampling=None):
    """AReaL ppo_actor_loss_fn @ 4aef98d, importance_sampling_level='token'. ``rejection_sampling``:
    None or a dict(action=, upper=, lower=) for the token-level ratio metric."""
    loss_mask_count = loss_mask.count_nonzero() or 1
    if rejection_sampling is not None:
        loss_mask, behave_imp_weight = areal_rejection_sampling_token(proximal_logprobs, old_logprobs, loss_mask,
                                                                      **rejection_sampling)
    loss_mask = loss_mask.bool()
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher))
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * clipped_ratio
    pg_loss = torch.max(pg_loss1, pg_loss2)
    if c_clip is not None:
        assert c_clip > 1.0
        pg_loss3 = torch.sign(advantages) * c_clip * advantages
        pg_loss = torch.min(pg_loss, pg_loss3)
    if rejection_sampling is not None:
        pg_loss = pg_loss * behave_imp_weight
    return torch.where(loss_mask, pg_loss, 0).sum() / loss_mask_count


def areal_m2po_mask(old_logp, prox_logp, loss_mask, m2_threshold):
    """AReaL _apply_m2po_masking + _get_m2po_loss_mask @ 4aef98d (M2 of behaviour vs proximal, all tokens)."""
    delta = old_logp - prox_logp
    m2 = delta * delta
    mask_flat = loss_mask.view(-1)
    m2_selected = m2.view(-1)[mask_flat]
    if m2_selected.numel() == 0:
        return loss_mask
    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    restored_indices = torch.argsort(indices)
    n = sorted_m2.numel()
    suffix_sums = sorted_m2.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    avg_m2_suffix = suffix_sums / counts
    below = torch.where(avg_m2_suffix < m2_threshold)[0]
    num_to_mask = below[0].item() if len(below) > 0 else n - 1
    keep_sorted = torch.ones_like(sorted_m2, dtype=torch.bool)
    if num_to_mask > 0:
        keep_sorted[:num_to_mask] = False
    full = torch.zeros_like(mask_flat, dtype=torch.bool)
    full[mask_flat] = keep_sorted[restored_indices]
    return full.view_as(loss_mask)


# ----------------------------------------------------------------------------- identical random tensors
def make_batch(seed: int, *, B: int = 8, T: int = 12, scale: float = 0.3, extreme: bool = False,
               old_scale: float | None = None, min_abs: float = 0.0):
    """Logprobs of the current, proximal and behaviour policies, sequence advantages (GRPO-like,
    some exactly 0) and a right-padded mask (one row fully valid, one with a single token).

    ``scale``: std of log π_θ - log π_behaviour; ``extreme`` plants |log-ratios| of 5..30 on
    some valid tokens (beyond verl's ±20 clamp too); ``min_abs`` is added to every |log-ratio|.
    Padding holds garbage logprobs."""
    g = torch.Generator().manual_seed(seed)
    beh = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4.0 - 0.01
    drift = torch.randn(B, T, generator=g, dtype=torch.float64) * scale
    drift = drift + torch.sign(drift) * min_abs
    if extreme:
        pick = torch.rand(B, T, generator=g) < 0.15
        big = (torch.rand(B, T, generator=g, dtype=torch.float64) * 25 + 5) * torch.sign(torch.randn(B, T, generator=g))
        drift = torch.where(pick, big.to(torch.float64), drift)
    logp = beh + drift
    old = beh + drift * torch.rand(B, T, generator=g, dtype=torch.float64) + \
        torch.randn(B, T, generator=g, dtype=torch.float64) * (old_scale if old_scale is not None else scale / 3)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = T, 1
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    garbage = torch.randn(B, T, generator=g, dtype=torch.float64) * 50
    logp, old, beh = (torch.where(mask.bool(), x, garbage) for x in (logp, old, beh))
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[torch.rand(B, generator=g) < 0.2] = 0.0
    return logp, old, beh, adv, mask


def grad_of(fn, logp):
    x = logp.clone().requires_grad_()
    value = fn(x)
    (g,) = torch.autograd.grad(value, x, allow_unused=True)
    return value.detach(), torch.zeros_like(logp) if g is None else g


def assert_same(ours, theirs, logp, mask=None):
    v_ours, g_ours = grad_of(ours, logp)
    v_ref, g_ref = grad_of(theirs, logp)
    assert torch.isfinite(v_ours) and torch.isfinite(g_ours).all()
    assert v_ours.item() == pytest.approx(v_ref.item(), abs=ATOL, rel=1e-9), (v_ours.item(), v_ref.item())
    if mask is not None:  # gradients off the mask: ours exactly 0; the reference may leave NaN*0 there
        assert (g_ours[~mask.bool()] == 0).all()
        g_ours, g_ref = g_ours[mask.bool()], g_ref[mask.bool()]
    assert torch.allclose(g_ours, g_ref, atol=ATOL, rtol=0), (g_ours - g_ref).abs().max()


SEEDS = range(6)


# ----------------------------------------------------------------------------- "none" = PPO-clip vs behaviour
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("clip_high,dual_clip", [(None, None), (0.28, None), (None, 3.0), (0.28, 3.0)])
def test_none_matches_verl_bypass_ppo_clip(seed, extreme, clip_high, dual_clip):
    """correction "none" = verl bypass_mode/ppo_clip: vanilla with old_log_prob = rollout_log_prob, no IS weight.
    verl always dual-clips (clip_ratio_c, default 3); ``dual_clip=None`` is compared with c = 1e30."""
    logp, _, beh, adv, mask = make_batch(seed, scale=0.5, extreme=extreme)
    A = adv[:, None].expand_as(logp)
    n_tokens = float(mask.sum()) + 7.0  # a mini-batch total, as the trainer passes for micro-batches
    ours = lambda x: losses.policy_loss(x, beh, beh, adv, mask, correction="none", clip_low=0.2, clip_high=clip_high,
                                        dual_clip=dual_clip, n_tokens=n_tokens).loss
    theirs = lambda x: verl_policy_loss_vanilla(beh, x, A, mask, clip_ratio=0.2, clip_ratio_high=clip_high,
                                                clip_ratio_c=dual_clip or 1e30, batch_num_tokens=n_tokens)
    assert_same(ours, theirs, logp, mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_none_matches_areal_coupled_ppo(seed, dual_clip):
    """correction "none" = AReaL ppo_actor_loss_fn without decoupling (proximal = behaviour, no rejection
    sampling). AReaL does not clamp the log-ratio: the tensors stay within verl's ±20 here."""
    logp, _, beh, adv, mask = make_batch(seed, scale=0.5)
    A = adv[:, None].expand_as(logp)
    ours = lambda x: losses.policy_loss(x, beh, beh, adv, mask, correction="none", dual_clip=dual_clip).loss
    theirs = lambda x: areal_ppo_actor_loss_fn(x, beh, beh, A, 0.2, mask.bool(), c_clip=dual_clip)
    assert_same(ours, theirs, logp, mask)


# ----------------------------------------------------------------------------- "tis" = decoupled PPO
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("cap", [2.0, 10.0])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_tis_matches_verl_decoupled_rollout_is(seed, extreme, cap, dual_clip):
    """correction "tis" = verl decoupled mode: vanilla(old_log_prob = the recomputed π_old) times the
    token-level rollout_is_weights min(π_old/π_rollout, C)."""
    logp, old, beh, adv, mask = make_batch(seed, scale=0.5, extreme=extreme, old_scale=0.4)
    A = adv[:, None].expand_as(logp)
    ours = lambda x: losses.policy_loss(x, old, beh, adv, mask, correction="tis", tis_cap=cap,
                                        dual_clip=dual_clip).loss
    w = verl_rollout_is_weights_token(old, beh, mask, rollout_is_threshold=cap)
    theirs = lambda x: verl_policy_loss_vanilla(old, x, A, mask, clip_ratio=0.2, clip_ratio_c=dual_clip or 1e30,
                                                rollout_is_weights=w)
    assert_same(ours, theirs, logp, mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_high", [None, 0.28])
def test_tis_matches_areal_decoupled_loss_with_clamped_weight(seed, clip_high):
    """correction "tis" = AReaL ppo_actor_loss_fn with use_decoupled_loss (proximal = recomputed π_old) and
    token-level rejection_sampling(metric=ratio, action=clamp, upper=C). AReaL's default action is
    'mask' (drop tokens with π_prox/π_behave > upper, weight unclamped below): not what TIS does."""
    logp, old, beh, adv, mask = make_batch(seed, scale=0.5, old_scale=0.4)
    A = adv[:, None].expand_as(logp)
    ours = lambda x: losses.policy_loss(x, old, beh, adv, mask, correction="tis", tis_cap=2.0,
                                        clip_high=clip_high).loss
    theirs = lambda x: areal_ppo_actor_loss_fn(x, old, beh, A, 0.2, mask.bool(), eps_clip_higher=clip_high,
                                               rejection_sampling=dict(action="clamp", upper=2.0))
    assert_same(ours, theirs, logp, mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_tis_single_update_is_the_truncated_is_policy_gradient(seed):
    """The trainer's one-update path passes old_logp = logp.detach() (π_old = π_θ at the step's start):
    the PPO ratio is 1, no clip is active, and the gradient is the truncated-IS policy gradient
    -min(π_old/π_behaviour, C)·A/N on each valid token, as verl's decoupled loss gives too."""
    logp, _, beh, adv, mask = make_batch(seed, scale=0.8, extreme=True)
    A = adv[:, None].expand_as(logp)
    ours = lambda x: losses.policy_loss(x, x.detach(), beh, adv, mask, correction="tis", tis_cap=2.0).loss
    w = verl_rollout_is_weights_token(logp, beh, mask, 2.0)
    theirs = lambda x: verl_policy_loss_vanilla(x.detach(), x, A, mask, rollout_is_weights=w)
    assert_same(ours, theirs, logp, mask)
    _, g = grad_of(ours, logp)
    expected = -(torch.exp((logp - beh).clamp(-20, 20)).clamp(max=2.0)) * A * mask / mask.sum()
    assert torch.allclose(g, expected, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- "m2po"
def _m2po_pair(logp, beh, adv, mask, tau):
    A = adv[:, None].expand_as(logp)
    ours = lambda x: losses.policy_loss(x, beh, beh, adv, mask, correction="m2po", m2po_tau=tau).loss
    theirs = lambda x: m2po_authors_policy_loss(beh, x, A, mask, M2_budget=tau)[0]
    return ours, theirs


def _m2po_boundary_token(logp, beh, adv, mask, tau):
    """The harmful token whose (log r)^2 is the threshold v_{k-1}, or None."""
    clip, delta = losses.m2po_clip(logp - beh, adv, mask, tau)
    if not math.isfinite(delta) or delta == 0.0:
        return None
    v2 = (logp - beh).square().float().double()
    d = torch.where(mask.bool(), (v2 - delta ** 2).abs(), torch.full_like(v2, math.inf))
    return divmod(int(d.argmin()), logp.shape[1])


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("scale,extreme,min_abs,tau", [
    (0.05, False, 0.0, 0.04),   # under budget: nothing clipped
    (0.3, False, 0.0, 0.04),    # over budget: an adaptive bound
    (0.6, True, 0.0, 0.04),     # far over (|log r| up to 30): a tight bound
    (0.6, True, 0.25, 0.04),    # every (log r)^2 > tau: all harmful tokens clipped (the reference's k = 0)
    (0.8, False, 0.0, 0.2),
])
def test_m2po_matches_authors_code(seed, scale, extreme, min_abs, tau):
    """correction "m2po" = Infini-AI-Lab/M2PO compute_m2po_policy_loss (old_log_prob = behaviour).

    float32 logprobs, as the trainer has them (the reference's ±1e-12 tolerances act in float32).
    The one token at the bound (v = v_{k-1}) gets, in the reference, the full gradient, half of it
    (r == e^{±δ} in float32: torch.maximum splits a tie, and clamp passes nothing at its bound) or
    none, depending on the last ulp of exp(sqrt(v - 1e-12)) against exp(log r); ours gives it the
    full gradient (capping at v_{k-1} leaves that token unchanged). tau = 0 is not compared: the
    reference's solver then returns a bare float where its caller unpacks a pair, and raises."""
    logp, _, beh, adv, mask = (t.float() for t in make_batch(seed, B=16, T=16, scale=scale, extreme=extreme,
                                                              min_abs=min_abs))
    _, delta = losses.m2po_clip(logp - beh, adv, mask, tau)
    assert (delta == math.inf) == (scale == 0.05) and (delta == 0.0) == (min_abs > 0)  # the intended regime
    ours, theirs = _m2po_pair(logp, beh, adv, mask, tau)
    v_ours, g_ours = grad_of(ours, logp)
    v_ref, g_ref = grad_of(theirs, logp)
    assert v_ours.item() == pytest.approx(v_ref.item(), abs=1e-5, rel=1e-5)
    valid = mask.bool()
    assert (g_ours[~valid] == 0).all()
    same = torch.isclose(g_ours, g_ref, atol=1e-6, rtol=1e-5) | ~valid
    edge = _m2po_boundary_token(logp, beh, adv, mask, tau)
    if edge is not None and not same[edge]:
        assert g_ours[edge] != 0 and (g_ref[edge] == 0 or torch.isclose(2 * g_ref[edge], g_ours[edge], rtol=1e-5))
        same[edge] = True
    assert same.all(), (g_ours - g_ref).abs().max()


def test_m2po_clip_by_hand():
    """Four harmful tokens (A>0, log r = .1, .2, .3, 1.0 -> v = .01, .04, .09, 1) and two that moved
    against the advantage (A>0, log r = -2; A<0, log r = +3), never candidates, never clipped.
    mean(v) = 1.14/4 > .04; budget n·tau = .16: capping at v_0=.01 gives .04, at v_1=.04 gives
    .01+.04*3 = .13, at v_2=.09 gives .05+.09*2 = .23 >= .16 -> k = 2, bound sqrt(.04) = .2:
    the tokens with log r .3 and 1.0 are clipped."""
    lr = torch.tensor([[0.1, 0.2, 0.3, 1.0, -2.0], [3.0, 0.0, 0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    clip, delta = losses.m2po_clip(lr, adv, mask, tau=0.04)
    assert clip.tolist() == [[False, False, True, True, False], [False] * 5]
    assert delta == pytest.approx(0.2)
    # under the budget nothing is clipped
    clip, delta = losses.m2po_clip(lr, adv, mask, tau=0.3)
    assert not clip.any() and delta == math.inf
    # value: clipped tokens hold the constant -A·e^{δ} (the authors' clamped branch), the rest -r·A
    logp = lr.clone().requires_grad_()
    out = losses.policy_loss(logp, torch.zeros_like(lr), torch.zeros_like(lr), adv, mask, correction="m2po",
                             m2po_tau=0.04)
    r = lr.exp()
    expected = -(r[0, 0] + r[0, 1] + 2 * math.exp(0.2) + r[0, 4]) + r[1, 0]
    assert out.loss.item() == pytest.approx(float(expected) / 6, rel=1e-6)
    out.loss.backward()
    assert logp.grad[0, 2] == 0 and logp.grad[0, 3] == 0 and logp.grad[0, 4] < 0 and logp.grad[1, 0] > 0


def test_m2po_areal_port_differs_from_the_authors():
    """AReaL's M2PO port masks by the M2 of *all* valid tokens with the removal rule (drop the largest
    until the mean of the rest is < tau), so it also masks tokens whose ratio moved against the
    advantage, which the authors' code never constrains. We follow the authors' code (the one the
    paper's results come from); this test records where the port would differ."""
    lr = torch.tensor([[0.1, 0.15, -0.1, -1.5]], dtype=torch.float32)  # last: A>0, r = e^-1.5 < 1: helpful
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 4)
    beh = torch.zeros(1, 4)
    areal_keep = areal_m2po_mask(beh, lr, mask.bool(), 0.04)
    ours_keep = mask.bool() & ~losses.m2po_clip(lr, adv, mask, tau=0.04)[0]
    assert areal_keep.tolist() == [[True, True, True, False]]   # drops the helpful token
    assert ours_keep.tolist() == [[True, True, True, True]]     # harmful M2 = (.01+.0225)/2 <= .04
    ours, theirs = _m2po_pair(lr, beh, adv, mask, 0.04)
    assert_same(ours, theirs, lr)


# ----------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize("seed", SEEDS)
def test_aggregate_matches_verl_agg_loss(seed):
    """token-mean = verl token-mean (batch_num_tokens = the mini-batch's token count);
    seq-mean = verl seq-mean-token-mean (global_batch_size = the mini-batch's sequences; verl's
    default divides by the non-empty sequences only, ours by n_seqs: the same when none is empty);
    seq-sum-norm = verl seq-mean-token-sum-norm / n_seqs: ours is Dr. GRPO's (Liu et al. 2025, eq. 3)
    1/G Σ_i Σ_t ·/L with the 1/G, verl drops the 1/G (a constant factor; kept ours, documented)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    x = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    m = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    n_tok, n_seq = float(m.sum()) + 5, B + 2
    assert losses.aggregate(x, m, "token-mean", n_tokens=n_tok).item() == pytest.approx(
        verl_agg_loss(x, m, "token-mean", batch_num_tokens=n_tok).item(), abs=1e-12)
    assert losses.aggregate(x, m, "seq-mean", n_seqs=n_seq).item() == pytest.approx(
        verl_agg_loss(x, m, "seq-mean-token-mean", global_batch_size=n_seq).item(), abs=1e-7)
    assert losses.aggregate(x, m, "seq-mean").item() == pytest.approx(
        verl_agg_loss(x, m, "seq-mean-token-mean").item(), abs=1e-7)
    assert losses.aggregate(x, m, "seq-sum-norm", n_seqs=n_seq, norm_len=T).item() * n_seq == pytest.approx(
        verl_agg_loss(x, m, "seq-mean-token-sum-norm", loss_scale_factor=T).item(), abs=1e-12)
