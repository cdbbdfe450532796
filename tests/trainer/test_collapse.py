"""The collapse watch (trainer/collapse.py): a reward under half its best window while the entropy moves."""
import pytest

from trainer.collapse import WINDOW, CollapseWatch


def feed(watch: CollapseWatch, rewards: list[float], entropies: list[float], start: int = 1):
    """Every collapse the watch reports over the steps, as (step, collapse)."""
    out = []
    for i, (r, e) in enumerate(zip(rewards, entropies), start):
        c = watch.observe(i, r, e)
        if c is not None:
            out.append((i, c))
    return out


def test_a_fall_with_an_entropy_jump_is_said_within_a_few_steps():
    # the shape of search-tiny's collapse at lr 5e-4: 0.75 at its best, then 0 for good with the entropy up x3
    rewards = [0.4] * 20 + [0.75] * 30 + [0.0] * 30
    entropies = [0.1] * 20 + [0.05] * 30 + [0.15] * 30
    found = feed(CollapseWatch(), rewards, entropies)
    assert len(found) == 1, found
    step, c = found[0]
    assert 51 <= step <= 51 + WINDOW // 2 + 1, step  # half the window is enough to halve the mean
    assert c.best_window == pytest.approx(0.75) and c.best_step == 20 + WINDOW  # the first window at 0.75
    assert c.reward_window < 0.5 * 0.75 and c.entropy_ratio > 1.5
    assert "collapsed at step" in c.describe() and c.values()["collapse"] == 1.0


def test_an_entropy_fall_counts_too():
    rewards = [0.6] * 20 + [0.05] * 20
    entropies = [0.09] * 20 + [0.04] * 20
    assert len(feed(CollapseWatch(), rewards, entropies)) == 1


def test_a_harder_batch_with_the_same_entropy_is_not_a_collapse():
    rewards = [0.6] * 20 + [0.1] * 20
    entropies = [0.09] * 20 + [0.1] * 20
    assert feed(CollapseWatch(), rewards, entropies) == []


def test_noise_around_a_plateau_and_a_run_that_never_learned_are_not_collapses():
    noisy = [0.7, 0.55, 0.8, 0.6, 0.75] * 12
    assert feed(CollapseWatch(), noisy, [0.1, 0.2, 0.05, 0.3, 0.1] * 12) == []
    assert feed(CollapseWatch(), [0.0] * 40, [0.5] * 20 + [2.0] * 20) == []


def test_one_alert_per_fall_and_another_after_a_recovery():
    rewards = [0.8] * 20 + [0.0] * 30 + [0.8] * 30 + [0.0] * 30
    entropies = [0.1] * 20 + [0.3] * 30 + [0.1] * 30 + [0.3] * 30
    found = feed(CollapseWatch(), rewards, entropies)
    assert [s for s, _ in found][:1] and len(found) == 2, found
    assert 80 < found[1][0] <= 80 + WINDOW, found


@pytest.mark.parametrize("kwargs", [dict(window=0), dict(reward_fraction=1.0), dict(entropy_factor=1.0)])
def test_out_of_range_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="collapse watch"):
        CollapseWatch(**kwargs)
