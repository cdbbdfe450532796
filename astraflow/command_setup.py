"""What the CLI's commands share before their work: the run config loaded, the policy a command names, the bus's
admin (each exits with status 2 and one message when it cannot), and a component process's setup."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

if TYPE_CHECKING:
    from astraflow.config import RunConfig
    from topics.bus import Admin


def load(config: Path, overrides: Optional[list[str]]) -> RunConfig:
    """Load the config or exit with status 2 and the field-by-field error."""
    from astraflow.config import ConfigError, load_config

    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2)


def load_policy(config: Path, overrides: Optional[list[str]], policy: Optional[str]) -> tuple[RunConfig, str]:
    """The config and the policy ``--policy`` names (None: the config's only policy), or exit with status 2 and
    the policies the config has."""
    cfg = load(config, overrides)
    if policy is None and len(cfg.policies) == 1:
        policy = next(iter(cfg.policies))
    if policy not in cfg.policies:
        typer.echo(f"unknown policy {policy!r}; give --policy, one of {sorted(cfg.policies)}", err=True)
        raise typer.Exit(2)
    return cfg, policy


def bus_admin(cfg: RunConfig) -> Admin:
    """The config's bus admin, or exit with status 2 and one line saying why the bus cannot be used."""
    from topics.bus import BusError, connect

    try:
        return connect(cfg.bus, cfg.kafka).admin()
    except BusError as e:
        typer.echo(f"cannot use bus {cfg.bus}: {e}", err=True)
        raise typer.Exit(2)


def check_store(cfg: RunConfig) -> None:
    """Exit with status 2 and one line naming ``store`` and the cause when the config's weight store does not answer
    a listing of the run's objects (unreachable after obstore's retries, a bucket that does not exist, credentials
    it refuses): a run whose trainer cannot publish would only wait."""
    from weights.store import StoreError, WeightStore

    try:
        store = WeightStore(cfg.store, cfg.run)
        for policy in cfg.policies:
            store.objects(policy)
    except StoreError as e:
        typer.echo(f"cannot use store {cfg.store}: {e}", err=True)
        raise typer.Exit(2)


def setup_component(name: str, cfg: RunConfig) -> threading.Event:
    """:func:`astraflow.launched.component_setup` of component ``name``, creating the run's topics on the config's
    bus (exit with status 2 when the bus cannot be used)."""
    from astraflow.launched import component_setup
    from topics.layout import ensure_run_topics
    from topics.names import TopicNames

    return component_setup(name, lambda: ensure_run_topics(bus_admin(cfg), TopicNames(cfg.run), list(cfg.policies)))
