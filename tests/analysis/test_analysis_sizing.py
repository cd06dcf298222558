"""Sizing advice on literal stack-distance histograms with a preset of round numbers."""

import numpy as np
import pytest

from kvscope.analysis.mrc import DistanceHistogram
from kvscope.analysis.sizing import SizingParams, advise, flag_gib, kneedle
from kvscope.engine.presets import ModelPreset

# 16 bytes of KV per token (2 * 1 layer * 1 head * 4 dims * 2 bytes); prefill 1000 tokens/s
ROUND = ModelPreset(name="round", layers=1, kv_heads=1, head_dim=4, dtype="float16",
                    block_tokens=1, params=1.0, peak_flops=2000.0, mfu=1.0)
FAST = 1.6e6  # bytes/s: promoting a token takes 10 us, recomputing it 1 ms


def far_reuse(total=100.0, hits=50.0, distance=9):
    h = np.zeros(distance + 1)
    h[distance] = hits
    return DistanceHistogram(h, total)


def test_offload_pays_and_is_sized_to_the_reuse():
    advice = advise(far_reuse(), SizingParams(ROUND, block_tokens=1, bandwidth=FAST), 10.0)
    assert advice.offload and advice.reasons == []
    p = advice.recommended
    assert p.blocks == 10 and p.bytes == 160  # reuse at distance 9 needs 10 blocks
    assert p.cpu_token_hit_share == pytest.approx(0.5)
    assert p.prefill_seconds_saved == pytest.approx(0.05)  # 50 tokens at 1000 tokens/s
    assert p.transfer_seconds == pytest.approx(50 * 16 / FAST)
    assert advice.kv_offloading_size_gib == 0.1  # rounded up to 0.1 GiB
    assert advice.offload_bytes_per_second == pytest.approx(50 * 16 / 10.0)  # misses stored
    assert advice.verdict.startswith("Offload:")
    assert [c.blocks for c in advice.curve] == sorted(c.blocks for c in advice.curve)


def test_the_inputs_own_tier_is_evaluated_on_the_same_curve():
    """By hand: half the 100 tokens are reused at distance 9, a tier of 10 blocks serves them
    all; the input's own tier of 5 blocks serves none, one of 12 all 50 (0.05 s of prefill at
    1,000 tokens/s, 50 x 16 bytes of copies); not known, nothing is evaluated."""
    for blocks, share in ((5, 0.0), (12, 0.5)):
        current = advise(far_reuse(), SizingParams(ROUND, 1, FAST, current_blocks=blocks),
                         10.0).current
        assert (current.blocks, current.bytes) == (blocks, blocks * 16)
        assert current.cpu_token_hit_share == pytest.approx(share)
        assert current.prefill_seconds_saved == pytest.approx(share * 100 / 1000)
        assert current.transfer_seconds == pytest.approx(share * 100 * 16 / FAST)
    assert advise(far_reuse(), SizingParams(ROUND, 1, FAST), 10.0).current is None


def test_nearly_unique_prompts_are_called_out():
    advice = advise(far_reuse(hits=1.0), SizingParams(ROUND, 1, FAST), 10.0)
    assert not advice.offload and advice.recommended is None
    assert "nearly all unique" in advice.verdict


def test_the_flag_stays_within_the_budget():
    """A 160-byte tier (far_reuse: 10 blocks of 16 bytes) under budgets of 2 MiB and 1 GiB.
    Rounded up to 0.1 GiB the flag was 50 times the first budget; 0.01 GiB (10,737,418 bytes)
    is over 2 MiB (2,097,152) too, 0.001 GiB (1,073,742) is the first step that fits; under
    1 GiB it is 0.1 as before. And 0.875 GiB under a 0.88 GiB budget is 0.88, not 0.9."""
    for budget, gib in ((2 << 20, 0.001), (1 << 30, 0.1)):
        advice = advise(far_reuse(), SizingParams(ROUND, 1, FAST, budget_bytes=budget), 10.0)
        assert advice.kv_offloading_size_gib == gib
        assert advice.verdict.startswith("Offload: a CPU tier of 10 blocks (160 bytes) serves")
        assert advice.verdict.endswith(f"; vLLM --kv-offloading-size {gib:g}.")
        assert gib * 2**30 <= budget
    assert flag_gib(0.875 * 2**30, 0.88 * 2**30) == 0.88
    assert flag_gib(0.875 * 2**30) == 0.9


def test_promotions_slower_than_prefill_are_called_out():
    advice = advise(far_reuse(), SizingParams(ROUND, 1, bandwidth=16_000), 10.0)
    assert not advice.offload
    assert "slower than recomputing" in advice.reasons[0]
    # a sentence of its own after the decision, times in plain microseconds (not "2.05e+03")
    assert advice.verdict == "Do not offload. " + advice.reasons[0]
    assert "e+" not in advice.verdict and " us, prefill takes " in advice.verdict


def test_reuse_beyond_the_budget_is_called_out():
    advice = advise(far_reuse(), SizingParams(ROUND, 1, FAST, budget_bytes=80), 10.0)
    assert not advice.offload
    assert "too far apart" in advice.verdict and "0.1 GiB" in advice.verdict


@pytest.mark.parametrize("budget", [10, 16])
def test_a_budget_that_holds_no_block_recommends_none(budget):
    """Reuse at distance 0: a tier of 1 block (16 bytes) serves 50%. A 10-byte budget holds
    no block: do not offload, it says why (a 1-block tier, 1.6 times the budget, was
    recommended: a 70B model's 512-token block is 160 MB). 16 bytes hold it: offload."""
    advice = advise(far_reuse(distance=0), SizingParams(ROUND, 1, FAST, budget_bytes=budget),
                    10.0)
    if budget < 16:
        assert not advice.offload and advice.recommended is None
        assert advice.verdict == ("Do not offload. The budget holds no block: 10 bytes of host "
                                  "RAM is less than one block of 1 tokens (16 bytes).")
    else:
        assert advice.offload and advice.recommended.blocks == 1


def test_a_gpu_cache_that_already_holds_the_reuse_leaves_nothing_to_offload():
    advice = advise(far_reuse(), SizingParams(ROUND, 1, FAST, gpu_tokens=10), 10.0)
    assert advice.gpu_token_hit_share == pytest.approx(0.5)
    assert not advice.offload and "GPU prefix cache" in advice.verdict


def test_kneedle_finds_the_bend_and_none_where_the_curve_bends_nowhere():
    """Normalised, the concave curve's point 1 is 0.8 - 0.25 = 0.55 above the chord: the knee.
    A flat, a straight and a convex curve (every point on or below the chord) have none; their
    largest difference is an end point (0), which read as a knee at the smallest size."""
    x = np.array([0, 1, 2, 3, 4], dtype=float)
    assert kneedle(x, np.array([0, 0.8, 0.9, 0.95, 1.0])) == 1
    assert kneedle(x, np.zeros(5)) is None
    assert kneedle(x, x / 4) is None
    assert kneedle(x, np.array([0, 0.05, 0.2, 0.5, 1.0])) is None


@pytest.mark.parametrize("budget_blocks", [None, 10, 30, 50])
def test_the_knee_is_the_workload_s_whatever_the_budget(budget_blocks):
    """GPU cache 4 blocks; reuse at distances 5 (30 tokens), 20 (20) and 59 (10), of 100: the
    gain is 30% from 6 blocks, 50% from 21, 60% from 60. Normalised over 4..60, 21 blocks
    (0.5 / 0.6 = 0.83 of the gain at 17 / 56 = 0.30 of the span) stands 0.53 above the chord,
    6 blocks (0.5 at 0.04) 0.46: the knee is 21, budget or not (over the affordable sizes
    alone, a 10- or a 30-block budget made it 6). The recommendation stays affordable, and the curve
    runs to the working set, through the budget's own size."""
    h = np.zeros(60)
    h[[5, 20, 59]] = [30.0, 20.0, 10.0]
    budget = None if budget_blocks is None else budget_blocks * 16
    advice = advise(DistanceHistogram(h, 100.0),
                    SizingParams(ROUND, 1, FAST, gpu_tokens=4, budget_bytes=budget), 10.0)
    assert advice.knee.blocks == 21 and advice.knee.cpu_token_hit_share == pytest.approx(0.5)
    assert advice.curve[-1].blocks == 60
    assert advice.recommended.blocks <= (budget_blocks or 60)
    assert 10 in [p.blocks for p in advice.curve]


def test_the_knee_lies_where_the_cpu_tier_adds_and_a_convex_gain_has_none():
    """GPU cache 4 blocks. Reuse at distances 5 (30 tokens) and 9 (20), of 100: the CPU tier's
    gain is 0 up to 5 blocks, 30% from 6, 50% from 10: it bends at 6 blocks (30% there is
    0.6 of the gain at 1/3 of the span from 4 to 10 blocks). Reuse at 9 alone (convex up to
    its step at 10, the working set's end): no knee; it was 1 block serving 0%, below the
    GPU cache, where an inclusive tier serves nothing."""
    h = np.zeros(10)
    h[[5, 9]] = [30.0, 20.0]
    advice = advise(DistanceHistogram(h, 100.0), SizingParams(ROUND, 1, FAST, gpu_tokens=4),
                    10.0)
    assert advice.knee.blocks == 6 and advice.knee.cpu_token_hit_share == pytest.approx(0.3)
    convex = advise(far_reuse(), SizingParams(ROUND, 1, FAST, gpu_tokens=4), 10.0)
    assert convex.offload and convex.knee is None


def test_store_traffic_of_a_trace_that_spans_no_time_is_not_measured():
    """A trace whose accesses all came at one instant has no rate of store traffic: None, said
    as "not measured", never 0 GB/s."""
    assert advise(far_reuse(), SizingParams(ROUND, 1, FAST), 0.0).offload_bytes_per_second is None
