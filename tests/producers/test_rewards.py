"""Reward functions, the process-pool timeout, the registry and `astraflow verify-rewards`."""
import json
import logging
import os
import time

import pytest
from typer.testing import CliRunner

from astraflow.cli import app
from producers.rewards import (RewardError, perturb_answer, pool_workers, register_reward, reward_errors, score,
                               score_many, score_pairs)
from producers.sources import load_source
from topics.schemas import Prompt


def math_prompt(answer: str, **meta) -> Prompt:
    return Prompt(prompt_id="m", source="t", task_type="math", text="q", answer=answer, metadata=meta)


def test_arith_is_an_exact_match_up_to_eos():
    p = Prompt(prompt_id="a", source="arith", task_type="arith", text="12+13=", answer="25")
    assert score_many(p, ["25", " 25</s>junk", "25\n3+4=7", "250", "2 5", "", "-25"]) == [1, 1, 1, 0, 0, 0, 0]


def test_math_accepts_equivalent_answers_and_rejects_wrong_ones():
    p = math_prompt("\\frac{1}{2}")
    completions = ["so the answer is \\boxed{\\frac{1}{2}}", "$\\boxed{0.5}$", "\\boxed{1/2}",
                   "\\boxed{\\frac{1}{3}}", "I don't know", ""]
    assert score_many(p, completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert score(math_prompt("70000"), "The answer is $\\boxed{70,000}$.") == 1.0


def hangs(prompt: Prompt, completion: str) -> float:
    """A reward that never returns (stands in for math-verify stuck on adversarial input)."""
    time.sleep(3600)
    return 1.0


register_reward("test_hangs", mode="process")(hangs)


def worker_pid(prompt: Prompt, completion: str) -> float:
    """A reward that scores the pid of the pool worker that ran it, after a moment (so that a second item goes
    to another worker, when one is ready)."""
    time.sleep(0.2)
    return float(os.getpid())


register_reward("test_worker_pid", mode="process")(worker_pid)


def all_pool_workers_started(deadline_s: float = 300.0) -> None:
    """Wait until every worker of the reward process pool has answered (spawned and warmed: ~25 s on a busy 2-core
    machine), so that what a test times next is not the pool's start-up."""
    probe, deadline = math_prompt("0", reward="test_worker_pid"), time.monotonic() + deadline_s
    while len(set(score_pairs([(probe, "x")] * pool_workers(), timeout_s=60))) < pool_workers():
        assert time.monotonic() < deadline, "the reward pool's workers did not all start"


def test_a_hung_process_reward_scores_zero_and_the_pool_recovers(caplog):
    all_pool_workers_started()
    start, before = time.monotonic(), reward_errors().get("test_hangs", 0)
    stuck = math_prompt("1", reward="test_hangs")
    with caplog.at_level(logging.WARNING, logger="producers.rewards"):
        assert score_pairs([(stuck, "x"), (math_prompt("2"), "\\boxed{2}")], timeout_s=2) == [0.0, 1.0]
    # given up at its 2 s timeout (~2.5-5 s in all), not after the reward's 3600 s hang
    assert time.monotonic() - start < 60
    assert reward_errors()["test_hangs"] == before + 1
    assert [r.getMessage() for r in caplog.records] == [
        "reward 'test_hangs' failed on prompt m, scored 0.0: no result within 2 s"]
    assert score(math_prompt("3"), "\\boxed{3}") == 1.0  # the killed worker was replaced


def breaks_on_empty(prompt: Prompt, completion: str) -> float:
    """A reward with a bug: it divides by the completion's length."""
    return 1.0 / len(completion)


register_reward("test_breaks_inline")(breaks_on_empty)
register_reward("test_breaks_thread", mode="thread")(breaks_on_empty)


@pytest.mark.parametrize("name", ["test_breaks_inline", "test_breaks_thread"])
def test_a_reward_that_raises_scores_zero_and_is_logged_and_counted(name, caplog):
    before = reward_errors().get(name, 0)
    prompts = [Prompt(prompt_id=f"p{i}", source="t", task_type="math", text="q", answer="1",
                      metadata={"reward": name}) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="producers.rewards"):
        assert score_pairs([(prompts[0], "ab"), (prompts[1], ""), (prompts[2], "")]) == [0.5, 0.0, 0.0]
    assert reward_errors()[name] == before + 2
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"reward {name!r} failed on prompt p{i}, scored 0.0: ZeroDivisionError: float division by zero")
        for i in (1, 2)]


def test_code_reward_runs_the_tests():
    he = load_source("humaneval")[0]
    full = "```python\nfrom typing import List\n\ndef has_close_elements(numbers, threshold):\n" \
           + he.metadata["solution"] + "```"
    assert score_many(he, [he.metadata["solution"], full, "    return None\n", "    syntax error(\n"]) == [1, 1, 0, 0]
    mb = load_source("mbpp")[0]
    assert score_many(mb, [mb.metadata["solution"], "def f(): pass"]) == [1.0, 0.0]


def test_boxed_format_and_user_rewards_from_the_registry():
    fmt = math_prompt("1", reward="boxed_format")
    assert score_many(fmt, ["\\boxed{7}", "7"]) == [1.0, 0.0]

    @register_reward("test_length")
    def length(prompt, completion):
        return min(1.0, len(completion) / 10)

    assert score(math_prompt("1", reward="test_length"), "12345") == 0.5
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_length")(length)
    with pytest.raises(RewardError, match="no reward named 'nope'"):
        score(math_prompt("1", reward="nope"), "x")


def test_perturbed_answers_differ():
    assert perturb_answer("18") == "19"
    assert perturb_answer("52_8") == "62_8"
    assert perturb_answer("\\frac{\\pi}{2}") == "\\frac{\\pi}{3}"
    assert perturb_answer("\\text{Evelyn}") == "\\text{Evelyn}+1"


@pytest.mark.parametrize("dataset,gold_min", [("math500", 0.99), ("gsm8k", 0.99), ("humaneval", 0.98), ("search", 1.0)])
def test_verify_rewards_meets_the_thresholds(dataset, gold_min):
    result = CliRunner().invoke(app, ["verify-rewards", "--dataset", dataset, "--limit", "50"])
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.exit_code == (0 if report["gold_accept"] == report["wrong_reject"] == 1.0 else 1), result.output
    assert report["n"] == 50
    assert report["gold_accept"] >= gold_min and report["wrong_reject"] >= 0.99, result.stdout
