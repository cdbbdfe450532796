"""Where the trainer's per-step metrics go: the ``metrics`` topic, the console, a JSONL file.

TensorBoard and W&B are written from the ``metrics`` topic by the tracker component (:mod:`astraflow.tracker`,
``tracking:`` in the run config), never on the trainer's path."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from topics.bus import Producer
from topics.codec import encode, headers_for
from topics.schemas import Metric

#: Metrics shown on the console line, in order (the rest go to the bus and the JSONL file only).
CONSOLE_KEYS = ("loss", "pg_loss", "kl", "clipfrac", "entropy", "grad_norm", "reward_mean", "reward_std",
                "staleness_mean", "is_ratio_max", "tokens_per_s", "wait_frac")


class MetricsSink:
    """Sends one flat ``name -> float`` record per step to every configured sink.

    Args:
        component: the component id (``trainer.<policy>``), the Metric's key.
        policy: the policy name.
        producer, topic: the bus producer and the run's ``metrics`` topic (both or neither).
        console: print a one-line summary per step with ``rich``.
        jsonl_path: append each record as a JSON line (file).

    Raises:
        ValueError: only one of ``producer`` and ``topic`` is given.
    """

    def __init__(self, component: str, policy: str | None = None, *, producer: Producer | None = None,
                 topic: str | None = None, console: bool = True, jsonl_path: str | Path | None = None):
        if (producer is None) != (topic is None):
            raise ValueError("MetricsSink needs both producer and topic, or neither")
        self.component, self.policy = component, policy
        self.producer, self.topic = producer, topic
        self.jsonl_path = Path(jsonl_path) if jsonl_path else None
        self._console = None
        if console:
            from rich.console import Console

            self._console = Console(stderr=True)

    def emit(self, step: int, values: dict[str, Any]) -> None:
        """Send ``values`` (numbers) for ``step`` to every sink; the bus record is queued, not flushed."""
        vals = {k: float(v) for k, v in values.items()}
        if self.producer is not None:
            msg = Metric(component=self.component, kind="trainer", policy=self.policy, step=step, values=vals)
            self.producer.send(self.topic, encode(msg), key=self.component, headers=headers_for(msg))
        if self.jsonl_path is not None:
            with self.jsonl_path.open("a") as f:
                f.write(json.dumps({"step": step, **vals}) + "\n")
        if self._console is not None:
            shown = "  ".join(f"{k} [bold]{vals[k]:.4g}[/bold]" for k in CONSOLE_KEYS if k in vals)
            self._console.print(f"[cyan]{self.component}[/cyan] step {step}  {shown}", highlight=False)

    def alert(self, values: dict[str, Any]) -> None:
        """Send a condition that is not a training step (e.g. ``publish_errors``) to the bus and the console
        at once (flushed), not to the per-step JSONL file."""
        vals = {k: float(v) for k, v in values.items()}
        if self.producer is not None:
            msg = Metric(component=self.component, kind="trainer", policy=self.policy, values=vals)
            self.producer.send(self.topic, encode(msg), key=self.component, headers=headers_for(msg))
            self.producer.flush()
        if self._console is not None:
            shown = "  ".join(f"{k} [bold]{v:.4g}[/bold]" for k, v in vals.items())
            self._console.print(f"[yellow]{self.component}[/yellow] {shown}", highlight=False)

    def close(self) -> None:
        """Flush the producer."""
        if self.producer is not None:
            self.producer.flush()
