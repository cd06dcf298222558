"""The engine's replacement decisions against libCacheSim (PyPI ``libcachesim``), an
independent cache simulator, on the real Mooncake conversation trace.

With a single ``gpu`` tier of N blocks, block accesses in trace order (requests by timestamp,
each request's blocks first to last, a missed block inserted) are exactly a cache of N
unit-size objects fed the same id sequence, so the hit counts must be equal, not just close.
"""

import pytest

from kvscope.engine.engine import OffloadEngine
from kvscope.engine.presets import get_preset
from kvscope.engine.workload import MOONCAKE_BLOCK_TOKENS, read_mooncake
from traces import trace_path

lcs = pytest.importorskip("libcachesim")

SIZES = [1, 7, 100, 1000, 5000, 20000]


@pytest.fixture(scope="module")
def requests():
    return read_mooncake(trace_path())


def _oracle_hits(cache, ids) -> int:
    req = lcs.Request()
    req.obj_size = 1
    hits = 0
    for obj_id in ids:
        req.obj_id = obj_id
        hits += cache.get(req)
    return hits


@pytest.mark.parametrize("policy,oracle", [("lru", "LRU"), ("arc", "ARC")])
@pytest.mark.parametrize("blocks", SIZES)
def test_gpu_only_hit_ratio_equals_libcachesim(requests, policy, oracle, blocks):
    ids = [h for r in requests for h in r.block_hashes]
    expected = _oracle_hits(getattr(lcs, oracle)(cache_size=blocks), ids)
    engine = OffloadEngine(get_preset("tiny"), blocks, 0, block_tokens=MOONCAKE_BLOCK_TOKENS,
                           policy=policy, payload=False)
    for request in requests:
        engine.process(request)
    summary = engine.stats.summary(engine.block_bytes, 0.0)
    assert summary["block_accesses"] == len(ids) == 288_500
    assert engine.stats.block_hits["gpu"] == expected
    assert summary["block_hit_ratio"] == expected / len(ids)
    if blocks >= 1000:
        assert expected > 0.04 * len(ids)  # the comparison is not vacuous


@pytest.mark.parametrize("policy,oracle", [("lru", "LRU"), ("arc", "ARC")])
def test_lower_tiers_do_not_change_gpu_decisions(requests, policy, oracle):
    """The gpu tier's decisions depend only on the access sequence: adding cpu and disk tiers
    moves hits from recompute to promotions but leaves gpu hits equal to the oracle's."""
    ids = [h for r in requests for h in r.block_hashes]
    expected = _oracle_hits(getattr(lcs, oracle)(cache_size=1000), ids)
    engine = OffloadEngine(get_preset("tiny"), 1000, 3000, 9000,
                           block_tokens=MOONCAKE_BLOCK_TOKENS, policy=policy, payload=False)
    for request in requests:
        engine.process(request)
    assert engine.stats.block_hits["gpu"] == expected
    assert engine.stats.block_hits["cpu"] > 0 and engine.stats.block_hits["disk"] > 0
