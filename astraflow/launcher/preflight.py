"""Preflight: what a run config names is checked before any process of ``astraflow run`` starts."""
from __future__ import annotations

from astraflow.config import RunConfig
from astraflow.placement import check_placement


def preflight(cfg: RunConfig) -> None:
    """Check what the config names before any process starts: the workflow, its options and the tools it calls
    (each configured under ``tools``), the data sources, the curators, each policy's filter chain, serving
    policies and model directory, the packages of the tracking sinks, the placement's CPUs, and the scaling
    controller's actuator (its compose file or Kubernetes credentials; the bus is checked by the caller).

    Raises:
        KeyError, ValueError, TypeError: an unknown workflow, role, option or filter (the message lists the known ones);
            a placement on CPUs this machine lacks (:class:`~astraflow.config.ConfigError`, a ValueError); a
            controller's compose file that does not exist, or no Kubernetes credentials for it.
        ValueError: a weight store URI that is not file:///abs/dir or s3://bucket/prefix; a trainer on CUDA where
            torch sees none; a tool the workflow calls that ``tools`` lacks (naming ``tools.<name>``).
        producers.sources.SourceError: a data source that is neither built in nor a readable dataset.
        FileNotFoundError: a model directory that does not exist.
        astraflow.tracker.TrackingUnavailable: a tracking sink is set and its package is not installed.
    """
    from astraflow.tracker import require_packages
    from policies.base import Curator, Filter, PolicyConfigError
    from policies.registry import build_chain, build_serving
    from producers.sources import load_source
    from producers.workflows import get_workflow
    from weights.models import BUILT_MODELS, resolve_model
    from weights.store import StoreError, check_store_uri

    check_placement(cfg)
    try:
        check_store_uri(cfg.store)
    except StoreError as e:
        raise ValueError(f"store: {e}") from None
    get_workflow(cfg.workflow.name, policies=cfg.workflow.roles or None, **cfg.workflow.options)
    cfg.workflow.check_tools(cfg.tools)
    for src in cfg.data.sources:
        load_source(src.name, adapter=src.adapter, split=src.split, seed=cfg.seed)
    try:
        build_chain(cfg.curators, Curator)
    except PolicyConfigError as e:
        raise PolicyConfigError(e.policy, f"{e.reason} (curators)", e.param) from None
    for name, pc in cfg.policies.items():
        for field, build in (("filters", lambda: build_chain(pc.filters, Filter)),
                             ("serving", lambda: build_serving(pc.serving))):
            try:
                build()
            except PolicyConfigError as e:
                raise PolicyConfigError(e.policy, f"{e.reason} (policies.{name}.{field})", e.param) from None
        if pc.model not in BUILT_MODELS:
            resolve_model(pc.model)
        if pc.trainer.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"policies.{name}.trainer.device is {pc.trainer.device!r}, and torch sees no CUDA "
                                 "device here (use auto or cpu)")
    search = cfg.tools.search
    if search is not None and search.url is None:  # the corpus the launched search server indexes
        from producers.search_server import DEFAULT_CORPUS, load_corpus

        try:
            load_corpus(search.corpus or DEFAULT_CORPUS)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"tools.search.corpus: {e}") from None
    require_packages(cfg.tracking)
    if cfg.controller.enabled:  # the controller's actuator: its compose file, or Kubernetes credentials
        from astraflow.actuators import ActuatorError, build_actuator

        try:
            build_actuator(cfg.controller)
        except ActuatorError as e:
            raise ValueError(str(e)) from None


class ConfigRefused(ValueError):
    """A run config :func:`preflight` refuses; the message is the reason."""


def check_run_config(cfg: RunConfig) -> None:
    """:func:`preflight`, what it refuses raised as one exception.

    Raises:
        ConfigRefused: the reason :func:`preflight` gave (a KeyError's message, not its repr).
    """
    from astraflow.tracker import TrackingUnavailable

    try:
        preflight(cfg)
    except (KeyError, ValueError, TypeError, FileNotFoundError, TrackingUnavailable) as e:
        raise ConfigRefused(e.args[0] if isinstance(e, KeyError) and e.args else str(e)) from e
