"""Exact LRU stack distances and miss-ratio curves (Mattson et al. 1970), checked against a
naive LRU stack, the streaming Fenwick counter, and libcachesim's LRU on the Mooncake trace."""

import numpy as np
import pytest

from kvscope.analysis.inputs import load_trace
from kvscope.analysis.mrc import (DistanceHistogram, MissRatioCurve, lru_curve, lru_histogram,
                                  mean_absolute_error, size_grid)
from kvscope.analysis.stackdist import StackCounter, previous_access, stack_distances
from tests.traces import trace_path


def naive_distances(seq):
    """The textbook LRU stack: distance = depth of the block in the recency stack."""
    stack, out = [], []
    for x in seq:
        if x in stack:
            i = stack.index(x)
            out.append(len(stack) - 1 - i)
            stack.pop(i)
        else:
            out.append(-1)
        stack.append(x)
    return out


def test_stack_distances_of_a_literal_sequence():
    #        a   b   c   a  a  b  d   c
    seq = [1, 2, 3, 1, 1, 2, 4, 3]
    assert stack_distances(np.array(seq)).tolist() == [-1, -1, -1, 2, 0, 2, -1, 3]
    assert previous_access(np.array(seq)).tolist() == [-1, -1, -1, 0, 3, 1, -1, 2]


@pytest.mark.parametrize("seed", range(20))
def test_vectorized_and_streaming_match_the_naive_stack(seed):
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, rng.integers(1, 50), rng.integers(0, 400))
    expected = naive_distances(seq.tolist())
    assert stack_distances(seq).tolist() == expected
    counter = StackCounter(capacity=16)  # small: forces renumbering
    assert [counter.access(int(x)) for x in seq] == expected


def test_stack_counter_forget_removes_a_block_from_later_distances():
    counter = StackCounter()
    for block in (1, 2, 3):
        counter.access(block)
    counter.forget(2)
    assert 2 not in counter and len(counter) == 2
    assert counter.access(1) == 1  # only 3 lies between
    assert counter.access(2) == -1  # forgotten: new again
    counter.forget(99)  # unknown: ignored


def test_histogram_hit_ratio_at_sizes():
    h = DistanceHistogram.from_distances(np.array([-1, -1, -1, 2, 0, 2, -1, 3]))
    # hits need distance < size: size 1 -> {0}; 3 -> {0,2,2}; 4 -> all four reuses
    assert h.hit_ratio([0, 1, 2, 3, 4, 100]).tolist() == [0, 1 / 8, 1 / 8, 3 / 8, 4 / 8, 4 / 8]
    assert h.max_useful_size == 4
    weighted = DistanceHistogram.from_distances(np.array([-1, 0, 1]), np.array([10, 5, 1]))
    assert weighted.hit_ratio([1, 2]).tolist() == [5 / 16, 6 / 16]


def test_curve_interpolation_mae_and_plain_data():
    a = MissRatioCurve(np.array([1, 3]), np.array([1.0, 0.5]), "x")
    b = MissRatioCurve(np.array([1, 3]), np.array([0.9, 0.5]), "y")
    assert a.at(2) == 0.75
    assert mean_absolute_error(a, b) == pytest.approx(0.05)
    assert a.to_dict(bytes_per_block=10)["sizes_bytes"] == [10, 30]


def test_size_grid_is_sorted_unique_and_bounded():
    grid = size_grid(100_000, 96)
    assert grid[0] == 1 and grid[-1] == 100_000
    assert np.all(np.diff(grid) > 0)
    assert size_grid(0).tolist() == [1]


def test_mooncake_trace_oracles():
    trace = load_trace(trace_path())
    assert len(trace) == 288_500
    assert len(np.unique(trace.block_ids)) == 182_790
    assert round(float(lru_histogram(trace.block_ids).hit_ratio([10**9])[0]), 4) == 0.3664


@pytest.mark.parametrize("size", [100, 2_000, 10_000, 50_000, 150_000])
def test_exact_lru_equals_libcachesim_on_the_mooncake_trace(size):
    lcs = pytest.importorskip("libcachesim")
    trace = load_trace(trace_path())
    cache, req, hits = lcs.LRU(size), lcs.Request(), 0
    req.obj_size = 1
    for block in trace.block_ids.tolist():
        req.obj_id = block
        hits += cache.get(req)
    oracle = hits / len(trace)
    ours = 1.0 - lru_curve(trace.block_ids, np.array([size])).miss_ratio[0]
    assert round(ours, 4) == round(oracle, 4)
    assert ours == pytest.approx(oracle, abs=1e-12)  # in fact the same count of hits


@pytest.mark.parametrize("size", [1_000, 10_000])
def test_exact_lru_equals_the_engine_simulate_replay(size):
    """`kvscope replay --simulate` with only a GPU tier of ``size`` blocks is one LRU cache: its
    block hit ratio is the curve's, and its prefix (token) hit ratio the token-weighted curve's
    (under LRU every prefix of a cached prefix is cached, so block hits are prefix hits)."""
    import json
    import subprocess
    import sys

    path = trace_path()
    run = subprocess.run([sys.executable, "-m", "kvscope", "replay", "--simulate", "--trace",
                          str(path), "--gpu-blocks", str(size), "--cpu-blocks", "0", "--json"],
                         capture_output=True, text=True, check=True)
    summary = json.loads(run.stdout)
    trace = load_trace(path)
    by_access = lru_histogram(trace.block_ids).hit_ratio([size])[0]
    by_token = lru_histogram(trace.block_ids, trace.tokens).hit_ratio([size])[0]
    assert summary["block_accesses"] == len(trace)
    assert summary["block_hit_ratio"] == pytest.approx(by_access, abs=1e-12)
    assert summary["prefix_hit_ratio"] == pytest.approx(by_token, abs=1e-12)
