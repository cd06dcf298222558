"""The sample fields the dashboard reads, as the pipeline records them and the agent's API
serves them: percentiles computed once per sample over a window of histogram counts (as
PromQL's histogram_quantile over rate()), drops, per-bucket eviction counts, the host and
PCIe values passed in, and the timeseries ``window`` parameter."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvscope import events as ev
from kvscope.agent.config import AgentSettings
from kvscope.percentiles import histogram_quantile
from kvscope.agent.pipeline import Pipeline
from kvscope.service.agent import Agent
from kvscope.service.api import SAMPLE_FIELDS, create_app

T = 1764410000.0


def test_histogram_quantile_interpolates_like_promql():
    """Buckets (0, 1], (1, 2], (2, +Inf) with 2, 2, 0 observations: the median's rank 2 lies at
    the top of the first bucket (1.0); p75's rank 3 halfway through the second (1.5)."""
    assert histogram_quantile(0.5, (1, 2), (2, 2, 0)) == 1.0
    assert histogram_quantile(0.75, (1, 2), (2, 2, 0)) == 1.5
    assert histogram_quantile(0.99, (1, 2), (0, 0, 5)) == 2.0  # +Inf: the highest bound
    assert histogram_quantile(0.5, (1, 2), (0, 0, 0)) is None


def _finished(rid: str, ttft: float, ts: float) -> ev.RequestFinished:
    return ev.RequestFinished(ts=ts, request_id=rid, ttft=ttft, prompt_tokens=16,
                              promotion_wait=ttft / 2)


def test_percentiles_cover_the_last_window_of_samples():
    """Window of 2 samples: the first sample sees its own observations; after two more samples
    without requests the window is empty and the percentiles are None."""
    pipe = Pipeline(quantile_window=2)
    pipe.ingest("e", [_finished("a", 0.02, T), _finished("b", 0.02, T)])
    pipe.record_sample(T, None)
    first = pipe.samples()[-1]
    assert 0.01 < first["ttft_seconds"]["p50"] <= 0.025  # inside the (0.01, 0.025] bucket
    assert first["promotion_wait_seconds"]["p99"] <= 0.01
    pipe.record_sample(T + 1, None)
    pipe.record_sample(T + 2, None)
    assert pipe.samples()[-1]["ttft_seconds"] == {"p50": None, "p95": None, "p99": None}


def test_requests_that_waited_for_no_promotion_wait_exactly_zero():
    """Promotion wait is exactly 0 for a request with nothing to promote, and has a bucket of
    its own at 0 (PromQL's histogram_quantile answers a first bucket bound <= 0 with the bound).
    Without it a demo read p99 1.0 ms with 498 of 500 requests waiting nothing: the zeros were
    spread over the (0, 1 ms] bucket. By hand, 400 requests waiting 0 and 100 waiting 40 ms:
    p50's rank 250 lies among the zeros (0); p95's rank 475 and p99's 495 lie past them, in
    (25, 50] ms, at 25 + 25 * 75/100 = 43.75 ms and 25 + 25 * 95/100 = 48.75 ms."""
    pipe = Pipeline()
    pipe.ingest("e", [ev.RequestFinished(ts=T, request_id=f"r{i}", ttft=0.1, prompt_tokens=16,
                                         promotion_wait=0.04 if i >= 400 else 0.0)
                      for i in range(500)])
    pipe.record_sample(T, None)
    wait = pipe.samples()[-1]["promotion_wait_seconds"]
    assert wait == pytest.approx({"p50": 0.0, "p95": 0.04375, "p99": 0.04875})


def test_transfer_percentiles_drops_and_eviction_buckets():
    pipe = Pipeline()
    pipe.ingest("e", [
        ev.Transfer(ts=T, src="cpu", dst="gpu", blocks=4, bytes=4096, duration=0.002),
        ev.Transfer(ts=T, src="gpu", dst="cpu", blocks=2, bytes=2048, duration=0.0004),
        ev.Eviction(ts=T, tier="gpu", blocks=3, bytes=3072, age=0.5, hits=0, offloaded=True),
        ev.Eviction(ts=T, tier="cpu", blocks=2, bytes=2048, age=20.0, hits=3, offloaded=False),
    ])
    pipe.record_sample(T, 1e9, host_memory_reserve=2e8, host_memory_headroom=8e8,
                       offload_budgets={"cpu": 4096}, pcie_link_max={"0": 3.2e10})
    s = pipe.samples()[-1]
    assert set(s["transfer_seconds"]) == {"cpu->gpu", "gpu->cpu"}
    assert 0.001 < s["transfer_seconds"]["cpu->gpu"]["p50"] <= 0.005
    assert s["transfer_blocks"] == {"cpu->gpu": 4, "gpu->cpu": 2}
    assert s["transfer_seconds_sum"]["cpu->gpu"] == pytest.approx(0.002)
    assert s["dropped_blocks"] == {"gpu": 0, "cpu": 2}  # the gpu blocks were copied down
    assert s["evicted_block_hits"]["gpu"][0] == 3  # bucket le=0: never hit
    assert s["evicted_block_hits"]["cpu"][3] == 2  # bucket (2, 4]
    assert s["block_residency_seconds"]["gpu"][1] == 3  # (0.1, 1] s
    assert (s["host_memory_reserve_bytes"], s["host_memory_headroom_bytes"]) == (2e8, 8e8)
    assert s["offload_budget_bytes"] == {"cpu": 4096}
    assert s["pcie_link_max_bytes_per_second"] == {"0": 3.2e10}
    assert set(SAMPLE_FIELDS) <= set(s)


def test_timeseries_window_and_new_fields_over_the_api():
    agent = Agent(AgentSettings(), with_ingest=False)
    for i in range(5):
        agent.pipeline.record_sample(T + i, None)
    with TestClient(create_app(agent)) as client:
        body = client.get("/api/v1/timeseries", params={"window": 2}).json()
        assert [s["ts"] - T for s in body["samples"]] == [2, 3, 4]
        picked = client.get("/api/v1/timeseries",
                            params={"metric": ["ttft_seconds", "dropped_blocks"]}).json()
        assert set(picked["samples"][0]) == {"ts", "ttft_seconds", "dropped_blocks"}
