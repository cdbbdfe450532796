"""How a bench reports a repeated measurement: every repetition, the median and the spread (min, max), and the
order in which side-by-side arms run (interleaved, so that a machine's drift hits every arm alike)."""
from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from typing import TypeVar

Arm = TypeVar("Arm")


def spread(runs: Sequence[float | None], digits: int = 4) -> dict:
    """Every repetition of one figure and its spread.

    Args:
        runs: the figure of each repetition, in the order run; None where a repetition has none (e.g. a
            threshold never reached).

    Returns:
        ``{"runs": [...], "n": repetitions with a value, "median", "min", "max"}``, rounded to ``digits``;
        ``median``, ``min`` and ``max`` are None when no repetition has a value.
    """
    xs = [x for x in runs if x is not None]
    stat = (lambda f: round(f(xs), digits)) if xs else (lambda f: None)
    return {"runs": [None if x is None else round(x, digits) for x in runs], "n": len(xs),
            "median": stat(statistics.median), "min": stat(min), "max": stat(max)}


def describe(s: dict, fmt: str = ".3f") -> str:
    """``s`` (from :func:`spread`) in words: ``median 0.74 [0.70, 0.78] over 3 (0.70, 0.78, 0.74)``."""
    runs = ", ".join("-" if x is None else format(x, fmt) for x in s["runs"])
    if s["median"] is None:
        return f"none over {len(s['runs'])} ({runs})"
    missing = len(s["runs"]) - s["n"]
    return (f"median {s['median']:{fmt}} [{s['min']:{fmt}}, {s['max']:{fmt}}] over {s['n']}"
            + (f" ({missing} without)" if missing else "") + f" ({runs})")


def interleaved(arms: Sequence[Arm], rounds: int) -> Iterator[tuple[int, Arm]]:
    """(round, arm) in run order: every arm once per round, the order reversed on odd rounds (A B, B A, A B,
    ...), so that neither a slow drift nor running first or second favours an arm."""
    for r in range(rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            yield r, arm
