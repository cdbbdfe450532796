"""The run summary's reward figures (:func:`astraflow.launcher.outputs.reward_summary`): first, last and best window
of a fifth of the steps, each step counted once with its newest reward."""
import pytest

from astraflow.launcher.outputs import reward_summary


def test_a_run_that_learned_and_fell_back_shows_its_best_window():
    # 10 steps, windows of 2: rises to 0.9 at steps 5-6, falls back to 0.3
    rewards = [0.1, 0.2, 0.4, 0.6, 0.9, 0.9, 0.7, 0.5, 0.3, 0.3]
    first, last, best = reward_summary(list(enumerate(rewards, 1)))
    assert (first, last, best) == pytest.approx((0.15, 0.3, 0.9))


def test_a_redone_step_counts_once_with_its_newest_reward():
    # step 2 trained again after a restart (0.8 replaces 0.0); 5 steps: windows of 1
    history = [(1, 0.5), (2, 0.0), (3, 0.1), (2, 0.8), (4, 0.2), (5, 0.3)]
    assert reward_summary(history) == pytest.approx((0.5, 0.3, 0.8))


def test_no_steps_no_figures():
    assert reward_summary([]) == (None, None, None)
