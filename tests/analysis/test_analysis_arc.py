"""ARC (Megiddo & Modha, FAST'03) and its miniature simulation (Waldspurger et al., ATC'17)."""

import numpy as np
import pytest

from kvscope.analysis.arc import ArcCache, arc_curve, arc_hit_ratio
from kvscope.analysis.inputs import load_trace
from kvscope.analysis.mrc import lru_curve
from tests.traces import trace_path


def test_arc_resists_a_scan_that_flushes_lru():
    # a hot pair used twice, a scan of ten new blocks, the hot pair again; capacity 4
    seq = np.array([1, 2, 1, 2] + list(range(10, 20)) + [1, 2])
    assert arc_hit_ratio(seq, 4) * len(seq) == pytest.approx(4)  # hot pair survives in T2
    assert (1 - lru_curve(seq, np.array([4])).miss_ratio[0]) * len(seq) == pytest.approx(2)


def test_arc_lists_stay_within_their_bounds():
    rng = np.random.default_rng(0)
    cache = ArcCache(8)
    for block in rng.integers(0, 40, 5_000).tolist():
        cache.access(block)
        assert len(cache) <= 8
        assert len(cache.t1) + len(cache.b1) <= 8
        assert len(cache) + len(cache.b1) + len(cache.b2) <= 16
        assert 0 <= cache.p <= 8
    with pytest.raises(ValueError):
        ArcCache(0)


@pytest.mark.parametrize("size", [1_000, 10_000, 50_000])
def test_arc_equals_libcachesim_on_the_mooncake_trace(size):
    lcs = pytest.importorskip("libcachesim")
    ids = load_trace(trace_path()).block_ids
    cache, req, hits = lcs.ARC(size), lcs.Request(), 0
    req.obj_size = 1
    for block in ids.tolist():
        req.obj_id = block
        hits += cache.get(req)
    assert arc_hit_ratio(ids, size) == pytest.approx(hits / len(ids), abs=1e-12)


def test_miniature_simulation_tracks_the_full_one():
    ids = load_trace(trace_path()).block_ids
    sizes = np.array([5_000, 10_000, 20_000, 50_000, 100_000])
    full = arc_curve(ids, sizes, rate=1.0)
    assert full.method == "arc-exact"
    for seed in (0, 1):
        mini = arc_curve(ids, sizes, rate=0.1, seed=seed)
        assert np.mean(np.abs(mini.miss_ratio - full.miss_ratio)) <= 0.01
    with pytest.raises(ValueError):
        arc_curve(ids, sizes, rate=0)


@pytest.mark.parametrize("capacity", [1, 2, 3, 5, 8])
def test_arc_matches_libcachesim_hit_by_hit_on_small_random_streams(capacity):
    """Small caches on small universes reach ARC's corner cases (full L1, ties with p)."""
    lcs = pytest.importorskip("libcachesim")
    rng = np.random.default_rng(capacity)
    for universe in (capacity + 1, 2 * capacity + 1, 4 * capacity + 3):
        seq = rng.integers(0, universe, 3_000).tolist()
        ours, theirs, req = ArcCache(capacity), lcs.ARC(capacity), lcs.Request()
        req.obj_size = 1
        for i, block in enumerate(seq):
            req.obj_id = block
            assert ours.access(block) == theirs.get(req), (universe, i)
