"""The sections the consumers' components take of the run config (kept free of heavy imports: the run config
composes them)."""
from __future__ import annotations

from pathlib import Path

from pydantic import Field

from producers.config import RolloutPolicyConfig, RunAddress


class EvalSection(RunAddress):
    """What an evaluation of one policy takes (:func:`main`): the config's ``eval`` settings, before options."""

    store: str = Field(description="the run's weight store, file:///abs/dir or s3://bucket/prefix")
    run_dir: Path = Field(description="the run's directory; a vLLM server started for the evaluation logs there")
    seed: int = Field(description="seed of the sampling")
    policy: str = Field(description="the policy evaluated")
    engine: RolloutPolicyConfig = Field(description="its rollout settings: model and engine")
    param_dtype: str = Field(description="the dtype its trainer publishes, for a vLLM server started for it")
    benchmarks: list[str] = Field(description="benchmarks to evaluate; empty: DEFAULT_BENCHMARKS")
    k: int = Field(description="samples per prompt")
    temperature: float = Field(description="sampling temperature")
    limit: int | None = Field(description="first N prompts per benchmark; None: all")
    max_new_tokens: int | None = Field(description="the most tokens a sample has")
