"""The policy registry and config loading (DESIGN.md, step 9 "Compose").

A run's config lists policies in order, each an entry ``{"name": ..., **params}``, read into a typed config
(:mod:`policies.config`). ``name`` is either a registered name (``"greso"``, ``"filter_zero_adv"``, ...)
or ``"package.module:Class"``, a user's own class imported with importlib
from the user's code (the module must be importable: on ``sys.path``, or in the working directory).

Example::

    filters = build_chain([policy_spec({"name": "filter_zero_adv"}),
                           policy_spec({"name": "filter_length", "max_tokens": 4096})], Filter)
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Iterable, TypeVar

from policies.base import Policy, PolicyConfigError

if TYPE_CHECKING:
    from policies.config import PolicySpec

P = TypeVar("P", bound=type)

_REGISTRY: dict[str, type[Policy]] = {}
_BUILTIN_MODULES = ("policies.curators", "policies.filters", "policies.replay")


def register_policy(name: str) -> Callable[[P], P]:
    """Class decorator: register a policy class under ``name`` (and set ``cls.name``).

    Raises:
        ValueError: ``name`` is already taken by another class, or contains ``:``.
    """

    def deco(cls: P) -> P:
        if ":" in name:
            raise ValueError(f"policy name {name!r} may not contain ':' (reserved for module:Class)")
        old = _REGISTRY.get(name)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(f"policy name {name!r} is already registered to {old.__module__}.{old.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def import_user_module(name: str) -> ModuleType:
    """Import a user's module (a plugin's): from ``sys.path`` or, last, the working directory, also when the
    ``astraflow`` script runs (unlike ``python -m``, it does not put the working directory on the path).

    Raises:
        ImportError: no such module, or importing it failed.
    """
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    return importlib.import_module(name)


def user_class(spec: str) -> type:
    """The class ``spec`` names as ``package.module:Class``, its module imported by :func:`import_user_module`.

    Raises:
        ValueError: the module cannot be imported, or has no class of that name (the message starts with ``spec``).
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = import_user_module(module_name)
    except ImportError as e:
        raise ValueError(f"{spec}: cannot import module {module_name!r}: {e}") from None
    found = getattr(module, attr, None)
    if not isinstance(found, type):
        raise ValueError(f"{spec}: module {module_name!r} has no class {attr!r}")
    return found


def check_params(spec: str, cls: type, params: dict) -> None:
    """Check that ``cls(**params)`` binds to the class's signature (a user's plugin, named ``spec`` in messages).

    Raises:
        ValueError: an option the class does not take, or a required one missing; the message lists the accepted.
    """
    try:
        inspect.signature(cls).bind(**params)
    except TypeError as e:
        accepted = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
        raise ValueError(f"{spec}: {e}; accepted parameters: {', '.join(accepted) or 'none'}") from None


def known_policies() -> list[str]:
    """The registered policy names, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def resolve_policy(name: str) -> type[Policy]:
    """The class for ``name``: a registered name or ``module:Class`` (the module imported by
    :func:`import_user_module`).

    Raises:
        PolicyConfigError: unknown name (the message lists the known ones), a
            module that cannot be imported, a missing attribute, or something
            that is not a policy class.
    """
    if not isinstance(name, str) or not name:
        raise PolicyConfigError(repr(name), "a policy entry needs a non-empty string `name`")
    if ":" not in name:
        _load_builtins()
        cls = _REGISTRY.get(name)
        if cls is None:
            raise PolicyConfigError(name, f"unknown policy; known: {', '.join(known_policies())} "
                                          "(or name your own class as module:Class)")
        return cls
    module_name, _, attr = name.partition(":")
    try:
        module = import_user_module(module_name)
    except ImportError as e:
        raise PolicyConfigError(name, f"cannot import module {module_name!r}: {e}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise PolicyConfigError(name, f"module {module_name!r} has no attribute {attr!r}")
    if not (inspect.isclass(cls) and issubclass(cls, Policy)):
        raise PolicyConfigError(name, f"{attr!r} is not a subclass of policies.base.Policy "
                                      "(subclass Curator, Filter or ServingPolicy)")
    return cls


def build_policy(spec: PolicySpec) -> Policy:
    """Instantiate one policy from its typed config (:mod:`policies.config`, whose validation checked the name and
    the parameters' names and types).

    Raises:
        PolicyConfigError: a parameter value the policy rejects (the error names both).
    """
    name = spec.name
    cls = resolve_policy(name)
    try:
        return cls(**spec.params())
    except PolicyConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise PolicyConfigError(name, str(e)) from None


def build_chain(specs: Iterable[PolicySpec], kind: type[Policy] = Policy) -> list[Policy]:
    """Instantiate the ordered policies of ``specs``, each required to be a ``kind``
    (:class:`Curator`, :class:`Filter` or :class:`ServingPolicy`).

    Raises:
        PolicyConfigError: as :func:`build_policy`, or a policy of the wrong kind.
    """
    out = []
    for spec in specs:
        policy = build_policy(spec)
        if not isinstance(policy, kind):
            raise PolicyConfigError(spec.name, f"is a {policy.kind} policy, where a {kind.kind} was expected")
        out.append(policy)
    return out


def build_serving(specs: Iterable[PolicySpec]) -> Policy | None:
    """The trainer's serving policy, as its serving stage takes it: at most one (e.g. ``replay``), or None.
    The serving stage applies the policy's ``max_staleness`` itself.

    Raises:
        PolicyConfigError: as :func:`build_chain` with :class:`ServingPolicy`; more than one entry.
    """
    from policies.base import ServingPolicy

    policies = build_chain(specs, ServingPolicy)
    if len(policies) > 1:
        raise PolicyConfigError(policies[1].name, f"{len(policies)} serving policies given; the serving stage "
                                                  "takes one")
    return policies[0] if policies else None
