"""A workflow plugin: one class that registers itself, and one config entry that names its module
(``workflow: {name: short_answer, module: examples.plugins.short_answer, options: {penalty: 0.02}}``;
docs/guides/plugins.md).

:class:`ShortAnswer` rolls out one answer per sample, as ``single_turn`` does, and rewards it with the prompt's
score minus ``penalty`` per generated token: among correct answers, the shorter learns faster.
"""
from __future__ import annotations

from typing import ClassVar, Mapping

from producers.engine_batcher import EngineBatcher
from producers.engines import SamplingParams
from producers.workflows import Tool, Trajectory, Workflow, prompt_ids, register_workflow, rewards_of
from topics.schemas import Prompt, TrajectoryGroup


@register_workflow("short_answer")
class ShortAnswer(Workflow):
    """G single-turn answers; reward = the prompt's score (:func:`producers.rewards.score_many`) minus
    ``penalty`` x the answer's generated tokens.

    Args:
        policies: role -> policy overrides (one role, ``policy``, played by ``actor`` by default).
        penalty: reward taken off per generated token, >= 0.

    Raises:
        ValueError: a negative ``penalty``.
    """

    roles: ClassVar[dict[str, str]] = {"policy": "actor"}

    def __init__(self, policies: Mapping[str, str] | None = None, penalty: float = 0.01):
        super().__init__(policies)
        if penalty < 0:
            raise ValueError(f"workflow short_answer: penalty must be >= 0, got {penalty}")
        self.penalty = penalty

    async def rollout(self, prompt: Prompt, engines: Mapping[str, EngineBatcher], sampling: SamplingParams,
                      tools: Mapping[str, Tool]) -> list[TrajectoryGroup]:
        engine = self.engine(engines, "policy")
        ids = prompt_ids(engine.tokenizer, prompt)
        gens = await engine.generate_many([ids] * prompt.n_samples, sampling)
        texts = [engine.tokenizer.decode(list(g.output_ids), skip_special_tokens=True) for g in gens]
        scores = await rewards_of(prompt, texts)
        samples = []
        for gen, score in zip(gens, scores):
            trajectory = Trajectory(ids)
            trajectory.add_generation(gen)
            samples.append(trajectory.to_sample(score - self.penalty * len(gen.output_ids)))
        return [self.group(prompt, "policy", samples)]
