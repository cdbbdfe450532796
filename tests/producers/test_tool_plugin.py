"""A tool plugin is one class and one config entry (``tools: {name: {class: module:Class, **params}}``): imported and
its options checked when the config is read, built in each RaaS worker by make_tools, and called by name."""
import asyncio
from pathlib import Path

import pytest

from astraflow.config import ConfigError, load_config
from producers.raas import make_tools

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples" / "arith-tiny.yaml")
ENTRY = 'tools={calculator: {class: "examples.plugins.calculator:Calculator", digits: 4}}'


def test_the_config_entry_builds_the_tool_and_it_answers(monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(CONFIG, [ENTRY])
    tools = make_tools(cfg.raas_section().tools)
    calculator = tools["calculator"]
    async def ask() -> list[str]:
        return [await calculator(e) for e in ("3*(4+5)", "2/3", "1/0", "__import__('os')")]

    answers = asyncio.run(ask())
    assert answers[:2] == ["27", "0.6667"]
    assert answers[2].startswith("error: ZeroDivisionError") and answers[3].startswith("error: ValueError")
    assert (calculator.calls, calculator.errors) == (4, {"ZeroDivisionError": 1, "ValueError": 1})


@pytest.mark.parametrize("entry, message", [
    ('tools={calculator: {class: "examples.plugins.calculator:Calculator", digts: 4}}',
     r"tools\.calculator: .*got an unexpected keyword argument 'digts'; accepted parameters: digits"),
    ('tools={calculator: {class: "examples.plugins.calculater:Calculator"}}',
     r"tools\.calculator: .*cannot import module 'examples.plugins.calculater'"),
])
def test_a_misspelled_tool_option_or_module_is_refused_at_load(entry, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIG, [entry])
