"""Loss functions against values computed by hand on tiny tensors."""
import math

import pytest
import torch

from trainer import losses


def test_grpo_advantages_by_hand():
    # group 0: rewards 1, 0 -> mean .5, std .5 -> +1, -1 ; group 1: 2, 2, 5 -> mean 3, std sqrt(2)
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, 5.0])
    gi = torch.tensor([7, 7, 3, 3, 3])
    adv = losses.group_advantages(rewards, gi, eps=0.0)
    s = math.sqrt(2.0)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1 / s, -1 / s, 2 / s]), atol=1e-6)


def test_dr_grpo_advantages_are_centred_only():
    adv = losses.group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0, 5.0]), torch.tensor([0, 0, 1, 1, 1]),
                                  scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -1.0, -1.0, 2.0]))


def test_equal_rewards_give_zero_advantage():
    adv = losses.group_advantages(torch.tensor([3.0, 3.0]), torch.tensor([0, 0]))
    assert torch.equal(adv, torch.zeros(2))


def test_ppo_clip_by_hand():
    ratio = torch.tensor([[0.5, 1.1, 1.5, 0.5]])
    adv = torch.tensor([[1.0, 1.0, 1.0, -2.0]])
    loss, clipped = losses.ppo_clip(ratio, adv, clip_low=0.2)
    # min(r A, clip(r) A): .5 vs .8 -> .5 ; 1.1 vs 1.1 ; 1.5 vs 1.2 -> 1.2 (clipped) ; -1 vs -1.6 -> -1.6 (clipped)
    assert torch.allclose(loss, -torch.tensor([[0.5, 1.1, 1.2, -1.6]]))
    assert clipped.tolist() == [[False, False, True, True]]


def test_ppo_clip_higher():
    loss, clipped = losses.ppo_clip(torch.tensor([[1.25]]), torch.tensor([1.0]), clip_low=0.2, clip_high=0.28)
    assert torch.allclose(loss, torch.tensor([[-1.25]])) and not clipped.any()


def test_tis_weight_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    beh = torch.log(torch.tensor([[0.25, 0.1, 0.2]]))
    w = losses.truncated_is_weight(old, beh, cap=3.0)
    assert torch.allclose(w, torch.tensor([[2.0, 3.0, 0.5]]), atol=1e-6)  # 2, min(9, 3), 0.5


def test_m2po_clip_ignores_padding_by_hand():
    # All A > 0 and r > 1 (harmful): (log r)^2 = .01, .04, .09, 1.0 on valid tokens; padding (huge) ignored.
    # mean = .285 > .04; budget 4*.04 = .16; capping at .01 -> .04, at .04 -> .13, at .09 -> .23 >= .16:
    # bound sqrt(.04), so the .09 and 1.0 tokens are clipped (the authors' capping rule, not removal).
    log_ratio = torch.tensor([[0.1, 0.2, 0.3], [1.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([1.0, 1.0])
    clip, _ = losses.m2po_clip(log_ratio, adv, mask, tau=0.04)
    assert clip.tolist() == [[False, False, True], [True, False, False]]
    # under tau already: nothing clipped
    assert not losses.m2po_clip(log_ratio, adv, mask, tau=0.3)[0].any()
    # tokens that moved against their advantage are never clipped
    assert not losses.m2po_clip(log_ratio, -adv, mask, tau=0.0)[0].any()


def test_m2po_dual_clip_bounds_the_raised_tokens_a_negative_advantage_pushes_down_by_hand():
    # A < 0 everywhere: r = e^-1 moved with the advantage (M2PO's harmful side: tau large, so not clipped); r = 2
    # and r = 20 moved against it, which M2PO never bounds. With dual_clip 3 the r = 20 token weighs 3|A| and
    # has no gradient; the others keep r·|A|.
    logp = torch.tensor([[-1.0, math.log(2.0), math.log(20.0)]], requires_grad=True)
    zeros, mask, adv = torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([-2.0])
    out = losses.policy_loss(logp, zeros, zeros, adv, mask, correction="m2po", m2po_tau=10.0, dual_clip=3.0,
                             agg="seq-sum-norm", norm_len=1)
    out.loss.backward()
    assert out.clipped.tolist() == [[False, False, True]]
    assert out.loss.item() == pytest.approx(2.0 * (math.exp(-1.0) + 2.0 + 3.0), rel=1e-5)
    assert torch.allclose(logp.grad, torch.tensor([[2.0 * math.exp(-1.0), 4.0, 0.0]]), atol=1e-5)
    without = losses.policy_loss(logp.detach(), zeros, zeros, adv, mask, correction="m2po", m2po_tau=10.0,
                                 agg="seq-sum-norm", norm_len=1)
    assert without.loss.item() == pytest.approx(2.0 * (math.exp(-1.0) + 2.0 + 20.0), rel=1e-5)
    with pytest.raises(ValueError, match="dual_clip"):
        losses.policy_loss(logp, zeros, zeros, adv, mask, correction="m2po", dual_clip=1.0)


def test_k3_kl_by_hand():
    logp = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    # d = log .5 ; exp(d) - d - 1 = .5 + log 2 - 1
    assert torch.allclose(losses.k3_kl(logp, ref), torch.tensor([0.5 + math.log(2) - 1]))
    assert losses.k3_kl(ref, ref).item() == 0.0


def test_aggregation_modes():
    tl = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert losses.aggregate(tl, m, "token-mean").item() == pytest.approx(10 / 4)
    assert losses.aggregate(tl, m, "seq-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert losses.aggregate(tl, m, "seq-sum-norm", norm_len=5).item() == pytest.approx(10 / (2 * 5))
    with pytest.raises(ValueError, match="norm_len"):
        losses.aggregate(tl, m, "seq-sum-norm")


def test_policy_loss_on_policy_gradient_sign():
    logp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    out = losses.policy_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0]), torch.tensor([[0, 1]]))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0)
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] < 0  # descent raises logp of the positive sample


def test_policy_loss_tis_scales_by_weight():
    logp = torch.zeros(1, 2, requires_grad=True)
    beh = torch.log(torch.tensor([[1.0, 0.25]]))
    out = losses.policy_loss(logp, logp.detach(), beh, torch.tensor([1.0]), torch.ones(1, 2),
                             correction="tis", tis_cap=2.0)
    # ratio 1 everywhere; weights 1 and min(4, 2)=2 -> token-mean of -(1, 2) = -1.5
    assert out.loss.item() == pytest.approx(-1.5)
    assert out.is_weight.tolist() == [[1.0, 2.0]]


def test_policy_loss_rejects_unknown_correction():
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        losses.policy_loss(z, z, z, torch.zeros(1), torch.ones(1, 1), correction="vtrace")
