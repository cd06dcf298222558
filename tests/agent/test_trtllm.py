"""The TensorRT-LLM source: its KV cache events drain and its Prometheus mapping, on what
TensorRT-LLM's serializer and metric collector print (tests/data/trtllm/, recorded by hand from
its source: see the README there), served over real HTTP on loopback with the routes and
methods of ``trtllm-serve`` (tests/trtllm_server.py), including drains that break half way.
No engine runs here: TensorRT-LLM needs CUDA."""

from __future__ import annotations

import json
import logging

import pytest

from kvscope import events as ev
from kvscope.agent.config import AgentSettings, load_settings
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources import base
from kvscope.agent.sources.base import MAX_GAP
from kvscope.agent.sources.scrape import parse
from kvscope.agent.sources.trtllm import TrtllmMetrics, TrtllmSource
from kvscope.agent.sources.trtllm_events import TrtllmResidency, decode
from kvscope.service.agent import Agent
from tests.trtllm_server import DATA, Cut, Trickle, serving_trtllm

BLOCK = 65536  # bytes of one KV block in these tests
DRAINS = [(DATA / f"drain-{i}.json").read_bytes() for i in (1, 2, 3, 4)]
TIMES = [1000.0, 1010.0, 1025.0, 1040.0]  # Unix seconds of the four drains


def kinds(events, kind):
    return [e for e in events if isinstance(e, kind)]


def test_the_recorded_drains_fold_into_residency_copies_evictions_and_admissions():
    """drain 1 (t 1000): created 100 GPU / 400 host blocks; A, B, C stored on the GPU, D (a
    child of C, priority 10). gpu 4 of 100 resident, cpu 0 of 400.
    drain 2 (t 1010): A, B 0 -> 1 (priority null), D removed, C's priority 35 -> 80 alone:
    gpu->cpu 2; GPU evictions 2 offloaded and 1 dropped, unmeasured (a GPU block's hits send
    no event); cpu admissions: stored 2, skipped 1; gpu 1 (C), cpu 2 (A, B).
    drain 3 (t 1025): A 1 -> 0, B removed from the host, a "cleared" event: cpu->gpu 1; one
    cpu eviction, measured: age 1025 - 1010 = 15 s, 0 hits, idle 15 s; gpu 2, cpu 0; one
    unknown kind.
    drain 4 (t 1040): id 12 after 9 (2 lost: gap), C removed (dropped from the GPU, skipped by
    the host), a hash never stored (ignored): gpu 1."""
    r = TrtllmResidency(block_bytes=BLOCK)
    out = [r.apply(ts, decode(body)) for ts, body in zip(TIMES, DRAINS)]
    (first, d1), (second, d2), (third, d3), (fourth, d4) = out
    assert [(s.tier, s.capacity_blocks, s.resident_blocks, s.capacity_bytes) for s in first] == [
        ("gpu", 100, 4, 100 * BLOCK), ("cpu", 400, 0, 400 * BLOCK)]
    assert not d1 and not d2
    assert [(t.src, t.dst, t.blocks, t.bytes, t.timed) for t in kinds(second, ev.Transfer)] == [
        ("gpu", "cpu", 2, 2 * BLOCK, False)]
    assert [(e.tier, e.blocks, e.offloaded, e.measured) for e in kinds(second, ev.Eviction)] == [
        ("gpu", 1, False, False), ("gpu", 2, True, False)]
    assert [(a.tier, a.stored, a.skipped, a.failed) for a in kinds(second, ev.Admission)] == [
        ("cpu", 2, 1, None)]
    assert [(s.tier, s.resident_blocks) for s in kinds(second, ev.TierSnapshot)] == [
        ("gpu", 1), ("cpu", 2)]
    assert [(t.src, t.dst, t.blocks) for t in kinds(third, ev.Transfer)] == [("cpu", "gpu", 1)]
    [evicted] = kinds(third, ev.Eviction)
    assert (evicted.tier, evicted.blocks, evicted.age, evicted.hits, evicted.idle,
            evicted.measured, evicted.offloaded) == ("cpu", 1, 15.0, 0, 15.0, True, False)
    assert kinds(third, ev.Admission) == []  # nothing left the gpu
    assert [(s.tier, s.resident_blocks) for s in kinds(third, ev.TierSnapshot)] == [
        ("gpu", 2), ("cpu", 0)]
    assert d3 == {"unknown_kind": 1}
    assert d4 == {"gap": 2}
    assert [(e.tier, e.blocks, e.offloaded) for e in kinds(fourth, ev.Eviction)] == [
        ("gpu", 1, False)]
    assert [(a.stored, a.skipped) for a in kinds(fourth, ev.Admission)] == [(0, 1)]
    assert [(s.tier, s.resident_blocks) for s in kinds(fourth, ev.TierSnapshot)] == [("gpu", 1)]
    for events in (first, second, third, fourth):
        assert [ev.validate(e) for e in events] == events


def _event(event_id, data, **envelope):
    return {"event_id": event_id, "data": data, "window_size": 2048, **envelope}


def _stored(*hashes, level=0):
    return {"type": "stored", "parent_hash": None, "blocks": [
        {"type": "stored_block", "block_hash": h, "tokens": [], "cache_level": level,
         "priority": 35} for h in hashes]}


def _moved(block_hash, old, new, priority=None):
    return {"type": "updated", "block_hash": block_hash, "priority": priority,
            "cache_level": {"type": "event_diff", "new_value": new, "old_value": old}}


def test_a_misshapen_event_costs_itself_alone_and_none_diffs_are_read():
    """One body: a stored block (1), a level move whose priority diff holds nulls (the
    serializer's diff of a None priority, TensorRT-LLM#4666), an envelope without event_id, a
    stored event whose blocks are no list, and a priority-only update with a null level.
    Kept: the store and the move (gpu->cpu 1); dropped: 2 invalid."""
    body = json.dumps([
        _event(0, _stored(1)),
        _event(1, _moved(1, 0, 1, {"type": "event_diff", "new_value": None, "old_value": None})),
        {"data": _stored(2), "window_size": 2048},
        _event(2, {"type": "stored", "parent_hash": None, "blocks": 3}),
        _event(3, {"type": "updated", "block_hash": 1, "cache_level": None,
                   "priority": {"type": "event_diff", "new_value": 0, "old_value": 35}}),
    ]).encode()
    events, drops = TrtllmResidency().apply(5.0, decode(body))
    assert drops == {"invalid": 2}
    assert [(t.src, t.dst, t.blocks) for t in kinds(events, ev.Transfer)] == [("gpu", "cpu", 1)]


def test_an_event_id_far_ahead_is_followed_and_logged_not_counted_as_lost(caplog):
    """ids 0, 1, then 10**21 (no engine buffers 10**21 events: a corrupt or foreign id), then
    10**21 + 3 (2 lost after it). The jump is followed and logged once, and counts no gap (it
    read 10**21 lost, for good, in kvscope_events_dropped_total); the next real gap counts 2;
    a jump of MAX_GAP ids exactly still counts as lost."""
    r = TrtllmResidency()
    jump = 10 ** 21
    with caplog.at_level(logging.WARNING):
        drops = [r.apply(1.0, decode(json.dumps([_event(i, _stored(i))]).encode()))[1]
                 for i in (0, 1, jump, jump + 3)]
    assert drops == [{}, {}, {}, {"gap": 2}]
    assert [m for m in caplog.messages if "jumped" in m] == [
        f"TensorRT-LLM KV cache events: event_id jumped {jump - 2} ahead; following it from "
        "there, not counted as a gap (logged once)"]
    edge = TrtllmResidency()
    edge.apply(1.0, decode(json.dumps([_event(0, _stored(1))]).encode()))
    _, lost = edge.apply(2.0, decode(json.dumps([_event(MAX_GAP + 1, _stored(2))]).encode()))
    assert lost == {"gap": MAX_GAP}


def test_ranks_and_windows_keep_their_own_blocks_capacity_and_event_ids():
    """Attention DP: ranks 0 and 1 each create 10 GPU / 20 host blocks and store hash 7 (one
    block each: 2 resident, capacity 20 / 40); rank 1's ids restart from 0 without a gap or a
    restart of rank 0; a third drain's rank-0 id going back (0 after 1) is an engine restart:
    residency starts over."""
    r = TrtllmResidency()
    created = {"type": "created", "num_blocks_per_cache_level": [10, 20]}
    body = json.dumps([_event(0, created, attention_dp_rank=0),
                       _event(0, created, attention_dp_rank=1),
                       _event(1, _stored(7), attention_dp_rank=0),
                       _event(1, _stored(7), attention_dp_rank=1)]).encode()
    events, drops = r.apply(1.0, decode(body))
    assert not drops
    assert [(s.tier, s.capacity_blocks, s.resident_blocks) for s in events] == [
        ("gpu", 20, 2), ("cpu", 40, 0)]
    events, drops = r.apply(2.0, decode(json.dumps([_event(0, created)]).encode()))
    assert not drops
    assert [(s.tier, s.capacity_blocks, s.resident_blocks) for s in events] == [
        ("gpu", 10, 0), ("cpu", 20, 0)]


def test_blocks_past_max_tracked_are_counted_not_remembered():
    """max_tracked 2: of 3 stored blocks 2 are resident, 1 untracked; its later removal is
    ignored (no eviction of a block the agent did not count)."""
    r = TrtllmResidency(max_tracked=2)
    events, drops = r.apply(1.0, decode(json.dumps([_event(0, _stored(1, 2, 3))]).encode()))
    assert drops == {"untracked": 1} and events[0].resident_blocks == 2
    events, drops = r.apply(2.0, decode(json.dumps([
        _event(1, {"type": "removed", "block_hashes": [3]})]).encode()))
    assert not drops and kinds(events, ev.Eviction) == []


def test_three_levels_map_a_host_to_disk_move_as_an_offload():
    """levels gpu, cpu, disk (KVCacheManagerV2's host and disk tiers): a block stored on the
    GPU at t 0, offloaded at 10, moved to disk at 30: gpu->cpu 1 then cpu->disk 1; its cpu
    eviction at 30 is measured (20 s, offloaded), and admitted as stored into disk."""
    r = TrtllmResidency(("gpu", "cpu", "disk"))
    r.apply(0.0, decode(json.dumps([_event(0, _stored(5))]).encode()))
    r.apply(10.0, decode(json.dumps([_event(1, _moved(5, 0, 1))]).encode()))
    events, _ = r.apply(30.0, decode(json.dumps([_event(2, _moved(5, 1, 2))]).encode()))
    assert [(t.src, t.dst) for t in kinds(events, ev.Transfer)] == [("cpu", "disk")]
    [evicted] = kinds(events, ev.Eviction)
    assert (evicted.tier, evicted.age, evicted.offloaded, evicted.measured) == (
        "cpu", 20.0, True, True)
    assert [(a.tier, a.stored, a.skipped) for a in kinds(events, ev.Admission)] == [
        ("disk", 1, 0)]


class Clock:
    def __init__(self, times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0) if len(self.times) > 1 else self.times[0]


def _agent():
    return Agent(AgentSettings(collectors={"gpu": {"enabled": False},
                                           "host": {"enabled": False}}), with_ingest=False)


def _source(server, consumer, times=TIMES, **kwargs):
    kwargs.setdefault("residency", TrtllmResidency(block_bytes=BLOCK))
    source = TrtllmSource(consumer, server.url, clock=Clock(times), **kwargs)
    source.prepare()
    return source


def test_the_agent_exports_the_drains_of_a_loopback_trtllm_serve():
    """The four drains, each over a real POST /kv_cache_events, into one agent. Its /metrics,
    by hand (see the first test): transfers gpu->cpu 2 blocks (131,072 bytes), cpu->gpu 1;
    evictions gpu 4 (A, B offloaded; D, C dropped), cpu 1 (B, dropped); admissions cpu stored
    2, skipped 2; residency and idle histograms of cpu: 1 block, 15 s; of gpu: none (absent);
    hits of evicted cpu blocks: 1 observation of 0; tiers: gpu 1 of 100 blocks, cpu 0 of 400;
    drops gap 2, unknown_kind 1, the other reasons exported at 0; source up."""
    agent = _agent()
    with serving_trtllm(DRAINS) as server:
        source = _source(server, agent.pipeline)
        assert [source.drain_once() for _ in DRAINS] == [True] * 4
        assert server.posts == 4
    value = agent.exposition.registry.get_sample_value
    assert value("kvscope_transfer_blocks_total", {"src": "gpu", "dst": "cpu"}) == 2
    assert value("kvscope_transfer_bytes_total", {"src": "gpu", "dst": "cpu"}) == 2 * BLOCK
    assert value("kvscope_transfer_blocks_total", {"src": "cpu", "dst": "gpu"}) == 1
    # the drain shows no failed copy: not measured, not 0
    assert value("kvscope_transfer_failures_total",
                 {"src": "gpu", "dst": "cpu", "reason": "unknown"}) is None
    assert value("kvscope_evicted_blocks_total", {"tier": "gpu", "reason": "capacity"}) == 4
    assert value("kvscope_evicted_blocks_total", {"tier": "cpu", "reason": "capacity"}) == 1
    assert value("kvscope_dropped_blocks_total", {"tier": "gpu"}) == 2
    assert value("kvscope_dropped_blocks_total", {"tier": "cpu"}) == 1
    assert value("kvscope_store_admissions_total", {"tier": "cpu", "result": "stored"}) == 2
    assert value("kvscope_store_admissions_total", {"tier": "cpu", "result": "skipped"}) == 2
    assert value("kvscope_store_admissions_total", {"tier": "cpu", "result": "failed"}) is None
    for hist in ("kvscope_block_residency_seconds", "kvscope_block_idle_seconds"):
        assert (value(f"{hist}_count", {"tier": "cpu"}), value(f"{hist}_sum", {"tier": "cpu"})
                ) == (1, 15.0)
        assert value(f"{hist}_count", {"tier": "gpu"}) is None
    assert (value("kvscope_evicted_block_hits_count", {"tier": "cpu"}),
            value("kvscope_evicted_block_hits_sum", {"tier": "cpu"})) == (1, 0)
    assert [value(f"kvscope_tier_{what}", {"tier": tier}) for tier in ("gpu", "cpu")
            for what in ("capacity_blocks", "resident_blocks", "resident_bytes")] == [
        100, 1, BLOCK, 400, 0, 0]
    drops = {reason: value("kvscope_events_dropped_total",
                           {"source": "trtllm", "reason": reason})
             for reason in ("gap", "unknown_kind", "cut", "too_large", "malformed", "invalid",
                            "untracked")}
    assert drops == {"gap": 2, "unknown_kind": 1, "cut": 0, "too_large": 0, "malformed": 0,
                     "invalid": 0, "untracked": 0}
    assert value("kvscope_source_up", {"source": "trtllm"}) == 1


def _dropped(pipeline, reason):
    return pipeline.snapshot().events_dropped.get(("trtllm", reason), 0)


def test_a_drain_cut_half_way_counts_what_it_lost_once():
    """drain 1 whole; drain 2's answer stops half way and the connection closes: 1 event
    counted as cut at once; drain 3 then starts at id 7 after 2, so ids 3-6 were lost: 3 more
    cut (4 in all), none as gap. The source stays up (the engine answered)."""
    pipeline = Pipeline()
    with serving_trtllm([DRAINS[0], Cut(DRAINS[1][:len(DRAINS[1]) // 2]), DRAINS[2]]) as server:
        source = _source(server, pipeline, timeout=3.0)
        assert source.drain_once()
        assert not source.drain_once()
        assert _dropped(pipeline, "cut") == 1
        assert source.drain_once()
    assert (_dropped(pipeline, "cut"), _dropped(pipeline, "gap")) == (4, 0)
    assert pipeline.snapshot().source_up["trtllm"] is True


@pytest.mark.parametrize("drain, reason, kwargs", [
    (b'[{"event_id": 0, "data": {"type": "created", "num_blocks', "malformed", {}),
    (b'{"event_id": 0}', "malformed", {}),
    (DRAINS[0], "too_large", {"max_body": 1024}),
    (Trickle(), "cut", {"timeout": 1.0}),
])
def test_a_drain_that_cannot_be_read_counts_one_lost_and_the_next_drain_goes_on(
        drain, reason, kwargs):
    """An answer that is no JSON array (cut JSON, an object), one over max_body (drain 1 is
    about 2.7 kB), one trickling past the timeout: one event dropped for its reason; then a
    small drain from the same server (created, 2 blocks stored) is folded (gpu 2 resident):
    the source goes on."""
    assert len(DRAINS[0]) > 1024
    small = json.dumps([_event(0, {"type": "created", "num_blocks_per_cache_level": [9, 0]}),
                        _event(1, _stored(1, 2))]).encode()
    pipeline = Pipeline()
    with serving_trtllm([drain, small]) as server:
        source = _source(server, pipeline, **kwargs)
        assert not source.drain_once()
        assert source.drain_once()
    assert _dropped(pipeline, reason) == 1
    assert pipeline.snapshot().tiers["gpu"].resident_blocks == 2


def test_an_engine_that_does_not_answer_loses_nothing_and_is_down():
    """A refused connection and a 404 (events off, or not trtllm-serve): nothing was drained,
    so nothing is counted lost; the source is down."""
    pipeline = Pipeline()
    with serving_trtllm() as server:
        url = server.url
    source = TrtllmSource(pipeline, url, residency=TrtllmResidency(), timeout=1.0)
    source.prepare()
    assert not source.drain_once()
    with serving_trtllm() as server:
        source.events_url = server.url + "/v1/kv_cache_events"
        assert not source.drain_once()
    assert sum(n for (name, _), n in pipeline.snapshot().events_dropped.items()
               if name == "trtllm") == 0
    assert pipeline.snapshot().source_up["trtllm"] is False


MAIN = [parse((DATA / f"metrics-main-{i}.prom").read_text()) for i in (1, 2)]


def test_main_metrics_map_tokens_by_tier_scheduler_and_ttft_and_leave_copies_to_events():
    """Scrape 1 is the baseline (gauges only); scrape 2 adds 4,096 prompt tokens, 1,536 of
    them cached (gpu 512, host 1,024 -> cpu): recompute 4,096 - 1,536 = 2,560. Gauges: 2
    waiting, 3 running, usage 0.625. TTFT: 1 in (0.04, 0.06], 2 in (0.1, 0.25], sum 0.45.
    With the events on, no transfer and no GPU snapshot (the drain reports them)."""
    m = TrtllmMetrics()
    first = m.map(MAIN[0], 1.0)
    assert first == [ev.SchedulerStats(ts=1.0, waiting=2, running=3, gpu_kv_usage=0.625)]
    second = m.map(MAIN[1], 2.0)
    [lookup] = kinds(second, ev.Lookup)
    assert lookup.tokens == {"gpu": 512, "cpu": 1024, "recompute": 2560}
    [ttft] = kinds(second, ev.LatencyHistogram)
    assert ttft.bounds[5:9] == [0.06, 0.08, 0.1, 0.25] and len(ttft.bounds) == 22
    assert {i: n for i, n in enumerate(ttft.counts) if n} == {5: 1, 8: 2}
    assert ttft.sum == pytest.approx(0.45)
    assert kinds(second, ev.Transfer) == kinds(second, ev.TierSnapshot) == []


def test_without_the_events_the_byte_counters_and_block_gauges_report_the_copies():
    """events off, 64 KiB blocks: scrape 2's 2 MiB offloaded = 32 blocks gpu->cpu, 512 KiB
    onboarded = 8 blocks cpu->gpu; the GPU tier from trtllm_kv_cache_{max,used}_blocks on
    every scrape: 40 of 100."""
    m = TrtllmMetrics(events=False, block_bytes=BLOCK)
    first = m.map(MAIN[0], 1.0)
    assert kinds(first, ev.Transfer) == []
    second = m.map(MAIN[1], 2.0)
    assert [(t.src, t.dst, t.blocks, t.bytes) for t in kinds(second, ev.Transfer)] == [
        ("gpu", "cpu", 32, 2 << 20), ("cpu", "gpu", 8, 512 << 10)]
    for events in (first, second):
        assert [(s.tier, s.capacity_blocks, s.resident_blocks) for s in
                kinds(events, ev.TierSnapshot)] == [("gpu", 100, 40)]


def test_the_1_2_metrics_give_usage_and_ttft_and_nothing_else():
    """TensorRT-LLM 1.2's collector: kv_cache_utilization (0.625) and the TTFT histogram; no
    token counters, so no Lookup (absent, not 0), no request gauges (None), and the hit rate
    gauge is never read. Two scrapes of the same text: no new TTFT observation."""
    text = parse((DATA / "metrics-1.2.prom").read_text())
    m = TrtllmMetrics()
    for ts in (1.0, 2.0):
        assert m.map(text, ts) == [ev.SchedulerStats(ts=ts, gpu_kv_usage=0.625)]


def test_the_source_scrapes_and_drains_one_server_and_the_agent_shows_both():
    """events and metrics on, over real HTTP: two rounds (drains 1 and 2, scrapes 1 and 2).
    The agent's /metrics: prompt tokens gpu 512, cpu 1,024, disk absent (not measured: the
    server reports gpu and host tiers only), recompute 2,560; requests waiting
    2; gpu->cpu 2 blocks from the drain; source up."""
    agent = _agent()
    expositions = [(DATA / f"metrics-main-{i}.prom").read_text() for i in (1, 2)]
    with serving_trtllm(DRAINS[:2], expositions) as server:
        source = _source(server, agent.pipeline, metrics=TrtllmMetrics())
        for _ in range(2):
            assert source.drain_once() and source.scrape_once()
    value = agent.exposition.registry.get_sample_value
    assert [value("kvscope_prompt_tokens_total", {"source": s})
            for s in ("gpu", "cpu", "disk", "recompute")] == [512, 1024, None, 2560]
    assert value("kvscope_requests_waiting", {"source": "trtllm"}) == 2
    assert value("kvscope_transfer_blocks_total", {"src": "gpu", "dst": "cpu"}) == 2
    assert value("kvscope_source_up", {"source": "trtllm"}) == 1


def test_the_table_is_off_by_default_checked_and_claims_its_levels_tiers():
    """[trtllm] is registered and off; levels must be distinct tiers, the GPU's first; beside
    the KV events source both report gpu and cpu, which the settings refuse."""
    assert "trtllm" in base.REGISTRY and not load_settings(None).trtllm.enabled
    assert load_settings(None, **{"trtllm.levels": ["gpu", "cpu", "disk"]}
                         ).trtllm.levels == ["gpu", "cpu", "disk"]
    for levels in (["cpu", "gpu"], ["gpu", "gpu"], ["gpu", "ssd"], []):
        with pytest.raises(ValueError):
            load_settings(None, **{"trtllm.levels": levels})
    with pytest.raises(ValueError, match=r"\[kv_events\] and \[trtllm\] both report"):
        load_settings(None, **{"trtllm.enabled": "true", "kv_events.enabled": "true"})


def test_an_agent_with_trtllm_enabled_drains_and_scrapes_on_its_own():
    """The agent as `kvscope agent` builds it from [trtllm] (events and metrics on, every
    0.1 s) against the loopback server: it polls by itself until drain 1 is in (gpu 4 of 100
    resident) and a scrape set the request gauges (2 waiting), says so in its banner line, and
    keeps draining, and
    stops cleanly (shutdown twice is safe)."""
    from conftest import wait_until
    from kvscope.agent.sources.base import REGISTRY

    expositions = [(DATA / "metrics-main-1.prom").read_text()]
    with serving_trtllm(DRAINS[:1], expositions) as server:
        settings = AgentSettings(trtllm={"enabled": True, "url": server.url, "metrics": True,
                                         "interval": 0.1},
                                 collectors={"gpu": {"enabled": False},
                                             "host": {"enabled": False}})
        agent = Agent(settings, with_ingest=False)
        part = agent.sources["trtllm"]
        line = REGISTRY["trtllm"].banner(settings.trtllm, part, "")
        assert line == (f"trtllm: POST {server.url}/kv_cache_events and GET {server.url}"
                        "/prometheus/metrics every 0.1 s; reports tiers gpu, cpu")
        agent.start()
        try:
            value = agent.exposition.registry.get_sample_value
            assert wait_until(lambda: value("kvscope_tier_resident_blocks", {"tier": "gpu"})
                              == 4 and value("kvscope_requests_waiting",
                                             {"source": "trtllm"}) == 2, timeout=20)
            assert value("kvscope_tier_capacity_blocks", {"tier": "gpu"}) == 100
            assert value("kvscope_source_up", {"source": "trtllm"}) == 1
            assert wait_until(lambda: server.posts >= 3, timeout=20)  # it goes on draining
        finally:
            agent.shutdown()
            agent.shutdown()


def test_the_table_in_docs_engines_loads_as_it_stands(tmp_path):
    """docs/engines.md's [trtllm] example is a valid table (it drifts otherwise)."""
    from conftest import REPO_ROOT

    section = (REPO_ROOT / "docs" / "engines.md").read_text().split("## TensorRT-LLM", 1)[1]
    example = section.split("```toml", 1)[1].split("```", 1)[0]
    path = tmp_path / "agent.toml"
    path.write_text(example)
    config = load_settings(path).trtllm
    assert (config.enabled, config.events, config.metrics, config.levels) == (
        True, True, True, ["gpu", "cpu"])


def test_no_prometheus_metrics_is_said_with_the_setting_that_serves_them(caplog):
    """trtllm-serve answers 404 at /prometheus/metrics unless its extra options say
    return_perf_metrics: true: the log says that, not httpx's sentence."""
    from tests.engine_servers import exposition_server

    with exposition_server("trtllm_x 1\n", path="/elsewhere") as server:
        source = TrtllmSource(Pipeline(), server.url.removesuffix("/elsewhere"),
                              metrics=TrtllmMetrics())
        assert not source.scrape_once()
    (line,) = [r.getMessage() for r in caplog.records if "TensorRT-LLM metrics" in r.getMessage()]
    assert line.endswith("/prometheus/metrics: answered HTTP 404 Not Found; trtllm-serve serves "
                         "it with return_perf_metrics: true in its --extra_llm_api_options file "
                         "(or set [trtllm] metrics = false)"), line
