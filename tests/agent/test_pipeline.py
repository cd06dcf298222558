"""The pipeline folds events into counters, gauges, histograms, request records and samples."""

import time

import pytest

from kvscope import catalog
from kvscope import events as ev
from kvscope.agent.metrics import snapshot_samples
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.assembler import MAX_REUSES, RequestAssembler
from kvscope.agent.requests import RequestRecord
from kvscope.vocabulary import FAILURE_REASONS

CPU_GPU = ("cpu", "gpu")


def _every_reason(*directions):
    return {(src, dst, reason): 0 for src, dst in directions for reason in FAILURE_REASONS}


def _feed(pipeline, rid="r1", arrival=100.0):
    pipeline.ingest("engine", [
        ev.RequestStarted(ts=arrival, request_id=rid, prompt_tokens=40, trace_id="ab" * 16),
        ev.TierSnapshot(ts=100.0, tier="gpu", capacity_bytes=1000, resident_bytes=400,
                        capacity_blocks=10, resident_blocks=4),
        ev.TierSnapshot(ts=100.0, tier="cpu", capacity_bytes=4000, resident_bytes=100,
                        capacity_blocks=40, resident_blocks=1),
        ev.Lookup(ts=100.0, request_id=rid, tokens={"gpu": 16, "cpu": 16, "recompute": 8},
                  blocks=3, block_hits={"gpu": 1, "cpu": 1}, prefill_tokens_per_second=1000.0),
        ev.Transfer(ts=100.001, src="cpu", dst="gpu", blocks=1, bytes=100, duration=0.0003,
                    request_id=rid),
        ev.Transfer(ts=100.002, src="cpu", dst="gpu", blocks=2, bytes=200, duration=0.002),
        ev.Transfer(ts=100.003, src="gpu", dst="cpu", blocks=1, bytes=100, duration=0.1, ok=False,
                    reason="io"),
        ev.Eviction(ts=100.0, tier="gpu", blocks=2, bytes=200, age=30.0, hits=0),
        ev.TierSnapshot(ts=101.0, tier="gpu", capacity_bytes=1000, resident_bytes=500,
                        capacity_blocks=10, resident_blocks=5),
        ev.RequestFinished(ts=100.07, request_id=rid, ttft=0.07, prompt_tokens=40, queueing=0.01,
                           lookup=0.001, promotion_wait=0.0003, prefill=0.008),
    ])


def test_counters_gauges_and_histograms():
    """Tokens add per source (disk absent: no lookup measures it, the engine has no disk
    tier); lookups cascade: 3 blocks -> gpu 1 hit 2 miss,
    the 2 reach cpu -> 1 hit 1 miss. Saved prefill: (16 + 16) tokens / 1000 tokens/s = 0.016 s
    per source pair (gpu 0.016, cpu 0.016). Only successful transfers add bytes (cpu->gpu: 3
    blocks, 300 bytes); the failed one counts as a failure. 0.0003 s lands in the 0.0005 s bucket
    and 0.002 s in the 0.005 s bucket. Failures: io 1, every other reason of both directions 0
    (the source sees failures). An eviction of 2 blocks observes 2 hits=0 and 2 ages."""
    pipeline = Pipeline()
    _feed(pipeline)
    snap = pipeline.snapshot()
    assert snap.prompt_tokens == {"gpu": 16, "cpu": 16, "recompute": 8}
    assert snap.lookup_blocks == {("gpu", "hit"): 1, ("gpu", "miss"): 2, ("cpu", "hit"): 1,
                                  ("cpu", "miss"): 1}
    assert snap.prefill_seconds_saved == {"gpu": 0.016, "cpu": 0.016}
    assert snap.transfer_bytes == {CPU_GPU: 300}
    assert snap.transfer_blocks == {CPU_GPU: 3}
    assert snap.transfer_failures == {**_every_reason(CPU_GPU, ("gpu", "cpu")),
                                      ("gpu", "cpu", "io"): 1}
    hist = snap.transfer_seconds[CPU_GPU]
    bounds = dict(zip(hist.buckets, hist.counts))
    assert bounds[0.0005] == 1 and bounds[0.005] == 1 and hist.count == 2
    assert abs(hist.sum - 0.0023) < 1e-12
    # the transfer made for r1 carries r1's trace id as its bucket's exemplar
    assert [e[0] for e in hist.exemplars.values()] == ["ab" * 16]
    assert snap.evicted_blocks == {("gpu", "capacity"): 2}
    assert snap.evicted_block_hits["gpu"].counts[0] == 2
    assert snap.block_residency_seconds["gpu"].count == 2
    assert snap.tiers["gpu"].resident_bytes == 500
    assert snap.requests == 1 and snap.recent_ttft == [0.07]
    assert snap.ttft_seconds.exemplars[snap.ttft_seconds.buckets.index(0.1)][0] == "ab" * 16
    assert snap.events_received == {"engine": 10}


def test_request_record_joins_the_events():
    pipeline = Pipeline()
    finished = []
    pipeline.subscribe(finished.append)
    _feed(pipeline)
    record = pipeline.requests.get("r1")
    assert finished == [record]
    assert record.trace_id == "ab" * 16 and record.arrival == 100.0
    assert record.tokens == {"gpu": 16, "cpu": 16, "recompute": 8}
    assert [(t.src, t.dst, t.bytes) for t in record.transfers] == [("cpu", "gpu", 100)]
    assert (record.ttft, record.queueing, record.prefill, record.finished) == (0.07, 0.01, 0.008, 100.07)


def test_request_table_is_bounded_and_sortable():
    from kvscope.agent.requests import RequestTable

    pipeline = Pipeline(table=RequestTable(capacity=3))
    for i in range(5):
        _feed(pipeline, rid=f"r{i}", arrival=100.0 + i)
    assert len(pipeline.requests) == 3 and pipeline.requests.get("r0") is None
    assert [r.request_id for r in pipeline.requests.recent(2, "arrival")] == ["r4", "r3"]


def test_two_sources_with_the_same_request_ids_keep_their_own_records():
    """Engines number requests on their own, so ids collide: each source's record stays, and a
    lookup without a source gets the one that finished last (beta's, at 10.9)."""
    pipeline = Pipeline()
    for source, ttft in (("alpha", 0.1), ("beta", 0.9)):
        pipeline.ingest(source, [ev.RequestStarted(ts=10.0, request_id="shared", prompt_tokens=4),
                                 ev.RequestFinished(ts=10.0 + ttft, request_id="shared",
                                                    ttft=ttft, prompt_tokens=4)])
    assert len(pipeline.requests) == 2 == pipeline.snapshot().requests
    assert pipeline.requests.get("shared", "alpha").ttft == 0.1
    assert pipeline.requests.get("shared", "beta").ttft == 0.9
    assert pipeline.requests.get("shared").source == "beta"
    assert pipeline.requests.get("shared", "gamma") is None


def test_a_request_aborted_before_its_first_token_is_closed_and_counted_nowhere():
    """r1 started, looked up 64 tokens and was aborted before its first token (vLLM's tap
    sends RequestAborted): its prompt tokens count (the lookup ran), but it is no finished
    request (0 requests, no TTFT) and no record; nothing of it stays in flight, so a later
    request of the id is a new one (its own arrival, 50.0)."""
    pipeline = Pipeline()
    pipeline.ingest("vllm", [ev.RequestStarted(ts=10.0, request_id="r1", prompt_tokens=64),
                             ev.Lookup(ts=10.5, request_id="r1", tokens={"recompute": 64}),
                             ev.RequestAborted(ts=40.0, request_id="r1")])
    snap = pipeline.snapshot()
    assert (snap.requests, snap.ttft_seconds.count) == (0, 0)
    assert snap.prompt_tokens == {"recompute": 64}
    assert pipeline.requests.get("r1") is None
    pipeline.ingest("vllm", [ev.RequestFinished(ts=50.2, request_id="r1", ttft=0.2,
                                                prompt_tokens=64)])
    assert pipeline.requests.get("r1").arrival == 50.0 and pipeline.snapshot().requests == 1


def test_a_late_transfer_of_an_aborted_request_opens_no_record():
    """vLLM's worker tap sends its batches up to a flush interval after the scheduler's: a
    load of a request aborted in prefill came after the abort and opened a record nothing
    would finish (held until abandoned, and counted so). Its bytes count; no record opens.
    The id reused by a new request: its own transfer joins it."""
    pipeline = Pipeline()
    pipeline.ingest("vllm", [ev.RequestStarted(ts=10.0, request_id="r1", prompt_tokens=64),
                             ev.RequestAborted(ts=11.0, request_id="r1")])
    load = ev.Transfer(ts=10.5, src="cpu", dst="gpu", blocks=2, bytes=20, duration=0.01,
                       request_id="r1")
    pipeline.ingest("worker0", [load], scope="vllm")
    assert pipeline._assembler.in_flight("vllm", "r1") is None
    assert pipeline.snapshot().transfer_bytes == {("cpu", "gpu"): 20}
    pipeline.ingest("vllm", [ev.RequestStarted(ts=20.0, request_id="r1", prompt_tokens=64)])
    pipeline.ingest("worker0", [ev.Transfer(ts=20.1, src="cpu", dst="gpu", blocks=2, bytes=20,
                                            duration=0.01, request_id="r1")], scope="vllm")
    pipeline.ingest("vllm", [ev.RequestFinished(ts=20.5, request_id="r1", ttft=0.5,
                                                prompt_tokens=64)])
    assert [t.bytes for t in pipeline.requests.get("r1").transfers] == [20]


def test_requests_never_finished_beyond_the_inflight_bound_are_counted_as_abandoned(caplog):
    """The assembler holds 10,000 open requests per source: 10,003 starts without a finish
    abandon the 3 oldest, counted under their source so the loss is not silent."""
    pipeline = Pipeline()
    pipeline.ingest("quiet", [ev.RequestStarted(ts=0.5, request_id="q", prompt_tokens=1,
                                                trace_id="ab" * 16)])
    pipeline.ingest("engine", [ev.RequestStarted(ts=1.0, request_id=f"r{i}", prompt_tokens=1)
                               for i in range(10_003)])
    assert pipeline.snapshot().events_dropped == {("engine", "abandoned"): 3}
    assert caplog.text.count("source 'engine' has 10000 requests started and not finished") == 1
    # the bound is per source: the busy engine did not push out the quiet one's open request
    pipeline.ingest("quiet", [ev.RequestFinished(ts=1.5, request_id="q", ttft=1.0,
                                                 prompt_tokens=1)])
    assert pipeline.requests.get("q", "quiet").trace_id == "ab" * 16


def test_a_record_keeps_its_first_transfers_and_counts_the_rest():
    """300 transfers of 1 block for one request: the record keeps MAX_TRANSFERS (64) and counts
    the other 236; the transfer metrics count all 300 blocks."""
    from kvscope.agent.requests import MAX_TRANSFERS

    pipeline = Pipeline()
    pipeline.ingest("engine", [ev.RequestStarted(ts=1.0, request_id="r", prompt_tokens=1)] + [
        ev.Transfer(ts=1.0 + i, src="cpu", dst="gpu", blocks=1, bytes=8, duration=0.001,
                    request_id="r") for i in range(300)] + [
        ev.RequestFinished(ts=400.0, request_id="r", ttft=0.5, prompt_tokens=1)])
    record = pipeline.requests.get("r")
    assert MAX_TRANSFERS == 64 and len(record.transfers) == 64
    assert record.transfers_omitted == 236 and record.transfers[-1].start == 64.0
    assert pipeline.snapshot().transfer_blocks == {CPU_GPU: 300}


def test_drops_and_source_health():
    pipeline = Pipeline()
    pipeline.drop("ingest", "malformed")
    pipeline.drop("ingest", "malformed", 2)
    pipeline.set_source_up("ingest", True)
    snap = pipeline.snapshot()
    assert snap.events_dropped == {("ingest", "malformed"): 3}
    assert snap.source_up == {"ingest": True}


def test_samples_are_cumulative_and_filtered_by_time():
    pipeline = Pipeline(history=2)
    pipeline.record_sample(10.0, 5e9)
    _feed(pipeline)
    pipeline.record_sample(11.0, 4e9)
    pipeline.record_sample(12.0, 3e9)  # history=2 drops the first sample
    samples = pipeline.samples()
    assert [s["ts"] for s in samples] == [11.0, 12.0]
    assert samples[-1]["prompt_tokens"]["recompute"] == 8
    assert samples[-1]["transfer_bytes"] == {"cpu->gpu": 300}
    assert samples[-1]["evicted_blocks"] == {"gpu": 2}
    assert samples[-1]["tier_resident_bytes"] == {"gpu": 500, "cpu": 100}
    assert [s["ts"] for s in pipeline.samples(since=11.0)] == [12.0]


def test_a_host_reading_missed_once_is_no_swap_in():
    """The host had read 5 GiB back from swap since boot, and one sample missed the host
    collector's reading: the counter holds 0 there (a declared counter is a number). Counted,
    the window's increase read 5 GiB -> 0 as a reset and 0 -> 5 GiB as 5 GiB swapped in just
    now, and the Overview said the host was overcommitted (a review). The swap-in of a window
    counts the samples that read the host alone: none here."""
    from kvscope.dashboard.series import swap_in_increase

    pipeline = Pipeline()
    for ts, swapped, limit in ((1.0, 5 * 2**30, 64 * 2**30), (2.0, None, None),
                               (3.0, 5 * 2**30, 64 * 2**30)):
        pipeline.record_sample(ts, None, host_swap_in=swapped, host_memory_limit=limit)
    samples = pipeline.samples()
    assert [s["host_swap_in_bytes"] for s in samples] == [5 * 2**30, 0.0, 5 * 2**30]
    assert swap_in_increase(samples) == 0.0
    assert swap_in_increase(samples[1:2]) is None  # no reading: not measured


def test_snapshot_is_a_copy():
    pipeline = Pipeline()
    _feed(pipeline)
    snap = pipeline.snapshot()
    _feed(pipeline, rid="r2")
    assert snap.prompt_tokens["gpu"] == 16
    assert pipeline.snapshot().prompt_tokens["gpu"] == 32


def test_untimed_transfers_and_unmeasured_evictions_count_without_histograms():
    """A vLLM KV-events source sees copies and evictions but no durations, ages or hits: bytes
    and blocks count, the histograms stay empty."""
    pipeline = Pipeline()
    pipeline.ingest("vllm", [
        ev.Transfer(ts=1.0, src="gpu", dst="cpu", blocks=2, bytes=64, duration=0.0, timed=False),
        ev.Eviction(ts=1.0, tier="cpu", blocks=3, bytes=96, age=0.0, hits=0, measured=False),
    ])
    snap = pipeline.snapshot()
    assert snap.transfer_bytes == {("gpu", "cpu"): 64} and snap.transfer_seconds == {}
    assert snap.evicted_blocks == {("cpu", "capacity"): 3} and snap.dropped_blocks == {"cpu": 3}
    assert snap.evicted_block_hits == {} and snap.block_residency_seconds == {}


def test_blocks_of_unknown_size_count_blocks_and_leave_bytes_not_measured():
    """A source without the block size (KVBM, SGLang, ... with block_bytes unset) sends its
    transfers with 0 bytes: kvscope_transfer_bytes_total read 0, and throughput panels 0 B/s.
    Now no bytes series for them (not measured); another sender's bytes still count, and a
    transfer of no blocks is 0 bytes, measured."""
    pipeline = Pipeline()
    pipeline.ingest("kvbm", [
        ev.Transfer(ts=1.0, src="gpu", dst="cpu", blocks=5, bytes=0, duration=0.0, timed=False),
        ev.Transfer(ts=1.0, src="cpu", dst="disk", blocks=0, bytes=0, duration=0.0, timed=False)])
    snap = pipeline.snapshot()
    assert snap.transfer_blocks == {("gpu", "cpu"): 5, ("cpu", "disk"): 0}
    assert snap.transfer_bytes == {("cpu", "disk"): 0}
    samples = snapshot_samples(snap)
    assert ["gpu", "cpu"] not in [labels for labels, _ in samples[catalog.TRANSFER_BYTES]]
    # failures are initialised for the direction all the same
    assert (["gpu", "cpu", "io"], 0) in samples[catalog.TRANSFER_FAILURES]
    pipeline.ingest("vllm", [
        ev.Transfer(ts=2.0, src="gpu", dst="cpu", blocks=2, bytes=64, duration=0.001)])
    assert pipeline.snapshot().transfer_bytes == {("gpu", "cpu"): 64, ("cpu", "disk"): 0}


def test_bytes_without_blocks_leave_blocks_not_measured():
    """vLLM's /metrics count offload bytes, not blocks: without block_bytes its source sends
    transfers of 0 blocks, and kvscope_transfer_blocks_total read 0 beside 44 MB moved (the
    Tiers page: "no block movement" above a throughput of 6 MB/s). Now no blocks series for
    them; 2 blocks of another sender still count."""
    pipeline = Pipeline()
    pipeline.ingest("vllm_metrics", [
        ev.Transfer(ts=1.0, src="gpu", dst="cpu", blocks=0, bytes=44_000_000, duration=0.0,
                    timed=False)])
    snap = pipeline.snapshot()
    assert snap.transfer_bytes == {("gpu", "cpu"): 44_000_000} and snap.transfer_blocks == {}
    samples = snapshot_samples(snap)
    assert ["gpu", "cpu"] not in [labels for labels, _ in samples[catalog.TRANSFER_BLOCKS]]
    pipeline.ingest("vllm", [
        ev.Transfer(ts=2.0, src="gpu", dst="cpu", blocks=2, bytes=64, duration=0.001)])
    assert pipeline.snapshot().transfer_blocks == {("gpu", "cpu"): 2}


def test_engine_latency_histograms_fold_into_ttft():
    """vLLM-style buckets (0.02, 0.04, 0.06, +Inf) with counts 1, 2, 0, 1: each lands in our
    bucket holding its upper bound — 0.02 -> 0.025, 0.04 -> 0.05, +Inf -> +Inf; sum adds. The
    4 TTFTs are 4 requests that finished their prefill (kvscope_requests_total's meaning):
    without spans they read 0 requests beside 4 TTFTs, and the dashboard's offload verdict
    said "too little traffic" under load. Once a finished record came (a tap's, or a span's),
    requests and TTFTs are counted from records alone: an engine's histogram beside them (a
    tap with vllm_metrics on, spans later than vllm_metrics waits for) counted each one twice.
    Both alike: the count once skipped the histogram's, the TTFT histogram did not (a review:
    5 requests beside 6 TTFTs)."""
    pipeline = Pipeline()
    pipeline.ingest("vllm", [ev.LatencyHistogram(ts=1.0, metric="ttft", bounds=[0.02, 0.04, 0.06],
                                                 counts=[1, 2, 0, 1], sum=0.5)])
    hist = pipeline.snapshot().ttft_seconds
    by_bound = dict(zip((*hist.buckets, float("inf")), hist.counts))
    assert (by_bound[0.025], by_bound[0.05], by_bound[float("inf")]) == (1, 2, 1)
    assert hist.count == 4 and hist.sum == 0.5
    assert pipeline.snapshot().requests == 4
    pipeline.ingest("tap", [ev.RequestStarted(ts=2.0, request_id="r", prompt_tokens=4),
                            ev.RequestFinished(ts=2.1, request_id="r", ttft=0.1,
                                               prompt_tokens=4)])
    pipeline.ingest("vllm", [ev.LatencyHistogram(ts=3.0, metric="ttft", bounds=[0.02, 0.04, 0.06],
                                                 counts=[0, 0, 0, 1], sum=0.1)])
    pipeline.publish_settled(everything=True)
    snap = pipeline.snapshot()
    assert snap.requests == 5 and snap.ttft_seconds.count == 5
    assert snap.ttft_seconds.sum == pytest.approx(0.6)  # the engine's 0.5 and the tap's 0.1


def test_another_sources_transfers_join_a_request_even_when_they_arrive_late():
    """vLLM's worker tap (source ``w``, scope ``s``) sends the loads of the scheduler tap's
    (source ``s``) requests on its own connection, so they may arrive before the request's start
    or after its finish. Request a: its load arrives first (the start then still sets arrival
    100.0 and the trace id). Request b: its load arrives after its finish: the record, in the
    table at once, has waited (join window) before the subscribers get it, and so they get it
    with that load. A transfer without a request id joins nothing."""
    records = []
    pipeline = Pipeline(join_window=3600.0)
    pipeline.subscribe(records.append)

    def load(rid, ts):
        return ev.Transfer(ts=ts, src="cpu", dst="gpu", blocks=2, bytes=200, duration=0.004,
                           request_id=rid)

    pipeline.ingest("w", [load("a", 100.01), load("", 100.02)], scope="s")
    pipeline.ingest("s", [
        ev.RequestStarted(ts=100.0, request_id="a", prompt_tokens=64, trace_id="cd" * 16),
        ev.RequestFinished(ts=100.2, request_id="a", ttft=0.1, prompt_tokens=64),
        ev.RequestStarted(ts=101.0, request_id="b", prompt_tokens=64),
        ev.RequestFinished(ts=101.2, request_id="b", ttft=0.1, prompt_tokens=64),
    ])
    assert records == [] and len(pipeline.requests) == 2  # the sinks wait for late transfers
    pipeline.ingest("w", [load("b", 101.05)], scope="s")
    pipeline.publish_settled(everything=True)
    assert [r.request_id for r in records] == ["a", "b"]
    a, b = records
    assert pipeline.requests.get("b") is b
    assert (a.arrival, a.trace_id, a.source) == (100.0, "cd" * 16, "s")
    assert [(t.src, t.dst, t.blocks, t.start) for t in a.transfers] == [("cpu", "gpu", 2, 100.01)]
    assert [t.start for t in b.transfers] == [101.05]
    snap = pipeline.snapshot()
    assert snap.requests == 2 and snap.transfer_blocks == {CPU_GPU: 6}
    # the load made for a carries a's trace id as its exemplar (the latest in its bucket: b's)
    assert [e[0] for e in snap.transfer_seconds[CPU_GPU].exemplars.values()] == [b.trace_id]
    assert snap.events_received == {"w": 3, "s": 4}


def test_requests_of_sources_no_other_source_joins_are_published_at_once():
    records = []
    pipeline = Pipeline(join_window=3600.0)
    pipeline.subscribe(records.append)
    _feed(pipeline)
    assert [r.request_id for r in records] == ["r1"] and pipeline.requests.get("r1")


def test_an_early_subscriber_gets_a_joined_record_at_once_and_again_once_it_waited():
    """The store subscribes early (a kill -9 must not lose the 6 s a vLLM record waits for its
    span); the OTLP exporter does not: it gets the record once, after the wait."""
    pipeline = Pipeline()
    pipeline.join("vllm", 3600.0)
    early, late = [], []
    pipeline.subscribe(early.append, early=True)
    pipeline.subscribe(late.append)
    pipeline.ingest("vllm", [ev.RequestFinished(ts=1.0, request_id="a", ttft=0.1,
                                                prompt_tokens=1)])
    assert [r.request_id for r in early] == ["a"] and late == []
    pipeline.publish_settled(everything=True)
    assert [r.request_id for r in early] == ["a", "a"] and [r.request_id for r in late] == ["a"]


def test_a_finish_alone_dates_its_arrival_back_by_the_ttft_but_never_before_1970():
    """Without a start, arrival = finish - TTFT: 100 - 0.5 = 99.5; a TTFT of 1,000 s at 100
    would be -900 (which OTLP cannot carry): 0."""
    pipeline = Pipeline()
    pipeline.ingest("e", [ev.RequestFinished(ts=100.0, request_id=rid, ttft=ttft, prompt_tokens=1)
                          for rid, ttft in (("a", 0.5), ("b", 1000.0))])
    assert [pipeline.requests.get(rid).arrival for rid in "ab"] == [99.5, 0.0]


def test_a_lookup_counts_misses_in_its_own_engines_tiers_only():
    """Engine "ref" reports gpu, cpu and disk tiers; vLLM's tap ("vllm") names the tiers it
    consulted, gpu and cpu, with no hits: its 10 blocks miss in gpu and cpu (10 each), not in
    the disk tier vLLM does not have (they once counted 10 disk misses). ref's own lookup of
    4 blocks, 1 found on disk, counts 4 gpu and 4 cpu misses, 1 disk hit and 3 disk misses
    (the blocks found nowhere)."""
    pipeline = Pipeline()
    pipeline.ingest("ref", [ev.TierSnapshot(ts=1.0, tier=t, capacity_bytes=1, resident_bytes=0,
                                            capacity_blocks=1, resident_blocks=0)
                            for t in ("gpu", "cpu", "disk")])
    pipeline.ingest("vllm", [ev.Lookup(ts=1.0, request_id="v", tokens={"recompute": 160},
                                       blocks=10, block_hits={"gpu": 0, "cpu": 0})])
    assert pipeline.snapshot().lookup_blocks == {("gpu", "hit"): 0, ("gpu", "miss"): 10,
                                                 ("cpu", "hit"): 0, ("cpu", "miss"): 10}
    pipeline.ingest("ref", [ev.Lookup(ts=1.0, request_id="r", tokens={"disk": 16, "recompute": 48},
                                      blocks=4, block_hits={"disk": 1})])
    assert pipeline.snapshot().lookup_blocks == {
        ("gpu", "hit"): 0, ("gpu", "miss"): 14, ("cpu", "hit"): 0, ("cpu", "miss"): 14,
        ("disk", "hit"): 1, ("disk", "miss"): 3}


def test_a_joined_source_reusing_a_request_id_later_makes_a_new_request():
    """vLLM's tap strips vLLM's suffix, so a client's X-Request-Id may come back: a start
    after the first request's finish (160 > 100.5) is a new request, not the first one's
    record (which a joined source's late events may still complete): 2 requests, the first
    record intact."""
    pipeline = Pipeline()
    pipeline.join("vllm", 6.0)
    pipeline.ingest("vllm", [
        ev.RequestStarted(ts=100.0, request_id="r1", prompt_tokens=10),
        ev.RequestFinished(ts=100.5, request_id="r1", ttft=0.2, prompt_tokens=10)])
    first = pipeline.requests.get("r1")
    pipeline.ingest("vllm", [
        ev.RequestStarted(ts=160.0, request_id="r1", prompt_tokens=999),
        ev.Lookup(ts=160.0, request_id="r1", tokens={"gpu": 999}),
        ev.RequestFinished(ts=163.0, request_id="r1", ttft=2.0, prompt_tokens=999)])
    pipeline.publish_settled(everything=True)
    assert pipeline.snapshot().requests == 2
    assert (first.arrival, first.finished, first.prompt_tokens, first.tokens) == (
        100.0, 100.5, 10, {})
    assert pipeline.requests.get("r1").prompt_tokens == 999


def test_a_late_load_of_a_reused_id_joins_the_request_under_way_at_its_start():
    """A client reuses id R: request 1 runs 100-101, request 2 starts at 102. The worker's load
    stamped 100.5 arrives while request 2 is in flight: it is request 1's (under way at 100.5),
    where it once went to request 2, which started 1.5 s after it. Request 2's own load at 102.5
    still joins request 2."""
    records = []
    pipeline = Pipeline(join_window=3600.0)
    pipeline.subscribe(records.append)

    def load(ts):
        return ev.Transfer(ts=ts, src="cpu", dst="gpu", blocks=4, bytes=4096, duration=0.05,
                           request_id="R")

    pipeline.ingest("vllm", [ev.RequestStarted(ts=100.0, request_id="R", prompt_tokens=10),
                             ev.RequestFinished(ts=101.0, request_id="R", ttft=0.2,
                                                prompt_tokens=10)])
    pipeline.ingest("vllm", [ev.RequestStarted(ts=102.0, request_id="R", prompt_tokens=20)])
    pipeline.ingest("worker", [load(100.5), load(102.5)], scope="vllm")
    pipeline.ingest("vllm", [ev.RequestFinished(ts=103.0, request_id="R", ttft=0.3,
                                                prompt_tokens=20)])
    pipeline.publish_settled(everything=True)
    first, second = records
    assert (first.arrival, [t.start for t in first.transfers]) == (100.0, [100.5])
    assert (second.arrival, [t.start for t in second.transfers]) == (102.0, [102.5])


def test_a_span_joins_a_record_whose_start_went_missing():
    """The tap's start of r never arrived (its emitter dropped it), so r's record dates its
    arrival from its finish: 101.0 - 0.05 = 100.95. vLLM's span of r runs 100.0-101.0: it
    starts before that arrival, yet is about r (under way 100.95-101.0). One request, amended
    by the span (TTFT 0.3), where the span once made a second (2 counted, TTFT sum 0.35)."""
    pipeline = Pipeline()
    pipeline.join("vllm", 6.0)
    pipeline.ingest("vllm", [ev.RequestFinished(ts=101.0, request_id="r", ttft=0.05,
                                                prompt_tokens=100, output_tokens=5)])
    amended = pipeline.report(
        "vllm", "ab" * 16, ev.RequestStarted(ts=100.0, request_id="r", prompt_tokens=100),
        ev.RequestFinished(ts=101.0, request_id="r", ttft=0.3, prompt_tokens=100))
    pipeline.publish_settled(everything=True)
    snap = pipeline.snapshot()
    assert amended and snap.requests == 1
    record = pipeline.requests.get("r")
    assert (record.ttft, record.trace_id, record.output_tokens) == (0.3, "ab" * 16, 5)


@pytest.mark.parametrize("tap_saw_r1", [False, True])
def test_a_span_of_a_reused_id_never_joins_the_request_after_it(tap_saw_r1):
    """R1 runs 100.0-101.0, R2 of the same id arrives 0.5 ms after R1's finish (101.0005-102.0);
    R1's span (100.0-101.0) comes after both. It shares no time with R2, so it never amends R2:
    with no record of R1 it makes its own request, and with R1's record (its start lost: its
    arrival 101.0 - 0.05 = 100.95) it amends that one. A review found R2 taking R1's TTFT."""
    records = []
    pipeline = Pipeline()
    pipeline.join("vllm", 6.0)
    pipeline.subscribe(records.append)
    if tap_saw_r1:
        pipeline.ingest("vllm", [ev.RequestFinished(ts=101.0, request_id="R", ttft=0.05,
                                                    prompt_tokens=10)])
    pipeline.ingest("vllm", [ev.RequestStarted(ts=101.0005, request_id="R", prompt_tokens=20),
                             ev.RequestFinished(ts=102.0, request_id="R", ttft=0.2,
                                                prompt_tokens=20)])
    amended = pipeline.report(
        "vllm", "aa" * 16, ev.RequestStarted(ts=100.0, request_id="R", prompt_tokens=10,
                                             trace_id="aa" * 16),
        ev.RequestFinished(ts=101.0, request_id="R", ttft=0.7, prompt_tokens=10))
    pipeline.publish_settled(everything=True)
    assert amended is tap_saw_r1 and pipeline.snapshot().requests == 2
    r1, r2 = sorted(records, key=lambda r: r.arrival)
    assert (r2.arrival, r2.ttft) == (101.0005, 0.2) and r2.trace_id != "aa" * 16
    assert (r1.ttft, r1.trace_id) == (0.7, "aa" * 16)


def test_a_span_joins_an_aborted_record_and_a_zero_length_span_a_restored_one():
    """An aborted request whose start was lost has arrival = finish (TTFT 0): a record of no
    length at 101.0, inside its span 100.0-101.0, which joins it (one request). A span of no
    length at 100.5 joins the record under way then even from the table (a restored record,
    past the recent ones), as it does a recent one. A review found both made second
    requests when the rule asked for time shared."""
    pipeline = Pipeline()
    pipeline.join("vllm", 6.0)
    pipeline.ingest("vllm", [ev.RequestFinished(ts=101.0, request_id="a", ttft=0.0,
                                                prompt_tokens=10)])
    assert pipeline.report("vllm", "aa" * 16,
                           ev.RequestStarted(ts=100.0, request_id="a", prompt_tokens=10),
                           ev.RequestFinished(ts=101.0, request_id="a", ttft=0.3, prompt_tokens=10))
    restored = RequestRecord("b", "bb" * 16, "vllm", 100.0, prompt_tokens=10, ttft=0.2,
                             finished=101.0)
    pipeline.restore([restored])
    assert pipeline.report("vllm", "cc" * 16,
                           ev.RequestStarted(ts=100.5, request_id="b", prompt_tokens=10),
                           ev.RequestFinished(ts=100.5, request_id="b", ttft=0.0, prompt_tokens=10))
    pipeline.publish_settled(everything=True)
    assert pipeline.snapshot().requests == 1 and restored.trace_id == "cc" * 16


def test_a_prefill_rate_under_one_token_per_second_counts_as_unknown():
    """A rate of 5e-324 tokens/s is a valid float: 16 tokens over it made the seconds saved
    infinite, for good. Under 1 token/s the configured rate is used: 16 / 10,000 + 16 / 10,000
    (the second lookup at 0, unknown) = 0.0032 s."""
    pipeline = Pipeline(prefill_tokens_per_second=10_000.0)
    pipeline.ingest("e", [ev.Lookup(ts=1.0, request_id=f"r{i}", tokens={"gpu": 16},
                                    prefill_tokens_per_second=rate)
                          for i, rate in enumerate((5e-324, 0.0))])
    assert pipeline.snapshot().prefill_seconds_saved == {"gpu": 0.0032}


def test_joined_requests_reach_the_subscribers_once_their_wait_is_over():
    """A source joined for an hour (a span receiver's wait) holds its records back; one joined
    for 0 s hands them over at the next call (the agent calls once a second)."""
    records = []
    pipeline = Pipeline()
    pipeline.subscribe(records.append)
    pipeline.join("slow", 3600.0)
    pipeline.join("quick", 0.0)
    for source in ("slow", "quick"):
        pipeline.ingest(source, [ev.RequestFinished(ts=1.0, request_id=source, ttft=0.1,
                                                    prompt_tokens=1)])
    pipeline.publish_settled()
    assert [r.request_id for r in records] == ["quick"]
    assert pipeline.requests.get("slow") is not None  # in the table all along
    pipeline.publish_settled(everything=True)
    assert [r.request_id for r in records] == ["quick", "slow"]


def test_a_sampled_eviction_counts_its_blocks_once_and_stands_for_weight_in_histograms():
    """A tap tracking 1 in 4 blocks' ages sends 3 tracked blocks with weight 4 and 9 untracked
    ones unmeasured: 12 blocks evicted; the histograms hold 3 x 4 = 12 observations, all at
    age 5 s and 0 hits (the Horvitz-Thompson estimate of the 12)."""
    pipeline = Pipeline()
    pipeline.ingest("vllm", [
        ev.Eviction(ts=1.0, tier="cpu", blocks=3, bytes=300, age=5.0, hits=0, weight=4),
        ev.Eviction(ts=1.0, tier="cpu", blocks=9, bytes=900, age=0.0, hits=0, measured=False)])
    snap = pipeline.snapshot()
    assert snap.evicted_blocks == {("cpu", "capacity"): 12} and snap.dropped_blocks == {"cpu": 12}
    assert snap.evicted_block_hits["cpu"].counts[0] == 12
    residency = snap.block_residency_seconds["cpu"]
    assert residency.count == 12 and residency.sum == 60.0


def _mixed_batch():
    a = "a" * 32
    return [
        ev.TierSnapshot(ts=1.0, tier="cpu", capacity_bytes=100, resident_bytes=0,
                        capacity_blocks=10, resident_blocks=0),
        ev.RequestStarted(ts=1.0, request_id="A", prompt_tokens=160, trace_id=a),
        ev.Lookup(ts=1.0, request_id="A", tokens={"gpu": 64, "cpu": 48, "recompute": 48},
                  blocks=10, block_hits={"gpu": 4, "cpu": 3}),
        ev.Lookup(ts=1.0, request_id="B", tokens={"disk": 32, "recompute": 64}, blocks=6,
                  block_hits={"disk": 2}, prefill_tokens_per_second=1000.0),
        ev.Lookup(ts=1.0, request_id="C", tokens={"recompute": 80}, blocks=5),
        ev.Transfer(ts=1.1, src="cpu", dst="gpu", blocks=2, bytes=20, duration=0.002,
                    request_id="A"),
        ev.Transfer(ts=1.2, src="disk", dst="cpu", blocks=3, bytes=30, duration=0.0,
                    timed=False, sees_failures=False),
        ev.Transfer(ts=1.3, src="cpu", dst="gpu", blocks=1, bytes=10, duration=0.001, ok=False,
                    reason="cosmic-ray", request_id="A"),
        ev.Transfer(ts=1.4, src="cpu", dst="gpu", blocks=4, bytes=40, duration=0.003),
        ev.Eviction(ts=1.5, tier="gpu", blocks=2, bytes=20, age=1.0, hits=0, offloaded=True),
        ev.Eviction(ts=1.5, tier="gpu", blocks=1, bytes=10, age=5.0, hits=3, weight=4),
        ev.Eviction(ts=1.5, tier="cpu", blocks=7, bytes=70, age=0.0, hits=0, reason="cleared",
                    measured=False),
        ev.RequestFinished(ts=2.0, request_id="A", ttft=0.5, prompt_tokens=160),
    ]


def test_a_batch_of_mixed_kinds_folds_each_event_by_its_own_fields():
    """One batch, hand-counted. Tiers known from snapshots: cpu. Lookups cascade top down over
    the known tiers and those a lookup's hits name:
    A (10 blocks): gpu 4 hit, 6 miss; cpu 3 hit, 3 miss.
    B (6 blocks): cpu 0 hit, 6 miss; disk 2 hit, 4 miss (gpu neither known nor named).
    C (5 blocks): cpu 0 hit, 5 miss.
    Totals: gpu 4/6, cpu 3/14, disk 2/4. Saved prefill at each lookup's own rate (the
    pipeline's 10,000 tokens/s when 0): gpu 64/10,000, cpu 48/10,000, disk 32/1,000.
    Transfers: cpu->gpu 2 + 4 blocks (20 + 40 bytes) timed at 0.002 and 0.003 s, both in the
    0.005 s bucket, whose exemplar is A's (the 0.003 s one has no request); disk->cpu 3 blocks
    untimed, from a source blind to failures; the failed one counts under "other", and every
    other reason of cpu->gpu at 0, none of disk->cpu (not measured). Evictions: gpu capacity
    2 + 1 blocks, 1 dropped; hits histogram 2 at 0 and 1 x 4 at 3 (sum 12); residency sum
    2 x 1 + 4 x 5 = 22; cpu cleared 7, dropped, unmeasured. A's record lists its two
    transfers in arrival order."""
    pipeline = Pipeline(prefill_tokens_per_second=10_000.0)
    pipeline.ingest("e", _mixed_batch())
    snap = pipeline.snapshot()
    assert snap.lookup_blocks == {("gpu", "hit"): 4, ("gpu", "miss"): 6, ("cpu", "hit"): 3,
                                  ("cpu", "miss"): 14, ("disk", "hit"): 2, ("disk", "miss"): 4}
    assert snap.prompt_tokens == {"gpu": 64, "cpu": 48, "disk": 32, "recompute": 192}
    assert snap.prefill_seconds_saved == {"gpu": 64 / 10_000, "cpu": 48 / 10_000,
                                          "disk": 32 / 1_000}
    assert snap.transfer_bytes == {CPU_GPU: 60, ("disk", "cpu"): 30}
    assert snap.transfer_blocks == {CPU_GPU: 6, ("disk", "cpu"): 3}
    assert snap.transfer_failures == {**_every_reason(CPU_GPU), ("cpu", "gpu", "other"): 1}
    hist = snap.transfer_seconds[CPU_GPU]
    assert list(snap.transfer_seconds) == [CPU_GPU] and hist.count == 2
    assert hist.counts[hist.buckets.index(0.005)] == 2
    assert hist.exemplars == {hist.buckets.index(0.005): ("a" * 32, 0.002, 1.1)}
    assert snap.evicted_blocks == {("gpu", "capacity"): 3, ("cpu", "cleared"): 7}
    assert snap.dropped_blocks == {"gpu": 1, "cpu": 7}
    hits = snap.evicted_block_hits["gpu"]
    assert (hits.counts[0], hits.count, hits.sum) == (2, 6, 12)
    assert snap.block_residency_seconds["gpu"].sum == 22
    assert list(snap.evicted_block_hits) == ["gpu"]
    record = pipeline.requests.get("A")
    assert [(t.src, t.ok) for t in record.transfers] == [("cpu", True), ("cpu", False)]
    assert record.tokens == {"gpu": 64, "cpu": 48, "recompute": 48}
    assert snap.events_received == {"e": 13}


def test_folding_a_batch_at_once_equals_folding_its_events_one_at_a_time():
    batch, one_by_one = Pipeline(), Pipeline()
    batch.ingest("e", _mixed_batch())
    for event in _mixed_batch():
        one_by_one.ingest("e", [event])
    whole, single = batch.snapshot(), one_by_one.snapshot()
    for name in ("lookup_blocks", "prompt_tokens", "transfer_bytes", "transfer_blocks",
                 "transfer_failures", "evicted_blocks", "dropped_blocks", "events_received"):
        assert getattr(whole, name) == getattr(single, name), name
    for name in ("transfer_seconds", "evicted_block_hits", "block_residency_seconds"):
        assert ({k: (h.counts, h.sum, h.exemplars) for k, h in getattr(whole, name).items()}
                == {k: (h.counts, h.sum, h.exemplars) for k, h in getattr(single, name).items()})
    assert batch.requests.get("A") == one_by_one.requests.get("A")


def test_a_worker_tap_first_heard_after_a_request_finished_still_joins_its_transfer():
    """The scheduler's request s1 finishes before the agent has heard anything from the worker
    tap (so nothing told it to wait for joins); the worker's load for s1 comes next and still
    lands in s1's record."""
    pipeline = Pipeline()
    pipeline.ingest("sched", [
        ev.RequestStarted(ts=1.0, request_id="s1", prompt_tokens=64),
        ev.RequestFinished(ts=1.5, request_id="s1", ttft=0.5, prompt_tokens=64)])
    pipeline.ingest("worker0", [ev.Transfer(ts=1.1, src="cpu", dst="gpu", blocks=2, bytes=20,
                                            duration=0.01, request_id="s1")], scope="sched")
    assert [t.blocks for t in pipeline.requests.get("s1").transfers] == [2]
    assert pipeline.snapshot().requests == 1


def test_a_request_finishing_far_ahead_of_the_clock_is_dropped_as_invalid(caplog):
    """A request said to finish in 2099 sorted first in the table for good, and a restarted
    agent's store refused it (more than an hour ahead): the pipeline now drops it as invalid
    from the start, as one that started in 2096 and finished now (first by arrival). One
    finishing 10 minutes ahead (a clock step) is kept. Of the 4 events, the 2 finishes dropped
    are not also received (they were counted both ways), and the drop is logged once."""
    pipeline = Pipeline()
    now = time.time()
    pipeline.ingest("engine", [ev.RequestStarted(ts=3_980_000_000.0, request_id="early",
                                                 prompt_tokens=8)] + [
        ev.RequestFinished(ts=ts, request_id=rid, ttft=0.1, prompt_tokens=8)
        for rid, ts in (("far", 4_070_000_000.0), ("near", now + 600), ("early", now))])
    assert pipeline.requests.get("far") is None and pipeline.requests.get("early") is None
    assert pipeline.requests.get("near") is not None
    snap = pipeline.snapshot()
    assert snap.events_dropped == {("engine", "invalid"): 2} and snap.requests == 1
    assert snap.events_received == {"engine": 2}
    pipeline.ingest("engine", [ev.RequestFinished(ts=4_070_000_000.0, request_id="far2", ttft=0.1,
                                                  prompt_tokens=8)])
    warned = [r.getMessage() for r in caplog.records if "ahead of this host's clock" in r.message]
    assert len(warned) == 1 and "dropped 2 finished requests of source 'engine'" in warned[0]


def test_tier_snapshots_of_several_engines_add_up():
    """Taps dp0 and dp1 (one per engine) report their cpu tiers: 1000 + 3000 bytes of capacity,
    100 + 300 resident. The last report used to replace the other (3000). Then dp0 reports 500
    resident: its own share changes (500 + 300), dp1's stays."""
    pipeline = Pipeline()

    def snap(source, capacity, resident):
        pipeline.ingest(source, [ev.TierSnapshot(ts=1.0, tier="cpu", capacity_bytes=capacity,
                                                 resident_bytes=resident,
                                                 capacity_blocks=capacity // 10,
                                                 resident_blocks=resident // 10)])

    snap("dp0", 1000, 100)
    snap("dp1", 3000, 300)
    cpu = pipeline.snapshot().tiers["cpu"]
    assert (cpu.capacity_bytes, cpu.resident_bytes, cpu.capacity_blocks,
            cpu.resident_blocks) == (4000, 400, 400, 40)
    snap("dp0", 1000, 500)
    cpu = pipeline.snapshot().tiers["cpu"]
    assert (cpu.capacity_bytes, cpu.resident_bytes) == (4000, 800)


def test_a_residency_no_sender_reports_is_not_measured_never_0():
    """KV events without block_bytes know a tier's blocks, not their bytes, and vLLM's /metrics
    its capacity alone: kvscope_tier_resident_bytes read 0 beside 600 resident blocks, and the
    dashboard drew the tier empty. A residency nobody reports is now absent (/metrics, the
    samples) and null (/api/v1/summary, with a capacity of 0: unknown); a capacity-only
    sender adds to another's residency (4096 blocks, 600 of them held), and one that knows
    the blocks' size is summed as before."""
    pipeline = Pipeline()
    pipeline.ingest("kv_events", [ev.TierSnapshot(ts=1.0, tier="cpu", capacity_bytes=0,
                                                  resident_bytes=None, capacity_blocks=0,
                                                  resident_blocks=600)])
    pipeline.ingest("vllm_metrics", [ev.TierSnapshot(ts=1.0, tier="cpu", capacity_bytes=0,
                                                     resident_bytes=None, capacity_blocks=4096,
                                                     resident_blocks=None)])
    cpu = pipeline.snapshot().tiers["cpu"]
    assert (cpu.capacity_blocks, cpu.resident_blocks, cpu.resident_bytes) == (4096, 600, None)
    samples = snapshot_samples(pipeline.snapshot())
    assert samples[catalog.TIER_RESIDENT_BLOCKS] == [(["cpu"], 600)]
    assert samples[catalog.TIER_RESIDENT_BYTES] == [] and samples[catalog.TIER_CAPACITY_BYTES] == []
    sample = pipeline.record_sample(2.0, None)
    assert sample["tier_resident_bytes"] == {} and sample["tier_resident_blocks"] == {"cpu": 600}
    pipeline.ingest("tap", [ev.TierSnapshot(ts=1.0, tier="cpu", capacity_bytes=1000,
                                            resident_bytes=100, capacity_blocks=10,
                                            resident_blocks=1)])
    cpu = pipeline.snapshot().tiers["cpu"]
    assert (cpu.capacity_bytes, cpu.resident_bytes, cpu.resident_blocks) == (1000, 100, 601)


def test_a_scoped_taps_tier_snapshot_adds_to_its_scopes_own():
    """Source sched reports 100 bytes of cpu capacity, its worker (scope sched) 50: 150, where
    the worker's report once replaced the scheduler's (kept under the scope's name). The
    scope's lookups still count misses in the tiers either reported (cpu: 2 misses)."""
    pipeline = Pipeline()
    for source, scope, capacity in (("sched", None, 100), ("worker", "sched", 50)):
        pipeline.ingest(source, [ev.TierSnapshot(ts=1.0, tier="cpu", capacity_bytes=capacity,
                                                 resident_bytes=0, capacity_blocks=1,
                                                 resident_blocks=0)], scope=scope)
    pipeline.ingest("sched", [ev.Lookup(ts=1.0, request_id="r", tokens={"recompute": 32},
                                        blocks=2)])
    snap = pipeline.snapshot()
    assert snap.tiers["cpu"].capacity_bytes == 150
    assert snap.lookup_blocks[("cpu", "miss")] == 2


@pytest.mark.parametrize("trace_id", ['a"b\n} 1 # x', "AB" * 16, "0" * 32, "g" * 32])
def test_a_trace_id_that_is_not_w3c_is_taken_as_none(trace_id):
    """A tap's trace id that is not 32 lowercase hex digits, or is all zeros (W3C Trace Context
    3.2.2.3: invalid), became the TTFT exemplar's label as it was (a quote and a newline broke
    prometheus_client's own parser); it is taken as absent, and the agent makes one."""
    pipeline = Pipeline()
    pipeline.ingest("engine", [
        ev.RequestStarted(ts=1.0, request_id="r", prompt_tokens=8, trace_id=trace_id),
        ev.RequestFinished(ts=1.5, request_id="r", ttft=0.5, prompt_tokens=8)])
    made = pipeline.requests.get("r").trace_id
    assert made != trace_id and len(made) == 32 and int(made, 16) > 0
    assert [e[0] for e in pipeline.snapshot().ttft_seconds.exemplars.values()] == [made]


def test_the_recently_finished_requests_are_bounded_in_records_not_ids():
    """``max_recent`` 100: a source reusing 10 ids 30 times each (300 finishes, one id after
    the other). Its newest 100 records span 4 ids (id6's last 10, id7 to id9); ids leave
    whole, oldest first, so id6 goes and 90 records of 3 ids stay. The bound once counted
    ids: all 10 stayed, up to MAX_REUSES records each."""
    assert MAX_REUSES >= 30
    assembler = RequestAssembler(max_recent=100)
    for n in range(300):
        assembler.finished("engine", [ev.RequestFinished(
            ts=1.0 + n, request_id=f"id{n // 30}", ttft=0.1, prompt_tokens=1)])
    kept = [rid for rid in (f"id{i}" for i in range(10))
            if assembler.finished_recently("engine", rid, 1.0 + 30 * int(rid[2:]) + 29)]
    assert kept == ["id7", "id8", "id9"]


def test_a_batch_folds_in_the_order_its_events_came():
    """One batch: request X starts, finishes, and a second request of id X comes without a
    start (its start went missing): its lookup (32 recompute tokens) and load are the second
    request's, never the first's, and its finish makes it the second request (2 in all). A
    lookup of 4 blocks before engine e's first tier snapshot (cpu) counts no cpu misses; the
    same lookup after it counts 4."""
    pipeline, records = Pipeline(), []
    pipeline.subscribe(records.append)
    pipeline.ingest("e", [
        ev.RequestStarted(ts=1.0, request_id="X", prompt_tokens=16),
        ev.Lookup(ts=1.0, request_id="X", tokens={"gpu": 16}),
        ev.RequestFinished(ts=1.5, request_id="X", ttft=0.5, prompt_tokens=16),
        ev.Lookup(ts=2.0, request_id="X", tokens={"recompute": 32}),
        ev.Transfer(ts=2.1, src="cpu", dst="gpu", blocks=1, bytes=8, duration=0.01,
                    request_id="X"),
        ev.RequestFinished(ts=2.5, request_id="X", ttft=0.4, prompt_tokens=32),
    ])
    first, second = records  # the table keeps the newest of an id: the second
    assert (first.tokens, first.transfers, first.finished) == ({"gpu": 16}, (), 1.5)
    assert second.tokens == {"recompute": 32} and [t.start for t in second.transfers] == [2.1]
    assert pipeline.snapshot().requests == 2 and pipeline.requests.get("X") is second

    def lookup():
        return ev.Lookup(ts=3.0, request_id="", tokens={"recompute": 64}, blocks=4)

    snapshot = ev.TierSnapshot(ts=3.0, tier="cpu", capacity_bytes=1, resident_bytes=0,
                               capacity_blocks=1, resident_blocks=0)
    pipeline.ingest("f", [lookup(), snapshot])
    assert pipeline.snapshot().lookup_blocks == {}
    pipeline.ingest("f", [lookup()])
    assert pipeline.snapshot().lookup_blocks == {("cpu", "hit"): 0, ("cpu", "miss"): 4}


def test_scheduler_stats_are_kept_per_source_and_absent_until_reported():
    """Two senders. "vllm": waiting 3, running 2, 1 preemption, 40% of its GPU KV cache; then
    waiting 0 and 2 more preemptions, running and usage not said (kept: 2, 0.4). "engine" never
    reports preemptions (it has none to count): no series, not 0; its waiting 5, running 1,
    usage 0.25. Preemptions add up: 1 + 2 = 3. Once "engine"'s emitter closes, its gauges
    leave; "vllm"'s counter and gauges stay. A pipeline nobody reported to has none."""
    pipeline = Pipeline()
    assert (pipeline.snapshot().requests_waiting, pipeline.snapshot().preemptions) == ({}, {})
    pipeline.ingest("vllm", [
        ev.SchedulerStats(ts=1.0, waiting=3, running=2, preemptions=1, gpu_kv_usage=0.4),
        ev.SchedulerStats(ts=2.0, waiting=0, preemptions=2)])
    pipeline.ingest("engine", [ev.SchedulerStats(ts=2.0, waiting=5, running=1,
                                                 gpu_kv_usage=0.25)])
    snap = pipeline.snapshot()
    assert snap.requests_waiting == {"vllm": 0, "engine": 5}
    assert snap.requests_running == {"vllm": 2, "engine": 1}
    assert snap.preemptions == {"vllm": 3}
    assert snap.gpu_kv_cache_usage == {"vllm": 0.4, "engine": 0.25}
    pipeline.forget_tiers("engine")
    pipeline.forget_tiers("vllm")
    pipeline.ingest("vllm", [ev.SchedulerStats(ts=3.0, waiting=7)])  # it came back
    snap = pipeline.snapshot()
    assert (snap.requests_waiting, snap.requests_running, snap.gpu_kv_cache_usage,
            snap.preemptions) == ({"vllm": 7}, {}, {}, {"vllm": 3})
    sample = pipeline.record_sample(4.0, None)
    assert (sample["requests_waiting"], sample["requests_running"], sample["preemptions"],
            sample["gpu_kv_cache_usage_ratio"]) == ({"vllm": 7}, {}, {"vllm": 3}, {})


def test_idle_time_before_eviction_is_absent_where_no_source_measures_it():
    """cpu: a sampled chunk of 2 blocks standing for 4 each (8 observations of 30 s) and one
    block of 0.5 s; gpu: evictions without ``idle`` (KV events: unmeasured; a sender that
    does not see it) make no idle histogram, not one of zeros, though they count as
    evictions."""
    pipeline = Pipeline()
    pipeline.ingest("vllm", [
        ev.Eviction(ts=1.0, tier="cpu", blocks=2, bytes=64, age=40.0, hits=1, weight=4,
                    idle=30.0),
        ev.Eviction(ts=1.0, tier="cpu", blocks=1, bytes=32, age=0.5, hits=0, idle=0.5),
        ev.Eviction(ts=1.0, tier="gpu", blocks=3, bytes=96, age=0.0, hits=0, measured=False),
        ev.Eviction(ts=1.0, tier="gpu", blocks=1, bytes=32, age=2.0, hits=0)])
    snap = pipeline.snapshot()
    assert list(snap.block_idle_seconds) == ["cpu"]
    idle = snap.block_idle_seconds["cpu"]
    by_bound = dict(zip((*idle.buckets, float("inf")), idle.counts))
    assert (by_bound[1.0], by_bound[60.0], idle.count, idle.sum) == (1, 8, 9, 240.5)
    assert snap.evicted_blocks == {("cpu", "capacity"): 3, ("gpu", "capacity"): 4}


def test_store_admissions_add_up_per_tier_and_result_and_a_none_stays_absent():
    """The engine's two cpu deltas (2 stored, 1 skipped; then 1 stored, 3 skipped, 0 failed)
    and one of disk (1 failed, stored 0), and vLLM's metrics source's cpu skipped 4 (stored and
    failed None: not seen). cpu: 3 stored, 8 skipped, 0 failed; disk: 0 stored, 0 skipped, 1
    failed; a tier (gpu) outside the events has no series."""
    pipeline = Pipeline()
    pipeline.ingest("engine", [
        ev.Admission(ts=1.0, tier="cpu", stored=2, skipped=1, failed=0),
        ev.Admission(ts=2.0, tier="disk", stored=0, skipped=0, failed=1),
        ev.Admission(ts=3.0, tier="cpu", stored=1, skipped=3, failed=0)])
    pipeline.ingest("vllm_metrics", [ev.Admission(ts=3.0, tier="cpu", skipped=4)])
    assert pipeline.snapshot().store_admissions == {
        ("cpu", "stored"): 3, ("cpu", "skipped"): 8, ("cpu", "failed"): 0,
        ("disk", "stored"): 0, ("disk", "skipped"): 0, ("disk", "failed"): 1}
    pipeline = Pipeline()
    pipeline.ingest("vllm_metrics", [ev.Admission(ts=3.0, tier="cpu", skipped=4)])
    assert pipeline.snapshot().store_admissions == {("cpu", "skipped"): 4}


def test_transfers_in_flight_are_each_senders_last_report_and_leave_with_it():
    """"vllm" reports 2 stores (5 blocks) then 1 (2 blocks) in flight, and 1 load (4 blocks);
    "engine" 0 stores. Each sender's last report per direction stands; "engine"'s leave once
    its emitter closes, "vllm"'s stay. /metrics shows them per source and direction."""
    pipeline = Pipeline()
    assert pipeline.snapshot().transfers_in_flight == {}
    pipeline.ingest("vllm", [
        ev.TransfersInFlight(ts=1.0, src="gpu", dst="cpu", transfers=2, blocks=5),
        ev.TransfersInFlight(ts=1.0, src="cpu", dst="gpu", transfers=1, blocks=4),
        ev.TransfersInFlight(ts=2.0, src="gpu", dst="cpu", transfers=1, blocks=2)])
    pipeline.ingest("engine", [ev.TransfersInFlight(ts=2.0, src="gpu", dst="cpu", transfers=0,
                                                    blocks=0)])
    snap = pipeline.snapshot()
    assert snap.transfers_in_flight == {("vllm", "gpu", "cpu"): 1, ("vllm", "cpu", "gpu"): 1,
                                        ("engine", "gpu", "cpu"): 0}
    assert snap.transfer_blocks_in_flight == {("vllm", "gpu", "cpu"): 2,
                                              ("vllm", "cpu", "gpu"): 4,
                                              ("engine", "gpu", "cpu"): 0}
    samples = snapshot_samples(snap)
    assert sorted(samples[catalog.TRANSFER_BLOCKS_IN_FLIGHT]) == [
        (["engine", "gpu", "cpu"], 0), (["vllm", "cpu", "gpu"], 4), (["vllm", "gpu", "cpu"], 2)]
    pipeline.forget_tiers("engine")
    assert pipeline.snapshot().transfers_in_flight == {("vllm", "gpu", "cpu"): 1,
                                                       ("vllm", "cpu", "gpu"): 1}


def test_a_token_source_is_exported_from_the_first_lookup_that_measures_it_never_before():
    """An agent whose sources report no prompt tokens (Dynamo KVBM's counters are transfers
    only) exports none: not measured, never 0 tokens/s. A lookup exports the sources it
    measures, at 0 until they have tokens (so rate() sees their first ones): those it names in
    ``tokens`` (0 included), recompute (the rest of every prompt), the tiers it names in
    ``block_hits`` and those its engine reports in snapshots. So LMCache's 8 cpu tokens show
    cpu 8 and recompute 0, and no gpu (LMCache never sees the engine's GPU hits) nor disk (no
    such tier); a vLLM scrape naming gpu with 0 adds gpu 0, a tap's lookup naming disk in its
    block hits adds disk 0, and an engine reporting a disk tier does as well."""
    pipeline = Pipeline()
    pipeline.ingest("kvbm", [ev.Transfer(ts=1.0, src="gpu", dst="cpu", blocks=1, bytes=0,
                                         duration=0.0, timed=False)])
    assert pipeline.snapshot().prompt_tokens == {}
    assert snapshot_samples(pipeline.snapshot())[catalog.PROMPT_TOKENS] == []
    pipeline.ingest("lmcache", [ev.Lookup(ts=2.0, request_id="", tokens={"cpu": 8})])
    assert pipeline.snapshot().prompt_tokens == {"cpu": 8, "recompute": 0}
    pipeline.ingest("vllm", [ev.Lookup(ts=3.0, request_id="", tokens={"gpu": 0, "cpu": 4})])
    assert pipeline.snapshot().prompt_tokens == {"cpu": 12, "recompute": 0, "gpu": 0}
    pipeline.ingest("tap", [ev.Lookup(ts=4.0, request_id="", tokens={"recompute": 16},
                                      blocks=1, block_hits={"gpu": 0, "cpu": 0, "disk": 0})])
    assert pipeline.snapshot().prompt_tokens == {"cpu": 12, "recompute": 16, "gpu": 0,
                                                 "disk": 0}
    other = Pipeline()
    other.ingest("ref", [ev.TierSnapshot(ts=1.0, tier="disk", capacity_bytes=1,
                                         resident_bytes=0, capacity_blocks=1, resident_blocks=0),
                         ev.Lookup(ts=2.0, request_id="", tokens={"recompute": 16})])
    assert other.snapshot().prompt_tokens == {"recompute": 16, "disk": 0}


def test_a_sources_finished_requests_measure_the_prefill_rate_its_lookups_lack():
    """vLLM's tap sends lookups without a prefill rate: the seconds saved were priced at the
    agent's assumed rate (a tryout's card read 19.5x saved per transfer second where kvscope
    compare measured 4.8x). Once 10 (fold.MIN_PREFILL_REQUESTS) of the source's requests
    finished with recomputed tokens and a prefill time, their rate prices its later lookups:
    here 10 requests of 600 recomputed tokens in 0.02 s of prefill each, 6,000 tokens in
    0.2 s, 30,000 tokens/s. Before: 9 requests (not enough), each with 300 gpu tokens at the
    configured 10,000 tokens/s: 9 x 0.03 = 0.27 s; then 300 gpu tokens after the 10th:
    0.27 + 0.03 (the 10th's own lookup, before its finish) + 300 / 30,000 = 0.31 s. A lookup
    with a rate of its own keeps it (another source's 300 cpu tokens at 1,000: 0.3 s)."""
    from kvscope.agent.fold import MIN_PREFILL_REQUESTS

    assert MIN_PREFILL_REQUESTS == 10
    pipeline = Pipeline(prefill_tokens_per_second=10_000.0)
    for i in range(10):
        rid = f"r{i}"
        pipeline.ingest("vllm", [
            ev.RequestStarted(ts=100.0 + i, request_id=rid, prompt_tokens=900),
            ev.Lookup(ts=100.0 + i, request_id=rid, tokens={"gpu": 300, "recompute": 600},
                      blocks=56),
            ev.RequestFinished(ts=100.5 + i, request_id=rid, ttft=0.03, prompt_tokens=900,
                               prefill=0.02)])
        if i == 8:
            assert pipeline.snapshot().prefill_seconds_saved == {"gpu": pytest.approx(0.27)}
    pipeline.ingest("vllm", [ev.Lookup(ts=120.0, request_id="late", tokens={"gpu": 300},
                                       blocks=18)])
    pipeline.ingest("engine", [ev.Lookup(ts=120.0, request_id="x", tokens={"cpu": 300},
                                         blocks=18, prefill_tokens_per_second=1000.0)])
    assert pipeline.snapshot().prefill_seconds_saved == {"gpu": pytest.approx(0.31),
                                                         "cpu": pytest.approx(0.3)}
