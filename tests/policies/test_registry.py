"""Registry and config: names, parameters, clear errors, user classes named module:Class."""
from __future__ import annotations

import sys
import textwrap

import pytest
from pydantic import ValidationError

from policies.base import Curator, Filter, PolicyConfigError, ServingPolicy
from policies.config import policy_spec
from policies.curators import Greso
from policies.registry import build_chain, build_policy, known_policies
from policy_factories import make_group


def test_builtins_are_registered():
    assert {"accept_all", "filter_solved", "greso", "filter_zero_adv", "filter_length", "filter_format",
            "replay"} <= set(known_policies())


def test_chain_in_order_with_params():
    chain = build_chain([policy_spec({"name": "filter_zero_adv"}),
                         policy_spec({"name": "filter_length", "max_tokens": 64})], Filter)
    assert [p.name for p in chain] == ["filter_zero_adv", "filter_length"]
    assert chain[1].max_tokens == 64
    g = build_policy(policy_spec({"name": "greso", "p_easy": 0.3, "floor": 0.2}))
    assert isinstance(g, Greso) and g.p_easy == 0.3


def test_clear_errors():
    with pytest.raises(ValidationError, match=r"unknown policy name; known here: .*filter_zero_adv.*greso"):
        policy_spec({"name": "gresso"})
    with pytest.raises(ValidationError, match=r"greso\.p_eazy\n  Extra inputs are not permitted"):
        policy_spec({"name": "greso", "p_eazy": 0.3})
    with pytest.raises(ValidationError, match=r"policy 'replay', parameter 'ratio': must be in \[0, 1\)"):
        policy_spec({"name": "replay", "ratio": 1.5})
    with pytest.raises(PolicyConfigError, match=r"'replay'.*serving policy, where a filter was expected"):
        build_chain([policy_spec({"name": "replay"})], Filter)
    with pytest.raises(ValidationError, match="cannot import module 'no_such_mod'"):
        policy_spec({"name": "no_such_mod:Thing"})
    with pytest.raises(ValidationError, match="unknown policy name"):
        policy_spec({"max_tokens": 3})


def test_custom_filter_from_user_module(tmp_path, monkeypatch):
    (tmp_path / "my_user_filters.py").write_text(textwrap.dedent('''
        from policies.base import Decision, Filter

        class OnlySource(Filter):
            """Keep groups from one source."""

            def __init__(self, source: str):
                self.source = source

            def keep(self, group):
                return Decision(group.source == self.source, "kept" if group.source == self.source else "other_source")

        class NotAPolicy:
            pass
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    chain = build_chain([policy_spec({"name": "accept_all"}),
                         policy_spec({"name": "my_user_filters:OnlySource", "source": "math"})], Filter)
    decisions = [chain[1].keep(make_group([0, 1], source=s)) for s in ("math", "gsm8k")]
    assert [(d.keep, d.reason) for d in decisions] == [(True, "kept"), (False, "other_source")]
    with pytest.raises(ValidationError, match="has no attribute 'Missing'"):
        policy_spec({"name": "my_user_filters:Missing"})
    with pytest.raises(ValidationError, match="not a subclass of policies.base.Policy"):
        policy_spec({"name": "my_user_filters:NotAPolicy"})
    with pytest.raises(ValidationError, match="OnlySource: missing a required argument: 'source'; accepted parameters: source"):
        policy_spec({"name": "my_user_filters:OnlySource", "src": "x"})
    sys.modules.pop("my_user_filters", None)


def test_kinds():
    assert isinstance(build_policy(policy_spec({"name": "greso"})), Curator)
    assert isinstance(build_policy(policy_spec({"name": "replay"})), ServingPolicy)
