"""The one staleness rule (DESIGN.md, "Staleness")."""
from policies.staleness import staleness, too_stale


def test_data_is_too_stale_past_max_staleness_and_never_without_a_version():
    assert [staleness(3, v) for v in (2, 3, 5)] == [0, 0, 2]  # never negative: weights newer than the trainer's
    assert not too_stale(3, 5, 2) and too_stale(3, 6, 2)  # 2 versions behind is within 2; 3 is not
    assert not too_stale(7, 7, 0) and too_stale(6, 7, 0)  # max_staleness 0: only the trainer's own version
    assert staleness(-1, 100) == 0 and not too_stale(-1, 100, 0)  # no generated tokens: never stale
