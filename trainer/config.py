"""The trainer's configuration: one validated pydantic model, and the section a trainer process takes."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.config import ServingSpec
from topics.kafka_security import KafkaSecurity

#: How per-token losses are reduced to one number (see :func:`trainer.losses.aggregate`).
AggMode = Literal["token-mean", "seq-mean", "seq-sum-norm"]
#: The off-policy correction of the policy-gradient loss (see :func:`trainer.losses.policy_loss`).
Correction = Literal["none", "tis", "m2po"]


class TrainerConfig(BaseModel):
    """Everything that shapes one policy's optimisation.

    Units: ``lr`` per step; ``temperature`` dimensionless; ``max_grad_norm`` in the
    L2 norm of all gradients; counts in samples (sequences) unless named otherwise.

    Temperature convention: the rollout engine records the logprobs of the
    temperature-scaled distribution it sampled from, so the trainer divides the
    logits by the same ``temperature`` before ``log_softmax``.
    """

    model_config = ConfigDict(extra="forbid")

    policy: str = Field(default="policy", min_length=1, description="the policy trained; the run config names it "
                        "after its policy (leave unset)")
    # model and optimiser
    param_dtype: Literal["bfloat16", "float32"] = Field(
        default="bfloat16", description="the dtype the forward pass computes in and the weights are published in")
    master_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="the dtype of the weights AdamW updates. float32: fp32 master weights and "
        "optimizer state, the forward/backward under bf16 autocast when param_dtype is bfloat16 (FSDP2: a "
        "MixedPrecisionPolicy; DeepSpeed: its bf16 mode). bfloat16: the bf16-only optimizer, asked for by name: "
        "AdamW updates bf16 weights in place, and every update under half a bf16 ulp (0.2-0.4% of the weight) "
        "rounds away, so at lr 1e-6 almost no weight moves")
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto (CUDA when torch "
                        "sees it, else the CPU), cpu, cuda, cuda:N")
    backend: Literal["torch", "deepspeed"] = Field(default="torch", description="deepspeed: ZeRO, via its launcher")
    ranks: int = Field(default=1, ge=1, description="processes training this policy together (FSDP2, under "
                       "torchrun; gloo on CPU, nccl on CUDA); 1: one plain process")
    zero_stage: int = Field(default=2, ge=2, le=3, description="ZeRO stage of the deepspeed backend")
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="overrides of the DeepSpeed config dict")
    lr: float = Field(default=1e-6, gt=0, description="AdamW learning rate, per step")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW (beta1, beta2)")
    max_grad_norm: float = Field(default=1.0, gt=0, description="clip the gradients to this global L2 norm")
    temperature: float = Field(default=1.0, gt=0, description="logits are divided by it before log_softmax; the run "
                               "config sets it to sampling.temperature")
    # PPO / GRPO
    adv_scale_by_std: bool = Field(default=True, description="GRPO (True) or Dr. GRPO (False) advantages")
    clip_low: float = Field(default=0.2, ge=0, description="PPO clip ε_low of the ratio (correction none and tis)")
    clip_high: float | None = Field(default=None, ge=0, description="DAPO clip-higher ε_high; None: = clip_low")
    dual_clip: float | None = Field(default=None, gt=1, description="dual-clip c: a token with a negative "
                                    "advantage weighs at most c x |A| (PPO's dual clip, and for m2po the tokens its "
                                    "trust region leaves unbounded); None: off")
    correction: Correction = Field(default="tis", description="off-policy correction: none (PPO-clip against the "
                                   "behaviour policy), tis (decoupled PPO times a truncated importance weight) or "
                                   "m2po (M2PO's second-moment trust region)")
    tis_cap: float = Field(default=2.0, gt=0, description="tis: cap C of the weight min(π_old/π_behaviour, C)")
    m2po_tau: float = Field(default=0.04, ge=0, description="m2po: bound on the second moment of the harmful tokens' "
                            "log-ratios (the paper's τ_M2)")
    kl_coef: float = Field(default=0.0, ge=0, description="k3 KL to the initial model; 0 loads no reference")
    entropy_coef: float = Field(default=0.0, ge=0, description="entropy bonus: the loss minus this times the mean "
                                "token entropy")
    loss_agg: AggMode = Field(default="token-mean", description="how per-token losses become one: token-mean (DAPO), "
                              "seq-mean (GRPO) or seq-sum-norm (Dr. GRPO, needs norm_len)")
    norm_len: int | None = Field(default=None, gt=0, description="tokens; required by loss_agg=seq-sum-norm")
    ppo_epochs: int = Field(default=1, ge=1, description="passes over each step's batch, each in a new shuffle")
    mini_batch_size: int | None = Field(default=None, ge=1, description="samples per optimiser step; None: whole batch")
    micro_batch_size: int | None = Field(default=None, ge=1, description="samples per forward; None: whole mini-batch")
    pad_token_id: int = Field(default=0, description="token id that pads the packed batch's sequences")
    seed: int = Field(default=0, description="torch's seed, and with the version each step's mini-batch shuffle")

    @model_validator(mode="before")
    @classmethod
    def _replaced_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "master_fp32" in data:
            raise ValueError("trainer.master_fp32 is replaced by trainer.master_dtype: fp32 master weights are the "
                             "default (master_dtype: float32); the bf16-only optimizer is master_dtype: bfloat16")
        return data

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        if self.master_dtype == "bfloat16" and self.param_dtype != "bfloat16":
            raise ValueError(f"trainer.master_dtype bfloat16 (the bf16-only optimizer) needs param_dtype bfloat16, "
                             f"got param_dtype {self.param_dtype!r}: remove master_dtype")
        if self.master_dtype == "bfloat16" and self.backend == "deepspeed":
            raise ValueError("trainer.master_dtype bfloat16 (the bf16-only optimizer) is not available with backend "
                             "deepspeed: DeepSpeed's bf16 mode keeps fp32 master weights; remove master_dtype")
        if self.loss_agg == "seq-sum-norm" and not self.norm_len:
            raise ValueError("loss_agg 'seq-sum-norm' (Dr. GRPO) needs norm_len, e.g. the max generation length")
        if self.backend != "deepspeed":
            unused = sorted(f for f in ("zero_stage", "deepspeed") if f in self.model_fields_set)
            if unused:
                raise ValueError(f"{', '.join(unused)} configure the deepspeed backend, but backend is "
                                 f"{self.backend!r}: set backend: deepspeed, or remove them")
        return self


class TrainerSection(BaseModel):
    """What one policy's trainer process takes (:func:`trainer.main.main`)."""

    model_config = ConfigDict(extra="forbid")

    run: str = Field(pattern=r"^[A-Za-z0-9._-]+$", description="the run name every topic and group is prefixed with")
    bus: str = Field(description="kafka://host:port or local://PATH")
    kafka: KafkaSecurity = Field(default_factory=KafkaSecurity, description="SASL and TLS of a kafka:// bus")
    store: str = Field(description="the run's weight store, file:///abs/dir or s3://bucket/prefix")
    policy: str = Field(description="the policy trained")
    model: str = Field(description="its model, as the config names it")
    run_dir: Path = Field(description="the trainer's own directory (checkpoints, metrics.jsonl)")
    trainer: TrainerConfig = Field(description="its trainer config (RunConfig.trainer_config)")
    steps: int = Field(ge=1, description="training steps on the lineage of the final weights")
    batch_groups: int = Field(ge=1, description="groups per training step")
    max_staleness: int = Field(ge=0, description="versions; older samples are dropped")
    checkpoint_every: int = Field(ge=1, description="steps between checkpoints")
    keep_versions: int | None = Field(ge=1, description="weight versions kept in the store; None keeps all")
    serving: list[ServingSpec] = Field(description="at most one serving policy (policies/config.py)")
    barrier_peers: dict[str, int] | None = Field(description="lockstep coupling: each other policy and its steps; "
                                                 "None: independent")
    stop_on_collapse: bool = Field(default=False, description="stop on a reward collapse and keep the best "
                                   "window's checkpoint (trainer/collapse.py)")
