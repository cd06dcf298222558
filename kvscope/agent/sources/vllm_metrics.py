"""The vLLM metrics source: scrapes vLLM's Prometheus ``/metrics`` and maps what it has onto
kvscope events (counters as deltas between scrapes, so restarts and resets stay correct).

Mapped (vLLM 0.32 names, ``vllm/v1/metrics/loggers.py`` and the offloading connector's
``offloading/metrics.py``); names a given vLLM version lacks are simply absent:

- ``vllm:prompt_tokens_total`` with ``vllm:prompt_tokens_cached_by_source_total{source}``
  (device -> ``gpu``, host -> ``cpu``, disk -> ``disk``, p2p and external_unspecified -> ``cpu``)
  -> one aggregate ``Lookup`` per scrape (no request id); the uncached rest is ``recompute``.
  Without the by-source counter: ``vllm:prefix_cache_hits_total`` -> gpu and
  ``vllm:external_prefix_cache_hits_total`` -> cpu.
- ``vllm:kv_offload_store_bytes_total`` / ``..._load_bytes_total`` (older:
  ``vllm:kv_offload_total_bytes_total{transfer_type}``) -> untimed ``Transfer`` gpu->cpu /
  cpu->gpu (blocks from ``block_bytes`` when known); the stores only when ``stores`` is on
  (leave it off when the KV events source reports the cpu tier: it sees every offload).
- ``vllm:time_to_first_token_seconds`` histogram -> ``LatencyHistogram`` (bucket deltas), unless
  vLLM's request spans report the same requests' TTFTs: then each would count twice. With
  ``span_ttft`` (when the OTLP receiver last took a TTFT from a span, monotonic seconds), a
  scrape's histogram waits ``span_wait`` seconds (vLLM sends spans in batches) and is used only
  if no span brought a TTFT since the scrape before it.
- ``vllm:kv_cache_usage_perc`` x ``num_gpu_blocks`` (``vllm:cache_config_info``) ->
  ``TierSnapshot`` gpu, when ``gpu_snapshot`` is on (leave it off when the KV events source
  reports GPU residency; vLLM's usage counts blocks held by running requests only).
- The host KV offload budget -> ``EngineMemory`` (``kv_offload_budget``, bytes, every engine's
  added up), for the memory budget breakdown where no tap reports it (docs/collectors.md,
  Memory budgets): 0.33's ``vllm:kv_offload_config_info`` ``cpu_kv_cache_size_bytes`` (the pool
  vLLM sized), else ``vllm:cache_config_info`` ``kv_offloading_size`` (GiB,
  ``--kv-offloading-size``; bytes = GiB x 2^30 as vLLM computes ``cpu_bytes_to_use`` from it);
  sent when it changes (first at the first scrape); none when neither says (``"None"``:
  offloading set up through ``--kv-transfer-config`` only, or off).
- ``vllm:cache_config_info`` ``enable_prefix_caching`` (``"True"``/``"False"``) and
  ``cache_dtype`` (``CacheConfig.metrics_info()``: every field as ``str()``; the dtype is
  ``--kv-cache-dtype``'s, ``auto`` unless it or the model's quantization config names one) ->
  the source's ``kvscope_engine_cache_config_info`` (:func:`cache_config`, told to the
  pipeline at each scrape that has them, not an event), for the "Should I offload here?"
  check of cheaper steps. vLLM's engines of one server share one ``CacheConfig``: the lowest
  engine's is read.
- The scheduler, whether GPU memory is the limiter -> one ``SchedulerStats`` per scrape, each
  field absent when vLLM has no such series: ``vllm:num_requests_waiting`` and
  ``vllm:num_requests_running`` (gauges, added up over the engines); the increase of
  ``vllm:num_preemptions_total`` (a counter, as the others); ``vllm:kv_cache_usage_perc`` (a
  share, 0 to 1, despite its name), the largest over the engines: one engine that is full
  preempts and queues however empty the others are, and the mean would hide it (the
  ``TierSnapshot`` above holds the blocks in use over all of them). Every gauge of the scrape,
  whatever ``gpu_snapshot`` says: they are this source's own metrics, no tier's.

Offloading (vLLM 0.33 ``kv_offload/base.py``, ``kv_offload/cpu/common.py``,
``kv_offload/tiering/{base,spec,metrics}.py``, ``offloading/metrics.py``; the tiering counters
are 0.32's too). ``kv_events_tiers`` names the tiers the agent's KV events source reports
(and, under their connectors, Dynamo KVBM's and LMCache's sources, where vLLM has no
``vllm:kv_offload_*`` series of its own): what it sees is left to it, so that nothing counts
twice.

- ``vllm:kv_offload_config_info`` (0.33), the series whose ``cpu_num_chunks``,
  ``cpu_blocks_per_chunk`` and ``cpu_kv_cache_size_bytes`` are numbers (the CPU tier's: plain,
  or ``tier="0:primary"`` under tiering) -> ``TierSnapshot`` cpu with the capacity only
  (chunks x blocks per chunk, vLLM's bytes, every engine's added up) and nothing resident, sent
  only when the KV events source reports cpu (its snapshot holds the residency, and the
  pipeline adds the two up); the blocks per chunk also turn the chunk counts below into blocks.
- The tiering ``tier`` label is ``<index>:<type>``; :data:`TIER_TYPES` maps the type (``primary``
  -> cpu, ``fs`` -> disk, ``obj`` and ``p2p`` -> remote); tiers of other types (``example``,
  ``kvcr``, out-of-tree classes) are left out.
- ``vllm:kv_offload_tiering_read_bytes_total{tier}`` / ``..._write_bytes_total{tier}`` ->
  untimed ``Transfer`` <tier>->cpu / cpu-><tier> (blocks from the chunk size of
  ``config_info``, else from ``block_bytes``); the reads only when the KV events source does
  not report cpu, the writes only when it does not report disk (it sees those promotions and
  stores, and names every STORAGE tier disk).
- ``vllm:kv_offload_tiering_chunk_queries_total{tier}`` / ``..._chunk_hits_total{tier}`` (one
  query per chunk and tier, a tier asked only when the tiers before it missed) -> the
  aggregate ``Lookup``'s ``blocks`` (the primary tier's queries) and ``block_hits`` by tier, in
  blocks (needs ``config_info``); only with ``gpu_snapshot`` off, as the agent would otherwise
  take this source's GPU tier as consulted, missed by every block.
- ``vllm:kv_offload_tiering_promotion_latency_seconds{tier,result="success"}`` (0.33; from the
  promotion job's creation to its completion, queueing included) -> one timed ``Transfer``
  <tier>->cpu of no bytes per observation (bucket deltas; each placed inside its vLLM bucket:
  :func:`spread`), for ``kvscope_transfer_seconds``: its sum is vLLM's, and so are its buckets
  from 5 ms up, as each holds whole vLLM buckets (vLLM's first one is (0, 5 ms]).
- ``vllm:kv_block_idle_before_evict_seconds`` (with ``--kv-cache-metrics``; ``v1/core/
  kv_cache_metrics.py``) -> ``IdleHistogram`` gpu (bucket deltas over the engines): vLLM
  samples GPU blocks only (1 in 100 by default, ``--kv-cache-metrics-sample``; the rate is not
  on /metrics) when they are allocated, and observes, when the block pool hands a sampled block
  out again, the seconds since its last hit (a prefix-cache ``touch``) or its allocation. So
  the counts are vLLM's sample, the shape of idle times and not how many blocks left, and a
  block freed before it was cached (no hash) counts too. Its buckets (1 ms .. 30 min) land
  in kvscope's bucket holding their upper bound.
- ``vllm:kv_offload_stores_skipped_total`` (``kv_offload/cpu/common.py``; vLLM's CPU manager,
  only with a ``store_threshold`` of 2 or more: store candidates, chunks, declined for being
  seen fewer times; made at its first increase) -> ``Admission`` cpu ``skipped``, in blocks
  (x the blocks per chunk of ``config_info``, 0.33; an engine without it is left out), every
  scrape that has the series (0 included). Whatever ``kv_events_tiers`` says: neither the KV
  events (they report stores made) nor the tap (it counts the keys of a store the manager
  could not make room for) sees these declines, so nothing counts twice.
- ``vllm:kv_offload_tiering_promotion_job_failures_total{tier}`` /
  ``..._cascade_job_failures_total{tier}`` -> one failed ``Transfer`` <tier>->cpu / cpu-><tier>
  per job (reason ``unknown``: vLLM does not say why).

Left out (no kvscope metric fits them without counting something twice; vLLM exports them
itself): the lookup delays (``lookup_{sync,async}_delay_seconds``, plain and tiering),
``vllm:num_requests_waiting_by_reason`` (the waiting requests split by reason: the total is
mapped), ``allocation_failure`` (one per ``prepare_store`` call the manager could not make
room for, whatever the chunks offered: no block count; the tap counts those chunks as
skipped), ``tiering_promotion_allocation_failures`` and ``tiering_backpressure_*`` (stores
never made), the in-flight gauges (``kv_offload_*_usage_perc``, ``active_*_jobs``), the tiers'
read and write times (sums only), and ``--kv-cache-metrics``'
``vllm:kv_block_{lifetime,reuse_gap}_seconds`` (sampled GPU blocks: kvscope's residency
histogram comes with evictions the KV events source counts, and per-block reuse cannot be
rebuilt from totals); their sibling idle-before-evict histogram is mapped (above), as no other
source measures a GPU block's idle time.

Mapping (:class:`MetricsMapper`) does no I/O; the scrape loop is
:class:`~kvscope.agent.sources.scrape.ScrapeSource`'s: every ``interval`` seconds, a failed
scrape sets ``kvscope_source_up{source="vllm_metrics"}`` to 0 and the next good one back to 1.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable

from pydantic import Field, field_validator

from kvscope import events as ev
from kvscope.agent.sections import EngineSection, http_url
from kvscope.agent.sources.base import Built, Consumer, SourceSpec, register, yielded_tiers
from kvscope.agent.sources.scrape import (MAX_SERIES, Counters, Samples, ScrapeSource, series,
                                          spread)

log = logging.getLogger(__name__)
NAME = "vllm_metrics"
SOURCE_TIER = {"device": "gpu", "host": "cpu", "disk": "disk", "p2p": "cpu",
               "external_unspecified": "cpu"}
# vLLM's tier types (TieringOffloadingSpec's ``secondary_tiers[].type``, registered in
# ``kv_offload/tiering/factory.py``; the CPU tier is ``primary``) -> kvscope's tiers
TIER_TYPES = {"primary": "cpu", "fs": "disk", "obj": "remote", "p2p": "remote"}
def tier_of(label: str) -> str | None:
    """kvscope's tier of vLLM's tiering ``tier`` label (``"1:fs"``: disk), None for another."""
    return TIER_TYPES.get(label.partition(":")[2])


TTFT = "vllm:time_to_first_token_seconds"
WAITING, RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"
PREEMPTIONS = "vllm:num_preemptions_total"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
CONFIG_INFO = "vllm:kv_offload_config_info"
_TIERING = "vllm:kv_offload_tiering_"
READ_BYTES, WRITE_BYTES = _TIERING + "read_bytes_total", _TIERING + "write_bytes_total"
CHUNK_QUERIES, CHUNK_HITS = _TIERING + "chunk_queries_total", _TIERING + "chunk_hits_total"
PROMOTION_LATENCY = _TIERING + "promotion_latency_seconds"
IDLE_BEFORE_EVICT = "vllm:kv_block_idle_before_evict_seconds"
PROMOTION_FAILURES = _TIERING + "promotion_job_failures_total"
CASCADE_FAILURES = _TIERING + "cascade_job_failures_total"
STORES_SKIPPED = "vllm:kv_offload_stores_skipped_total"
# Events one scrape may make of observations and failed jobs (one each): vLLM makes a promotion
# job per tier and step at most, hundreds per scrape; far more is no vLLM's, and is left out.
MAX_OBSERVATIONS = 20_000


def cache_config(samples: Samples) -> tuple[bool, str] | None:
    """(whether GPU prefix caching is on, the KV cache dtype as vLLM names it) from the lowest
    engine's ``vllm:cache_config_info``; None without that series, or when it lacks either
    label or ``enable_prefix_caching`` is neither ``"True"`` nor ``"False"``."""
    infos = sorted((dict(ls) for ls in series(samples, "vllm:cache_config_info")),
                   key=lambda labels: labels.get("engine", ""))
    if not infos:
        return None
    prefix, dtype = infos[0].get("enable_prefix_caching"), infos[0].get("cache_dtype")
    if prefix not in ("True", "False") or not dtype:
        return None
    return prefix == "True", dtype


class MetricsMapper:
    """Turns successive scrapes into kvscope events. ``block_bytes``: KV bytes per block (0:
    unknown). ``kv_events_tiers``: the tiers the agent's KV events source reports (see the
    module). ``gpu_snapshot``: report GPU usage as a TierSnapshot; ``stores``: report gpu->cpu
    offloads; each None: as ``kv_events_tiers`` has it (gpu, resp. cpu, not among them). Not
    thread-safe.

    A counter's increase is taken per series (one per vLLM engine and label set) and then
    added up, so a series missing from a scrape is no reset of the sum. A series seen for the
    first time is a baseline, but for the tiering ones, which vLLM makes at their first
    observation (``offloading/metrics.py``, ``_get_prometheus_metric``): one of those that
    appears on an engine the scrape before saw counts from 0 (a tier's first failed job is
    counted). Baselines are kept for :data:`MAX_SERIES` series; past that, only the latest
    scrape's (a series that comes back then starts over from its value, and from then on every
    new series is a baseline)."""

    def __init__(self, block_bytes: int = 0, gpu_snapshot: bool | None = None,
                 stores: bool | None = None, kv_events_tiers: Iterable[str] = ()) -> None:
        told = frozenset(kv_events_tiers)
        self.block_bytes = block_bytes
        self.gpu_snapshot = "gpu" not in told if gpu_snapshot is None else gpu_snapshot
        self.stores = "cpu" not in told if stores is None else stores
        # the CPU tier's capacity, beside the KV events source's residency of it
        self.cpu_capacity = "cpu" in told
        # bytes into the CPU tier from a lower one (KV events see those promotions) and out
        # of it into a lower one (KV events see those stores, every STORAGE tier as disk)
        self.tier_promotions = "cpu" not in told
        self.tier_offloads = "disk" not in told
        self._counters = Counters()
        self._budget_sent: int | None = None  # the host KV budget last reported (_budget)
        # the engine labels of the scrape before (None once baselines were dropped: MAX_SERIES)
        self._engines: frozenset | None = frozenset()
        self._engines_before: frozenset | None = frozenset()
        # cached prompt tokens not yet matched by vllm:prompt_tokens (<= 0): see _lookup
        self._unmatched = 0
        self._connector = False  # vLLM's KV connector was queried (see _lookup)
        # per (histogram, engine: labels but le), its bucket bounds, and other bounds seen
        # once: _read_as_before
        self._bounds: dict[tuple[str, frozenset], frozenset] = {}
        self._pending: dict[tuple[str, frozenset], frozenset] = {}
        self._too_many_logged = False

    def _increase(self, samples: Samples, name: str, **labels) -> float | None:
        """The sum over ``name``'s series carrying ``labels`` of their increase since the last
        scrape (a series seen for the first time: 0, its baseline; one that went down: reset,
        its value); None when there is no such series."""
        return self._increase_of(name, series(samples, name, **labels))

    def _increase_of(self, name: str, values: dict[frozenset, float],
                     lazy: bool = False) -> float | None:
        """See :meth:`_increase`; ``lazy``: vLLM makes these series at their first observation,
        so one first seen on an engine the scrape before saw counts from 0 (see the class)."""
        return self._counters.increase(name, values, self._on_known_engine if lazy else None)

    def _on_known_engine(self, labels: frozenset) -> bool:
        return bool(self._engines_before) and dict(labels).get("engine") in self._engines_before

    def _by_tier(self, samples: Samples, name: str) -> dict[tuple[str, str | None], float]:
        """The increases of tiering counter ``name`` by (kvscope tier, engine label), for the
        series whose ``tier`` kvscope maps (every series' baseline is kept)."""
        out: dict[tuple[str, str | None], float] = {}
        for ls, value in series(samples, name).items():
            labels = dict(ls)
            increase = self._increase_of(name, {ls: value}, lazy=True)
            tier = tier_of(labels.get("tier", ""))
            if tier is not None and increase:
                key = (tier, labels.get("engine"))
                out[key] = out.get(key, 0.0) + increase
        return out

    def map(self, samples: Samples, ts: float) -> list:
        self._counters.begin(samples)
        if self._engines is not None:
            self._engines_before = self._engines
            self._engines = frozenset(dict(ls).get("engine") for _, ls in samples) - {None}
        out: list = []
        chunks = self._cpu_chunks(samples)
        tokens = self._lookup(samples, bool(chunks))
        tiers = self._tier_lookups(samples, chunks) if not self.gpu_snapshot else None
        if tokens or tiers:
            blocks, hits = tiers or (0, {})
            out.append(ev.Lookup(ts=ts, request_id="", tokens=tokens, blocks=blocks,
                                 block_hits=hits))
        out += self._transfers(samples, ts)
        out += self._tiering(samples, ts, chunks)
        hist = self._ttft(samples, ts)
        if hist is not None:
            out.append(hist)
        out += self._idle(samples, ts)
        out += self._stores_skipped(samples, ts, chunks)
        if self.gpu_snapshot:
            out += self._gpu(samples, ts)
        if self.cpu_capacity and chunks:
            out.append(ev.TierSnapshot(
                ts=ts, tier="cpu", capacity_bytes=sum(c[2] for c in chunks.values()),
                resident_bytes=None, capacity_blocks=sum(c[0] * c[1] for c in chunks.values()),
                resident_blocks=None))  # what the tier holds: the tap's or KV events' to say
        out += self._scheduler(samples, ts)
        out += self._budget(samples, ts, chunks)
        if self._counters.commit():  # baselines dropped: keep the current ones
            self._engines = self._engines_before = None  # a new series may be an old one
        return out

    def _budget(self, samples: Samples, ts: float, chunks: dict) -> list[ev.EngineMemory]:
        """The host KV offload budget over every engine (see the module) when it is new or
        changed since this mapper last reported it (the pipeline keeps the last; a restarted
        agent's new mapper reports it at its first scrape), else []; also [] when vLLM does
        not say. ``chunks``: :meth:`_cpu_chunks`."""
        sizes: dict[str | None, int] = {engine: c[2] for engine, c in chunks.items()}
        for ls in series(samples, "vllm:cache_config_info") if not sizes else ():
            labels = dict(ls)
            try:
                gib = float(labels.get("kv_offloading_size", "None"))
            except ValueError:  # "None": not set
                continue
            if math.isfinite(gib) and 0 < gib < 2**23:  # below 2^53 bytes, the event's bound
                sizes[labels.get("engine")] = int(gib * (1 << 30))
        budget = sum(sizes.values()) if sizes else None
        if budget is None or budget == self._budget_sent:
            return []
        self._budget_sent = budget
        return [ev.EngineMemory(ts=ts, kv_offload_budget=budget)]

    def forget_budget(self) -> None:
        """Report the budget at the next scrape that has it, changed or not (the pipeline forgot
        it: :meth:`VllmMetricsSource.forget_gauges`)."""
        self._budget_sent = None

    def _scheduler(self, samples: Samples, ts: float) -> list[ev.SchedulerStats]:
        """The scheduler's gauges over every engine and its preemptions since the last scrape
        (see the module); [] when vLLM has none of them. A value out of the event's bounds
        (no vLLM's) makes the event invalid: the scrape drops and counts it."""
        def added(name: str) -> int | None:
            values = series(samples, name)
            return int(sum(values.values())) if values else None

        preempted = self._increase(samples, PREEMPTIONS)
        usage = series(samples, KV_CACHE_USAGE)
        stats = ev.SchedulerStats(
            ts=ts, waiting=added(WAITING), running=added(RUNNING),
            preemptions=None if preempted is None else int(preempted),
            gpu_kv_usage=max(usage.values()) if usage else None)
        return [] if stats == ev.SchedulerStats(ts=ts) else [stats]

    def _lookup(self, samples: Samples, cpu_tier: bool) -> dict[str, int]:
        """The prompt tokens of this scrape by source: those with tokens, and at 0 those vLLM
        measures here (gpu and recompute; cpu once it has a CPU tier: ``cpu_tier``, or its KV
        connector was queried); {} where the scrape brought no prompt tokens. vLLM makes every
        series of ``prompt_tokens_cached_by_source`` whatever its tiers, so a cpu or disk
        series at 0 does not say that the engine has that tier."""
        prompt = self._increase(samples, "vllm:prompt_tokens_total") or 0.0
        # vLLM counts connector queries only with a KV connector (the offloading one included)
        queried = self._increase(samples, "vllm:external_prefix_cache_queries_total")
        self._connector |= bool(queried)
        tokens: dict[str, int] = {}
        cached = "vllm:prompt_tokens_cached_by_source_total"
        by_source = series(samples, cached)
        if by_source:
            for ls, value in by_source.items():  # one series per engine and source
                tier = SOURCE_TIER.get(dict(ls).get("source", "external_unspecified"), "cpu")
                tokens[tier] = tokens.get(tier, 0) + int(self._increase_of(cached, {ls: value}))
        else:
            for tier, name in (("gpu", "vllm:prefix_cache_hits_total"),
                               ("cpu", "vllm:external_prefix_cache_hits_total")):
                hits = self._increase(samples, name)
                if hits is not None:
                    tokens[tier] = int(hits)
        # vLLM counts a request's cached tokens when it is scheduled and its prompt tokens at
        # its first token, often a scrape later: cached tokens this scrape's prompt tokens do
        # not cover are taken off the next scrape's recomputed ones (cut at 0 scrape by scrape,
        # a 10,000-token prompt with 8,000 cached straddling a scrape counted 10,000
        # recomputed, not 2,000). Only for one scrape: the cached tokens of a request aborted
        # before its first token, or of an engine gone, are never matched.
        cached_now = sum(tokens.values())
        owed = int(prompt) - cached_now + self._unmatched
        tokens["recompute"] = max(0, owed)
        self._unmatched = max(min(0, owed), -cached_now)
        if not any(n > 0 for n in tokens.values()):
            return {}
        measured = {"gpu", "recompute"} | ({"cpu"} if cpu_tier or self._connector else set())
        return {k: v for k, v in tokens.items() if v > 0 or k in measured}

    def _cpu_chunks(self, samples: Samples) -> dict[str | None, tuple[int, int, int]]:
        """The CPU tier of each engine from ``vllm:kv_offload_config_info``: (chunks, blocks
        per chunk, bytes), by engine label. Series of other tiers (their cpu_ labels empty)
        and values that are no numbers are left out."""
        out: dict[str | None, tuple[int, int, int]] = {}
        for ls in series(samples, CONFIG_INFO):
            labels = dict(ls)
            try:
                shape = tuple(int(labels[key]) for key in (
                    "cpu_num_chunks", "cpu_blocks_per_chunk", "cpu_kv_cache_size_bytes"))
            except (KeyError, ValueError):
                continue
            if shape[0] >= 0 and shape[1] >= 1 and shape[2] >= 0:
                out[labels.get("engine")] = shape
        return out

    def _tier_lookups(self, samples: Samples, chunks: dict) -> tuple[int, dict[str, int]] | None:
        """(blocks, block hits by tier) of the tiering lookups of this scrape: the primary
        tier's chunk queries, and each tier's hits (every tier queried named, 0 hits too, so
        that the agent counts its misses), in blocks; None without any."""
        queries = self._by_tier(samples, CHUNK_QUERIES)
        hits = self._by_tier(samples, CHUNK_HITS)
        blocks: dict[str, int] = {}
        found: dict[str, int] = {}
        for into, counts in ((blocks, queries), (found, hits)):
            for (tier, engine), n in counts.items():
                shape = chunks.get(engine)
                if shape is not None:
                    into[tier] = into.get(tier, 0) + int(n) * shape[1]
        if blocks.get("cpu", 0) <= 0:
            return None
        return blocks["cpu"], {tier: found.get(tier, 0) for tier in blocks}

    def _transfers(self, samples: Samples, ts: float) -> list:
        out = []
        for kind, src, dst in (("store", "gpu", "cpu"), ("load", "cpu", "gpu")):
            if kind == "store" and not self.stores:
                continue
            name = f"vllm:kv_offload_{kind}_bytes_total"
            # made at vLLM's first copy (offloading/metrics.py _get_prometheus_metric): on an
            # engine seen before, its first value is that copy's (without _created samples,
            # as under --api-server-count > 1, it was a baseline and its bytes were lost)
            value = self._increase_of(name, series(samples, name), lazy=True)
            if value is None:  # vLLM before the per-direction names
                legacy = {"store": "GPU_to_CPU", "load": "CPU_to_GPU"}[kind]
                value = self._increase(samples, "vllm:kv_offload_total_bytes_total",
                                       transfer_type=legacy)
            nbytes = int(value or 0)
            if nbytes > 0:
                blocks = nbytes // self.block_bytes if self.block_bytes else 0
                out.append(ev.Transfer(ts=ts, src=src, dst=dst, blocks=blocks, bytes=nbytes,
                                       duration=0.0, timed=False, sees_failures=False))
        return out

    def _tiering(self, samples: Samples, ts: float, chunks: dict) -> list:
        """Transfers between the CPU tier and the tiers below it: bytes, promotion times,
        failed jobs."""
        out: list = []
        moved: dict[tuple[str, str], list[int]] = {}  # (src, dst) -> [blocks, bytes]
        for name, promotion, wanted in ((READ_BYTES, True, self.tier_promotions),
                                        (WRITE_BYTES, False, self.tier_offloads)):
            if not wanted:
                continue
            for (tier, engine), value in self._by_tier(samples, name).items():
                if tier == "cpu":
                    continue
                nbytes = int(value)
                shape = chunks.get(engine)
                if shape is not None and shape[0] > 0 and shape[2] > 0:  # whole chunks
                    blocks = (nbytes * shape[0] + shape[2] // 2) // shape[2] * shape[1]
                else:
                    blocks = nbytes // self.block_bytes if self.block_bytes else 0
                both = moved.setdefault((tier, "cpu") if promotion else ("cpu", tier), [0, 0])
                both[0] += blocks
                both[1] += nbytes
        # the tiering manager counts these directions' failed jobs (below), so their failures
        # are seen: series vLLM creates at the first failure, absent until then
        for (src, dst), (blocks, nbytes) in moved.items():
            out.append(ev.Transfer(ts=ts, src=src, dst=dst, blocks=blocks, bytes=nbytes,
                                   duration=0.0, timed=False))
        # failed jobs, then promotion times: one event each
        many: list[tuple[ev.Transfer, int]] = []
        for name, promotion in ((PROMOTION_FAILURES, True), (CASCADE_FAILURES, False)):
            for (tier, _), n in self._by_tier(samples, name).items():
                if tier != "cpu":
                    src, dst = (tier, "cpu") if promotion else ("cpu", tier)
                    many.append((ev.Transfer(ts=ts, src=src, dst=dst, blocks=0, bytes=0,
                                             duration=0.0, ok=False, reason="unknown",
                                             timed=False), int(n)))

        def succeeded(labels: dict) -> str | None:
            tier = tier_of(labels.get("tier", ""))
            return tier if labels.get("result") == "success" and tier != "cpu" else None

        for tier, (bounds, counts, total) in self._histograms(
                PROMOTION_LATENCY, samples, succeeded, lazy=True).items():
            for duration, n in spread(bounds, counts, total):
                many.append((ev.Transfer(ts=ts, src=tier, dst="cpu", blocks=0, bytes=0,
                                         duration=duration), n))
        if sum(n for _, n in many) > MAX_OBSERVATIONS:
            if not self._too_many_logged:
                self._too_many_logged = True
                log.warning("vLLM metrics: a scrape has over %d tiering job failures and "
                            "promotion times; they are left out (logged once)",
                            MAX_OBSERVATIONS)
            return out
        for event, n in many:
            out += [event] * n
        return out

    def _stores_skipped(self, samples: Samples, ts: float, chunks: dict) -> list[ev.Admission]:
        """The CPU manager's store candidates its threshold declined since the last scrape,
        in blocks, as one cpu ``Admission`` (``skipped`` only); [] without the series or
        the engines' chunk sizes (every series' baseline is kept)."""
        blocks, seen = 0, False
        for ls, value in series(samples, STORES_SKIPPED).items():
            increase = self._increase_of(STORES_SKIPPED, {ls: value}, lazy=True)
            labels = dict(ls)
            shape = chunks.get(labels.get("engine"))
            if shape is None or tier_of(labels.get("tier", "0:primary")) != "cpu":
                continue
            seen = True
            blocks += int(increase or 0) * shape[1]
        return [ev.Admission(ts=ts, tier="cpu", skipped=blocks)] if seen else []

    def _ttft(self, samples: Samples, ts: float) -> ev.LatencyHistogram | None:
        hist = self._observed(TTFT, samples)
        return None if hist is None else ev.LatencyHistogram(
            ts=ts, metric="ttft", bounds=hist[0], counts=hist[1], sum=hist[2])

    def _idle(self, samples: Samples, ts: float) -> list[ev.IdleHistogram]:
        """The GPU blocks' idle seconds before eviction since the last scrape, vLLM's sample
        over every engine (see the module); [] without the histogram or new observations."""
        hist = self._observed(IDLE_BEFORE_EVICT, samples)
        return [] if hist is None else [ev.IdleHistogram(
            ts=ts, tier="gpu", bounds=hist[0], counts=hist[1], sum=hist[2])]

    def _observed(self, name: str, samples: Samples) -> tuple | None:
        """Histogram ``name``'s ``(bounds, counts, sum)`` since the last scrape over every
        engine (see :meth:`_histograms`), None without the histogram or new observations."""
        hist = self._histograms(name, samples, lambda labels: "all").get("all")
        return hist if hist is not None and any(hist[1]) else None

    def _histograms(self, name: str, samples: Samples, group: Callable[[dict], str | None],
                    lazy: bool = False) -> dict[str, tuple]:
        """``{group: (bounds, counts, sum)}``: the increases since the last scrape of histogram
        ``name``'s series, added up over the engines (each: its labels but ``le``) that
        ``group`` gives that key (None: left out). ``bounds``: the finite bucket bounds,
        ascending; ``counts``: per bucket (not cumulative), the last one above every bound;
        ``sum``: of the observations counted. A bucket bound that is no number leaves the
        histogram out. ``lazy``: see :meth:`_increase_of`."""
        bucket, sum_name = f"{name}_bucket", f"{name}_sum"
        engines: dict[frozenset, dict[float, frozenset]] = {}  # labels but le -> le -> series
        for ls in series(samples, bucket):
            labels = dict(ls)
            try:
                bound = float(labels.pop("le", "+Inf"))
            except ValueError:  # not a bucket bound: not a histogram we can read
                return {}
            if math.isnan(bound):
                return {}
            engines.setdefault(frozenset(labels.items()), {})[bound] = ls
        sums = series(samples, sum_name)  # by engine: its labels are the buckets' but le
        # group -> (le -> its series (one per engine), the sums of the engines counted)
        groups: dict[str, tuple[dict[float, dict[frozenset, float]], dict]] = {}
        for engine, by_le in engines.items():
            key = group(dict(engine))
            if key is None:
                continue
            if self._read_as_before(name, engine, by_le, samples):
                by_bound, counted = groups.setdefault(key, ({}, {}))
                for bound, ls in by_le.items():
                    by_bound.setdefault(bound, {})[ls] = samples[(bucket, ls)]
                if engine in sums:
                    counted[engine] = sums[engine]
        if len(self._bounds) > MAX_SERIES:  # engines come and go: keep the current ones
            def current(key: tuple[str, frozenset]) -> bool:
                return key[0] != name or key[1] in engines
            self._bounds = {k: b for k, b in self._bounds.items() if current(k)}
            self._pending = {k: b for k, b in self._pending.items() if current(k)}
        out = {}
        for key, (by_bound, counted) in groups.items():
            bounds = sorted(by_bound)
            deltas = [self._increase_of(bucket, by_bound[b], lazy) or 0.0 for b in bounds]
            total = self._increase_of(sum_name, counted, lazy) or 0.0
            counts, previous = [], 0.0
            for d in deltas:  # cumulative deltas -> per-bucket counts
                counts.append(int(max(0.0, d - previous)))
                previous = max(previous, d)
            finite = [b for b in bounds if not math.isinf(b)]
            out[key] = (finite, counts[:len(finite)] + [sum(counts[len(finite):])], total)
        return out

    def _read_as_before(self, name: str, engine: frozenset, series: dict[float, frozenset],
                        samples: Samples) -> bool:
        """Whether ``engine``'s buckets of histogram ``name`` this scrape are the ones it had
        before (or it is new), so their increases count. Cumulative buckets are read against
        the last scrape's: one missing (a NaN is dropped) would count its observations in the
        next bucket up, then again once it is back. Such a scrape counts nothing of that engine
        and leaves its baselines (and its sum's); the same other buckets twice in a row (vLLM
        restarted with other buckets) become its new baselines."""
        bounds, before = frozenset(series), self._bounds.get((name, engine))
        if before is None or bounds == before:
            self._bounds[(name, engine)] = bounds
            self._pending.pop((name, engine), None)
            return True
        if self._pending.get((name, engine)) != bounds:
            self._pending[(name, engine)] = bounds
            return False
        # baselines only: nothing counted
        bucket, sum_name = f"{name}_bucket", f"{name}_sum"
        self._increase_of(bucket, {ls: samples[(bucket, ls)] for ls in series.values()})
        if (sum_name, engine) in samples:  # its sum's baseline too
            self._increase_of(sum_name, {engine: samples[(sum_name, engine)]})
        self._bounds[(name, engine)] = bounds
        del self._pending[(name, engine)]
        return False

    def _gpu(self, samples: Samples, ts: float) -> list:
        """The GPU tier over every engine: each engine's usage share of its own blocks."""
        def engine(labels: frozenset) -> str | None:  # vLLM labels only some series by model
            return dict(labels).get("engine")

        blocks: dict[str | None, int] = {}
        for ls in series(samples, "vllm:cache_config_info"):
            try:
                blocks[engine(ls)] = int(float(dict(ls).get("num_gpu_blocks", "None")))
            except (ValueError, OverflowError):  # "None" (not known yet), or not a number
                continue
        usage = {engine(ls): v for ls, v in series(samples, KV_CACHE_USAGE).items()
                 if blocks.get(engine(ls), 0) > 0}
        if not usage:
            return []
        capacity = sum(blocks[e] for e in usage)
        used = sum(int(round(min(1.0, max(0.0, u)) * blocks[e])) for e, u in usage.items())
        return [ev.TierSnapshot(ts=ts, tier="gpu", capacity_bytes=capacity * self.block_bytes,
                                resident_bytes=ev.bytes_of(used, self.block_bytes),
                                capacity_blocks=capacity,
                                resident_blocks=used)]


class VllmMetricsSource(ScrapeSource):
    """Scrapes ``url`` (vLLM's ``/metrics``) every ``interval`` seconds into ``pipeline``
    (:class:`~kvscope.agent.sources.scrape.ScrapeSource`: ``timeout``, ``clock``).
    ``span_ttft``, ``span_wait``: see the module (TTFT from spans or from the histogram)."""

    name = NAME
    thread_name = "kvscope-vllm-metrics"
    engine = "vLLM"
    prefix = "vllm:"
    mapper_class = MetricsMapper

    def __init__(self, pipeline: Consumer, url: str = "http://127.0.0.1:8000/metrics", *,
                 span_ttft: Callable[[], float] | None = None, span_wait: float = 6.0,
                 **kwargs) -> None:
        super().__init__(pipeline, url, **kwargs)
        self._span_ttft = span_ttft
        self._span_wait = span_wait
        # (monotonic seconds of the scrape before, of this one, its TTFT histogram), oldest first
        self._held: deque[tuple[float, float, ev.LatencyHistogram]] = deque()
        self._scraped = -math.inf
        self._prompt_tokens = 0  # prompt tokens this source has delivered (see check_overlap)
        self.shared_prompt_tokens = False  # another source counts prompt tokens too

    def map(self, samples: Samples, now: float) -> list:
        """The mapper's events; the engine's KV cache settings (:func:`cache_config`) go to the
        pipeline as they are read."""
        config = cache_config(samples)
        if config is not None:
            self.pipeline.set_cache_config(self.name, *config)
        return super().map(samples, now)

    def forget_gauges(self) -> None:
        """Also the host KV budget, which the mapper then reports again: an engine restarted
        with the same budget left it out for good (the weight-offload and budget detectors
        then read no KV offload)."""
        super().forget_gauges()
        self.mapper.forget_budget()

    def deliver(self, events: list) -> None:
        """Hold each TTFT histogram ``span_wait`` seconds when spans may report its requests."""
        now = time.monotonic()
        if self._span_ttft is not None:
            held = [e for e in events if isinstance(e, ev.LatencyHistogram)]
            events = [e for e in events if not isinstance(e, ev.LatencyHistogram)]
            self._held.extend((self._scraped, now, hist) for hist in held)
            events += self._released(now)
        self._scraped = now
        self._prompt_tokens += sum(sum(e.tokens.values()) for e in events
                                   if isinstance(e, ev.Lookup))
        super().deliver(events)
        if not self.shared_prompt_tokens:
            self.check_overlap()

    def check_overlap(self) -> bool:
        """Whether another source counts prompt tokens as well (kvscope's vLLM tap in the
        engine this source scrapes: both count every prompt's tokens, so
        ``kvscope_prompt_tokens_total`` doubles); logs one warning naming the config key the
        first time. Another source's tokens are the pipeline's beyond what this source
        delivered itself (counted before each delivery, so its own never look like another's).
        """
        snap = self.pipeline.snapshot()
        if sum(snap.prompt_tokens.values()) <= self._prompt_tokens:
            return False
        self.shared_prompt_tokens = True
        others = snap.senders_besides(self.name)
        log.warning(
            "vllm_metrics: prompt tokens are counted by another source as well (one of: %s), "
            "so kvscope_prompt_tokens_total counts them twice. With kvscope's vLLM tap in the "
            "vLLM this scrapes, which counts them per request, turn this source off: "
            "[vllm_metrics] enabled = false (environment: KVSCOPE_VLLM_METRICS__ENABLED=false); "
            "see docs/vllm.md.", ", ".join(others))
        return True

    def _released(self, now: float) -> list[ev.LatencyHistogram]:
        """The held TTFT histograms whose spans had time to come, but did not."""
        out = []
        while self._held and now - self._held[0][1] >= self._span_wait:
            since, _scraped, hist = self._held.popleft()
            if self._span_ttft() < since:
                out.append(hist)
        return out


class VllmMetricsConfig(EngineSection):
    """Scrape vLLM's ``/metrics`` (source ``vllm_metrics``) every ``interval`` seconds;
    ``block_bytes``: KV bytes per block (0: unknown)."""

    enabled: bool = False
    url: str = "http://127.0.0.1:8000/metrics"
    interval: float = Field(5.0, ge=0.1, le=3600, allow_inf_nan=False)
    block_bytes: int = Field(0, ge=0)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return http_url(value, "http://127.0.0.1:8000/metrics")


def _build(config: VllmMetricsConfig, consumer: Consumer, built: Built) -> VllmMetricsSource:
    # vLLM's spans and its TTFT histogram report the same requests: one of them counts
    receiver = built.parts.get("otlp_receiver")
    return VllmMetricsSource(
        consumer, config.url, interval=config.interval,
        mapper=MetricsMapper(config.block_bytes,
                             kv_events_tiers=yielded_tiers(SPEC, built.configs)),
        span_ttft=(lambda: receiver.last_ttft) if receiver is not None else None,
        span_wait=built.configs["otlp_receiver"].wait_seconds)


# what the KV events source reports, this one leaves out (else counted twice)
SPEC = register(SourceSpec(
    NAME, VllmMetricsConfig, _build, describe=lambda config: NAME,
    banner=lambda config, part, base_url: f"{NAME}: {config.url} every {config.interval:g} s",
    tiers=lambda config: ("cpu",), yields_to=("kv_events", "kvbm_metrics", "lmcache_metrics"),
    engine=lambda config: "vllm"))
