"""The SGLang metrics source on SGLang 0.5.23's exposition, served over loopback HTTP and scraped
through the source's real loop, and through the agent beside the KV events source.

The exposition is recorded by hand (SGLang does not run on this machine's CPU: see
tests/agent/test_sglang_kv_events.py). Every name, label and label value is one SGLang 0.5.23
writes: ``python/sglang/srt/observability/metrics_collector.py`` (``SchedulerMetricsCollector``:
``model_name``, ``engine_type`` "unified" (``disaggregation/utils.py`` ``to_engine_type``),
``tp_rank``, ``pp_rank``, ``moe_ep_rank``; ``TokenizerMetricsCollector``: ``model_name``,
``engine_type``, with ``is_streaming`` and ``cache_source``; ``RadixCacheMetricsCollector``:
``radix_cache_metric_labels``' ``cache_type``, ``tp_rank``, ``pp_rank``, ``dp_rank``, with
``pool`` and ``reason``; ``StorageMetricsCollector``: ``mem_cache/unified_cache/
storage_attachment.py``'s ``storage_backend``, ranks, ``pp_size``, ``attn_cp_*``), in
prometheus_client's multiprocess text (SGLang sets ``PROMETHEUS_MULTIPROC_DIR``: no
``_created`` samples). Two tensor-parallel ranks report the radix cache's token counters, each
the same logical count, and their own byte counts.
"""

from __future__ import annotations

import os

import pytest

from conftest import REPO_ROOT
from kvscope.agent.config import AgentSettings, load_settings
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources.scrape import parse
from kvscope.agent.sources.sglang_metrics import (SglangMapper, SglangMetricsConfig,
                                                  SglangMetricsSource, one_rank)
from kvscope.service.agent import Agent
from tests.engine_servers import exposition_server

SCHED = 'engine_type="unified",model_name="tiny",moe_ep_rank="0",pp_rank="0"'
TOK = 'engine_type="unified",model_name="tiny"'
CACHE = 'cache_type="UnifiedRadixCache",dp_rank="0",pp_rank="0"'
STORE = ('attn_cp_rank="0",attn_cp_size="1",dp_rank="0",pp_rank="0",pp_size="1",'
         'storage_backend="file",tp_rank="0"')


def exposition(v: dict) -> str:
    """SGLang's /metrics with the values of ``v`` (the scrape's counters and gauges)."""
    lines = ["# HELP sglang:page_size KV cache page size in tokens.",
             "# TYPE sglang:page_size gauge"]
    for tp in ("0", "1"):  # --enable-metrics-for-all-schedulers: both ranks' gauges
        lines += [
            f'sglang:page_size{{{SCHED},tp_rank="{tp}"}} 16.0',
            f'sglang:max_total_num_tokens{{{SCHED},tp_rank="{tp}"}} 8192.0',
            f'sglang:kv_used_tokens{{{SCHED},tp_rank="{tp}"}} {v["used"]}',
            f'sglang:kv_evictable_tokens{{{SCHED},tp_rank="{tp}"}} {v["evictable"]}',
            f'sglang:num_queue_reqs{{{SCHED},tp_rank="{tp}"}} {v["queue"]}',
            f'sglang:num_running_reqs{{{SCHED},tp_rank="{tp}"}} {v["running"]}',
            f'sglang:hicache_host_used_tokens{{{SCHED},tp_rank="{tp}"}} {v["host_used"]}',
            f'sglang:hicache_host_total_tokens{{{SCHED},tp_rank="{tp}"}} 65536.0',
            f'sglang:num_retracted_requests_total{{{SCHED},tp_rank="{tp}"}} {v["retracted"]}',
            f'sglang:cache_hit_rate{{{SCHED},tp_rank="{tp}"}} 0.4',
            f'sglang:hicache_backup_tokens_total{{{CACHE},pool="kv",tp_rank="{tp}"}} '
            f'{v["backup"]}',
            f'sglang:hicache_backup_tokens_total{{{CACHE},pool="mamba",tp_rank="{tp}"}} '
            f'{v["backup"] * 3}',
            f'sglang:hicache_backup_bytes_total{{{CACHE},tp_rank="{tp}"}} {v["backup_bytes"]}',
            f'sglang:load_back_tokens_total{{{CACHE},pool="kv",tp_rank="{tp}"}} {v["load"]}',
            f'sglang:load_back_bytes_total{{{CACHE},tp_rank="{tp}"}} {v["load_bytes"]}',
            f'sglang:evicted_tokens_total{{{CACHE},tp_rank="{tp}"}} {v["evicted"]}',
            f'sglang:hicache_dropped_tokens_total{{{CACHE},pool="kv",reason="host_pressure",'
            f'tp_rank="{tp}"}} {v["dropped"]}',
        ]
        if "unbacked" in v:  # made by SGLang at its first increment
            lines.append(f'sglang:hicache_dropped_tokens_total{{{CACHE},pool="kv",'
                         f'reason="write_through_unbacked_eviction",tp_rank="{tp}"}} '
                         f'{v["unbacked"]}')
    lines += [
        f'sglang:prompt_tokens_total{{{TOK},is_streaming="false"}} {v["prompt"]}',
        f'sglang:prompt_tokens_total{{{TOK},is_streaming="true"}} {v["prompt_streamed"]}',
        *(f'sglang:cached_tokens_total{{cache_source="{s}",{TOK}}} {v[s]}'
          for s in ("device", "host", "storage")),
        f'sglang:prefetched_tokens_total{{{STORE}}} {v["prefetched"]}',
        f'sglang:backuped_tokens_total{{{STORE}}} {v["backuped"]}',
        f'sglang:hicache_backup_dropped_tokens_total{{{STORE}}} {v["l3_declined"]}',
        f'sglang:storage_prefetch_hit_tokens_total{{{STORE}}} 999.0',
        "# TYPE sglang:time_to_first_token_seconds histogram",
        *(f'sglang:time_to_first_token_seconds_bucket{{{TOK},is_streaming="false",le="{le}"}} '
          f'{n}' for le, n in zip(TTFT_LE, v["ttft"])),
        f'sglang:time_to_first_token_seconds_count{{{TOK},is_streaming="false"}} {v["ttft"][-1]}',
        f'sglang:time_to_first_token_seconds_sum{{{TOK},is_streaming="false"}} {v["ttft_sum"]}',
    ]
    return "\n".join(lines) + "\n"


# SGLang's default TTFT buckets (metrics_collector.py), as prometheus_client writes them
TTFT_LE = ["0.1", "0.2", "0.4", "0.6", "0.8", "1.0", "2.0", "4.0", "6.0", "8.0", "10.0", "20.0",
           "40.0", "60.0", "80.0", "100.0", "200.0", "400.0", "+Inf"]
FIRST = dict(ttft=[1, 2, 3] + [3] * 16, ttft_sum=0.5, used=1024, evictable=2048, queue=3, running=5, host_used=4096, retracted=2,
             backup=640, backup_bytes=1e6, load=320, load_bytes=5e5, evicted=800, dropped=32,
             prompt=1000, prompt_streamed=200, device=300, host=100, storage=50,
             prefetched=160, backuped=480, l3_declined=16)
SECOND = dict(FIRST, used=1600, evictable=2400, queue=4, running=6, host_used=8192,
              retracted=5, backup=1280, backup_bytes=3e6, load=400, load_bytes=7e5,
              evicted=1600, dropped=64, unbacked=16, prompt=1600, prompt_streamed=400,
              device=500, host=250, storage=100, prefetched=320, backuped=800, l3_declined=40,
              ttft=[1, 4, 6] + [7] * 16, ttft_sum=1.9)
BLOCK_BYTES = 1000


def scraped(mapper: SglangMapper) -> Pipeline:
    """The pipeline after the source scraped FIRST (baselines) and then SECOND."""
    pipeline = Pipeline()
    with exposition_server(exposition(FIRST)) as server:
        source = SglangMetricsSource(pipeline, server.url, mapper=mapper)
        assert source.scrape_once()
        server.body = exposition(SECOND)
        assert source.scrape_once()
    return pipeline


def test_sglang_hicache_metrics_map_onto_tiers_sources_and_the_scheduler():
    """Alone (no KV events source), by hand from FIRST -> SECOND, pages of 16 tokens
    (``sglang:page_size``), block_bytes 1000, the radix cache's token counters read on tp_rank
    0 only, byte counters of both ranks added up:

    - Lookup: prompt +600 +200 = 800; cached device +200 -> gpu, host +150 -> cpu, storage +50
      -> disk; recompute 800 - 400 = 400.
    - gpu->cpu: backup pool kv +640 tokens = 40 blocks (pool mamba left out), bytes 2 ranks x
      2e6 = 4,000,000. cpu->gpu: load back +80 tokens = 5 blocks, bytes 2 x 2e5 = 400,000.
      disk->cpu: prefetched +160 = 10 blocks, 10,000 bytes. cpu->disk: backuped +320 = 20
      blocks, 20,000 bytes.
    - gpu evictions: evicted +800 tokens; dropped host_pressure +32 and the new
      write_through_unbacked_eviction series 16 (from 0) = 48 tokens = 3 blocks dropped; the
      other 752 tokens = 47 blocks offloaded (kept on the host): 50 in all.
    - disk admission skipped: L3 backups declined +24 tokens = 1 page (8 carried).
    - cpu tier: 65536 / 16 = 4096 blocks of capacity, 8192 / 16 = 512 resident; gpu tier:
      8192 / 16 = 512 capacity, (1600 + 2400) / 16 = 250 resident.
    - scheduler: waiting 4, running 6 (one rank's), preemptions 5 - 2 = 3 retractions, GPU KV
      usage 1600 / 8192 = 0.1953125.
    - TTFT: cumulative buckets 1, 2, 3, 3... -> 1, 4, 6, 7..., increases 0, 2, 3, 4...: 2 new
      in (0.1, 0.2], 1 in (0.2, 0.4], 1 in (0.4, 0.6]; 4 requests, sum 1.9 - 0.5 = 1.4 s.
    - cache_hit_rate and storage_prefetch_hit_tokens_total: not mapped."""
    snap = scraped(SglangMapper(block_bytes=BLOCK_BYTES)).snapshot()
    assert snap.prompt_tokens == {"gpu": 200, "cpu": 150, "disk": 50, "recompute": 400}
    assert snap.transfer_blocks == {("gpu", "cpu"): 40, ("cpu", "gpu"): 5, ("disk", "cpu"): 10,
                                    ("cpu", "disk"): 20}
    assert snap.transfer_bytes == {("gpu", "cpu"): 4_000_000, ("cpu", "gpu"): 400_000,
                                   ("disk", "cpu"): 10_000, ("cpu", "disk"): 20_000}
    assert snap.transfer_seconds == {}  # untimed
    assert snap.evicted_blocks == {("gpu", "capacity"): 50}
    assert snap.dropped_blocks == {"gpu": 3}
    assert snap.store_admissions == {("disk", "skipped"): 1}
    assert {t: (s.capacity_blocks, s.resident_blocks, s.resident_bytes)
            for t, s in snap.tiers.items()} == {"cpu": (4096, 512, 512_000),
                                                "gpu": (512, 250, 250_000)}
    source = "sglang_metrics"
    assert (snap.requests_waiting[source], snap.requests_running[source],
            snap.preemptions[source], snap.gpu_kv_cache_usage[source]) == (4, 6, 3, 0.1953125)
    assert snap.events_dropped == {}
    assert snap.ttft_seconds.count == 4 and snap.ttft_seconds.sum == pytest.approx(1.4)


def test_beside_sglang_kv_events_what_they_report_is_left_to_them():
    """With ``[kv_events] engine = "sglang"`` (tiers gpu and cpu) enabled, the agent builds the
    metrics source yielding those tiers: no gpu->cpu or disk->cpu transfers, no GPU evictions,
    no GPU snapshot, and the cpu snapshot with its capacity only (4096 blocks, residency not
    reported: the KV events hold it, and the pipeline adds the two). Kept: the lookup, loads back
    (cpu->gpu 5: KV events cannot see them), cpu->disk 20, the admission, the scheduler."""
    settings = AgentSettings(kv_events={"enabled": True, "engine": "sglang",
                                        "endpoint": "tcp://127.0.0.1:1"},
                             sglang_metrics={"enabled": True, "block_bytes": BLOCK_BYTES,
                                             "model": "tiny"},
                             collectors={"gpu": {"enabled": False}, "host": {"enabled": False}})
    agent = Agent(settings, with_ingest=False)
    mapper = agent.sources["sglang_metrics"].mapper
    assert mapper.report == {"gpu": False, "cpu": False, "disk": True}
    snap = scraped(mapper).snapshot()
    assert snap.transfer_blocks == {("cpu", "gpu"): 5, ("cpu", "disk"): 20}
    assert snap.evicted_blocks == {}
    assert {t: (s.capacity_blocks, s.resident_blocks) for t, s in snap.tiers.items()} == {
        "cpu": (4096, None)}
    assert snap.prompt_tokens["recompute"] == 400 and snap.preemptions["sglang_metrics"] == 3
    assert agent.pipeline.snapshot().source_info["sglang_metrics"] == ("sglang", "tiny")
    assert agent.pipeline.snapshot().source_info["kv_events"] == ("sglang", "")


def test_without_a_page_size_nothing_counted_in_pages_is_invented():
    """No ``sglang:page_size`` and no ``page_size`` setting: tokens cannot become blocks, so
    transfers, evictions, the admission and the tier snapshots are absent (not 0); the lookup
    (tokens) and the scheduler stay."""
    pipeline = Pipeline()
    first, second = (exposition(v).replace("sglang:page_size{", "sglang:other_gauge{")
                     for v in (FIRST, SECOND))
    with exposition_server(first) as server:
        source = SglangMetricsSource(pipeline, server.url, mapper=SglangMapper())
        assert source.scrape_once()
        server.body = second
        assert source.scrape_once()
    snap = pipeline.snapshot()
    assert snap.transfer_blocks == {} and snap.evicted_blocks == {} and snap.tiers == {}
    assert snap.store_admissions == {}
    assert snap.prompt_tokens == {"gpu": 200, "cpu": 150, "disk": 50, "recompute": 400}


def test_the_bytes_of_a_scrape_short_of_a_page_go_with_the_next_page():
    """Pages of 16 tokens; after FIRST (baselines) 4 scrapes, each backing up 8 tokens (pool kv,
    half a page) and 4,000 bytes per rank (2 ranks: 8,000): 32 tokens = 2 pages, 4 x 8,000 =
    32,000 bytes, as SGLang's counters say. The bytes of scrapes 1 and 3 (no whole page) were
    dropped, and only 16,000 counted."""
    pipeline = Pipeline()
    with exposition_server(exposition(FIRST)) as server:
        source = SglangMetricsSource(pipeline, server.url, mapper=SglangMapper())
        assert source.scrape_once()
        for i in range(1, 5):
            server.body = exposition(dict(FIRST, backup=640 + 8 * i,
                                          backup_bytes=1e6 + 4000 * i))
            assert source.scrape_once()
    snap = pipeline.snapshot()
    assert snap.transfer_blocks == {("gpu", "cpu"): 2}
    assert snap.transfer_bytes == {("gpu", "cpu"): 32_000}


def test_cached_tokens_without_a_source_make_no_lookup():
    """An SGLang without the per-source breakdown counts ``cache_source="total"``: where those
    tokens came from is unknown, so the scrape makes no lookup rather than a guess."""
    mapper = SglangMapper(page_size=16)
    body = 'sglang:prompt_tokens_total{{is_streaming="false"}} {}\n' \
           'sglang:cached_tokens_total{{cache_source="total"}} {}\n'
    assert mapper.map(parse(body.format(100, 10)), 1.0) == []
    assert mapper.map(parse(body.format(200, 60)), 2.0) == []


def test_one_rank_keeps_the_lowest_rank_of_each_cache():
    """Two DP ranks (dp_rank 0 and 1), each on TP ranks 0 and 1: one series per DP rank, its
    TP rank 0's."""
    values = {frozenset({("dp_rank", d), ("tp_rank", t)}): float(f"{d}{t}")
              for d in "01" for t in "10"}
    assert sorted(one_rank(values).values()) == [0.0, 10.0]


def test_a_server_that_is_not_sglang_is_down():
    with exposition_server("vllm:num_requests_running 1\n") as server:
        pipeline = Pipeline()
        assert not SglangMetricsSource(pipeline, server.url).scrape_once()
    assert pipeline.snapshot().source_up["sglang_metrics"] is False


@pytest.mark.parametrize("page", [0, 16])
def test_the_config_table_validates(page):
    assert SglangMetricsConfig(page_size=page).page_size == page
    with pytest.raises(ValueError):
        SglangMetricsConfig(page_size=-1)


def test_the_tables_docs_engines_md_gives_load_as_they_stand(tmp_path, monkeypatch):
    """docs/engines.md's SGLang tables are valid and turn both sources on (they drift
    otherwise)."""
    for key in [k for k in os.environ if k.startswith("KVSCOPE_")]:
        monkeypatch.delenv(key)
    section = (REPO_ROOT / "docs" / "engines.md").read_text().split("## SGLang HiCache", 1)[1]
    path = tmp_path / "agent.toml"
    path.write_text(section.split("```toml\n", 1)[1].split("```", 1)[0])
    settings = load_settings(path)
    assert settings.kv_events.enabled and settings.kv_events.engine == "sglang"
    assert settings.kv_events.tiers == ["gpu", "cpu"]
    assert settings.sglang_metrics.enabled and settings.sglang_metrics.model == "MODEL"
