"""One evaluation of a policy from its section (``astraflow eval``): the command line's options over the config's,
the benchmarks' prompts, and the run itself, offline on the newest stored version or live on every new one."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from consumers.config import EvalSection
from consumers.evaluation import DEFAULT_BENCHMARKS, EvalResult, LiveEvaluator, evaluate, load_benchmark, pull_newest
from producers.engines import EngineUpdateError
from producers.raas import standalone_engine
from producers.sources import SourceError
from topics.bus import connect
from topics.schemas import Prompt
from weights.puller import WeightsUnavailable
from weights.store import StoreError


class EvalRefused(ValueError):
    """An option or a benchmark that cannot be evaluated; the message names it and why."""


class WeightsNotLoaded(RuntimeError):
    """The newest stored version could not be brought into the engine; the message says why."""


@dataclass
class EvalPlan:
    """An evaluation ready to run: its section with the options applied, and its benchmarks' prompts."""

    section: EvalSection
    prompts: list[Prompt]


def plan(section: EvalSection, *, benchmarks: list[str] | None = None, k: int | None = None,
         temperature: float | None = None, limit: int | None = None, max_new_tokens: int | None = None) -> EvalPlan:
    """``section`` with the given options (None: the section's own) applied and checked, and the prompts of its
    benchmarks loaded.

    Raises:
        EvalRefused: ``k``, ``limit`` or ``max_new_tokens`` below 1, ``temperature`` not above 0 (avg@k samples), a
            benchmark that cannot be loaded or has no well-formed prompt.
    """
    section = section.model_copy(update={
        "benchmarks": list(benchmarks or section.benchmarks or DEFAULT_BENCHMARKS),
        "k": section.k if k is None else k,
        "temperature": section.temperature if temperature is None else temperature,
        "limit": section.limit if limit is None else limit,
        "max_new_tokens": section.max_new_tokens if max_new_tokens is None else max_new_tokens})
    for name, value in (("--k", section.k), ("--limit", section.limit), ("--max-new-tokens", section.max_new_tokens)):
        if value is not None and value < 1:
            raise EvalRefused(f"{name} must be >= 1, got {value}")
    if section.temperature <= 0:
        raise EvalRefused(f"--temperature must be > 0 for avg@k sampling, got {section.temperature}")
    prompts = []
    for name in section.benchmarks:
        try:
            found = load_benchmark(name, section.limit)
        except SourceError as e:
            raise EvalRefused(f"benchmark {name!r}: {e}") from e
        if not found:
            raise EvalRefused(f"benchmark {name!r} has no well-formed prompts")
        prompts += found
    return EvalPlan(section, prompts)


def main(evaluation: EvalPlan, stop: threading.Event | None = None) -> EvalResult | None:
    """Run ``evaluation`` on the policy's own engine (:func:`producers.raas.standalone_engine`): offline (``stop``
    None) on the newest version in the store, else the base model; live, until ``stop`` is set, on every version
    announced on ``weights``, each result published as ``Metric(kind="eval")`` on ``metrics``.

    Returns:
        the offline result; None after a live evaluation.

    Raises:
        WeightsNotLoaded: offline, the newest version could not be loaded.
        RuntimeError: a vLLM server started for it did not become healthy.
    """
    s = evaluation.section
    kwargs = dict(k=s.k, temperature=s.temperature, max_new_tokens=s.max_new_tokens, seed=s.seed)
    with standalone_engine(s.policy, s.engine, s.param_dtype, s.run_dir) as engine:
        if stop is not None:
            LiveEvaluator(connect(s.bus, s.kafka), s.store, s.run, s.policy, engine, evaluation.prompts,
                          **kwargs).run(stop)
            return None
        try:
            pull_newest(engine, s.store, s.run, s.policy)
        except (WeightsUnavailable, StoreError, EngineUpdateError) as e:
            raise WeightsNotLoaded(str(e)) from e
        return evaluate(engine, evaluation.prompts, **kwargs)
