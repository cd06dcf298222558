"""The rollout's run order (kvscope.rollout.plan): every arm at every level in every repetition,
the baseline's A/A twin beside it, and the order counterbalanced."""

from __future__ import annotations

import pytest

from kvscope.rollout.plan import aa_slot, plan, streams


def test_every_slot_runs_once_per_level_and_repetition_in_alternating_order():
    """Two arms, levels 1 and 2, two repetitions: 3 slots x 2 levels x 2 reps = 12 runs. By
    hand: rep 0 level 1 A B A'; rep 0 level 2 reversed (A' B A); rep 1 level 1 reversed; rep 1
    level 2 forward again: A and A' each lead two of the four groups."""
    steps = plan(["A", "B"], levels=[2, 1], repetitions=2)
    twin = aa_slot("A")
    assert [(s.rep, s.level, s.slot) for s in steps] == [
        (0, 1, "A"), (0, 1, "B"), (0, 1, twin), (0, 2, twin), (0, 2, "B"), (0, 2, "A"),
        (1, 1, twin), (1, 1, "B"), (1, 1, "A"), (1, 2, "A"), (1, 2, "B"), (1, 2, twin)]
    assert [s.index for s in steps] == list(range(12))
    assert {s.arm for s in steps if s.slot == twin} == {"A"}
    leaders = [steps[i].slot for i in range(0, 12, 3)]
    assert leaders.count("A") == leaders.count(twin) == 2


def test_without_the_aa_pair_and_with_three_arms():
    steps = plan(["A", "B", "C"], levels=[4], repetitions=3, aa=False)
    assert [s.slot for s in steps] == ["A", "B", "C", "C", "B", "A", "A", "B", "C"]


@pytest.mark.parametrize("arms, levels, reps, message", [
    (["A"], [1], 1, "two arms"), (["A", "A"], [1], 1, "repeat"),
    (["A", "B"], [1, 1], 1, "distinct"), (["A", "B"], [0], 1, "distinct"),
    (["A", "B"], [], 1, "distinct"), (["A", "B"], [1], 0, "repetitions")])
def test_bad_plans_are_refused(arms, levels, reps, message):
    with pytest.raises(ValueError, match=message):
        plan(arms, levels, reps)


def test_a_level_reads_as_streams_in_words():
    """The progress line said "at 1 streams"."""
    assert [streams(n) for n in (1, 2, 64)] == ["1 stream", "2 streams", "64 streams"]
