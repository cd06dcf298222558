"""Promotion seconds charged to the tier whose blocks they moved
(kvscope/analysis/transfer_cost.py), by hand: staged, direct, over-staged, two lower tiers."""

from __future__ import annotations

import pytest

from kvscope.analysis.transfer_cost import (farther_tier, is_promotion,
                                             promotion_seconds_by_tier, seconds_by_tier)


def test_a_staged_leg_is_charged_to_the_tier_it_staged_from():
    """100 blocks cpu->gpu in 10 s, 25 of them staged disk->cpu in 4 s: disk 4 + 10 x 25/100
    = 6.5 s, cpu the other 7.5 s; offloads (gpu->cpu) are no promotions."""
    assert promotion_seconds_by_tier(
        {"cpu->gpu": 10.0, "disk->cpu": 4.0, "gpu->cpu": 99.0},
        {"cpu->gpu": 100.0, "disk->cpu": 25.0, "gpu->cpu": 500.0}) == pytest.approx(
            {"cpu": 7.5, "disk": 6.5})


def test_a_direct_copy_stays_with_its_tier():
    """An engine that copies disk->gpu stages nothing through cpu: each leg is its source's."""
    assert promotion_seconds_by_tier({"cpu->gpu": 10.0, "disk->gpu": 3.0},
                                     {"cpu->gpu": 100.0, "disk->gpu": 30.0}) == {
        "cpu": 10.0, "disk": 3.0}


def test_more_staged_than_promoted_charges_the_whole_leg_below():
    """150 blocks staged, 100 promoted (the rest not yet): the cpu->gpu leg is all disk's."""
    assert promotion_seconds_by_tier({"cpu->gpu": 10.0, "disk->cpu": 4.0},
                                     {"cpu->gpu": 100.0, "disk->cpu": 150.0}) == {"disk": 14.0}


def test_two_lower_tiers_share_the_leg_by_their_blocks():
    """30 blocks from disk and 90 from remote staged into cpu, 100 promoted: shares 0.3 and
    0.9, scaled by 1.2 to 0.25 and 0.75 of the 10 s; remote's own leg untimed."""
    assert promotion_seconds_by_tier(
        {"cpu->gpu": 10.0},
        {"cpu->gpu": 100.0, "disk->cpu": 30.0, "remote->cpu": 90.0}) == pytest.approx(
            {"disk": 2.5, "remote": 7.5})


def test_untimed_or_idle_legs_charge_nothing():
    """vLLM's tiering manager's disk->cpu copies are counted, not timed: no seconds, but their
    blocks still say which cpu->gpu seconds were disk's."""
    assert promotion_seconds_by_tier({"cpu->gpu": 0.0}, {"cpu->gpu": 10.0}) == {}
    assert promotion_seconds_by_tier({"cpu->gpu": 2.0},
                                     {"cpu->gpu": 10.0, "disk->cpu": 5.0}) == {"cpu": 1.0,
                                                                                "disk": 1.0}


def test_promotion_is_a_copy_toward_the_gpu():
    assert is_promotion("cpu->gpu") and is_promotion("disk->cpu")
    assert not is_promotion("gpu->cpu") and not is_promotion("cpu->disk")
    assert [farther_tier(d) for d in ("gpu->cpu", "cpu->gpu", "cpu->disk", "disk->gpu")] == \
        ["cpu", "cpu", "disk", "disk"]


def test_offloads_are_the_tier_they_store_into():
    """The staged example above plus offloads gpu->cpu 2 s and cpu->disk 3 s: cpu 7.5 + 2 =
    9.5 s, disk 6.5 + 3 = 9.5 s (cpu->disk counted to the cpu tier too made it pay for the
    disk tier's copies); a promotion timed at 0 s in the window reads 0, not absent."""
    assert seconds_by_tier(
        {"cpu->gpu": 10.0, "disk->cpu": 4.0, "gpu->cpu": 2.0, "cpu->disk": 3.0},
        {"cpu->gpu": 100.0, "disk->cpu": 25.0, "gpu->cpu": 50.0, "cpu->disk": 30.0}) == \
        pytest.approx({"cpu": 9.5, "disk": 9.5})
    assert seconds_by_tier({"cpu->gpu": 0.0}, {}) == {"cpu": 0.0}
