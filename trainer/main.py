"""A trainer process from its section: the serving policy, the weight publisher and the :class:`TrainerService` on
rank 0, :func:`~trainer.service.run_follower` on the other ranks of a multi-rank trainer (``astraflow trainer``)."""
from __future__ import annotations

import gc
import logging
import os
import threading
from typing import Any

from policies.base import PolicyConfigError
from policies.registry import build_serving
from topics.bus import connect
from topics.names import TopicNames
from trainer.config import TrainerSection
from trainer.distributed import leave
from trainer.service import ServiceConfig, TrainerService, run_follower
from weights.models import resolve_model
from weights.publisher import Publisher
from weights.store import WeightStore

log = logging.getLogger(__name__)


class InvalidServing(ValueError):
    """The section's serving policy cannot be built; the message says why."""


def service_config(section: TrainerSection) -> ServiceConfig:
    """The :class:`ServiceConfig` of ``section``'s trainer process (its model resolved, no console output)."""
    return ServiceConfig(bus=section.bus, kafka=section.kafka, run=section.run, model_dir=resolve_model(section.model),
                         run_dir=section.run_dir, trainer=section.trainer, steps=section.steps,
                         batch_groups=section.batch_groups, max_staleness=section.max_staleness,
                         checkpoint_every=section.checkpoint_every, console=False, barrier_peers=section.barrier_peers,
                         stop_on_collapse=section.stop_on_collapse)


def main(section: TrainerSection, stop: threading.Event) -> dict[str, Any] | None:
    """Run this rank of ``section``'s trainer until its steps are done or ``stop`` is set, then leave the process
    group (:func:`trainer.distributed.leave`; not after a failure).

    Rank 0 (or the only rank) reads the bus, trains, publishes to the store and ``weights``, and checkpoints; a
    follower rank of a multi-rank trainer (``trainer.ranks`` > 1, ``$RANK`` not 0) does what rank 0 sends.

    Args:
        section: the trainer's section (``RunConfig.trainer_section``).
        stop: set to checkpoint and stop.

    Returns:
        rank 0's summary (:meth:`TrainerService.run`); None on a follower rank, which logs its own.

    Raises:
        InvalidServing: the serving policy cannot be built.
    """
    try:
        replay = build_serving(section.serving)
    except PolicyConfigError as e:
        raise InvalidServing(str(e)) from e
    config = service_config(section)
    if section.trainer.ranks > 1 and int(os.environ.get("RANK", "0")) != 0:
        summary = run_follower(config)
        leave()
        log.info("trainer.%s rank %d done: %s", section.policy, summary["rank"], summary)
        return None
    publisher = Publisher(WeightStore(section.store, section.run), connect(section.bus, section.kafka),
                          TopicNames(section.run), section.policy, keep_versions=section.keep_versions,
                          producer_id=f"trainer.{section.policy}")
    service = TrainerService(config, publisher=publisher, replay=replay)
    # The model, optimizer and what loading them allocated (~5 x 10^5 objects) live as long as the process: out of
    # the collector's sight, as what was imported before them (astraflow.launched.component_setup). A full
    # collection walked them in the steady state (one of 157 ms in RaaS, which does the same, in one run's window)
    gc.freeze()
    try:
        summary = service.run(stop)
    finally:
        publisher.close()
        service.close()
    leave()
    return summary
