"""The pipeline folds events into counters, gauges, histograms and one-second samples."""

from kvscope import events as ev
from kvscope.agent.pipeline import Pipeline


def _feed(pipeline):
    pipeline.ingest("engine", [
        ev.Lookup(ts=0.0, request_id="r1", tokens={"gpu": 32, "recompute": 8}),
        ev.Lookup(ts=0.0, request_id="r2", tokens={"cpu": 16, "recompute": 16}),
        ev.Transfer(ts=0.0, src="cpu", dst="gpu", blocks=1, bytes=100, duration=0.0003),
        ev.Transfer(ts=0.0, src="cpu", dst="gpu", blocks=2, bytes=200, duration=0.002),
        ev.Transfer(ts=0.0, src="gpu", dst="cpu", blocks=1, bytes=100, duration=0.1, ok=False,
                    reason="io"),
        ev.Eviction(ts=0.0, tier="gpu", blocks=1, bytes=100, age=1.0, hits=0),
        ev.TierSnapshot(ts=0.0, tier="gpu", capacity_bytes=1000, resident_bytes=400,
                        capacity_blocks=10, resident_blocks=4),
        ev.TierSnapshot(ts=1.0, tier="gpu", capacity_bytes=1000, resident_bytes=500,
                        capacity_blocks=10, resident_blocks=5),
        ev.RequestFinished(ts=1.0, request_id="r1", ttft=0.07, prompt_tokens=40),
    ])


def test_counters_gauges_and_histograms():
    """Tokens add per source (gpu 32, cpu 16, recompute 8+16=24); only successful transfers count
    (cpu->gpu: 3 blocks, 300 bytes; the failed gpu->cpu one adds nothing); 0.0003 s lands in the
    0.0005 s bucket and 0.002 s in the 0.005 s bucket; the latest tier snapshot wins."""
    pipeline = Pipeline()
    _feed(pipeline)
    snap = pipeline.snapshot()
    assert snap.prompt_tokens == {"gpu": 32, "cpu": 16, "recompute": 24}
    assert snap.transfer_bytes == {"cpu->gpu": 300}
    assert snap.transfer_blocks == {"cpu->gpu": 3}
    hist = snap.transfer_seconds["cpu->gpu"]
    bounds = dict(zip(hist.buckets, hist.counts))
    assert bounds[0.0005] == 1 and bounds[0.005] == 1 and hist.count == 2
    assert abs(hist.sum - 0.0023) < 1e-12
    assert snap.evicted_blocks == {"gpu": 1}
    assert snap.tiers["gpu"].resident_bytes == 500
    assert snap.requests == 1 and snap.recent_ttft == [0.07]
    assert snap.events_received == {"engine": 9}


def test_samples_are_cumulative_and_filtered_by_time():
    pipeline = Pipeline(history=2)
    pipeline.record_sample(10.0, 5e9)
    _feed(pipeline)
    pipeline.record_sample(11.0, 4e9)
    pipeline.record_sample(12.0, 3e9)  # history=2 drops the first sample
    samples = pipeline.samples()
    assert [s["ts"] for s in samples] == [11.0, 12.0]
    assert samples[-1]["prompt_tokens"]["recompute"] == 24
    assert samples[-1]["tier_resident_bytes"] == {"gpu": 500}
    assert [s["ts"] for s in pipeline.samples(since=11.0)] == [12.0]


def test_snapshot_is_a_copy():
    pipeline = Pipeline()
    _feed(pipeline)
    snap = pipeline.snapshot()
    _feed(pipeline)
    assert snap.prompt_tokens["gpu"] == 32
    assert pipeline.snapshot().prompt_tokens["gpu"] == 64
