"""The vLLM metrics source on literal exposition text, and the zero-code sources against a real
``vllm serve`` (vLLM's OpenAI server on loopback, the tiny model): /metrics is mapped, OTLP
request spans arrive at the agent's /v1/traces and join the tap's request records."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import threading
import time

import httpx
import pytest
import uvicorn

from kvscope import events as ev
from kvscope.agent.config import AgentSettings
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources.scrape import parse, spread
from kvscope.agent.sources.vllm_metrics import MetricsMapper, cache_config
from kvscope.service.agent import Agent
from kvscope.service.api import create_app
from conftest import REPO_ROOT, wait_until
from tests.engine_servers import Exposition
from tests.vllm_env import child_env, kill_group, tail, vllm_python

E = 'engine="0",model_name="m"'


def exposition(prompt, device, host, store, load, ttft_buckets, usage=0.5):
    lines = [f"vllm:prompt_tokens_total{{{E}}} {prompt}",
             f'vllm:prompt_tokens_cached_by_source_total{{{E},source="device"}} {device}',
             f'vllm:prompt_tokens_cached_by_source_total{{{E},source="host"}} {host}',
             f'vllm:prompt_tokens_cached_by_source_total{{{E},source="disk"}} 0.0',
             f"vllm:kv_offload_store_bytes_total{{{E}}} {store}",
             f"vllm:kv_offload_load_bytes_total{{{E}}} {load}",
             f"vllm:kv_cache_usage_perc{{{E}}} {usage}",
             f'vllm:cache_config_info{{block_size="32",cache_dtype="auto",'
             f'enable_prefix_caching="True",num_gpu_blocks="24",{E}}} 1.0',
             "# HELP vllm:time_to_first_token_seconds Histogram of time to first token."]
    cumulative = 0
    for le, n in ttft_buckets:
        cumulative += n
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{{E},le="{le}"}} {cumulative}')
    lines.append(f"vllm:time_to_first_token_seconds_sum{{{E}}} {0.1 * cumulative}")
    return "\n".join(lines) + "\n"


def test_counters_map_as_deltas_and_missing_names_are_absent():
    mapper = MetricsMapper(block_bytes=100)
    first = exposition(100, 20, 0, 0, 0, [("0.1", 1), ("1.0", 0), ("+Inf", 0)])
    baseline = mapper.map(parse(first), 1.0)
    # counters: baseline only; gauges as they are
    assert [type(e) for e in baseline] == [ev.TierSnapshot, ev.SchedulerStats]
    second = exposition(400, 70, 64, 3200, 6400, [("0.1", 3), ("1.0", 2), ("+Inf", 1)])
    events = mapper.map(parse(second), 2.0)
    lookup = next(e for e in events if isinstance(e, ev.Lookup))
    assert lookup.tokens == {"gpu": 50, "cpu": 64, "recompute": 186} and lookup.request_id == ""
    transfers = {(e.src, e.dst): e for e in events if isinstance(e, ev.Transfer)}
    assert transfers[("gpu", "cpu")].bytes == 3200 and transfers[("gpu", "cpu")].blocks == 32
    assert transfers[("cpu", "gpu")].bytes == 6400 and not transfers[("cpu", "gpu")].timed
    hist = next(e for e in events if isinstance(e, ev.LatencyHistogram))
    assert hist.bounds == [0.1, 1.0] and hist.counts == [2, 2, 1]
    gpu = next(e for e in events if isinstance(e, ev.TierSnapshot))
    assert gpu.capacity_blocks == 24 and gpu.resident_blocks == 12 and gpu.capacity_bytes == 2400
    # what vLLM does not print stays unknown (None), never 0
    assert MetricsMapper().map(parse("vllm:num_requests_running 1\n"), 3.0) == [
        ev.SchedulerStats(ts=3.0, running=1)]
    assert MetricsMapper().map(parse("vllm:engine_sleep_state 1\n"), 3.0) == []


def test_offloads_are_left_to_kv_events_when_it_reports_the_cpu_tier():
    """``stores=False`` (so when the agent's KV events source reports ``cpu``, which sees every
    offload): gpu->cpu bytes would be counted twice; cpu->gpu loads KV events cannot see."""
    mapper = MetricsMapper(gpu_snapshot=False, stores=False)
    text = (f"vllm:kv_offload_store_bytes_total{{{E}}} 100\n"
            f"vllm:kv_offload_load_bytes_total{{{E}}} 50\n")
    mapper.map(parse(text), 1.0)
    text = text.replace(" 100", " 400").replace(" 50", " 250")
    transfers = [(t.src, t.dst, t.bytes) for t in mapper.map(parse(text), 2.0)]
    assert transfers == [("cpu", "gpu", 200)]


def test_a_source_is_named_at_0_only_where_the_engine_has_it():
    """vLLM makes every ``prompt_tokens_cached_by_source`` series (device, host, disk, ...)
    whatever its tiers, so a 0 there says nothing: without a KV connector a scrape of 100
    prompt tokens, 30 from the GPU, names gpu 30 and recompute 70, no cpu or disk (not
    measured, never 0). Once the connector is queried (``external_prefix_cache_queries``
    rises: vLLM counts it only with one), cpu is named at 0 too; disk stays absent until it
    serves tokens (vLLM's tiering metrics name a disk tier in the lookups' block hits)."""
    def scrape(prompt, device, queries):
        return parse(f"vllm:prompt_tokens_total{{{E}}} {prompt}\n"
                     + "".join(f'vllm:prompt_tokens_cached_by_source_total{{{E},source="{s}"}} '
                               f"{device if s == 'device' else 0}\n"
                               for s in ("device", "host", "disk", "p2p"))
                     + f"vllm:external_prefix_cache_queries_total{{{E}}} {queries}\n")

    mapper = MetricsMapper(gpu_snapshot=False)
    assert mapper.map(scrape(0, 0, 0), 1.0) == []
    (lookup,) = mapper.map(scrape(100, 30, 0), 2.0)
    assert lookup.tokens == {"gpu": 30, "recompute": 70}
    (lookup,) = mapper.map(scrape(200, 40, 64), 3.0)
    assert lookup.tokens == {"gpu": 10, "cpu": 0, "recompute": 90}


def test_a_counter_reset_counts_from_zero():
    mapper = MetricsMapper(gpu_snapshot=False)
    mapper.map(parse(f"vllm:prompt_tokens_total{{{E}}} 500\n"), 1.0)
    events = mapper.map(parse(f"vllm:prompt_tokens_total{{{E}}} 40\n"), 2.0)  # vLLM restarted
    assert events[0].tokens == {"recompute": 40}


def test_a_restarted_engines_histogram_counts_from_zero_as_a_whole():
    """TTFT buckets 0.1: 5, 1.0: 5, +Inf: 6 (sum 5.0), then vLLM restarted and served 8:
    0.1: 2, 1.0: 7, +Inf: 8 (sum 6.0). The first bucket went down, so the histogram was reset:
    by hand its 8 observations are [2, 5, 1] with sum 6.0. Read series by series, the buckets
    and sum that grew past their old values counted as small increases: [2, 0, 0], sum 1.0
    (a review)."""
    def scrape(b01, b1, inf, total):
        return parse("".join(
            f'vllm:time_to_first_token_seconds_bucket{{{E},le="{le}"}} {v}\n'
            for le, v in (("0.1", b01), ("1.0", b1), ("+Inf", inf)))
            + f"vllm:time_to_first_token_seconds_sum{{{E}}} {total}\n")

    mapper = MetricsMapper(gpu_snapshot=False)
    mapper.map(scrape(5, 5, 6, 5.0), 1.0)
    (hist,) = [e for e in mapper.map(scrape(2, 7, 8, 6.0), 2.0)
               if isinstance(e, ev.LatencyHistogram)]
    assert (hist.bounds, hist.counts, hist.sum) == ([0.1, 1.0], [2, 5, 1], 6.0)
    # and the scrape after counts from the new values again: one more above 1 s
    (hist,) = [e for e in mapper.map(scrape(2, 7, 9, 8.0), 3.0)
               if isinstance(e, ev.LatencyHistogram)]
    assert (hist.counts, hist.sum) == ([0, 0, 1], 2.0)


def test_the_per_direction_offload_bytes_count_their_first_copy():
    """vLLM makes ``kv_offload_store_bytes`` at its first copy (offloading/metrics.py), while
    the legacy ``kv_offload_total_bytes`` is there at 0 from the start. Without ``_created``
    samples (vLLM's --api-server-count > 1: multiprocess mode) the new series' first value,
    64,000 bytes, was taken as a baseline and lost. On an engine the scrape before saw, it
    is that first copy's: 64,000, then 32,000."""
    def scrape(legacy, store=None):
        text = f'vllm:kv_offload_total_bytes_total{{{E},transfer_type="GPU_to_CPU"}} {legacy}\n'
        if store is not None:
            text += f"vllm:kv_offload_store_bytes_total{{{E}}} {store}\n"
        return parse(text)

    mapper = MetricsMapper(gpu_snapshot=False)
    moved = [[e.bytes for e in mapper.map(scrape(*args), ts) if isinstance(e, ev.Transfer)]
             for ts, args in enumerate([(0,), (64000, 64000), (96000, 96000)], 1)]
    assert moved == [[], [64000], [32000]]


def test_an_engine_started_after_the_agent_is_counted_from_zero():
    """The agent's first scrapes found vLLM not yet up; its first answer already counts 4
    requests: 524 prompt tokens, 384 of them from the GPU prefix cache. prometheus_client's
    ``_created`` samples date the series after the agent started, so they count whole: gpu
    384, recompute 524 - 384 = 140 (they were taken as baselines, and 4 requests went
    uncounted). Series created before the agent started are baselines, as before."""
    def scrape(created, prompt, device):
        return parse(f"vllm:prompt_tokens_total{{{E}}} {prompt}\n"
                     f"vllm:prompt_tokens_created{{{E}}} {created}\n"
                     f'vllm:prompt_tokens_cached_by_source_total{{{E},source="device"}} '
                     f"{device}\n"
                     f'vllm:prompt_tokens_cached_by_source_created{{{E},source="device"}} '
                     f"{created}\n")

    mapper = MetricsMapper(gpu_snapshot=False)
    later = time.time() + 5
    (lookup,) = mapper.map(scrape(later, 524, 384), later)
    assert lookup.tokens == {"gpu": 384, "recompute": 140}
    (lookup,) = mapper.map(scrape(later, 1048, 896), later + 5)  # then as deltas
    assert lookup.tokens == {"gpu": 512, "recompute": 12}
    mapper = MetricsMapper(gpu_snapshot=False)
    assert mapper.map(scrape(time.time() - 3600, 524, 384), later) == []


def test_a_restarted_engine_that_counted_past_its_predecessor_counts_whole():
    """vLLM counted 100 prompt tokens, then 120; restarted, it counted 150 by the agent's next
    scrape, past its predecessor's 120, so the value alone shows no reset: its ``_created``
    time moved on (1000 -> 2000), so all 150 count. Only 30 did (150 - 120). A histogram
    (TTFT) restarted alike counts its new observations whole too."""
    def scrape(created, prompt, ttfts):
        return parse(f"vllm:prompt_tokens_total{{{E}}} {prompt}\n"
                     f"vllm:prompt_tokens_created{{{E}}} {created}\n"
                     f'vllm:time_to_first_token_seconds_bucket{{{E},le="0.1"}} {ttfts}\n'
                     f'vllm:time_to_first_token_seconds_bucket{{{E},le="+Inf"}} {ttfts}\n'
                     f"vllm:time_to_first_token_seconds_count{{{E}}} {ttfts}\n"
                     f"vllm:time_to_first_token_seconds_sum{{{E}}} {ttfts * 0.05}\n"
                     f"vllm:time_to_first_token_seconds_created{{{E}}} {created}\n")

    mapper = MetricsMapper(gpu_snapshot=False)
    counted = []
    for ts, (created, prompt, ttfts) in enumerate([(1000, 100, 2), (1000, 120, 3),
                                                   (2000, 150, 4)], 1):
        events = mapper.map(scrape(created, prompt, ttfts), float(ts))
        counted.append((sum(e.tokens.get("recompute", 0) for e in events
                            if isinstance(e, ev.Lookup)),
                        sum(e.counts[-1] + sum(e.counts[:-1]) for e in events
                            if isinstance(e, ev.LatencyHistogram))))
    assert counted[1:] == [(20, 1), (150, 4)]


# vLLM's offloading metrics, as vLLM's own classes print them: tests/data/vllm_offload_metrics.py
# made each file (two scrapes, two scheduler steps apart) with the vLLM named in its first line;
# test_the_recorded_expositions_are_what_vllm_prints checks them against vLLM where it is.
DATA = REPO_ROOT / "tests" / "data"
NEXT_SCRAPE = "# ---- the next scrape ----\n"
RECORDED = {"vllm-0.32.0-tiering.prom": ("0.32.0", "tiering"),
            "vllm-0.33.0-tiering.prom": ("0.33.0", "tiering"),
            "vllm-0.33.0-cpu.prom": ("0.33.0", "cpu")}
KV_EVENTS_ALL = ("gpu", "cpu", "disk")  # the KV events source's default tiers


def _mapped(name, **kwargs):
    """The events of both scrapes of a recorded exposition, mapped with ``block_bytes`` 32768."""
    mapper = MetricsMapper(block_bytes=32768, **kwargs)
    first, second = (DATA / name).read_text().split(NEXT_SCRAPE)
    return mapper.map(parse(first), 1.0), mapper.map(parse(second), 2.0)


def _transfers(events):
    """(src, dst, blocks, bytes, timed, ok) -> how many, of the Transfer events."""
    out: dict = {}
    for e in events:
        if isinstance(e, ev.Transfer):
            key = (e.src, e.dst, e.blocks, e.bytes, e.timed, e.ok)
            out[key] = out.get(key, 0) + 1
    return out


def _cpu_capacity(events):
    return [(e.capacity_blocks, e.capacity_bytes, e.resident_blocks, e.resident_bytes)
            for e in events if isinstance(e, ev.TierSnapshot) and e.tier == "cpu"]


# vLLM 0.33's promotion times of the second step: 0.003, 0.02, 0.02, 0.7 s, in its buckets
# (0, 0.005], (0.01, 0.025] twice, (0.5, 1]; their sum 0.783 - 0.04 (the first step's) = 0.743.
# Placed at one fraction f of each bucket: 0 + 2 x 0.01 + 0.5 + f x (0.005 + 2 x 0.015 + 0.5)
# = 0.743, f = 0.223 / 0.535.
F = 0.223 / 0.535
PROMOTION_TIMES = [0.005 * F, 0.01 + 0.015 * F, 0.01 + 0.015 * F, 0.5 + 0.5 * F]


def test_vllm_0_33_tiering_beside_kv_events_adds_capacity_lookups_times_and_failures():
    """vLLM 0.33, TieringOffloadingSpec (CPU over fs and obj), the KV events source reporting
    gpu, cpu and disk (the agent's default). By hand, from the recorded scrapes:
    - config_info tier="0:primary": 64 chunks of 2 blocks, 4,194,304 bytes -> cpu capacity 128
      blocks and 4,194,304 bytes, nothing resident (the KV events source's part), each scrape.
    - chunk lookups of the second step: 0:primary 15 - 5 = 10 queries, 6 - 2 = 4 hits; 1:fs
      9 - 3 = 6 queries (the primary's misses), 5 - 2 = 3 hits; 2:obj 4 - 1 = 3 queries, 1 hit
      (its hits series new, on an engine seen before: counted from 0) -> 20 blocks looked up,
      hits cpu 8, disk 6, remote 2.
    - failed jobs (series new in the second scrape, counted from 0): 1 promotion from fs
      (disk->cpu), 2 cascades to it (cpu->disk); no bytes.
    - promotion times: four timed disk->cpu transfers of no bytes, PROMOTION_TIMES.
    - tier bytes (disk->cpu 196,608, cpu->disk 327,680) and gpu->cpu stores: left to KV events.
    """
    first, second = _mapped("vllm-0.33.0-tiering.prom", kv_events_tiers=KV_EVENTS_ALL)
    # baselines only, and the host KV budget (cpu_kv_cache_size_bytes) once
    assert first == [e for e in first if isinstance(e, (ev.TierSnapshot, ev.EngineMemory))]
    assert _cpu_capacity(first) == _cpu_capacity(second) == [(128, 4_194_304, None, None)]
    (lookup,) = [e for e in second if isinstance(e, ev.Lookup)]
    assert (lookup.tokens, lookup.blocks, lookup.block_hits) == (
        {}, 20, {"cpu": 8, "disk": 6, "remote": 2})
    assert _transfers(second) == {("disk", "cpu", 0, 0, False, False): 1,
                                  ("cpu", "disk", 0, 0, False, False): 2,
                                  ("disk", "cpu", 0, 0, True, True): 4}
    failed = [e for e in second if isinstance(e, ev.Transfer) and not e.ok]
    assert {e.reason for e in failed} == {"unknown"}
    times = sorted(e.duration for e in second if isinstance(e, ev.Transfer) and e.timed)
    assert times == pytest.approx(PROMOTION_TIMES) and sum(times) == pytest.approx(0.743)
    assert [type(e) for e in second if not isinstance(e, (ev.Lookup, ev.Transfer,
                                                            ev.TierSnapshot))] == []


def test_the_agent_shows_vllm_0_33_tiering_in_the_catalogs_metrics():
    """The second scrape's events (as above) and the KV events source's cpu snapshot (40 blocks
    of 32,768 bytes resident, capacity unknown: 0) in one agent. Its /metrics, by hand:
    cpu capacity 128 blocks / 4,194,304 bytes and 40 blocks / 1,310,720 bytes resident (the two
    sources' parts added); lookups: cpu 8 hits of 20, so 12 misses; disk asked for those 12: 6
    hits, 6 misses; remote asked for 6: 2 hits, 4 misses; no gpu series (the GPU's lookups are
    not this source's). disk->cpu transfer times PROMOTION_TIMES in kvscope's buckets (le):
    0.0021 <= 0.005, 0.0163 twice <= 0.05, 0.708 <= 1: cumulative 0 at 0.001, 1 at 0.005 and
    0.01, 3 at 0.05 to 0.5, 4 at 1; sum 0.743. Failures by reason unknown: disk->cpu 1,
    cpu->disk 2."""
    agent = Agent(AgentSettings(collectors={"gpu": {"enabled": False},
                                            "host": {"enabled": False}}), with_ingest=False)
    _, second = _mapped("vllm-0.33.0-tiering.prom", kv_events_tiers=KV_EVENTS_ALL)
    agent.pipeline.ingest("kv_events", [ev.TierSnapshot(
        ts=2.0, tier="cpu", capacity_bytes=0, resident_bytes=40 * 32768, capacity_blocks=0,
        resident_blocks=40)])
    agent.pipeline.ingest("vllm_metrics", second)
    value = agent.exposition.registry.get_sample_value
    assert [value(f"kvscope_tier_{what}", {"tier": "cpu"}) for what in (
        "capacity_blocks", "capacity_bytes", "resident_blocks", "resident_bytes")] == [
        128, 4_194_304, 40, 1_310_720]
    lookups = {(tier, result): value("kvscope_lookup_blocks_total",
                                     {"tier": tier, "result": result})
               for tier in ("gpu", "cpu", "disk", "remote") for result in ("hit", "miss")}
    assert lookups == {("gpu", "hit"): None, ("gpu", "miss"): None,
                       ("cpu", "hit"): 8, ("cpu", "miss"): 12, ("disk", "hit"): 6,
                       ("disk", "miss"): 6, ("remote", "hit"): 2, ("remote", "miss"): 4}
    disk = {"src": "disk", "dst": "cpu"}
    buckets = [value("kvscope_transfer_seconds_bucket", {**disk, "le": le})
               for le in ("0.001", "0.005", "0.01", "0.05", "0.1", "0.5", "1.0", "+Inf")]
    assert buckets == [0, 1, 1, 3, 3, 3, 4, 4]
    assert value("kvscope_transfer_seconds_sum", disk) == pytest.approx(0.743)
    assert value("kvscope_transfer_failures_total", {**disk, "reason": "unknown"}) == 1
    assert value("kvscope_transfer_failures_total",
                 {"src": "cpu", "dst": "disk", "reason": "unknown"}) == 2
    assert value("kvscope_transfer_bytes_total", disk) == 0  # the bytes are KV events' to say


def test_vllm_0_33_tiering_without_kv_events_maps_the_tier_bytes_and_no_lookups():
    """No KV events source: the tier bytes are this source's. By hand: a chunk is 4,194,304 /
    64 = 65,536 bytes of 2 blocks; disk->cpu 327,680 - 131,072 = 196,608 bytes = 3 chunks = 6
    blocks; cpu->disk 393,216 - 65,536 = 327,680 = 5 chunks = 10 blocks; gpu->cpu stores
    1,048,576 - 524,288 = 524,288 bytes / 32,768 = 16 blocks. Failures and promotion times as
    beside KV events. No cpu capacity (nothing would report its residency: it would read 0) and
    no lookup blocks (this source then reports the GPU tier, which the agent would take as
    consulted and missed by all 20 blocks)."""
    first, second = _mapped("vllm-0.33.0-tiering.prom")
    assert first == [ev.EngineMemory(ts=1.0, kv_offload_budget=4_194_304)]  # once: the budget
    assert _transfers(second) == {("gpu", "cpu", 16, 524_288, False, True): 1,
                                  ("disk", "cpu", 6, 196_608, False, True): 1,
                                  ("cpu", "disk", 10, 327_680, False, True): 1,
                                  ("disk", "cpu", 0, 0, False, False): 1,
                                  ("cpu", "disk", 0, 0, False, False): 2,
                                  ("disk", "cpu", 0, 0, True, True): 4}
    assert [e for e in second if not isinstance(e, ev.Transfer)] == []
    # vLLM counts the tiers' failed jobs, not failed stores from the GPU
    assert {(e.src, e.dst): e.sees_failures for e in second if e.blocks} == {
        ("gpu", "cpu"): False, ("disk", "cpu"): True, ("cpu", "disk"): True}


def test_vllm_0_32_tiering_maps_what_it_has_and_the_rest_is_absent():
    """vLLM 0.32 has the tiering counters but neither config_info nor promotion times, beside
    a KV events source reporting gpu only. By hand: disk->cpu 196,608 bytes / 32,768
    (block_bytes) = 6 blocks, cpu->disk 327,680 / 32,768 = 10, gpu->cpu 16 (as for 0.33);
    failures 1 and 2; no cpu capacity, no lookup blocks (blocks per chunk unknown), no times."""
    first, second = _mapped("vllm-0.32.0-tiering.prom", kv_events_tiers=("gpu",))
    assert first == []
    assert _transfers(second) == {("gpu", "cpu", 16, 524_288, False, True): 1,
                                  ("disk", "cpu", 6, 196_608, False, True): 1,
                                  ("cpu", "disk", 10, 327_680, False, True): 1,
                                  ("disk", "cpu", 0, 0, False, False): 1,
                                  ("cpu", "disk", 0, 0, False, False): 2}
    assert [e for e in second if not isinstance(e, ev.Transfer)] == []


def test_vllm_0_33_cpu_offloading_gives_the_cpu_tiers_capacity():
    """CPUOffloadingSpec's config_info has no tier label: 64 chunks x 2 blocks = 128 blocks,
    4,194,304 bytes, beside a KV events source reporting cpu; the stores (1,048,576 - 524,288 =
    524,288 bytes) are that source's then. Without it (or with tiers gpu only): no capacity,
    and the stores are this source's (16 blocks)."""
    first, second = _mapped("vllm-0.33.0-cpu.prom", kv_events_tiers=KV_EVENTS_ALL)
    assert first.pop() == ev.EngineMemory(ts=1.0, kv_offload_budget=4_194_304)  # once
    for events, ts in ((first, 1.0), (second, 2.0)):
        assert events == [ev.TierSnapshot(ts=ts, tier="cpu", capacity_bytes=4_194_304,
                                          resident_bytes=None, capacity_blocks=128,
                                          resident_blocks=None)]
    for tiers in ((), ("gpu",)):
        _, second = _mapped("vllm-0.33.0-cpu.prom", kv_events_tiers=tiers)
        assert _transfers(second) == {("gpu", "cpu", 16, 524_288, False, True): 1}
        assert _cpu_capacity(second) == []


def test_tiers_of_other_types_and_vllms_block_metrics_are_left_out():
    """The tier label is ``<index + 1>:<tier_type>`` (kv_offload/tiering/metrics.py,
    ``tier_label``); ``kvcr`` (KVCR's own DRAM and storage), ``example`` and out-of-tree classes
    name no kvscope tier, so their bytes and queries count nowhere: only fs's 4 chunks of
    writes (8 blocks) and the primary's lookups (6 queries, 2 hits -> 12 blocks, 4 hits) remain.
    ``vllm:kv_block_{lifetime,reuse_gap}_seconds`` (--kv-cache-metrics, v1/metrics/loggers.py)
    map to nothing; ``idle_before_evict`` to the gpu tier's idle histogram (1 more above every
    bound, and no sum series: 0)."""
    def text(n):
        tiers = ("1:fs", "2:kvcr", "3:example", "4:MyTier")
        lines = [f'vllm:kv_offload_config_info{{{E},cpu_num_chunks="8",cpu_blocks_per_chunk='
                 f'"2",cpu_kv_cache_size_bytes="8192",cpu_kv_cache_size_tokens="None",'
                 f'tier="0:primary"}} 1.0',
                 f'vllm:kv_offload_tiering_chunk_queries_total{{{E},tier="0:primary"}} {6 * n}',
                 f'vllm:kv_offload_tiering_chunk_hits_total{{{E},tier="0:primary"}} {2 * n}']
        for tier in tiers:
            lines += [f'vllm:kv_offload_tiering_write_bytes_total{{{E},tier="{tier}"}} {4096 * n}',
                      f'vllm:kv_offload_tiering_chunk_queries_total{{{E},tier="{tier}"}} {5 * n}']
        lines += [f'vllm:kv_block_{name}_seconds_bucket{{{E},le="+Inf"}} {n}'
                  for name in ("lifetime", "idle_before_evict", "reuse_gap")]
        return "\n".join(lines) + "\n"

    mapper = MetricsMapper(block_bytes=1024, kv_events_tiers=("gpu",))
    mapper.map(parse(text(1)), 1.0)
    events = mapper.map(parse(text(2)), 2.0)
    (lookup,) = [e for e in events if isinstance(e, ev.Lookup)]
    assert (lookup.blocks, lookup.block_hits) == (12, {"cpu": 4, "disk": 0})
    assert _transfers(events) == {("cpu", "disk", 8, 4096, False, True): 1}
    (idle,) = [e for e in events if isinstance(e, ev.IdleHistogram)]
    assert (idle.tier, idle.bounds, idle.counts, idle.sum) == ("gpu", [], [1], 0.0)
    assert len(events) == 3


def test_spread_keeps_each_observation_in_its_bucket_and_the_sum():
    """Buckets (0, 1], (1, 2], (2, +Inf), one observation each. Sum 10: the finite buckets hold
    at most 1 + 2 = 3, so both sit at their tops and the one above every bound is 10 - 3 = 7.
    Sum 2.5: the lows are 0 + 1 + 2 = 3 > 2.5, so each sits just above its bucket's low (never
    on the bound below: that would be the lower bucket). Sum 4: lows 3, the finite widths 2 ->
    half-way, 0.5 and 1.5, and the top one at 2 (4 - 0.5 - 1.5)."""
    assert spread([1.0, 2.0], [1, 1, 1], 10.0) == [(1.0, 1), (2.0, 1), (7.0, 1)]
    low = spread([1.0, 2.0], [1, 1, 1], 2.5)
    assert [v for v, _ in low] == [math.nextafter(0.0, 1), math.nextafter(1.0, 2),
                                   math.nextafter(2.0, 3)]
    assert spread([1.0, 2.0], [1, 1, 1], 4.0) == [(0.5, 1), (1.5, 1),
                                                  (math.nextafter(2.0, 3), 1)]
    assert spread([1.0, 2.0], [0, 3, 0], 4.5) == [(1.5, 3)]


def test_an_absurd_number_of_promotion_times_is_left_out_once_logged(caplog):
    """A promotion-latency count rising by 10**12 (no vLLM's: one job per tier and step) would
    make 10**12 events: left out, logged once; the next scrape's 1 more (in (0.1, 0.25]) counts,
    placed at the sum's 0.2."""
    def text(count, total):
        name = "vllm:kv_offload_tiering_promotion_latency_seconds"
        labels = f'{E},result="success",tier="1:fs"'
        return (f'{name}_bucket{{{labels},le="0.1"}} 0\n'
                f'{name}_bucket{{{labels},le="0.25"}} {count}\n'
                f'{name}_bucket{{{labels},le="+Inf"}} {count}\n'
                f'{name}_sum{{{labels}}} {total}\n')

    mapper = MetricsMapper(gpu_snapshot=False)
    assert mapper.map(parse(text(0, 0.0)), 1.0) == []
    with caplog.at_level("WARNING"):
        assert mapper.map(parse(text(10**12, 2e11)), 2.0) == []
    assert len(caplog.records) == 1
    (event,) = mapper.map(parse(text(10**12 + 1, 2e11 + 0.2)), 3.0)
    assert (event.src, event.dst, event.timed) == ("disk", "cpu", True)
    assert event.duration == pytest.approx(0.2, abs=1e-4)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_the_recorded_expositions_are_what_vllm_prints(name):
    """Regenerate a file with: <vLLM's python> tests/data/vllm_offload_metrics.py <spec> >
    tests/data/<name> (the 0.32 environment: scripts/vllm_env.sh; 0.33: --gpu-build)."""
    version, spec = RECORDED[name]
    python = vllm_python(gpu_build=version != "0.32.0")
    printed = subprocess.run([python, str(DATA / "vllm_offload_metrics.py"), spec],
                             capture_output=True, text=True, env=child_env(), timeout=300)
    assert printed.returncode == 0, printed.stderr[-4000:]
    assert printed.stdout.splitlines()[0].startswith(f"# vLLM {version} {spec}:"), \
        f"{python} is not vLLM {version}"
    assert printed.stdout == (DATA / name).read_text()


@pytest.fixture
def exposition_server():
    server = Exposition()
    yield server
    server.close()


def _source(server, **kwargs):
    from kvscope.agent.pipeline import Pipeline
    from kvscope.agent.sources.vllm_metrics import VllmMetricsSource

    return VllmMetricsSource(Pipeline(), server.url, mapper=MetricsMapper(gpu_snapshot=False),
                             **kwargs)


def test_ttft_comes_from_spans_while_they_arrive_else_from_the_histogram(exposition_server):
    """vLLM's /metrics served over real HTTP (loopback), scraped four times; span_wait 0, so a
    scrape's histogram is decided at once. Scrape 1 is the baseline; 2 adds 5 TTFTs and no span
    came: they count (5). A span brings a TTFT; 3 adds 3 more, which the spans report: not
    counted (5). 4 adds 2 with no span since scrape 3: counted (7)."""
    span = {"at": float("-inf")}
    source = _source(exposition_server, span_ttft=lambda: span["at"], span_wait=0.0)
    counts = []
    for total, span_before in ((0, False), (5, False), (8, True), (10, False)):
        if span_before:
            span["at"] = time.monotonic()
        exposition_server.body = exposition(0, 0, 0, 0, 0, [("0.1", total), ("+Inf", 0)])
        assert source.scrape_once()
        counts.append(source.pipeline.snapshot().ttft_seconds.count)
    source.shutdown()
    assert counts == [0, 5, 5, 7]


def test_a_stopping_source_scrapes_once_more_unless_the_engine_is_away(exposition_server):
    """A tryout stopped the agent a second after its traffic: vLLM had counted 26,880 prompt
    tokens, the capture 17,304, those to the last 5-second scrape. Started (a baseline of 0
    tokens) with an hour between scrapes, then 1,000 prompt tokens (600 from the GPU cache)
    served: stopping scrapes once more and counts them. A source whose last scrape failed
    (the engine away) does not try again on its way out."""
    exposition_server.body = exposition(0, 0, 0, 0, 0, [("+Inf", 0)])
    source = _source(exposition_server, interval=3600.0)
    source.start()
    assert wait_until(lambda: source.pipeline.snapshot().source_up.get("vllm_metrics"))
    exposition_server.body = exposition(1000, 600, 0, 0, 0, [("+Inf", 0)])
    source.shutdown()
    assert source.pipeline.snapshot().prompt_tokens == {"gpu": 600, "recompute": 400}

    exposition_server.body = "not vLLM's metrics\n"
    source = _source(exposition_server, interval=3600.0)
    scrapes = []
    scrape = source.scrape_once
    source.scrape_once = lambda: scrapes.append(scrape()) or scrapes[-1]
    source.start()
    assert wait_until(lambda: scrapes == [False])
    source.shutdown()
    assert scrapes == [False]


def test_the_kv_offload_budget_comes_back_after_the_engine_restarts(exposition_server):
    """vLLM 0.32 with --kv-offloading-size 16 (GiB) over real HTTP: the budget is 16 x 2^30
    bytes. vLLM restarts: a scrape fails, and the agent forgets the source's gauges and memory
    reports. It comes back with the same flag: the budget is reported again (it was left out
    for good, as unchanged since the mapper last sent it)."""
    source = _source(exposition_server)
    budget = lambda: source.pipeline.engine_memory().get(("vllm_metrics", ""), {}).get(
        "kv_offload_budget")
    up = ('vllm:cache_config_info{engine="0",kv_offloading_size="16"} 1.0\n'
          'vllm:num_requests_waiting{engine="0"} 0\n')
    seen = []
    for body in (up, "vLLM restarting: not its metrics\n", up, up):
        exposition_server.body = body
        source.scrape_once()
        seen.append(budget())
    source.shutdown()
    assert seen == [16 << 30, None, 16 << 30, 16 << 30]


def test_a_tap_counting_the_same_prompt_tokens_is_warned_of_once(exposition_server, caplog):
    """vLLM's /metrics over real HTTP, scraped alone: 1,000 prompt tokens (600 from the GPU
    cache) counted once, no warning (a near miss: this source's own tokens). Then the tap's
    Lookup of a 1,000-token prompt reaches the pipeline too (source "vllm"): the next scrape
    finds 2,000 tokens where it delivered 1,000 and warns once, naming the config key; a later
    scrape does not warn again."""
    source = _source(exposition_server)
    warned = lambda: [r for r in caplog.records if "counted by another source" in r.message]
    for prompt, device in ((0, 0), (1000, 600)):
        exposition_server.body = exposition(prompt, device, 0, 0, 0, [("+Inf", 0)])
        assert source.scrape_once()
    assert sum(source.pipeline.snapshot().prompt_tokens.values()) == 1000
    assert not source.shared_prompt_tokens and not warned()
    source.pipeline.ingest("vllm", [ev.Lookup(ts=1.0, request_id="r", tokens={
        "gpu": 600, "recompute": 400}, blocks=62)])
    for prompt in (1500, 2000):
        exposition_server.body = exposition(prompt, 600, 0, 0, 0, [("+Inf", 0)])
        assert source.scrape_once()
    source.shutdown()
    assert source.shared_prompt_tokens
    (record,) = warned()
    assert "(one of: vllm)" in record.message  # of the sources sending events
    assert "KVSCOPE_VLLM_METRICS__ENABLED=false" in record.message


def test_a_hostile_exposition_never_stops_the_scraper_nor_breaks_the_metrics(exposition_server):
    """Each of these once killed the scraper's thread or made the agent's /metrics fail for
    good: a NaN or infinite counter (skipped: no counter holds one), a bucket bound that is no
    number (that histogram is left out), and a counter jumping to 1.7e308 (its increase is out
    of bounds: the event is dropped as invalid, 1). Every scrape still succeeds, and the good
    counter keeps counting: 100 prompt tokens then 50 more, all recomputed."""
    source = _source(exposition_server)
    bodies = ["vllm:prompt_tokens_total 1000\n",
              "vllm:prompt_tokens_total NaN\nvllm:num_requests_running 0\n",
              "vllm:prompt_tokens_total 1100\nvllm:kv_offload_load_bytes_total +Inf\n",
              'vllm:time_to_first_token_seconds_bucket{le="abc"} 3\n'
              "vllm:prompt_tokens_total 1150\nvllm:kv_offload_load_bytes_total 0\n",
              "vllm:prompt_tokens_total 1150\nvllm:kv_offload_load_bytes_total 1.7e308\n"]
    for body in bodies:
        exposition_server.body = body
        assert source.scrape_once(), body
    snap = source.pipeline.snapshot()
    source.shutdown()
    assert snap.prompt_tokens["recompute"] == 150 and snap.transfer_bytes == {}
    assert snap.events_dropped == {("vllm_metrics", "invalid"): 1}
    assert snap.source_up == {"vllm_metrics": True}



def test_absurd_tiering_counters_never_fail_a_scrape(exposition_server):
    """A CPU tier of 1-byte chunks, then 1.7e308 bytes written to fs, 1.7e308 chunks queried
    and 1e300 failed jobs: blocks of 1.7e308 x 64 chunks / 1 byte once raised (an integer too
    large for a float) and failed every scrape. Now both scrapes succeed; the transfer and the
    lookup are out of bounds (2 dropped as invalid), the failed jobs over MAX_OBSERVATIONS left
    out."""
    source = _source(exposition_server)
    info = ('vllm:kv_offload_config_info{engine="0",tier="0:primary",cpu_num_chunks="64",'
            'cpu_blocks_per_chunk="2",cpu_kv_cache_size_bytes="1"} 1\n')
    for n, failed in (("0", "0"), ("1.7e308", "1e300")):
        exposition_server.body = (
            info + f'vllm:kv_offload_tiering_write_bytes_total{{engine="0",tier="1:fs"}} {n}\n'
            f'vllm:kv_offload_tiering_chunk_queries_total{{engine="0",tier="0:primary"}} {n}\n'
            'vllm:kv_offload_tiering_cascade_job_failures_total{engine="0",tier="1:fs"} '
            f'{failed}\n')
        assert source.scrape_once(), n
    snap = source.pipeline.snapshot()
    source.shutdown()
    assert snap.events_dropped == {("vllm_metrics", "invalid"): 2}
    assert snap.transfer_bytes == {} and snap.transfer_failures == {}
    assert snap.source_up == {"vllm_metrics": True}

def test_an_answer_without_vllm_series_is_a_failed_scrape(exposition_server):
    """A url that answers 200 with an HTML page, or with another server's metrics (a wrong
    port): the source was up and read nothing, so KvscopeSourceDown never fired."""
    source = _source(exposition_server)
    for body in ("<html><body>It works!</body></html>\n", "process_cpu_seconds_total 1.5\n"):
        exposition_server.body = body
        assert not source.scrape_once(), body
        assert source.pipeline.snapshot().source_up == {"vllm_metrics": False}
    exposition_server.body = "vllm:prompt_tokens_total 10\n"
    assert source.scrape_once()
    source.shutdown()


def test_a_ttft_bucket_missing_from_one_scrape_is_counted_once():
    """Buckets le=0.1/1/+Inf go 10/20/30, then 15/NaN/40 (NaN: dropped, the bucket missing),
    then 15/30/40: the +Inf bucket rose by 10, so 10 observations, 5 under 0.1 s and 5 in
    (0.1, 1]. They once counted 20: 5 + 5 (one in +Inf) in the second scrape, 10 more in the
    third. Then vLLM restarts with buckets 0.5/+Inf (3/5, twice, the new baseline) and goes
    on to 4/7: one more under 0.5 s and one above."""
    mapper = MetricsMapper()
    name = "vllm:time_to_first_token_seconds_bucket"

    def scrape(buckets):
        text = "".join(f'{name}{{le="{le}"}} {n}\n' for le, n in buckets.items())
        return [e for e in mapper.map(parse(text), 1.0) if isinstance(e, ev.LatencyHistogram)]

    counted = [scrape({"0.1": 10, "1.0": 20, "+Inf": 30}), scrape({"0.1": 15, "1.0": "NaN",
                                                                   "+Inf": 40})]
    assert counted == [[], []]
    (hist,) = scrape({"0.1": 15, "1.0": 30, "+Inf": 40})
    assert (hist.bounds, hist.counts) == ([0.1, 1.0], [5, 5, 0])
    assert scrape({"0.5": 3, "+Inf": 5}) == [] and scrape({"0.5": 3, "+Inf": 5}) == []
    (hist,) = scrape({"0.5": 4, "+Inf": 7})
    assert (hist.bounds, hist.counts) == ([0.5], [1, 1])


def test_an_engine_joining_costs_no_other_engines_observations():
    """Engine 0 serves 10 requests per interval (le=1 / +Inf go 0/0, 5/10, 10/20, 15/30,
    20/40: 40); engine 1 joins at the third scrape (0/0, then 5/10, 10/20: 20 once its first
    scrape is its baseline). 60 in all; a check of the whole bucket set once threw away two
    intervals of every engine when one joined (30 counted)."""
    mapper = MetricsMapper(gpu_snapshot=False)
    scrapes = [{"0": (0, 0)}, {"0": (5, 10)}, {"0": (10, 20), "1": (0, 0)},
               {"0": (15, 30), "1": (5, 10)}, {"0": (20, 40), "1": (10, 20)}]
    assert _ttft_counted(mapper, scrapes) == 60


def _ttft_counted(mapper, scrapes):
    """Observations the TTFT histograms of ``scrapes`` ({engine: (le=1 count, +Inf count)}
    each) count in all."""
    name = "vllm:time_to_first_token_seconds_bucket"
    counted = 0
    for engines in scrapes:
        text = "".join(f'{name}{{engine="{e}",le="1.0"}} {a}\n{name}{{engine="{e}",le="+Inf"}} {b}\n'
                       for e, (a, b) in engines.items())
        counted += sum(sum(e.counts) for e in mapper.map(parse(text), 1.0)
                       if isinstance(e, ev.LatencyHistogram))
    return counted


def test_the_ttft_sum_waits_with_its_engines_buckets():
    """Every TTFT is 1.0 s, 10 per interval; vLLM restarts with other buckets (counters from 0)
    after the second scrape: the two intervals its buckets cannot be read over are left out of
    the sum as of the counts, so count 20 and sum 20.0 (mean 1.0 s, not 1.5: a review)."""
    name, total = "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum"
    mapper = MetricsMapper(gpu_snapshot=False)
    count = seconds = 0
    for buckets, observed in (({"2.0": 0, "+Inf": 0}, 0), ({"2.0": 10, "+Inf": 10}, 10),
                              ({"1.5": 10, "+Inf": 10}, 10), ({"1.5": 20, "+Inf": 20}, 20),
                              ({"1.5": 30, "+Inf": 30}, 30)):
        text = "".join(f'{name}{{le="{le}"}} {n}\n' for le, n in buckets.items())
        for hist in mapper.map(parse(text + f"{total} {observed}\n"), 1.0):
            if isinstance(hist, ev.LatencyHistogram):
                count, seconds = count + sum(hist.counts), seconds + hist.sum
    assert (count, seconds) == (20, 20.0)


def test_an_engine_missing_from_every_other_scrape_keeps_being_counted():
    """Engine 0 counts 10 (its first scrape a baseline); vLLM restarts as engines a and b, 10
    requests per interval each, b's lines missing from every other scrape (i = 1..20, b at odd
    i). a: first scrape a baseline, then 19 x 10 = 190; b: baseline at i=1, seen last at i=19:
    18 x 10 = 180. 380 in all; a check of the whole bucket set counted 10 (never twice alike)."""
    scrapes = [{"0": (0, 0)}, {"0": (5, 10)}]
    for i in range(1, 21):
        scrapes.append({"a": (5 * i, 10 * i), **({"b": (5 * i, 10 * i)} if i % 2 else {})})
    assert _ttft_counted(MetricsMapper(gpu_snapshot=False), scrapes) == 10 + 190 + 180


def test_a_series_missing_from_one_scrape_is_no_counter_reset():
    """Two engines at 1,000,000 prompt tokens each; engine 1's line is missing from one scrape
    (or unparsable): summing first read that as a reset and added 1,000,000 phantom tokens.
    Per series, the increase is engine 0's 10 + 10 (engine 1 starts over from its baseline)."""
    mapper = MetricsMapper(gpu_snapshot=False)
    both = 'vllm:prompt_tokens_total{{engine="0"}} {}\nvllm:prompt_tokens_total{{engine="1"}} {}\n'
    recomputed = 0
    for text in (both.format(1_000_000, 1_000_000),
                 'vllm:prompt_tokens_total{engine="0"} 1000010\n',
                 both.format(1_000_020, 1_000_000)):
        recomputed += sum(e.tokens.get("recompute", 0) for e in mapper.map(parse(text), 1.0))
    assert recomputed == 20


def test_a_request_straddling_a_scrape_counts_its_recomputed_tokens_once():
    """vLLM counts a request's cached tokens when it schedules it and its prompt tokens at its
    first token. A 10,000-token prompt with 8,000 cached (device) falls across a scrape: the
    first scrape sees the 8,000 cached, the next the 10,000 prompt tokens. Recomputed: 10,000 -
    8,000 = 2,000, gpu 8,000; 10,000 in all. Scrape by scrape (cut at 0) it was 10,000
    recomputed, 18,000 in all."""
    mapper = MetricsMapper(gpu_snapshot=False)
    tokens: dict[str, int] = {}
    for prompt, device in ((0, 0), (0, 8000), (10_000, 8000)):
        text = (f"vllm:prompt_tokens_total{{{E}}} {prompt}\n"
                f'vllm:prompt_tokens_cached_by_source_total{{{E},source="device"}} {device}\n')
        for event in mapper.map(parse(text), 1.0):
            for source, n in event.tokens.items():
                tokens[source] = tokens.get(source, 0) + n
    assert tokens == {"gpu": 8000, "recompute": 2000}


def test_cached_tokens_never_matched_by_prompt_tokens_are_forgotten_after_a_scrape():
    """A request with 8,000 cached tokens is aborted before its first token: vLLM never counts
    its prompt tokens. The next scrape sees nothing new; the one after, a 10,000-token prompt
    with nothing cached: all 10,000 recomputed (carried on, the aborted request's 8,000 took
    8,000 off every later prompt's)."""
    mapper = MetricsMapper(gpu_snapshot=False)
    recomputed = []
    for prompt, device in ((0, 0), (0, 8000), (0, 8000), (10_000, 8000)):
        text = (f"vllm:prompt_tokens_total{{{E}}} {prompt}\n"
                f'vllm:prompt_tokens_cached_by_source_total{{{E},source="device"}} {device}\n')
        recomputed.append(sum(e.tokens.get("recompute", 0) for e in mapper.map(parse(text), 1.0)))
    assert recomputed == [0, 0, 0, 10_000]


def test_the_gpu_tier_adds_each_engines_own_share_of_its_own_blocks():
    """Engine 0: 25% of 100 blocks, engine 1: 50% of 200: 125 of 300 blocks resident (adding
    the shares first made 0.75 x 300 = 225). The scheduler's usage is the fuller engine's, 0.5."""
    text = ('vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
            'vllm:kv_cache_usage_perc{engine="1"} 0.5\n'
            'vllm:cache_config_info{engine="0",num_gpu_blocks="100"} 1.0\n'
            'vllm:cache_config_info{engine="1",num_gpu_blocks="200"} 1.0\n')
    gpu, stats = MetricsMapper(block_bytes=100).map(parse(text), 1.0)
    assert (gpu.resident_blocks, gpu.capacity_blocks, gpu.resident_bytes) == (125, 300, 12_500)
    assert stats == ev.SchedulerStats(ts=1.0, gpu_kv_usage=0.5)


def scheduler_exposition(running, waiting, capacity, preemptions, usage):
    """vLLM 0.32's and 0.33's scheduler series as prometheus_client prints them for two engines
    of one model (``v1/metrics/loggers.py``, the same in both: gauges
    ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (``num_waiting_reqs`` +
    ``num_skipped_waiting_reqs``), ``vllm:num_requests_waiting_by_reason{reason}`` (its split:
    capacity, deferred), ``vllm:kv_cache_usage_perc`` (a share, "1 means 100 percent usage");
    counter ``vllm:num_preemptions``, printed as ``_total`` and ``_created``; labels
    ``model_name``, ``engine``). Each argument: the value per engine, (engine 0, engine 1)."""
    lines = []
    for name, kind, values in (("vllm:num_requests_running", "gauge", running),
                               ("vllm:num_requests_waiting", "gauge", waiting),
                               ("vllm:kv_cache_usage_perc", "gauge", usage),
                               ("vllm:num_preemptions", "counter", preemptions)):
        lines += [f"# HELP {name} (vLLM's help)", f"# TYPE {name} {kind}"]
        for engine, value in enumerate(values):
            labels = f'engine="{engine}",model_name="m"'
            if kind == "counter":
                lines += [f"{name}_total{{{labels}}} {float(value)}",
                          f"{name}_created{{{labels}}} 1.7644e+09"]
            else:
                lines.append(f"{name}{{{labels}}} {float(value)}")
    name = "vllm:num_requests_waiting_by_reason"
    lines += [f"# HELP {name} (vLLM's help)", f"# TYPE {name} gauge"]
    for engine, (total, for_capacity) in enumerate(zip(waiting, capacity)):
        labels = f'engine="{engine}",model_name="m"'
        lines += [f'{name}{{{labels},reason="capacity"}} {float(for_capacity)}',
                  f'{name}{{{labels},reason="deferred"}} {float(total - for_capacity)}']
    return "\n".join(lines) + "\n"


# three scrapes of two engines: running, waiting, of those waiting for capacity, preemptions
# (cumulative; engine 0 restarts before the third), GPU KV cache usage
SCHEDULER_SCRAPES = [((2, 1), (4, 0), (3, 0), (5, 0), (0.9375, 0.25)),
                     ((2, 2), (6, 1), (6, 0), (8, 1), (1.0, 0.5)),
                     ((0, 2), (0, 1), (0, 1), (2, 1), (0.0, 0.5))]


def test_the_scheduler_maps_to_one_event_per_scrape_over_both_engines():
    """By hand (engine 0 + engine 1; usage the larger):
    scrape 1: running 2 + 1 = 3, waiting 4 + 0 = 4, preemptions 0 (the counter's baseline: a
    number, as vLLM counts preemptions), usage 0.9375;
    scrape 2: running 4, waiting 7, preemptions (8 - 5) + (1 - 0) = 4, usage 1.0;
    scrape 3 (engine 0 restarted): running 2, waiting 1, preemptions 2 (reset: its value) + 0,
    usage 0.5. waiting_by_reason (its split) counts nowhere: 4, 7, 1 are the totals. The same
    with gpu_snapshot off (the KV events source reports the GPU tier): these are no tier's."""
    for gpu_snapshot in (True, False):
        mapper = MetricsMapper(gpu_snapshot=gpu_snapshot)
        stats = [mapper.map(parse(scheduler_exposition(*scrape)), float(i))
                 for i, scrape in enumerate(SCHEDULER_SCRAPES)]
        assert stats == [[ev.SchedulerStats(ts=0.0, waiting=4, running=3, preemptions=0,
                                            gpu_kv_usage=0.9375)],
                         [ev.SchedulerStats(ts=1.0, waiting=7, running=4, preemptions=4,
                                            gpu_kv_usage=1.0)],
                         [ev.SchedulerStats(ts=2.0, waiting=1, running=2, preemptions=2,
                                            gpu_kv_usage=0.5)]]


def test_the_agent_shows_vllms_scheduler_under_its_source_and_refuses_a_usage_over_one(
        exposition_server):
    """The three scrapes above, served over HTTP and scraped into an agent: its /metrics says
    waiting 1, running 2, usage 0.5 (the last scrape's) and preemptions 0 + 4 + 2 = 6, under
    source vllm_metrics. Then a scrape whose usage reads 1.5 (no share; vLLM's is at most 1):
    its event is dropped and counted invalid, and the gauges keep their values."""
    from kvscope.agent.sources.vllm_metrics import VllmMetricsSource

    agent = Agent(AgentSettings(collectors={"gpu": {"enabled": False},
                                            "host": {"enabled": False}}), with_ingest=False)
    source = VllmMetricsSource(agent.pipeline, exposition_server.url, mapper=MetricsMapper())
    for scrape in SCHEDULER_SCRAPES:
        exposition_server.body = scheduler_exposition(*scrape)
        assert source.scrape_once()
    value = agent.exposition.registry.get_sample_value
    names = ("kvscope_requests_waiting", "kvscope_requests_running", "kvscope_preemptions_total",
             "kvscope_gpu_kv_cache_usage_ratio")
    assert [value(name, {"source": "vllm_metrics"}) for name in names] == [1, 2, 6, 0.5]
    exposition_server.body = scheduler_exposition(*SCHEDULER_SCRAPES[2][:4], (1.5, 0.5))
    assert source.scrape_once()
    assert [value(name, {"source": "vllm_metrics"}) for name in names] == [1, 2, 6, 0.5]
    assert value("kvscope_events_dropped_total",
                 {"source": "vllm_metrics", "reason": "invalid"}) == 1
    source.shutdown()


# vllm:cache_config_info as vLLM 0.32's CPU build prints it: PrometheusStatLogger.log_metrics_info
# ("cache_config", CacheConfig(block_size=16, cache_dtype="fp8_e4m3",
# enable_prefix_caching=False)) for engine 0, into a registry of its own
CACHE_CONFIG_INFO = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{_block_size_resolved="True",block_size="16",cache_dtype="fp8_e4m3",'
    'cache_hit_alignment_tokens="None",effective_attention_block_size="None",'
    'enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="False",engine="0",'
    'gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",'
    'kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="None",'
    'kv_cache_memory_bytes="None",kv_cache_size_tokens="None",kv_offloading_backend="native",'
    'kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",'
    'mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",'
    'mamba_ssm_cache_dtype="auto",num_cpu_blocks="None",num_gpu_blocks="None",'
    'num_gpu_blocks_override="None",prefix_cache_retention_interval="0",'
    'prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",'
    'skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",'
    'use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="True"} 1.0\n')


def test_cache_config_info_gives_the_engines_kv_cache_settings(exposition_server):
    """vLLM's cache_config_info, served over HTTP and scraped into an agent: its /metrics says
    prefix caching off and an 8-bit KV cache (fp8_e4m3) under source vllm_metrics; then the
    server restarted with prefix caching on and cache_dtype auto replaces that series. An
    exposition without the series, or with enable_prefix_caching neither True nor False,
    says nothing."""
    from kvscope.agent.sources.vllm_metrics import VllmMetricsSource

    agent = Agent(AgentSettings(collectors={"gpu": {"enabled": False},
                                            "host": {"enabled": False}}), with_ingest=False)
    source = VllmMetricsSource(agent.pipeline, exposition_server.url, mapper=MetricsMapper())
    value = agent.exposition.registry.get_sample_value
    name = "kvscope_engine_cache_config_info"
    exposition_server.body = CACHE_CONFIG_INFO
    assert source.scrape_once()
    assert value(name, {"source": "vllm_metrics", "prefix_caching": "off",
                        "kv_cache_dtype": "8bit"}) == 1
    exposition_server.body = CACHE_CONFIG_INFO.replace(
        'enable_prefix_caching="False"', 'enable_prefix_caching="True"').replace(
        'cache_dtype="fp8_e4m3"', 'cache_dtype="auto"')
    assert source.scrape_once()
    assert value(name, {"source": "vllm_metrics", "prefix_caching": "on",
                        "kv_cache_dtype": "auto"}) == 1
    assert agent.pipeline.snapshot().cache_config == {"vllm_metrics": ("on", "auto")}
    source.shutdown()
    assert cache_config(parse("vllm:num_requests_running 0\n")) is None
    assert cache_config(parse(CACHE_CONFIG_INFO.replace('"False",engine', '"None",engine'))) \
        is None


@pytest.mark.parametrize("trickle", ["body", "headers"])
def test_a_server_that_trickles_its_answer_fails_the_scrape_within_the_timeout(
        exposition_server, trickle):
    """A Content-Length of 1e8 and then one byte per 0.2 s, or one byte of a header per 0.2 s:
    httpx's timeout bounds each read, not the answer, so the scrape (and the agent's stop)
    once waited forever, for trickled headers until a hostile trial found it. With timeout 1 s
    the scrape fails and the source is down (the thread bounds the test, not its speed)."""
    exposition_server.trickle = trickle
    source = _source(exposition_server, timeout=1.0)
    result = []
    thread = threading.Thread(target=lambda: result.append(source.scrape_once()), daemon=True)
    thread.start()
    thread.join(60)
    assert result == [False]
    assert source.pipeline.snapshot().source_up == {"vllm_metrics": False}
    source.shutdown()


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports




@pytest.fixture
def vllm_serve(tmp_path):
    """An agent on loopback (ingest, /v1/traces, vLLM metrics scraping) and vLLM's OpenAI
    server with the kvscope tap, exporting spans to the agent over OTLP/HTTP."""
    yield from _served(tmp_path, tap=True)


def _served(tmp_path, tap: bool, **settings):
    """The agent (with ``settings`` besides its own) and vLLM's OpenAI server (24 GPU blocks of
    32 tokens) with the kvscope tap over a CPU tier of 64 blocks or, without ``tap``, alone
    (zero-code mode: vLLM's CPU offloading spec runs on CUDA and XPU only, so the GPU's
    prefix cache alone); yields (agent, vLLM's URL, model, vLLM's log)."""
    python = vllm_python()
    agent_port, vllm_port = _free_ports(2)
    endpoint = f"ipc://{tmp_path}/ingest.sock"
    agent = Agent(AgentSettings(
        ingest={"endpoint": endpoint}, collectors={"gpu": {"enabled": False}},
        vllm_metrics={"enabled": True, "url": f"http://127.0.0.1:{vllm_port}/metrics",
                      "interval": 1.0, "block_bytes": 32768}, **settings))
    agent.start()
    server = uvicorn.Server(uvicorn.Config(create_app(agent), host="127.0.0.1", port=agent_port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    model = tmp_path / "tiny-llama"
    model.mkdir()
    driver = json.loads(subprocess.run(
        [python, "-c", "import json, tests.vllm_driver as d; print(json.dumps(d.MODEL))"],
        capture_output=True, text=True, env=child_env(), timeout=60, check=True).stdout)
    (model / "config.json").write_text(json.dumps(driver))
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float32",
           "--max-model-len", "512", "--block-size", "32", "--num-gpu-blocks-override", "24",
           "--kv-cache-memory-bytes", str(24 * 32768), "--enforce-eager", "--max-num-seqs", "2",
           "--host", "127.0.0.1", "--port", str(vllm_port),
           "--otlp-traces-endpoint", f"http://127.0.0.1:{agent_port}/v1/traces"]
    if tap:
        extra = {"spec_name": "KvscopeOffloadingSpec",
                 "spec_module_path": "kvscope.agent.taps.vllm", "kvscope_endpoint": endpoint,
                 "cpu_bytes_to_use": 64 * 32768}
        cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "OffloadingConnector",
                                                    "kv_role": "kv_both",
                                                    "kv_connector_extra_config": extra})]
    env = dict(child_env(), OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
               OTEL_BSP_SCHEDULE_DELAY="200")
    log = tmp_path / "vllm_serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{vllm_port}"
        up = wait_until(lambda: proc.poll() is None and _ok(f"{base}/health"), 240)
        if not up:
            pytest.fail(f"vllm serve not up (rc {proc.poll()}):\n{tail(log)}")
        yield agent, base, str(model), log
    finally:
        kill_group(proc)
        server.should_exit = True
        thread.join(10)
        agent.shutdown()


def _ok(url):
    try:
        return httpx.get(url, timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def test_vllm_serve_metrics_spans_and_tap_reach_the_agent(vllm_serve):
    agent, base, model, log = vllm_serve
    prefix = [(i * 7) % 500 + 3 for i in range(256)]
    ids = []
    with httpx.Client(base_url=base, timeout=120, trust_env=False) as client:
        for tail_tokens in ([5, 6, 7], [8, 9, 10]):
            response = client.post("/v1/completions", json={
                "model": model, "prompt": prefix + tail_tokens, "max_tokens": 4,
                "temperature": 0})
            assert response.status_code == 200, response.text
            ids.append(response.json()["id"])
        text = client.get("/metrics").text
    # the mapping of the very exposition vLLM serves
    mapper = MetricsMapper(block_bytes=32768)
    zeros = {key: 0.0 for key in parse(text)}  # vLLM before any request: every counter at 0
    mapper.map(zeros, 0.0)
    events = mapper.map(parse(text), 1.0)
    kinds = {type(e).__name__ for e in events}
    assert {"Lookup", "Transfer", "LatencyHistogram", "TierSnapshot",
            "SchedulerStats"} <= kinds, kinds
    # both requests done, one after the other in 24 blocks: none waits, runs or was preempted
    (stats,) = [e for e in events if isinstance(e, ev.SchedulerStats)]
    assert (stats.waiting, stats.running, stats.preemptions) == (0, 0, 0)
    assert 0.0 <= stats.gpu_kv_usage <= 1.0
    hist = next(e for e in events if isinstance(e, ev.LatencyHistogram))
    assert sum(hist.counts) == 2 and hist.bounds  # both requests' TTFTs
    lookup = next(e for e in events if isinstance(e, ev.Lookup))
    assert lookup.tokens["gpu"] >= 256 - 32 and lookup.tokens["recompute"] > 0
    # the agent's own scrape: source up, events received
    assert wait_until(lambda: agent.pipeline.snapshot().source_up.get("vllm_metrics"), 120)
    assert wait_until(lambda: agent.pipeline.snapshot().events_received.get("vllm_metrics", 0) > 0, 120)
    # ... and its /metrics has vLLM's scheduler under the source, measured (0), not absent
    def scheduler():
        value = agent.exposition.registry.get_sample_value
        return [value(name, {"source": "vllm_metrics"}) for name in (
            "kvscope_requests_waiting", "kvscope_requests_running", "kvscope_preemptions_total")]
    assert wait_until(lambda: scheduler() == [0, 0, 0], 60), scheduler()
    usage = agent.exposition.registry.get_sample_value("kvscope_gpu_kv_cache_usage_ratio",
                                                       {"source": "vllm_metrics"})
    assert usage is not None and 0.0 <= usage <= 1.0
    # vLLM's KV cache settings from its cache_config_info: prefix caching on (vLLM's default,
    # and the second request's GPU hits above), no --kv-cache-dtype: auto
    assert cache_config(parse(text)) == (True, "auto")
    # the tap reports the same settings under its own source (read from vLLM's config)
    assert agent.pipeline.snapshot().cache_config == {"vllm_metrics": ("on", "auto"),
                                                      "vllm": ("on", "auto")}
    # the second request reused the prefix from the GPU prefix cache (tap's lookup)
    assert wait_until(lambda: all(agent.pipeline.requests.get(f"{i}-0") for i in ids), 120), \
        (ids, [r.request_id for r in agent.pipeline.requests.recent(10)], tail(log))
    # vLLM's spans reach /v1/traces and join the tap's records (same external request id):
    # a span after the tap's finish enriches its record (joined); one before it finishes the
    # record, and the tap's finish fills in what the span lacks (not a second request)
    receiver = agent.otlp_receiver
    assert wait_until(lambda: receiver.received - receiver.ignored >= 2, 120), (
        receiver.received, receiver.ignored, agent.pipeline.snapshot().events_dropped, tail(log))
    # a span may come before the tap's batch (sent every 0.25 s): the record holds the tap's
    # lookup once that came too (CI once read it in between: the span's record, no tokens)
    second = lambda: agent.pipeline.requests.get(f"{ids[1]}-0")  # noqa: E731
    assert wait_until(lambda: second().tokens.get("gpu", 0) >= 256 - 32, 60), second()
    assert second().ttft and len(second().trace_id) == 32
    # counted once joined: after the receiver's wait (6 s), on the agent's sampling thread
    assert wait_until(lambda: agent.pipeline.snapshot().requests == 2, 60)


def test_a_zero_code_capture_of_vllm_serve_holds_its_tokens_by_source(tmp_path):
    """vLLM serving without the tap, seen through /metrics and its spans: three prompts of 256
    + 3 tokens, A, B, then A again (777 prompt tokens by hand; A's second time reuses its 8
    full blocks of 32 tokens from the GPU's prefix cache). The requests' records (spans) carry
    no tokens by source, so the capture read "not measured" for hit quality; its token totals
    now hold what vLLM counted and the agent exported: the spans' 777 prompt tokens, A's
    prefix among them from the GPU, so compare prices them with the spans' prefill seconds."""
    from kvscope.analysis.capture_reader import read_request_sample, read_token_totals

    capture = tmp_path / "capture"
    served = _served(tmp_path, tap=False, capture_dir=capture)
    agent, base, model, log = next(served)
    try:
        a, b = ([(i * 7 + 97 * n) % 500 + 3 for i in range(256)] for n in range(2))
        with httpx.Client(base_url=base, timeout=120, trust_env=False) as client:
            for prefix in (a, b, a):
                response = client.post("/v1/completions", json={
                    "model": model, "prompt": prefix + [5, 6, 7], "max_tokens": 4,
                    "temperature": 0})
                assert response.status_code == 200, response.text
        counted = lambda: agent.pipeline.snapshot().prompt_tokens  # noqa: E731
        assert wait_until(lambda: sum(counted().values()) == 3 * 259, 120), (counted(), tail(log))
        assert wait_until(lambda: agent.pipeline.snapshot().requests == 3, 120), tail(log)
        exported = {s: n for s, n in counted().items() if n}
    finally:
        next(served, None)  # stops vLLM and the agent, which finishes the capture
    assert {s: n for s, n in read_token_totals(capture).items() if n} == exported
    sample = read_request_sample(capture)
    assert len(sample.ttft) == 3 and sum(sample.tokens.values()) == 3 * 259
    assert sample.tokens["gpu"] >= 256 - 32 and sample.tokens["recompute"] > 0
    assert sample.prefill_seconds > 0  # the spans' prefill prices the counted tokens


def _idle_scrape(mapper, buckets, total, engine="0"):
    """One scrape of vLLM's idle-before-evict histogram of engine ``engine`` in vLLM's format
    (``{le: cumulative count}``, the sum ``total``), and the IdleHistogram events it made."""
    name = "vllm:kv_block_idle_before_evict_seconds"
    labels = f'engine="{engine}",model_name="tiny"'
    text = (f"# HELP {name} Histogram of idle time before KV cache block eviction.\n"
            f"# TYPE {name} histogram\n"
            + "".join(f'{name}_bucket{{{labels},le="{le}"}} {n}\n' for le, n in buckets.items())
            + f"{name}_count{{{labels}}} {buckets['+Inf']}\n{name}_sum{{{labels}}} {total}\n")
    return [e for e in mapper.map(parse(text), 1.0) if isinstance(e, ev.IdleHistogram)]


def test_gpu_idle_before_eviction_comes_as_bucket_deltas():
    """vLLM's buckets 0.5/2/30/+Inf go 1/1/2/2 (sum 40: the baseline), then 3/6/7/8 (sum
    130.5): 6 more observations, 2 under 0.5 s, 3 in (0.5, 2], 0 in (2, 30] and 1 above, summing
    90.5 s, all of the gpu tier. A scrape with nothing new makes no event; the pipeline puts
    them in its buckets holding their upper bounds: 0.5 -> 1, 2 -> 10."""
    mapper = MetricsMapper(gpu_snapshot=False)
    assert _idle_scrape(mapper, {"0.5": 1, "2.0": 1, "30.0": 2, "+Inf": 2}, 40.0) == []
    (hist,) = _idle_scrape(mapper, {"0.5": 3, "2.0": 6, "30.0": 6, "+Inf": 8}, 130.5)
    assert (hist.tier, hist.bounds, hist.counts, hist.sum) == \
        ("gpu", [0.5, 2.0, 30.0], [2, 3, 0, 1], 90.5), hist
    assert _idle_scrape(mapper, {"0.5": 3, "2.0": 6, "30.0": 6, "+Inf": 8}, 130.5) == []
    pipeline = Pipeline()
    pipeline.ingest("vllm_metrics", [hist])
    idle = pipeline.snapshot().block_idle_seconds
    assert list(idle) == ["gpu"]
    by_bound = dict(zip((*idle["gpu"].buckets, float("inf")), idle["gpu"].counts))
    assert (by_bound[1.0], by_bound[10.0], by_bound[60.0], by_bound[float("inf")]) == (2, 3, 0, 1)
    assert idle["gpu"].sum == 90.5


def _skipped_scrape(mapper, skipped, ts, blocks_per_chunk=2):
    """One scrape of engine 0's config_info (64 chunks of ``blocks_per_chunk`` blocks) and,
    unless None, its vllm:kv_offload_stores_skipped_total ``skipped`` (chunks); the Admission
    events it made."""
    text = ('vllm:kv_offload_config_info{cpu_blocks_per_chunk="%d",cpu_kv_cache_size_bytes='
            '"4194304",cpu_num_chunks="64",engine="0",model_name="m"} 1.0\n' % blocks_per_chunk)
    if skipped is not None:
        text += ("# TYPE vllm:kv_offload_stores_skipped_total counter\n"
                 f'vllm:kv_offload_stores_skipped_total{{engine="0",model_name="m"}} {skipped}\n')
    return [e for e in mapper.map(parse(text), ts) if isinstance(e, ev.Admission)]


def test_stores_its_threshold_skipped_are_cpu_admissions_in_blocks():
    """vLLM's CPU manager makes stores_skipped at its first increase: scrape 1 has none (no
    event); scrape 2 shows 3 chunks on an engine scrape 1 saw, so from 0: 3 x 2 = 6 blocks;
    scrape 3, 5 chunks: 4 blocks; scrape 4 unchanged: 0 (the series exists); scrape 5, a
    reset to 1: 2 blocks. Only ``skipped``: the other outcomes stay None (absent), even
    beside a KV events source reporting cpu (it sees no declined store). Folded: cpu skipped
    12 and no stored or failed series."""
    mapper = MetricsMapper(kv_events_tiers=KV_EVENTS_ALL)
    assert _skipped_scrape(mapper, None, 1.0) == []
    got = [_skipped_scrape(mapper, n, float(ts)) for ts, n in ((2, 3), (3, 5), (4, 5), (5, 1))]
    assert got == [[ev.Admission(ts=float(ts), tier="cpu", skipped=blocks)]
                   for ts, blocks in ((2, 6), (3, 4), (4, 0), (5, 2))], got
    pipeline = Pipeline()
    pipeline.ingest("vllm_metrics", [e for events in got for e in events])
    assert pipeline.snapshot().store_admissions == {("cpu", "skipped"): 12}
