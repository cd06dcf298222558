"""The engine's running totals stay bounded over an endless run (the demo's synthetic stream)."""

import pytest

from kvscope.engine.stats import MAX_TTFTS, EngineStats


def test_an_endless_run_keeps_only_the_latest_ttfts():
    """Half of MAX_TTFTS requests at 100 s, then MAX_TTFTS at 1 s. By hand: kept whole, the
    1.5 million TTFTs would give p95 = 100 s (the top third is 100 s) and a mean of 34 s;
    the latest MAX_TTFTS are all 1 s, so every percentile and the mean are 1 s, and the
    memory held is that of MAX_TTFTS floats whatever the run's length."""
    stats = EngineStats()
    stats.ttfts.extend([100.0] * (MAX_TTFTS // 2))
    stats.ttfts.extend([1.0] * MAX_TTFTS)
    assert len(stats.ttfts) == MAX_TTFTS
    ttft = stats.summary(block_bytes=1, wall_seconds=1.0)["ttft_seconds"]
    assert ttft == pytest.approx({"p50": 1.0, "p95": 1.0, "p99": 1.0, "mean": 1.0})
