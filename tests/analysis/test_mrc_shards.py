"""SHARDS (Waldspurger et al., FAST'15) against the exact LRU curve."""

import numpy as np
import pytest

from kvscope.analysis import shards
from kvscope.analysis.inputs import load_trace
from kvscope.analysis.mrc import (DistanceHistogram, curve_from_histogram, lru_histogram,
                                  mean_absolute_error, size_grid)
from kvscope.analysis.stackdist import stack_distances
from kvscope.analysis.synthetic import prefix_stream
from tests.traces import trace_path


def _mae(exact: DistanceHistogram, estimate: DistanceHistogram) -> float:
    grid = size_grid(exact.max_useful_size, 200)
    return mean_absolute_error(curve_from_histogram(exact, grid, "exact"),
                               curve_from_histogram(estimate, grid, "shards"))


def test_spatial_hash_is_uniform_and_seeded():
    h = shards.spatial_hash(np.arange(200_000))
    assert h.min() >= 0 and h.max() < shards.MODULUS
    counts, _ = np.histogram(h, bins=10, range=(0, shards.MODULUS))
    assert counts.min() > 19_000 and counts.max() < 21_000
    assert shards.spatial_hash(np.array([0]))[0] != 0  # id 0 is not always sampled
    assert not np.array_equal(shards.spatial_hash(np.arange(100), seed=1),
                              shards.spatial_hash(np.arange(100)))


def test_rate_one_is_the_exact_curve():
    ids = prefix_stream(50_000, seed=1)
    exact = lru_histogram(ids)
    full = shards.fixed_rate(ids, 1.0).histogram
    assert _mae(exact, full) == 0.0
    assert shards.fixed_size(ids, max_blocks=10**9).rate == 1.0
    assert _mae(exact, shards.fixed_size(ids, max_blocks=10**9).histogram) == 0.0


def test_fixed_size_keeps_at_most_max_blocks():
    result = shards.fixed_size(prefix_stream(300_000, seed=2), max_blocks=500)
    assert result.sampled_blocks <= 500
    assert result.rate < 0.01


def test_bad_parameters_raise():
    with pytest.raises(ValueError):
        shards.fixed_rate(np.arange(10), 0.0)
    with pytest.raises(ValueError):
        shards.fixed_size(np.arange(10), 0)


def test_shards_on_ten_million_synthetic_accesses():
    """The issue's proof: MAE <= 0.01 at R = 0.01 on >= 10M accesses (fixed seed). About 15 s
    on 2 cores: the exact curve is the vectorized O(N log N) pass; SHARDS samples ~100K."""
    ids = prefix_stream(10_000_000, seed=7)
    assert len(ids) == 10_000_000
    exact = DistanceHistogram.from_distances(stack_distances(ids))
    assert 0.3 < exact.hit_ratio([10**9])[0] < 0.7  # a curve with room to err
    rate = shards.fixed_rate(ids, 0.01)
    assert 0.008 * len(ids) < rate.sampled_accesses < 0.012 * len(ids)
    assert _mae(exact, rate.histogram) <= 0.01
    # fixed size: 32768 blocks ends near R = 0.006 on this stream's 5M distinct blocks
    size = shards.fixed_size(ids, max_blocks=32_768)
    assert size.sampled_blocks <= 32_768 and size.rate < 0.01
    assert _mae(exact, size.histogram) <= 0.01


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shards_on_the_mooncake_trace(seed):
    """A real trace with one very hot block (id 0 starts every prompt): SHARDS_adj matters."""
    ids = load_trace(trace_path()).block_ids
    exact = lru_histogram(ids)
    assert _mae(exact, shards.fixed_rate(ids, 0.1, seed=seed).histogram) <= 0.01
    assert _mae(exact, shards.fixed_rate(ids, 0.01, seed=seed).histogram) <= 0.02
    assert _mae(exact, shards.fixed_size(ids, 4096, seed=seed).histogram) <= 0.01


def test_a_few_sampled_blocks_keep_their_hit_ratio_and_a_large_sample_is_adjusted():
    """A tap's capture of 42 requests: 8 sampled accesses, 8 blocks never reused, of 231 in
    the full stream at R = 1/16 (an expected 14.4 sampled). SHARDS_adj put the shortfall,
    231 - 8 x 16 = 103 accesses, into the first bucket: a 45% hit ratio from a sample without
    one reuse (and analyze said "Offload"). Under MIN_SAMPLED_BLOCKS distinct blocks the
    histogram is scaled to 231 instead: no hit at any size. A sample of 2,000 blocks is
    adjusted as the paper says: 16 x 2,000 = 32,000 sampled against 40,000 expected puts
    8,000 into the first bucket."""
    rate = 1 / 16
    under = np.flatnonzero(shards.spatial_hash(np.arange(100_000))
                           < shards.sampling.threshold(rate))
    few = shards.fixed_rate(under[:8], rate, sampled_at=rate, total=231).histogram
    assert few.total == 231 and few.hit_ratio([1, 10**6]).tolist() == [0.0, 0.0]
    many = shards.fixed_rate(under[:2000], rate, sampled_at=rate, total=40_000).histogram
    effective = shards.sampling.rate_of(shards.sampling.threshold(rate))
    assert many.total == 40_000
    assert many.hits[0] == pytest.approx(40_000 - 2000 / effective)


def test_a_hot_block_in_the_sample_takes_hits_away_rather_than_adding_them():
    """20,000 prompts, each a shared first block (in the sample at R = 0.1) and 8 blocks drawn
    from 20,000 others. The sample over-counts: its hot block's 20,000 accesses weigh 200,000,
    so SHARDS_adj's difference (expected - sampled) is negative, about -180,000. Clamped at
    0, those hits stayed and the curve read no miss at all from 10,000 blocks up. Hand
    calculation: 8 x 20,000 = 160,000 draws from 20,000 blocks touch 20,000 x (1 - e^-8) =
    19,993 of them, so the cold misses, the miss ratio of an unbounded cache, are (1 + 19,993)
    / 180,000 = 0.111."""
    rate = 0.1
    hot = int(np.flatnonzero(shards.spatial_hash(np.arange(100))
                             < shards.sampling.threshold(rate))[0])
    rng = np.random.default_rng(0)
    others = 100 + rng.integers(0, 20_000, size=(20_000, 8))
    ids = np.concatenate([np.full((20_000, 1), hot), others], axis=1).ravel()
    estimate = shards.fixed_rate(ids, rate).histogram
    assert estimate.hit_ratio([10**6])[0] == pytest.approx(1 - 0.111, abs=0.01)
    assert _mae(lru_histogram(ids), estimate) <= 0.02
