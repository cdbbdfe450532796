"""Reward functions: a registry of scorers ``(prompt, completion) -> float``.

The reward of a prompt is ``prompt.metadata["reward"]`` when set, else its
``task_type``. Built-in rewards:

- ``arith``: 1.0 when the completion, stripped and cut at the first EOS marker
  or newline, equals the gold answer exactly, else 0.0;
- ``search``: the search-agent demo's answer check, the same exact match as
  ``arith``; the completion is the last model turn's text (after the search
  call and its result), so a turn that searches again or answers wrongly scores 0.0;
- ``math``: 1.0 when math-verify finds the completion's final answer
  equivalent to the gold answer (``math_verify.parse`` + ``math_verify.verify``);
  run in a process pool, and an item that runs past its timeout (math-verify can
  hang on adversarial input) scores 0.0 and its worker process is replaced;
- ``code``: 1.0 when the program (prompt prefix, completion's code, tests)
  exits 0 in :mod:`producers.sandbox`, else 0.0; run in threads (each run is a
  subprocess under bubblewrap); where the sandbox cannot run, scoring raises
  :class:`~producers.sandbox.SandboxUnavailable` instead of scoring 0.0;
- ``boxed_format``: 1.0 when the completion has a ``\\boxed{...}`` answer.

New rewards are registered with :func:`register_reward`. Every reward returns a
float in [0, 1] here, but the registry does not require it.

A reward that raises (or, in the process pool, runs past its timeout or loses its worker) scores 0.0; each such
failure is logged as a warning naming the reward, the prompt and the error, and counted by reward name
(:func:`reward_errors`; a RaaS worker reports the sum as ``reward_errors_total`` on ``metrics``).

The process pool (pebble, ``spawn`` start method, :func:`pool_workers` workers)
re-imports the main script in each worker, as any ``spawn`` pool does: scripts
that score math must keep their work under ``if __name__ == "__main__":``.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from producers.sandbox import SandboxLimits, SandboxUnavailable, run_python
from topics.schemas import Prompt

log = logging.getLogger(__name__)

RewardFn = Callable[[Prompt, str], float]
#: ``inline``: called directly; ``thread``: in a thread pool (I/O or subprocess bound);
#: ``process``: in a process pool with a per-item timeout (CPU-bound, may hang).
Mode = Literal["inline", "thread", "process"]

EOS_MARKERS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<eos>", "\n")
DEFAULT_TIMEOUT_S = 10.0


class RewardError(KeyError):
    """No reward is registered under the name a prompt asks for."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class RewardSpec:
    """A registered reward: its function and how :func:`score_pairs` runs it."""

    name: str
    fn: RewardFn
    mode: Mode


REWARDS: dict[str, RewardSpec] = {}


def register_reward(name: str, mode: Mode = "inline") -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn(prompt, completion) -> float`` as reward ``name``.

    A ``process``-mode function must be importable at module top level (it is
    sent to worker processes by reference).

    Raises:
        ValueError: ``name`` is already registered or ``mode`` is unknown.
    """
    if mode not in ("inline", "thread", "process"):
        raise ValueError(f"reward {name!r}: unknown mode {mode!r} (inline, thread or process)")

    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered (by {REWARDS[name].fn.__qualname__})")
        REWARDS[name] = RewardSpec(name, fn, mode)
        return fn
    return deco


def reward_for(prompt: Prompt) -> RewardSpec:
    """The reward a prompt uses: ``metadata["reward"]``, else its ``task_type``.

    Raises:
        RewardError: no reward is registered under that name.
    """
    name = prompt.metadata.get("reward") or prompt.task_type
    spec = REWARDS.get(name)
    if spec is None:
        raise RewardError(f"prompt {prompt.prompt_id}: no reward named {name!r} "
                          f"(registered: {', '.join(sorted(REWARDS))})")
    return spec


# ---------------------------------------------------------------- built-in rewards

def strip_to_eos(completion: str) -> str:
    """The completion up to the first EOS marker or newline (:data:`EOS_MARKERS`), stripped."""
    text = completion.lstrip()
    for marker in EOS_MARKERS:
        text = text.split(marker, 1)[0]
    return text.strip()


@register_reward("arith")
def arith_reward(prompt: Prompt, completion: str) -> float:
    """1.0 when the completion up to EOS is exactly ``prompt.answer``, else 0.0."""
    return float(prompt.answer is not None and strip_to_eos(completion) == prompt.answer.strip())


@register_reward("search")
def search_reward(prompt: Prompt, completion: str) -> float:
    """1.0 when the last model turn's text (``completion``), cut at EOS or newline by :func:`strip_to_eos`, is
    exactly ``prompt.answer`` (the looked-up code, e.g. ``"381"``), else 0.0 (also when the prompt has no answer)."""
    return float(prompt.answer is not None and strip_to_eos(completion) == prompt.answer.strip())


#: Task types whose gold completion is the bare answer (exact-match rewards), not a boxed math answer.
EXACT_ANSWER_TASKS = frozenset({"arith", "search"})


def _gold_latex(answer: str) -> str:
    """The gold answer as LaTeX math-verify parses reliably: inside ``\\boxed{}`` unless already boxed."""
    answer = answer.strip()
    return answer if "\\boxed" in answer else f"\\boxed{{{answer}}}"


def math_verify_score(gold: str, completion: str, timeout_s: int = 5) -> float:
    """1.0 when math-verify finds ``completion``'s final answer equal to ``gold``, else 0.0.

    Uses math-verify's own signal-based timeouts, so call it in a process's
    main thread (the ``math`` reward runs it in the process pool). Parse and
    comparison errors score 0.0.
    """
    from math_verify import parse, verify

    try:
        gold_parsed = parse(_gold_latex(gold), parsing_timeout=timeout_s)
        pred_parsed = parse(completion, parsing_timeout=timeout_s)
        if not gold_parsed or not pred_parsed:
            return 0.0
        return float(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))
    except Exception:  # math-verify raises many types on malformed LaTeX; all mean "not verified"
        return 0.0


@register_reward("math", mode="process")
def math_reward(prompt: Prompt, completion: str) -> float:
    """math-verify equivalence of the completion's final answer with ``prompt.answer``."""
    if prompt.answer is None:
        return 0.0
    return math_verify_score(prompt.answer, completion)


_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.S)


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The code in a completion: the fenced block that defines ``entry_point`` (else the last
    fenced block), or the whole completion when it has no fences."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    if entry_point:
        for block in blocks:
            if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", block, re.M):
                return block
    return blocks[-1]


def build_program(prompt: Prompt, completion: str) -> str:
    """The program the code reward runs: the prompt's code prefix, the completion's code, the tests.

    When the prompt has ``metadata["code_prefix"]`` (HumanEval: the signature and
    docstring) and the code does not define ``entry_point`` itself, the code is a
    function body and is appended to the prefix; a full definition is placed
    after the prefix (keeping its imports) and replaces the prompt's stub.
    """
    code = extract_code(completion, prompt.entry_point)
    prefix = prompt.metadata.get("code_prefix") or ""
    defines = prompt.entry_point and re.search(rf"^\s*def\s+{re.escape(prompt.entry_point)}\s*\(", code, re.M)
    body = f"{prefix}\n{code}" if defines or not prefix else prefix + code
    return f"{body}\n\n{prompt.tests or ''}\n"


CODE_LIMITS = SandboxLimits()


@register_reward("code", mode="thread")
def code_reward(prompt: Prompt, completion: str) -> float:
    """1.0 when the completion passes the prompt's tests in the sandbox (:data:`CODE_LIMITS`), else 0.0.

    Raises:
        SandboxUnavailable: the sandbox cannot run here (bubblewrap missing, see
            :mod:`producers.sandbox`); :func:`score_pairs` lets it through rather than score 0.0.
    """
    if not prompt.tests:
        return 0.0
    return float(run_python(build_program(prompt, completion), CODE_LIMITS).passed)


_BOXED = re.compile(r"\\boxed\s*\{.+?\}", re.S)


@register_reward("boxed_format")
def boxed_format_reward(prompt: Prompt, completion: str) -> float:
    """1.0 when the completion states a ``\\boxed{...}`` answer, else 0.0 (a format reward)."""
    return float(bool(_BOXED.search(completion)))


# ---------------------------------------------------------------- execution

_lock = threading.Lock()
_process_pool = None
_thread_pool: ThreadPoolExecutor | None = None
_errors: Counter[str] = Counter()  # reward name -> items it failed to score in this process
_errors_lock = threading.Lock()


def reward_errors() -> dict[str, int]:
    """Items each reward failed to score in this process (raised, timed out or lost its worker), by reward name;
    each such item scored 0.0 (:func:`score_pairs`)."""
    with _errors_lock:
        return dict(_errors)


def _failed(spec: RewardSpec, prompt: Prompt, why: str) -> float:
    """Log and count an item that reward ``spec`` failed to score (``why``: what went wrong); its score, 0.0."""
    with _errors_lock:
        _errors[spec.name] += 1
    log.warning("reward %r failed on prompt %s, scored 0.0: %s", spec.name, prompt.prompt_id, why)
    return 0.0


def pool_workers() -> int:
    """Worker count for the reward pools: ``ASTRAFLOW_REWARD_WORKERS`` or the CPU count (at most 8)."""
    return int(os.environ.get("ASTRAFLOW_REWARD_WORKERS", min(8, os.cpu_count() or 1)))


def _warm_worker() -> None:
    """Each process-pool worker's start: import math-verify (sympy, the LaTeX grammar) and verify one
    answer, so that a cold worker's seconds of imports do not count against its first item's timeout (a
    loaded machine scored a correct first answer 0.0 that way)."""
    math_verify_score("1", "\\boxed{1}", timeout_s=60)


def _pools():
    """The shared process pool (pebble, spawned workers) and thread pool, created on first use."""
    global _process_pool, _thread_pool
    with _lock:
        if _process_pool is None:
            import multiprocessing

            from pebble import ProcessPool

            _process_pool = ProcessPool(max_workers=pool_workers(), context=multiprocessing.get_context("spawn"),
                                        initializer=_warm_worker)
            _thread_pool = ThreadPoolExecutor(max_workers=pool_workers(), thread_name_prefix="reward")
        return _process_pool, _thread_pool


def close_pools() -> None:
    """Stop the reward worker pools (they are recreated on next use)."""
    global _process_pool, _thread_pool
    with _lock:
        if _process_pool is not None:
            _process_pool.stop()
            _process_pool.join()
            _thread_pool.shutdown(wait=False, cancel_futures=True)
        _process_pool = _thread_pool = None


atexit.register(close_pools)


def score_pairs(pairs: Sequence[tuple[Prompt, str]], timeout_s: float = DEFAULT_TIMEOUT_S,
                on_done: Callable[[], None] | None = None) -> list[float]:
    """Score many (prompt, completion) pairs, in parallel where the reward's mode allows.

    Args:
        pairs: the items; each prompt picks its reward by :func:`reward_for`.
        timeout_s: per-item limit for ``process``-mode rewards (seconds, counted
            from when a worker starts the item); a late item scores 0.0.
        on_done: called once per finished item (for progress bars).

    Returns:
        One float per pair, in order. An item whose reward raises, times out or loses its worker scores 0.0,
        with a warning and a count in :func:`reward_errors`.

    Raises:
        RewardError: a prompt names an unregistered reward (checked before any work starts).
        SandboxUnavailable: a reward needs the code sandbox and it cannot run here (the message
            names the missing tool and how to install it); code is never scored unconfined.
    """
    specs = [reward_for(p) for p, _ in pairs]
    process_pool = thread_pool = None
    if any(s.mode != "inline" for s in specs):
        process_pool, thread_pool = _pools()
    futures: list[Future | float] = []
    for spec, (prompt, completion) in zip(specs, pairs):
        if spec.mode == "process":
            futures.append(process_pool.schedule(spec.fn, (prompt, completion), timeout=timeout_s))
        elif spec.mode == "thread":
            futures.append(thread_pool.submit(spec.fn, prompt, completion))
        else:
            try:
                futures.append(float(spec.fn(prompt, completion)))
            except SandboxUnavailable:
                raise
            except Exception as e:
                futures.append(_failed(spec, prompt, f"{type(e).__name__}: {e}"))
    scores = []
    for spec, (prompt, _), fut in zip(specs, pairs, futures):
        if isinstance(fut, Future):
            try:
                value = float(fut.result())
            except SandboxUnavailable:  # a host problem, not the completion's: refuse loudly
                raise
            except Exception as e:  # timeout, crashed worker or an error in the reward: no credit
                late = spec.mode == "process" and isinstance(e, TimeoutError)  # the pool's per-item limit
                why = f"no result within {timeout_s:g} s" if late else f"{type(e).__name__}: {e}"
                value = _failed(spec, prompt, why)
        else:
            value = fut
        scores.append(value)
        if on_done is not None:
            on_done()
    return scores


def score_many(prompt: Prompt, completions: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[float]:
    """Rewards of a group: one float per completion of ``prompt`` (see :func:`score_pairs`)."""
    return score_pairs([(prompt, c) for c in completions], timeout_s=timeout_s)


def score(prompt: Prompt, completion: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """The reward of one completion (see :func:`score_pairs`)."""
    return score_pairs([(prompt, completion)], timeout_s=timeout_s)[0]


# ---------------------------------------------------------------- checking a reward against gold answers

_DIGIT = re.compile(r"\d")


def perturb_answer(answer: str) -> str:
    """A wrong variant of a math answer: an integer plus one, else its first digit changed (d -> d+1 mod 10),
    else the answer plus one.

    The first digit, not the last, because trailing digits are often a base
    subscript (``52_8``), a unit's exponent (``cm^2``) or below math-verify's
    float rounding (``.0000672``)."""
    text = answer.strip()
    if re.fullmatch(r"-?\d+", text):
        return str(int(text) + 1)
    match = _DIGIT.search(text)
    if match:
        d = int(match.group())
        return f"{text[:match.start()]}{(d + 1) % 10}{text[match.end():]}"
    return f"{text}+1"


def gold_completion(prompt: Prompt) -> str:
    """A completion that should earn full reward: the gold answer (arith, search: :data:`EXACT_ANSWER_TASKS`), the
    boxed gold answer (math) or the reference solution (code).

    Raises:
        ValueError: the prompt has no gold answer or reference solution.
    """
    if prompt.task_type == "code":
        solution = prompt.metadata.get("solution")
        if not solution:
            raise ValueError(f"prompt {prompt.prompt_id} has no reference solution (metadata['solution'])")
        return solution
    if prompt.answer is None:
        raise ValueError(f"prompt {prompt.prompt_id} has no gold answer")
    return prompt.answer if prompt.task_type in EXACT_ANSWER_TASKS else f"The final answer is $\\boxed{{{prompt.answer}}}$."


def wrong_completion(prompt: Prompt) -> str:
    """A completion that should earn no reward: a perturbed answer (math, arith, search), or code whose
    entry point returns ``None`` (HumanEval: the body ``return None``; otherwise the reference
    solution followed by a redefinition of the entry point).

    Raises:
        ValueError: the prompt has no gold answer, or a code prompt has no entry point.
    """
    if prompt.task_type == "code":
        if not prompt.entry_point:
            raise ValueError(f"prompt {prompt.prompt_id} has no entry_point to break")
        if prompt.metadata.get("code_prefix"):
            return "    return None\n"
        return f"{gold_completion(prompt)}\n\ndef {prompt.entry_point}(*args, **kwargs):\n    return None\n"
    if prompt.answer is None:
        raise ValueError(f"prompt {prompt.prompt_id} has no gold answer")
    wrong = perturb_answer(prompt.answer)
    return wrong if prompt.task_type in EXACT_ANSWER_TASKS else f"The final answer is $\\boxed{{{wrong}}}$."


@dataclass(frozen=True)
class RewardCheck:
    """How a reward scored gold and perturbed completions of a set of prompts.

    Attributes:
        gold_accept: fraction of gold completions scored > 0.5.
        wrong_reject: fraction of wrong completions scored <= 0.5.
        n: number of prompts.
        disagreements: (prompt, "gold" or "wrong", completion, score) for each miss.
    """

    gold_accept: float
    wrong_reject: float
    n: int
    disagreements: list[tuple[Prompt, str, str, float]]

    def summary(self) -> dict[str, float | int]:
        """``{"gold_accept", "wrong_reject", "n"}``, the rates rounded to 4 places."""
        return {"gold_accept": round(self.gold_accept, 4), "wrong_reject": round(self.wrong_reject, 4), "n": self.n}


def check_rewards(prompts: Sequence[Prompt], timeout_s: float = DEFAULT_TIMEOUT_S,
                  on_done: Callable[[], None] | None = None) -> RewardCheck:
    """Score each prompt's :func:`gold_completion` and :func:`wrong_completion` (in parallel).

    ``on_done`` is called once per scored completion (2 per prompt).

    Raises:
        ValueError: ``prompts`` is empty, or a prompt lacks its gold answer or solution.
        RewardError: a prompt names an unregistered reward.
    """
    if not prompts:
        raise ValueError("no prompts to check")
    gold = [gold_completion(p) for p in prompts]
    wrong = [wrong_completion(p) for p in prompts]
    scores = score_pairs([*zip(prompts, gold), *zip(prompts, wrong)], timeout_s=timeout_s, on_done=on_done)
    n = len(prompts)
    gold_scores, wrong_scores = scores[:n], scores[n:]
    misses = [(p, "gold", c, s) for p, c, s in zip(prompts, gold, gold_scores) if s <= 0.5]
    misses += [(p, "wrong", c, s) for p, c, s in zip(prompts, wrong, wrong_scores) if s > 0.5]
    return RewardCheck(gold_accept=sum(s > 0.5 for s in gold_scores) / n,
                       wrong_reject=sum(s <= 0.5 for s in wrong_scores) / n, n=n, disagreements=misses)
