"""The LMCache metrics source: the mapping on LMCache 0.5.6's exposition (the names, labels and
format its multiprocess server prints: ``lmcache_mp_*`` through OpenTelemetry's Prometheus
fallback), and the real ``lmcache server`` from PyPI on loopback, driven by LMCache's own client
with CPU tensors and scraped through the agent's source (``tests/engine_servers.py``; skipped
with the reason when ``scripts/vllm_env.sh --lmcache`` has not built its environment)."""

from __future__ import annotations

import time

import pytest

from kvscope import events as ev
from kvscope.agent.config import AgentSettings
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources import REGISTRY, build_sources
from kvscope.agent.sources.base import Built
from kvscope.agent.sources.lmcache_metrics import (HIT_L1, HIT_L2, REQUESTED, LMCacheMapper,
                                                   LMCacheMetricsConfig, LMCacheMetricsSource,
                                                   _build)
from kvscope.agent.sources.scrape import parse, series
from tests.engine_servers import exposition_server, lmcache_python, lmcache_server

CHUNK = 4 << 20  # bytes: 256 tokens x 4 layers x (K, V) x 8 heads x 128 x 2 bytes (float16)
BOUNDS = [1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 7200.0,
          14400.0]  # LMCache's lifecycle buckets (l1_lifecycle.py), seconds
IDLE = """\
target_info{service_instance_id="3c1b",service_name="unknown_service"} 1.0
lmcache_mp_l1_eviction_loop_ticks_total 18.0
lmcache_mp_l1_memory_usage_bytes{backend="dram",l1_tag="_default"} 0.0
lmcache_mp_l1_usage_ratio{backend="dram",l1_tag="_default"} 0.0
lmcache_mp_l1_staging_bytes{backend="dram",l1_tag="_default"} 0.0
lmcache_mp_l2_usage_bytes{l2_name="fs"} 0.0
"""


def exposition(writes, loads, retrieved, stored, evicted, requested, l1_hits, l2_hits,
               used, ratio, idle=(0, 0, 0), idle_sum=0.0, l2="fs"):
    """LMCache's /metrics after traffic: the counters (chunks, tokens) as its server prints
    them, and the L1 idle histogram with ``idle`` observations in its first three buckets."""
    lines = [f'lmcache_mp_l1_memory_usage_bytes{{backend="dram",l1_tag="_default"}} {used}',
             f'lmcache_mp_l1_usage_ratio{{backend="dram",l1_tag="_default"}} {ratio}',
             f'lmcache_mp_l2_usage_bytes{{l2_name="{l2}"}} 0.0',
             f'lmcache_mp_l1_write_chunks_total{{l1_tag="_default"}} {writes}',
             f'lmcache_mp_l1_read_chunks_total{{l1_tag="_default"}} {2 * writes}',
             f"lmcache_mp_l2_prefetch_load_completed_chunks_total {loads}",
             f"lmcache_mp_l2_store_completed_objects_chunks_total {stored}",
             f'lmcache_mp_l2_store_completed_requests_total{{l2_name="{l2}"}} {stored // 2}',
             f'lmcache_mp_num_chunks_loaded_total{{cache_salt="",model_name="m",'
             f'worker_id="1000"}} {retrieved}',
             f'lmcache_mp_l1_evicted_chunks_total{{l1_tag="_default"}} {evicted}']
    for name, value in (("requested", requested), ("hit", l1_hits + l2_hits),
                        ("hit_l1", l1_hits), ("hit_l2", l2_hits)):
        lines.append(f'lmcache_mp_lookup_{name}_tokens_total{{cache_salt="",model_name="m"}} '
                     f'{value}')
    cumulative = 0
    for i, bound in enumerate([*BOUNDS, "+Inf"]):
        cumulative += idle[i] if i < len(idle) else 0
        lines.append(f'lmcache_mp_l1_chunk_idle_before_evict_seconds_bucket{{l1_tag="_default",'
                     f'le="{bound}"}} {cumulative}')
    lines.append(f'lmcache_mp_l1_chunk_idle_before_evict_seconds_count{{l1_tag="_default"}} '
                 f'{cumulative}')
    lines.append(f'lmcache_mp_l1_chunk_idle_before_evict_seconds_sum{{l1_tag="_default"}} '
                 f'{idle_sum}')
    return IDLE.replace('{l2_name="fs"}', f'{{l2_name="{l2}"}}') + "\n".join(lines) + "\n"


def _by_kind(events):
    out = {}
    for event in events:
        out.setdefault(type(event), []).append(event)
    return out


def _moved(events):
    return {(e.src, e.dst): (e.blocks, e.bytes) for e in events if isinstance(e, ev.Transfer)}


def test_an_idle_server_reports_nothing_it_does_not_know():
    """The real server's idle exposition (LMCache makes a counter's series at its first
    increment; L1 empty, so its size unknown): no event at all, not a zero of anything."""
    assert LMCacheMapper().map(parse(IDLE), 1.0) == []


def test_traffic_maps_to_transfers_evictions_idle_times_lookups_and_l1():
    """After the idle scrape, the first traffic (what the real test below drives: 40 requests
    of 2 chunks, then 4 of them again from L2). 16 engine blocks and 4 MiB per chunk. By hand:
    gpu->cpu: L1 writes 96 - L2 loads 16 = 80 chunks = 1,280 blocks, 335,544,320 B;
    cpu->gpu: 96 chunks retrieved = 1,536 blocks; cpu->disk (fs): 80 = 1,280 blocks;
    disk->cpu: 16 = 256 blocks, 67,108,864 B. L1 evicted 48 = 768 blocks, offloaded (an fs L2
    holds the copies). Idle: 16 <= 1 s, 19 in (1, 5], 13 in (5, 15], sum 157.5. Lookup:
    cpu 20,480, disk 4,096, recompute 45,056 - 24,576 = 20,480 tokens. L1: capacity
    201,326,592 / 0.75 = 268,435,456 B (0.25 GiB) = 1,024 blocks; resident 768 blocks."""
    mapper = LMCacheMapper(chunk_blocks=16, chunk_bytes=CHUNK)
    assert mapper.map(parse(IDLE), 1.0) == []
    events = _by_kind(mapper.map(parse(exposition(
        96, 16, 96, 80, 48, 45056, 20480, 4096, 201326592, 0.75, (16, 19, 13), 157.5)), 2.0))
    assert _moved(events[ev.Transfer]) == {
        ("gpu", "cpu"): (1280, 80 * CHUNK), ("cpu", "gpu"): (1536, 96 * CHUNK),
        ("cpu", "disk"): (1280, 80 * CHUNK), ("disk", "cpu"): (256, 16 * CHUNK)}
    assert all(not t.timed for t in events[ev.Transfer])
    [evicted] = events[ev.Eviction]
    assert (evicted.tier, evicted.blocks, evicted.bytes, evicted.offloaded, evicted.measured) \
        == ("cpu", 768, 48 * CHUNK, True, False)
    [idle] = events[ev.IdleHistogram]
    assert (idle.tier, idle.bounds, idle.counts[:4], sum(idle.counts), idle.sum) == (
        "cpu", BOUNDS, [16, 19, 13, 0], 48, 157.5)
    [lookup] = events[ev.Lookup]
    assert lookup.tokens == {"cpu": 20480, "disk": 4096, "recompute": 20480}
    assert lookup.request_id == ""
    [l1] = events[ev.TierSnapshot]
    assert (l1.tier, l1.capacity_bytes, l1.resident_bytes, l1.capacity_blocks,
            l1.resident_blocks) == ("cpu", 268435456, 201326592, 1024, 768)


def test_an_emptied_l1_keeps_its_size_and_loads_ahead_of_writes_carry_over():
    """Scrape 2: L1 emptied (0 bytes, ratio 0: its size is the one known from scrape 1, and
    it holds 0), and 4 L2 loads whose L1 writes are not counted yet: no store (not -4), 4
    disk->cpu. Scrape 3: 10 writes, no new load: 10 - 4 = 6 stores. No chunk_bytes: bytes 0
    and blocks per chunk 1 (the chunks themselves)."""
    mapper = LMCacheMapper()
    base = dict(retrieved=0, stored=0, evicted=0, requested=0, l1_hits=0, l2_hits=0)
    mapper.map(parse(exposition(10, 0, used=8 << 20, ratio=0.5, **base)), 1.0)
    second = _by_kind(mapper.map(parse(exposition(10, 4, used=0, ratio=0.0, **base)), 2.0))
    assert _moved(second[ev.Transfer]) == {("disk", "cpu"): (4, 0)}
    [l1] = second[ev.TierSnapshot]
    assert (l1.capacity_bytes, l1.resident_bytes, l1.capacity_blocks) == (16 << 20, 0, 0)
    third = mapper.map(parse(exposition(20, 4, used=0, ratio=0.0, **base)), 3.0)
    assert _moved(third) == {("gpu", "cpu"): (6, 0)}


def test_a_restarted_server_is_another_l1_of_unknown_size_and_counts_from_0():
    """16 MiB known from a half-full L1 (8 MiB at 0.5); the server restarts (another
    service_instance_id) with its L1 empty: its size is unknown again (no snapshot, not the
    old 16 MiB), and its first 3 writes count (counters start at 0 in a new process). Another
    restart whose new process wrote 15 by the next scrape, more than the 3 before it: 15
    count, not 15 - 3 = 12 (a review: read as the old process's counters going on)."""
    mapper = LMCacheMapper()
    base = dict(loads=0, retrieved=0, stored=0, evicted=0, requested=0, l1_hits=0, l2_hits=0)
    mapper.map(parse(exposition(10, used=8 << 20, ratio=0.5, **base)), 1.0)
    restarted = exposition(3, used=0, ratio=0.0, **base).replace('"3c1b"', '"9f2e"')
    events = mapper.map(parse(restarted), 2.0)
    assert not [e for e in events if isinstance(e, ev.TierSnapshot)]
    assert _moved(events) == {("gpu", "cpu"): (3, 0)}
    again = exposition(15, used=0, ratio=0.0, **base).replace('"3c1b"', '"77aa"')
    assert _moved(mapper.map(parse(again), 3.0)) == {("gpu", "cpu"): (15, 0)}


def test_a_restarted_or_unanswering_server_leaves_the_tier_gauges_its_counters_stay():
    """Scraped over real HTTP: the L1 is 8 MiB full at 0.5 (16 MiB) after 10 writes. The server
    restarts with an empty L1 (another service_instance_id): the cpu tier leaves the gauges
    (before, the old 8 MiB stayed for good); at 4 MiB used of 0.25 it is back, 16 MiB. Then
    the server answers without LMCache's series (stopped, another server on the port): the
    source is down and the tier gone again, as Prometheus' own series of a target it cannot
    scrape; the 10 + 3 stores counted stay."""
    base = dict(loads=0, retrieved=0, stored=0, evicted=0, requested=0, l1_hits=0, l2_hits=0)
    tiers = []
    with exposition_server() as server:
        source = LMCacheMetricsSource(Pipeline(), server.url)
        source.prepare()
        for body in (exposition(0, used=0, ratio=0.0, **base),
                     exposition(10, used=8 << 20, ratio=0.5, **base),
                     exposition(3, used=0, ratio=0.0, **base).replace('"3c1b"', '"9f2e"'),
                     exposition(3, used=4 << 20, ratio=0.25, **base).replace('"3c1b"', '"9f2e"'),
                     "other_metric 1\n"):
            server.body = body
            source.scrape_once()
            snap = source.pipeline.snapshot()
            tiers.append({t: (s.resident_bytes, s.capacity_bytes) for t, s in snap.tiers.items()})
    assert tiers == [{}, {"cpu": (8 << 20, 16 << 20)}, {}, {"cpu": (4 << 20, 16 << 20)}, {}]
    assert snap.source_up == {"lmcache_metrics": False}
    assert snap.transfer_blocks == {("gpu", "cpu"): 13}


def test_an_l1_on_gpudirect_storage_is_the_disk_tier():
    """An L1 manager on GDS (``backend="gds"``: NVMe, not host memory) with an fs L2: 4
    stores land on disk, and its capacity (1 GiB at 0.25 = 4 GiB) is the disk tier's."""
    text = exposition(4, 0, 0, 0, 0, 0, 0, 0, 1 << 30, 0.25).replace('"dram"', '"gds"')
    mapper = LMCacheMapper()
    mapper.map(parse(IDLE.replace('"dram"', '"gds"')), 1.0)
    events = mapper.map(parse(text), 2.0)
    assert _moved(events) == {("gpu", "disk"): (4, 0)}
    [snapshot] = [e for e in events if isinstance(e, ev.TierSnapshot)]
    assert (snapshot.tier, snapshot.capacity_bytes) == ("disk", 4 << 30)


def test_the_first_scrape_of_a_busy_server_is_only_baselines():
    """An agent started beside a server that has run: its counters are totals of the past,
    not traffic since the scrape before, so they count nothing; L1 is reported as it is."""
    events = LMCacheMapper().map(parse(exposition(
        96, 16, 96, 80, 48, 45056, 20480, 4096, 201326592, 0.75, (16, 19, 13), 157.5)), 1.0)
    assert [type(e) for e in events] == [ev.TierSnapshot]


@pytest.mark.parametrize("l2, l2_tiers, tier, source", [
    ("s3", {}, "remote", "cpu"),         # a remote L2: its hits reach the GPU through L1
    ("mock", {}, None, "cpu"),           # an adapter kvscope cannot place: no L2 transfers
    ("mock", {"mock": "disk"}, "disk", "disk"),  # placed by the operator
])
def test_l2_is_placed_by_its_adapter(l2, l2_tiers, tier, source):
    """10 chunks stored to L2 and 2 loaded back, 512 of 1,024 tokens from L2."""
    mapper = LMCacheMapper(l2_tiers=l2_tiers)
    mapper.map(parse(IDLE.replace('"fs"', f'"{l2}"')), 1.0)
    events = mapper.map(parse(exposition(12, 2, 0, 10, 0, 1024, 0, 512, 0, 0.0, l2=l2)), 2.0)
    moved = _moved(events)
    assert moved[("gpu", "cpu")] == (10, 0)
    if tier is None:
        assert set(moved) == {("gpu", "cpu")}
    else:
        assert moved[("cpu", tier)] == (10, 0) and moved[(tier, "cpu")] == (2, 0)
    [lookup] = [e for e in events if isinstance(e, ev.Lookup)]
    assert lookup.tokens == {"cpu": 0, source: 512, "recompute": 512}  # L1 (cpu) served none


def test_lookups_are_left_to_vllm_metrics_when_it_scrapes_the_same_vllm():
    """``lookups`` unset: on alone, off beside ``[vllm_metrics]`` (vLLM counts every prompt
    token); set, as set. Without lookups no Lookup is made, the rest as before."""
    def built(vllm_on, lookups=None):
        configs = {name: spec.config() for name, spec in REGISTRY.items()}
        configs["vllm_metrics"] = configs["vllm_metrics"].model_copy(update={"enabled": vllm_on})
        return _build(LMCacheMetricsConfig(enabled=True, lookups=lookups), Pipeline(),
                      Built(configs, {})).mapper.lookups
    assert (built(False), built(True), built(True, True), built(False, False)) == (
        True, False, True, False)
    mapper = LMCacheMapper(lookups=False)
    mapper.map(parse(IDLE), 1.0)
    events = mapper.map(parse(exposition(2, 0, 2, 0, 0, 512, 256, 0, 0, 0.0)), 2.0)
    assert not [e for e in events if isinstance(e, ev.Lookup)] and _moved(events)


def _metric(url, name):
    import httpx

    return sum(series(parse(httpx.get(url, trust_env=False).text), name).values())


@pytest.mark.skipif(lmcache_python() is None,
                    reason="no LMCache environment: bash scripts/vllm_env.sh --lmcache")
def test_the_real_lmcache_server_driven_by_its_own_client_reaches_the_pipeline():
    """``lmcache server --l1-size-gb 0.25 --eviction-policy LRU --host 127.0.0.1`` with an fs L2
    (LMCache 0.5.6 from PyPI, on this CPU), scraped through the source the agent builds from
    ``[lmcache_metrics]`` (chunk: 256 tokens of 4 layers of K and V, 8 heads of 128 float16 =
    4 MiB; 16 blocks of 16 tokens). LMCache's client takes CPU tensors (``lmcache bench server
    --mode cpu``: the server copies them through shared memory, as it would from a GPU).

    Scrape 1, the idle server: up, no event. Then requests 0..39 (512 tokens: 2 chunks each;
    per request a missing lookup, a store, a hitting lookup, a retrieve), and the eviction loop
    trims L1 (64 chunks of 4 MiB fit 0.25 GiB; LRU evicts the oldest, requests 0.. first).
    Then requests 0..3 again: evicted from L1, so both their lookups load them from the fs L2
    (LMCache drops a loaded chunk from L1 once read), 16 chunks; nothing is stored again.
    Scrape 2. By hand: stored gpu->cpu 80 chunks (L1's 96 writes less the 16 L2 loads) =
    1,280 blocks; cpu->disk 80 = 1,280; disk->cpu 16 = 256; lookups 88 x 512 = 45,056 tokens:
    cpu 40 x 512 = 20,480 (phase 1's second lookups), disk 8 x 512 = 4,096 (phase 2's),
    recompute 40 x 512 = 20,480 (phase 1's first lookups), unless a second lookup outran its
    request's store on LMCache's event bus (it did once: cpu 19,968, recompute 20,992): then
    the server's own hit counters say so, and kvscope's split follows them.
    cpu->gpu and evictions as the server's own counters say (the eviction loop runs at 1 Hz);
    the L1 capacity is 0.25 GiB exactly: 268,435,456 B = 1,024 blocks."""
    with lmcache_server(l1_size_gb=0.25) as server:
        settings = AgentSettings(lmcache_metrics={
            "enabled": True, "url": server.metrics_url, "chunk_blocks": 16,
            "chunk_bytes": CHUNK})
        pipeline = Pipeline()
        source = build_sources({name: getattr(settings, name) for name in REGISTRY},
                               pipeline, skip=("ingest",))["lmcache_metrics"]
        assert isinstance(source, LMCacheMetricsSource)
        assert source.scrape_once(), server.log()
        assert pipeline.snapshot().transfer_blocks == {} and not pipeline.snapshot().tiers
        server.drive(0, 40)
        evicted = "lmcache_mp_l1_evicted_chunks_total"
        deadline, settled = time.monotonic() + 60, None
        while time.monotonic() < deadline:  # the eviction loop has run and rests
            now = _metric(server.metrics_url, evicted)
            if now >= 24 and now == settled:
                break
            settled = now
            time.sleep(2.0)
        server.drive(0, 4)
        time.sleep(1.0)  # the event bus drains into the counters
        assert source.scrape_once(), server.log()
        snap = pipeline.snapshot()
        retrieved = _metric(server.metrics_url, "lmcache_mp_num_chunks_loaded_total")
        evicted_now = _metric(server.metrics_url, evicted)
        requested, hit_l1, hit_l2 = (_metric(server.metrics_url, name)
                                     for name in (REQUESTED, HIT_L1, HIT_L2))
    assert snap.transfer_blocks == {
        ("gpu", "cpu"): 1280, ("cpu", "disk"): 1280, ("disk", "cpu"): 256,
        ("cpu", "gpu"): 16 * retrieved}
    assert retrieved >= 80 + 8  # each request retrieved its 2 chunks at least once
    assert snap.transfer_bytes[("gpu", "cpu")] == 80 * CHUNK
    # (no gpu source: LMCache never sees the engine's GPU hits, so they are not measured)
    assert requested == 88 * 512 and hit_l2 == 4096 and 20480 - 2 * 512 <= hit_l1 <= 20480
    assert snap.prompt_tokens == {"cpu": hit_l1, "disk": hit_l2,
                                  "recompute": requested - hit_l1 - hit_l2}
    assert snap.evicted_blocks[("cpu", "capacity")] == 16 * evicted_now >= 16 * 24
    assert snap.dropped_blocks.get("cpu", 0) == 0  # the fs L2 holds every evicted chunk
    assert snap.block_idle_seconds["cpu"].count == evicted_now  # sample rate 1.0
    l1 = snap.tiers["cpu"]
    assert (l1.capacity_bytes, l1.capacity_blocks) == (268435456, 1024)
    assert 0 < l1.resident_bytes <= l1.capacity_bytes
    assert snap.source_up["lmcache_metrics"] is True
