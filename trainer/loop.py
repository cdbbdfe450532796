"""The optimisation loop of one policy: GRPO/PPO mini-batch updates with off-policy correction."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from dataclasses import dataclass

import torch

from policies.staleness import staleness
from topics.schemas import TrajectoryGroup
from trainer import losses
from trainer.backend import TorchBackend
from trainer.batch import PackedBatch, pack_groups
from trainer.checkpoint import Checkpoint
from trainer.config import TrainerConfig
from trainer.model import DTYPES, load_causal_lm, resolve_device, token_logprobs


@dataclass
class TrainedStep:
    """What one :meth:`Trainer.train_step` made.

    Attributes:
        version: the version of the new weights (:attr:`Trainer.version` after the step).
        metrics: the step's metrics, name -> float (listed in :meth:`Trainer.train_step`).
        weights: the new weights as engines run them (:meth:`Trainer.publish_state`: name -> tensor in
            ``param_dtype``, where the backend holds them) when the step was asked for them (``with_weights``);
            on ranks other than 0 an empty dict; None when not asked for.
    """

    version: int
    metrics: dict[str, float]
    weights: dict[str, torch.Tensor] | None = None


class Trainer:
    """Loads a policy from an HF directory and trains it on TrajectoryGroups. It computes only: publishing the
    weights it returns is the caller's (:class:`trainer.service.TrainerService`).

    Args:
        config: the :class:`TrainerConfig`.
        model_dir: a ``save_pretrained`` directory (the initial weights are version 0,
            and the reference model for the KL when ``kl_coef > 0``).

    Attributes:
        version: the version of the current weights: 0 at load, +1 per :meth:`train_step`.
        rank, world: this process's rank and the number of ranks (0 and 1 unless ``config.ranks > 1``).

    With ``config.ranks`` N > 1 (under torchrun; see :mod:`trainer.distributed`) every rank builds a
    Trainer and calls :meth:`train_step` with the same groups (and the same ``with_weights``); the
    model is sharded with FSDP2, rank r runs micro-batches r, r+N, ..., rank 0 gets the gathered weights, and
    the returned metrics are reduced over the ranks (the same on every rank).

    Raises:
        RuntimeError: ``config.ranks > 1`` but the process was not started with that many ranks.
    """

    def __init__(self, config: TrainerConfig, model_dir: str | Path):
        self.config = config
        if config.ranks > 1 or config.backend == "deepspeed":
            from trainer import distributed

            self.device = distributed.init(config)  # joins the torchrun process group (alone: its own)
        else:
            self.device = resolve_device(config.device)
        torch.manual_seed(config.seed)
        load_dtype = config.master_dtype  # the weights AdamW updates (float32 unless param_dtype is bfloat16)
        # the reference model first: under ZeRO-3 a model loaded later is created partitioned
        self.ref_model = (load_causal_lm(model_dir, config.param_dtype, self.device, trainable=False)
                          if config.kl_coef > 0 else None)
        if config.backend == "deepspeed":
            from trainer.deepspeed_backend import DeepSpeedBackend

            self.backend = DeepSpeedBackend.load(model_dir, load_dtype, self.device, config)
        else:
            model = load_causal_lm(model_dir, load_dtype, self.device)
            if config.ranks > 1:
                from trainer.distributed import FSDPBackend

                self.backend = FSDPBackend(model, config)
            else:
                self.backend = TorchBackend(model, config)
        self.model = self.backend.model
        self.optimizer = self.backend.optimizer
        self.version = 0
        #: this process's rank and the number of ranks (0 and 1 unless ``config.ranks > 1``)
        self.rank, self.world = (torch.distributed.get_rank(), config.ranks) if config.ranks > 1 else (0, 1)

    # -- state ------------------------------------------------------------
    def restore(self, ckpt: Checkpoint) -> None:
        """Load a :class:`trainer.checkpoint.Checkpoint`: its weights, optimizer state and version.

        A checkpoint whose model and optimizer state its backend wrote (``ckpt.sharded_dir`` set: FSDP2's DCP
        or DeepSpeed's) is loaded by the same backend on every rank (a collective).

        Raises:
            ValueError: the checkpoint was written by another backend than this trainer's.
        """
        written_by = ckpt.sharded_dir.name if ckpt.sharded_dir is not None else None
        if written_by != self.backend.CHECKPOINT_DIR:
            names = {None: "one plain process (trainer.ranks 1, backend torch)", "dcp": "FSDP2 (trainer.ranks > 1)",
                     "deepspeed": "DeepSpeed (trainer.backend deepspeed)"}
            raise ValueError(f"checkpoint {ckpt.path} was written by {names.get(written_by, written_by)}; this "
                             f"trainer is {names.get(self.backend.CHECKPOINT_DIR)}: resume it with the same backend")
        if ckpt.sharded_dir is not None:
            self.backend.load_sharded(ckpt.sharded_dir)
            self.version = ckpt.version
            return
        saved = load_causal_lm(ckpt.model_dir, self.config.master_dtype, self.device)
        self.model.load_state_dict(saved.state_dict())
        self.optimizer.load_state_dict(ckpt.optimizer)
        self.version = ckpt.version

    def renumber(self, version: int) -> None:
        """Give the current weights the new number ``version``, without training (nothing is gathered: the
        caller publishes :meth:`publish_state` as the new version).

        A trainer resumed from a checkpoint older than versions already published (killed after publishing
        steps it had not checkpointed) calls it with the next free version: those versions keep naming
        the weights they were announced with, and RaaS workers leave them for the checkpoint's weights at once.

        Raises:
            ValueError: ``version`` is not above :attr:`version`.
        """
        if version <= self.version:
            raise ValueError(f"renumber to version {version}: not above the current version {self.version}")
        self.version = version

    def publish_state(self) -> dict[str, torch.Tensor]:
        """The weights as published, name -> tensor in ``param_dtype``: the dtype engines run, so that a
        float32 trainer feeds float32 engines the very policy it trains (with ``master_dtype`` float32 the fp32
        master weights are rounded to ``param_dtype``, the dtype the forward pass computes in).

        The tensors stay where the backend holds them (the model's own parameters when the dtype matches):
        the publisher makes the one copy to host memory per version (pinned and non-blocking from CUDA).

        On several ranks a collective (the shards are gathered): every rank must call it; rank 0 gets the
        full dict, the others an empty one."""
        dtype = DTYPES[self.config.param_dtype]
        return {k: v.detach().to(dtype) for k, v in self.backend.full_state_dict().items()}

    # -- one step ----------------------------------------------------------
    def _autocast(self):
        if self.config.master_dtype != self.config.param_dtype:  # fp32 master weights, bf16 compute
            return torch.autocast(self.device.type, dtype=DTYPES[self.config.param_dtype])
        return torch.autocast(self.device.type, enabled=False)

    def _logprobs(self, model: torch.nn.Module, b: PackedBatch, with_entropy: bool = False):
        with self._autocast():
            return token_logprobs(model, b.input_ids, b.attention_mask, self.config.temperature, with_entropy)

    @torch.no_grad()
    def _frozen_logprobs(self, model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
        size = self.config.micro_batch_size or len(batch)
        out = torch.zeros_like(batch.behavior_logp)
        for start in range(0, len(batch), size):
            idx = torch.arange(start, min(start + size, len(batch)))
            part = batch.select(idx)
            out[idx, : part.input_ids.shape[1]] = self._logprobs(model, part)[0]
        return out

    def train_step(self, groups: list[TrajectoryGroup], version_now: int | None = None,
                   wait_s: float = 0.0, *, with_weights: bool = False) -> TrainedStep:
        """Run ``ppo_epochs`` passes of mini-batch updates on ``groups``: the weights become version + 1.

        Args:
            groups: the batch; each group's samples are one GRPO group.
            version_now: the trainer version staleness is measured against
                (default: :attr:`version`); staleness = version_now - group.min_version.
            wait_s: seconds the caller waited for this batch (for ``wait_frac``).
            with_weights: also return the new weights (:meth:`publish_state`, gathered within the step). On
                several ranks a collective: every rank passes the same value.

        Returns:
            The :class:`TrainedStep`: the new version, the new weights when asked for, and the step's metrics
            (floats): loss, pg_loss, kl, clipfrac, entropy, grad_norm (the global L2 norm before clipping, mean
            over the step's optimizer steps), grad_norm_clipped (after clipping to ``max_grad_norm``),
            zero_adv_frac (the share of groups whose rewards are all equal: no gradient), adv_abs_mean (mean |A|
            per sample), response_tokens (generated tokens per sample), turns_mean (model turns per episode: a
            tool workflow's calls are turns - 1), masked_frac (the share of the sequences' tokens not trained:
            prompt and tool output), reward_mean, reward_std, staleness_mean/max and ``staleness_hist/<k>`` counts of
            groups, is_ratio_mean/std/max/min (π_θ/π_behaviour on generated tokens before the
            update), behaviour_kl (KL(π_behaviour || π_θ) per generated token before the update, Schulman's
            k3 estimator r - 1 - log r with r = π_θ/π_behaviour: http://joschu.net/blog/kl-approx.html), tokens
            (generated, count), tokens_per_s, step_s (seconds, the weights' gather included), wait_s, wait_frac,
            groups, samples, version.

        Raises:
            ValueError: ``groups`` is empty or malformed (see :func:`trainer.batch.pack_groups`).
        """
        cfg = self.config
        start = time.perf_counter()
        version_now = self.version if version_now is None else version_now
        full = pack_groups(groups, cfg.pad_token_id).to(self.device)
        advantages = losses.group_advantages(full.rewards.cpu(), full.group_index.cpu(),
                                             scale_by_std=cfg.adv_scale_by_std).to(self.device)
        n = len(full)
        mini = cfg.mini_batch_size or n
        # TIS needs π_old, the policy before this step's update. With one update per batch that is the
        # policy being trained, so the training forward's detached logprobs are π_old and a separate
        # no-grad forward would only repeat them (it is ~20% of a step on the CPU).
        reuse_logp = cfg.correction == "tis" and cfg.ppo_epochs == 1 and mini >= n
        old_logp = (self._frozen_logprobs(self.backend.forward_model, full)
                    if cfg.correction == "tis" and not reuse_logp else full.behavior_logp)
        ref_logp = self._frozen_logprobs(self.ref_model, full) if self.ref_model is not None else None

        self.model.train()
        micro = cfg.micro_batch_size or mini
        sums: Counter = Counter()
        is_min, is_max = float("inf"), float("-inf")
        # The shuffle depends only on (seed, version): a resumed or replayed trainer shuffles as the original did.
        generator = torch.Generator().manual_seed((cfg.seed << 32) + self.version)
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=generator).to(self.device)
            for m_start in range(0, n, mini):
                m_idx = order[m_start: m_start + mini]
                n_tokens = float(full.loss_mask[m_idx].sum().clamp(min=1.0))
                self.backend.zero_grad()
                # On N ranks, rank r runs micro-batches r, r+N, ...; a rank short of one runs its first
                # again with a zero loss (every rank must run as many forward/backward passes).
                starts = list(range(0, len(m_idx), micro))
                passes = -(-len(starts) // self.world)
                mine = starts[self.rank::self.world]
                for i in range(passes):
                    dummy = i >= len(mine)
                    u_start = starts[0] if dummy else mine[i]
                    idx = m_idx[u_start: u_start + micro]
                    b = full.select(idx)
                    width = b.input_ids.shape[1]
                    self.backend.begin_micro_batch(i == passes - 1)
                    # the entropy is reported even at entropy_coef 0: computed in the same chunks (no memory),
                    # its gradient only when the loss uses it (trainer.model.token_logprobs)
                    logp, ent = self._logprobs(self.backend.forward_model, b, with_entropy=True)
                    out = losses.policy_loss(
                        logp, logp.detach() if reuse_logp else old_logp[idx, :width], b.behavior_logp, advantages[idx], b.loss_mask,
                        correction=cfg.correction, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                        dual_clip=cfg.dual_clip,
                        tis_cap=cfg.tis_cap, m2po_tau=cfg.m2po_tau,
                        ref_logp=None if ref_logp is None else ref_logp[idx, :width], kl_coef=cfg.kl_coef,
                        entropy=ent, entropy_coef=cfg.entropy_coef, agg=cfg.loss_agg,
                        n_tokens=n_tokens, n_seqs=len(m_idx), norm_len=cfg.norm_len)
                    self.backend.backward(out.loss * 0.0 if dummy else out.loss)
                    if dummy:
                        continue
                    valid = b.loss_mask.bool()
                    # micro-batch losses add up to their mini-batch's; mini-batches weigh by size
                    for key in ("loss", "pg_loss", "kl", "entropy"):
                        sums[key] += float(getattr(out, key).detach()) * len(m_idx) / n
                    sums["clipped"] += int(out.clipped.sum())
                    sums["valid"] += int(valid.sum())
                    log_ratio = (logp.detach() - b.behavior_logp)[valid]
                    ratio = torch.exp(log_ratio)
                    if ratio.numel():
                        sums["is_ratio_sum"] += float(ratio.sum())
                        sums["is_ratio_sq_sum"] += float(ratio.square().sum())
                        sums["behaviour_kl_sum"] += float((ratio - 1.0 - log_ratio).sum())
                        is_min, is_max = min(is_min, float(ratio.min())), max(is_max, float(ratio.max()))
                norm = self.backend.step()
                sums["grad_norm"] += norm
                sums["grad_norm_clipped"] += min(norm, cfg.max_grad_norm)
                sums["updates"] += 1
        self.model.eval()
        self.version += 1
        if self.world > 1:
            is_min, is_max = self._reduce_metrics(sums, is_min, is_max)
        weights = self.publish_state() if with_weights else None
        step_s = time.perf_counter() - start
        epochs = cfg.ppo_epochs
        stale = [staleness(g.min_version, version_now) for g in groups]
        gen_tokens = float(full.loss_mask.sum())
        rewards = full.rewards
        is_mean = sums["is_ratio_sum"] / max(sums["valid"], 1)
        all_tokens = float(full.attention_mask.sum())
        metrics = {
            "loss": sums["loss"] / epochs, "pg_loss": sums["pg_loss"] / epochs, "kl": sums["kl"] / epochs,
            "entropy": sums["entropy"] / epochs,
            "clipfrac": sums["clipped"] / max(sums["valid"], 1),
            "grad_norm": sums["grad_norm"] / max(sums["updates"], 1),
            "grad_norm_clipped": sums["grad_norm_clipped"] / max(sums["updates"], 1),
            "zero_adv_frac": sum(g.zero_adv for g in groups) / len(groups),
            "adv_abs_mean": float(advantages.abs().mean()),
            "response_tokens": gen_tokens / n, "turns_mean": sum(s.turns for g in groups for s in g.samples) / n,
            "masked_frac": 1.0 - gen_tokens / max(all_tokens, 1.0),
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
            "staleness_mean": sum(stale) / len(stale), "staleness_max": float(max(stale)),
            "is_ratio_mean": is_mean,
            "is_ratio_std": max(sums["is_ratio_sq_sum"] / max(sums["valid"], 1) - is_mean ** 2, 0.0) ** 0.5,
            "behaviour_kl": sums["behaviour_kl_sum"] / max(sums["valid"], 1),
            "is_ratio_max": is_max if sums["valid"] else 1.0, "is_ratio_min": is_min if sums["valid"] else 1.0,
            "tokens": gen_tokens, "tokens_per_s": gen_tokens * epochs / step_s, "step_s": step_s,
            "wait_s": wait_s, "wait_frac": wait_s / (wait_s + step_s),
            "groups": float(len(groups)), "samples": float(n), "version": float(self.version),
        }
        for k, count in Counter(stale).items():
            metrics[f"staleness_hist/{k}"] = float(count)
        return TrainedStep(self.version, metrics, weights)

    def _reduce_metrics(self, sums: Counter, is_min: float, is_max: float) -> tuple[float, float]:
        """Sum the per-rank metric sums (in place) and take the global IS-ratio min/max (a collective, on the
        training device: :func:`trainer.distributed.all_reduce_floats`).
        ``grad_norm`` and ``updates`` are global already and are left alone."""
        from trainer.distributed import all_reduce_floats

        keys = ("loss", "pg_loss", "kl", "entropy", "clipped", "valid", "is_ratio_sum", "is_ratio_sq_sum",
                "behaviour_kl_sum")
        for k, v in zip(keys, all_reduce_floats([float(sums[k]) for k in keys], self.device)):
            sums[k] = v
        low, neg_high = all_reduce_floats([is_min, -is_max], self.device, torch.distributed.ReduceOp.MIN)
        return low, -neg_high
