"""The optimisation loop on a tiny random Qwen2."""
import math

import numpy as np
import pytest
import torch

from trainer.batch import pack_groups
from trainer.config import TrainerConfig
from trainer.loop import Trainer
from trainer.model import token_logprobs

torch.set_num_threads(1)


def _seq_logp(trainer, group):
    b = pack_groups([group]).to(trainer.device)
    with torch.no_grad():
        logp, _ = token_logprobs(trainer.model, b.input_ids, b.attention_mask, trainer.config.temperature)
    return (logp.float() * b.loss_mask).sum(-1)


def _capture_logit_grads(model):
    """Record (input_ids int64[B, T], d loss / d logits float32[B, T, V]) for each training forward."""
    seen = []

    def hook(module, args, kwargs, output):
        if output.logits.requires_grad:
            ids = kwargs["input_ids"].detach().cpu()
            output.logits.register_hook(lambda g: seen.append((ids, g.detach().float().cpu())))

    return seen, model.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("cfg", [
    dict(correction="none", param_dtype="float32", lr=1e-4),
    dict(correction="tis", lr=3e-4),  # bf16 compute, fp32 master weights (the default)
    dict(correction="m2po", loss_agg="seq-mean", adv_scale_by_std=False, param_dtype="float32", lr=1e-4),
    dict(correction="tis", kl_coef=0.1, entropy_coef=0.01, micro_batch_size=3, param_dtype="float32", lr=1e-4),
])
def test_on_policy_update_pushes_each_token_in_its_advantage_direction(tiny_model_dir, make_group, cfg):
    """What the loss guarantees for any model, not what one model happens to do.

    On policy (ratio 1), d(-loss)/d logit[t-1, y_t] = A * w_t * (1 - p(y_t)) for the sampled token
    y_t (Williams 1992; GRPO: Shao et al. 2024, eq. 3), plus the small entropy/KL terms: so the
    gradient at every generated token's logit has the opposite sign of its sample's advantage.
    The step itself must raise the advantage-weighted logprob sum sum_i A_i * logp_i, which Adam's
    first step (a sign step) does to first order for any model.
    """
    groups = []
    for seed in range(60):
        g = make_group([1.0, 0.0], seed=seed, gen_len=2)
        # tokens neither near-certain (zero gradient) nor negligible, so that the entropy term is small
        if all((-3.0 < s.behavior_logprobs[s.loss_mask == 1]).all() and
               (s.behavior_logprobs[s.loss_mask == 1] < -0.1).all() for s in g.samples):
            groups.append(g)
        if len(groups) == 3:
            break
    assert len(groups) == 3
    trainer = Trainer(TrainerConfig(max_grad_norm=10.0, **cfg), tiny_model_dir)
    before = [_seq_logp(trainer, g) for g in groups]
    seen, handle = _capture_logit_grads(trainer.model)
    step = trainer.train_step(groups, with_weights=True)
    metrics = step.metrics
    handle.remove()
    after = [_seq_logp(trainer, g) for g in groups]

    by_ids = {}
    for ids, grad in seen:
        for row in range(ids.shape[0]):
            by_ids[tuple(ids[row].tolist())] = (ids[row], grad[row])
    checked = 0
    for g in groups:
        for s in g.samples:
            key = next(k for k in by_ids if k[: len(s.input_ids)] == tuple(s.input_ids.tolist()))
            ids, grad = by_ids[key]
            for t in np.flatnonzero(s.loss_mask):
                dlogit = float(grad[t - 1, ids[t]])
                assert (dlogit < 0) if s.reward > 0 else (dlogit > 0), (t, dlogit, s.reward)
                checked += 1
    assert checked == 3 * 2 * 2
    surrogate = sum(float(a[0] - b[0]) - float(a[1] - b[1]) for a, b in zip(after, before))  # A_pos > 0 > A_neg
    assert surrogate > 0, [(a - b).tolist() for a, b in zip(after, before)]
    assert trainer.version == step.version == 1 and metrics["version"] == 1.0
    # returned in the dtype the trainer trains in, which engines then run (a float32 trainer feeds float32 engines)
    assert {v.dtype for v in step.weights.values()} == {getattr(torch, cfg.get("param_dtype", "bfloat16"))}
    for key in ("loss", "pg_loss", "kl", "clipfrac", "entropy", "grad_norm", "reward_mean", "reward_std",
                "is_ratio_mean", "is_ratio_max", "is_ratio_min", "behaviour_kl", "tokens_per_s", "wait_frac"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    assert metrics["reward_mean"] == 0.5 and metrics["staleness_hist/0"] == 3.0
    assert metrics["samples"] == 6 and metrics["tokens"] == 12


def test_temperature_divides_logits(tiny_model_dir, make_group):
    g = make_group([1.0, 0.0], temperature=0.7)
    trainer = Trainer(TrainerConfig(temperature=0.7, param_dtype="float32"), tiny_model_dir)
    step = trainer.train_step([g])
    metrics = step.metrics
    assert step.weights is None  # not asked for: nothing gathered
    # behaviour logprobs were recorded at T=0.7, so on-policy ratios are exactly 1
    assert metrics["is_ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["is_ratio_min"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["behaviour_kl"] == pytest.approx(0.0, abs=1e-8)


def test_behaviour_kl_is_the_k3_estimate_on_generated_tokens(tiny_model_dir, make_group):
    """Behaviour logprobs lowered by 0.3 on every generated token: r = pi_theta/pi_behaviour = e^0.3 there, so
    the k3 estimate of KL(pi_behaviour || pi_theta) is e^0.3 - 1 - 0.3 per token."""
    g = make_group([1.0, 0.0])
    for s in g.samples:
        s.behavior_logprobs = s.behavior_logprobs - 0.3 * s.loss_mask
    metrics = Trainer(TrainerConfig(param_dtype="float32"), tiny_model_dir).train_step([g]).metrics
    assert metrics["is_ratio_mean"] == pytest.approx(math.exp(0.3), rel=1e-4)
    assert metrics["behaviour_kl"] == pytest.approx(math.exp(0.3) - 1.3, rel=1e-3)


def test_staleness_histogram(tiny_model_dir, make_group):
    groups = [make_group([1.0, 0.0], version=v, seed=v) for v in (3, 3, 5)]
    trainer = Trainer(TrainerConfig(param_dtype="float32"), tiny_model_dir)
    m = trainer.train_step(groups, version_now=6).metrics
    assert m["staleness_hist/3"] == 2.0 and m["staleness_hist/1"] == 1.0 and m["staleness_max"] == 3.0


def test_micro_batches_accumulate_to_the_full_batch_gradient(tiny_model_dir, make_group):
    groups = [make_group([1.0, 0.0, 0.5], seed=s, gen_len=2 + s) for s in range(2)]
    runs = []
    for micro in (None, 2):
        t = Trainer(TrainerConfig(lr=1e-3, param_dtype="float32", micro_batch_size=micro), tiny_model_dir)
        runs.append(t.train_step(groups).metrics)
    # same loss and same pre-clip gradient norm: the micro-batch gradients add up to the batch's
    assert runs[1]["loss"] == pytest.approx(runs[0]["loss"], rel=1e-5, abs=1e-7)
    assert runs[1]["grad_norm"] == pytest.approx(runs[0]["grad_norm"], rel=1e-4)


def test_mini_batches_take_several_optimizer_steps(tiny_model_dir, make_group):
    t = Trainer(TrainerConfig(lr=1e-3, param_dtype="float32", mini_batch_size=2, ppo_epochs=2), tiny_model_dir)
    m = t.train_step([make_group([1.0, 0.0, 1.0, 0.0])]).metrics
    assert t.optimizer.state_dict()["state"][0]["step"].item() == 4  # 2 mini-batches x 2 epochs
    assert m["version"] == 1.0


def test_the_bf16_only_optimizer_updates_bf16_params_and_publishes_bf16(tiny_model_dir, make_group):
    t = Trainer(TrainerConfig(lr=1e-3, master_dtype="bfloat16"), tiny_model_dir)
    before = [p.detach().clone() for p in t.model.parameters()]
    assert before[0].dtype == torch.bfloat16
    step = t.train_step([make_group([1.0, 0.0], gen_len=2)], with_weights=True)
    assert any(not torch.equal(b, p) for b, p in zip(before, t.model.parameters()))
    assert step.version == 1 and {v.dtype for v in step.weights.values()} == {torch.bfloat16}


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="norm_len"):
        TrainerConfig(loss_agg="seq-sum-norm")


def test_the_weights_a_step_returns_are_the_models_own_tensors(tiny_model_dir, make_group):
    """With ``param_dtype`` the model's dtype, the weights a step returns (:meth:`Trainer.publish_state`) are the
    model's own tensors, not a copy: the publisher's host copy is the one copy of a version."""
    trainer = Trainer(TrainerConfig(param_dtype="float32", lr=1e-3, device="cpu"), tiny_model_dir)
    step = trainer.train_step([make_group([1.0, 0.0], seed=0, gen_len=2)], with_weights=True)
    params = trainer.model.state_dict()
    assert step.weights and all(step.weights[k].data_ptr() == params[k].data_ptr() for k in step.weights)
