"""The search task as a verifiers (0.4, ``verifiers.v1``) environment, for the ``verifiers`` workflow
(:mod:`producers.verifiers_env`): ``workflow: {name: verifiers, options: {env:
"examples/environments/search_verifiers.py"}}`` with ``tools.search`` configured.

A task is a ``code of <name>?`` question and its code; its reward (``@vf.reward``) is 1 when the agent's last
reply, cut at a newline, is the code. The agent gets the run's ``search`` tool (``TOOLS``). In RaaS the tasks
are made from the run's prompts (the ``search`` source); ``load()`` reads the same questions for a standalone
verifiers run.
"""
from __future__ import annotations

import json
from pathlib import Path

import verifiers.v1 as vf
from pydantic import field_validator

from producers.environments import run_tool
from producers.rewards import strip_to_eos

#: The tools the agent offers the model: the run's configured ``search``.
TOOLS = [run_tool("search", "Search the knowledge base.", "query")]
QUESTIONS = Path(__file__).resolve().parents[2] / "producers" / "data" / "search_qa.jsonl"


class SearchData(vf.TaskData):
    """A question's data: ``answer``, the entity's code (found only through the search tool); a question given as
    text is stripped of the newline the search source ends it with, as chat models (``tiny-search-hermes`` among
    them) see a user message."""

    answer: str

    @field_validator("prompt")
    @classmethod
    def _strip_question(cls, prompt: object) -> object:
        return prompt.strip() if isinstance(prompt, str) else prompt


class SearchTask(vf.Task[SearchData]):
    """A search question, scored on the agent's last reply."""

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 when the last reply, cut at EOS or a newline, is the code, else 0.0."""
        return float(strip_to_eos(trace.last_reply) == self.data.answer.strip())


class SearchTasksetConfig(vf.TasksetConfig):
    """``limit``: how many questions ``load()`` reads (all when unset)."""

    limit: int | None = None


class SearchTaskset(vf.Taskset[SearchTask, SearchTasksetConfig]):
    """The search questions (``producers/data/search_qa.jsonl``)."""

    def load(self) -> list[SearchTask]:
        rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
        return [SearchTask(SearchData(prompt=r["question"], answer=r["answer"]), self.config.task)
                for r in rows[:self.config.limit]]


__all__ = ["SearchTaskset"]
