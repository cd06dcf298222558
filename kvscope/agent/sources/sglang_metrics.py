"""The SGLang metrics source: scrapes SGLang's Prometheus ``/metrics`` (``--enable-metrics``)
and maps its prefix-cache and HiCache series onto kvscope's tiers: SGLang's device KV pool ->
``gpu``, its HiCache host pool (L2) -> ``cpu``, its storage layer (L3, any
``--hicache-storage-backend``: a file system, Mooncake, 3FS...) -> ``disk``, as a prompt
token's source has no remote (the KV events source names SGLang's EXTERNAL medium remote).

Names, labels and meaning are SGLang 0.5.23's ``python/sglang/srt/observability/
metrics_collector.py`` (``SchedulerMetricsCollector``, ``TokenizerMetricsCollector``,
``RadixCacheMetricsCollector``, ``StorageMetricsCollector``): prefix ``sglang:`` (colons),
counters with ``_total``. Token counts become blocks through SGLang's page size
(``sglang:page_size``, else the ``page_size`` setting; unknown: every event counted in blocks is
left out, and said once), with the remainder carried to the next scrape; bytes are SGLang's
own where it counts them (those of a scrape short of a page carried with its tokens), else
blocks x ``block_bytes`` (0: unknown).

==============================================  ==================================================
SGLang series                                   kvscope
==============================================  ==================================================
``prompt_tokens_total``,                        one aggregate ``Lookup`` per scrape: device ->
``cached_tokens_total{cache_source}``           gpu, host -> cpu, storage -> disk, the rest of the
                                                prompt tokens recompute (a ``total`` source, from
                                                an SGLang without the breakdown, makes none)
``hicache_backup_tokens_total{pool="kv"}``,     untimed ``Transfer`` gpu -> cpu (write-through or
``hicache_backup_bytes_total``                  write-back backups)
``load_back_tokens_total{pool="kv"}``,          untimed ``Transfer`` cpu -> gpu (load back)
``load_back_bytes_total``
``prefetched_tokens_total``                     untimed ``Transfer`` disk -> cpu (L3 prefetch)
``backuped_tokens_total``                       untimed ``Transfer`` cpu -> disk (L3 backup)
``evicted_tokens_total``,                       ``Eviction`` gpu: the dropped tokens not
``hicache_dropped_tokens_total{reason,pool}``   offloaded, the rest of the evicted ones offloaded
                                                (kept on the host); without HiCache every one
                                                dropped
``hicache_backup_dropped_tokens_total``         ``Admission`` disk ``skipped`` (L3 admission
                                                declined them, or their source went stale)
``hicache_host_{used,total}_tokens``            ``TierSnapshot`` cpu
``max_total_num_tokens``, ``kv_used_tokens``,   ``TierSnapshot`` gpu (resident: used + evictable
``kv_evictable_tokens``                         slots, the radix cache's blocks included)
``num_queue_reqs``, ``num_running_reqs``,       ``SchedulerStats`` (waiting, running, preemptions:
``num_retracted_requests_total``                SGLang retracts a request when its KV pool runs
                                                out; gpu_kv_usage: used / total slots, the
                                                largest over DP ranks)
``time_to_first_token_seconds`` (histogram)     ``LatencyHistogram`` ttft (bucket increases over
                                                every label set, SGLang's buckets)
==============================================  ==================================================

Ranks: SGLang's radix cache reports its token counters on every tensor- (and pipeline-)
parallel rank, each the same logical count ("read one rank rather than summing ranks"), and
its scheduler's gauges on each stats-logging rank: token series are read from one rank per
cache, the lowest ``tp_rank``/``pp_rank``/``moe_ep_rank`` of each set of other labels
(``dp_rank`` among them: each data-parallel rank's cache is its own, and they add up). Byte
counters are every rank's own shard: they add up.

Beside the KV events source (``[kv_events] engine = "sglang"``), what it reports is left to it,
so that nothing counts twice: its tiers' residency (this source then sends the cpu tier's
capacity alone, which the pipeline adds to the KV events' residency), the transfers into them
(gpu -> cpu, disk -> cpu; cpu -> disk) and evictions from them. Loads back into the GPU
(cpu -> gpu) are sent whatever it reports: KV events cannot tell a loaded GPU block from a
computed one.

Left out: ``cache_hit_rate`` (a gauge: kvscope exports counters), the L3 prefetch diagnostics
``storage_prefetch_{hit,unfulfilled,deferred}_tokens_total`` (attempts, by reason: what was
fetched is ``prefetched_tokens_total``, what served a prompt ``cached_tokens_total``),
``hicache_prefetch_aux_alloc_failed_tokens_total``, and the other histograms: load-back,
backup and eviction durations (one timed transfer of no bytes per observation would make
kvscope's average transfer size, bytes over timed transfers, meaningless beside the untimed
transfers that carry the bytes), inter-token latency (kvscope's ITL is a per-request mean),
pages and bandwidth per L3 operation.

A counter series SGLang makes at its first increment (its labelled counters are created on
use) counts from 0 when it appears after a scrape that saw SGLang; at the agent's first scrape
every series is a baseline. Parsing and mapping (:class:`SglangMapper`) do no I/O; the scrape
loop is :class:`~kvscope.agent.sources.scrape.ScrapeSource`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from pydantic import Field

from kvscope import events as ev
from kvscope.agent.sections import ScrapeSection
from kvscope.agent.sources.base import (Built, Consumer, SourceSpec, register,
                                        yielded_tiers)
from kvscope.agent.sources.scrape import Counters, Samples, ScrapeSource, series
from kvscope.vocabulary import LOCAL_TIERS

log = logging.getLogger(__name__)
NAME = "sglang_metrics"
DEFAULT_URL = "http://127.0.0.1:30000/metrics"
P = "sglang:"
# cached_tokens_total's cache_source -> the token's source
CACHE_SOURCE = {"device": "gpu", "host": "cpu", "storage": "disk"}
RANK_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")
# token counters -> (src, dst, SGLang's byte counter of the same copies, if any)
TRANSFERS: dict[str, tuple[str, str, str | None]] = {
    P + "hicache_backup_tokens_total": ("gpu", "cpu", P + "hicache_backup_bytes_total"),
    P + "load_back_tokens_total": ("cpu", "gpu", P + "load_back_bytes_total"),
    P + "prefetched_tokens_total": ("disk", "cpu", None),
    P + "backuped_tokens_total": ("cpu", "disk", None),
}
EVICTED, DROPPED = P + "evicted_tokens_total", P + "hicache_dropped_tokens_total"
ADMISSION_SKIPPED = P + "hicache_backup_dropped_tokens_total"
HOST_USED, HOST_TOTAL = P + "hicache_host_used_tokens", P + "hicache_host_total_tokens"
GPU_TOTAL, GPU_USED = P + "max_total_num_tokens", P + "kv_used_tokens"
GPU_EVICTABLE = P + "kv_evictable_tokens"
WAITING, RUNNING = P + "num_queue_reqs", P + "num_running_reqs"
RETRACTED = P + "num_retracted_requests_total"
TTFT = P + "time_to_first_token_seconds"


def one_rank(values: Mapping[frozenset, float]) -> dict[frozenset, float]:
    """Of series that differ only in their rank labels (:data:`RANK_LABELS`), the lowest
    rank's: {labels: value}. Pure."""
    best: dict[frozenset, tuple[tuple, frozenset]] = {}
    for labels, _ in values.items():
        ranks = dict(labels)
        key = frozenset((k, v) for k, v in labels if k not in RANK_LABELS)
        order = tuple(_number(ranks.get(name, "0")) for name in RANK_LABELS)
        if key not in best or order < best[key][0]:
            best[key] = (order, labels)
    return {labels: values[labels] for _, labels in best.values()}


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("inf")


class SglangMapper:
    """Successive scrapes of SGLang's ``/metrics`` -> kvscope events (see the module).
    ``page_size``: tokens per KV page when SGLang does not export it (0: unknown);
    ``block_bytes``: KV bytes per page (0: unknown); ``kv_events_tiers``: the tiers the KV
    events source reports (left to it). Not thread-safe."""

    def __init__(self, page_size: int = 0, block_bytes: int = 0,
                 kv_events_tiers: Iterable[str] = ()) -> None:
        told = frozenset(kv_events_tiers)
        self.page_size = page_size
        self.block_bytes = block_bytes
        self.report = {tier: tier not in told for tier in LOCAL_TIERS}
        self.counters = Counters()
        self._scraped = False  # a scrape saw SGLang before: new series count from 0
        self._rest: dict[str, float] = {}  # tokens short of a page, per counter
        # bytes of scrapes whose tokens made no whole page, per token counter: they go with
        # the Transfer of the page they are part of
        self._rest_bytes: dict[str, float] = {}
        self._page_logged = False

    def map(self, samples: Samples, now: float) -> list:
        """One scrape's events (``now``: their Unix timestamp)."""
        self.counters.begin(samples)

        def increase(name: str, per_rank: bool = True, **labels: str) -> float | None:
            values = series(samples, name, **labels)
            return self.counters.increase(name, one_rank(values) if per_rank else values,
                                          from_zero)

        def from_zero(labels: frozenset) -> bool:
            return self._scraped

        page = self._page(samples)
        out: list = self._lookup(samples, increase, now)
        moved = {name: (increase(name, pool="kv") if name in _POOLED else increase(name),
                        increase(bytes_name, per_rank=False) if bytes_name else None)
                 for name, (_, _, bytes_name) in TRANSFERS.items()}
        evicted, dropped = increase(EVICTED), increase(DROPPED, pool="kv")
        skipped = increase(ADMISSION_SKIPPED)
        retracted = increase(RETRACTED)
        ttft = self.counters.observed(TTFT, samples, from_zero)
        self.counters.commit()
        self._scraped = True
        out += self._scheduler(samples, retracted, now)
        if ttft is not None:
            out.append(ev.LatencyHistogram(ts=now, metric="ttft", bounds=ttft[0],
                                           counts=ttft[1], sum=ttft[2]))
        if not page:
            return out
        for name, (src, dst, _) in TRANSFERS.items():
            tokens, nbytes = moved[name]
            blocks = self._blocks(name, tokens, page)
            if nbytes is not None:
                nbytes += self._rest_bytes.pop(name, 0.0)
                if not blocks:
                    self._rest_bytes[name] = nbytes
            if blocks and (dst == "gpu" or self.report[dst]):
                out.append(ev.Transfer(ts=now, src=src, dst=dst, blocks=blocks, duration=0.0,
                                       bytes=int(nbytes) if nbytes is not None
                                       else blocks * self.block_bytes, timed=False,
                                       sees_failures=False))
        out += self._evictions(samples, evicted, dropped, page, now)
        if skipped is not None:
            out.append(ev.Admission(ts=now, tier="disk",
                                    skipped=self._blocks(ADMISSION_SKIPPED, skipped, page)))
        return out + self._snapshots(samples, page, now)

    def _page(self, samples: Samples) -> int:
        """Tokens per page: SGLang's gauge, else the setting; 0 (said once) when neither."""
        pages = [v for v in one_rank(series(samples, P + "page_size")).values() if v >= 1]
        if pages:
            return int(max(pages))
        if not self.page_size and not self._page_logged:
            self._page_logged = True
            log.warning("SGLang metrics: no sglang:page_size and no [sglang_metrics] page_size:"
                        " transfers, evictions and tier sizes (counted in pages) are left out "
                        "(logged once)")
        return self.page_size

    def _blocks(self, name: str, tokens: float | None, page: int) -> int:
        """``tokens`` (an increase) in whole pages, the rest carried to the next scrape."""
        if not tokens:
            return 0
        whole, rest = divmod(tokens + self._rest.get(name, 0.0), page)
        self._rest[name] = rest
        return int(whole)

    def _lookup(self, samples: Samples, increase, now: float) -> list[ev.Lookup]:
        prompt = increase(P + "prompt_tokens_total", per_rank=False)
        cached = {source: increase(P + "cached_tokens_total", per_rank=False,
                                   cache_source=source) for source in (*CACHE_SOURCE, "total")}
        if not prompt or cached["total"]:
            return []
        # every source SGLang has made a series of (its first hit), 0 included: measured
        tokens = {CACHE_SOURCE[s]: int(n) for s, n in cached.items()
                  if s != "total" and n is not None}
        tokens["recompute"] = max(0, int(prompt) - sum(tokens.values()))
        return [ev.Lookup(ts=now, request_id="", tokens=tokens)]

    def _evictions(self, samples: Samples, evicted: float | None, dropped: float | None,
                   page: int, now: float) -> list[ev.Eviction]:
        if not self.report["gpu"] or evicted is None:
            return []
        hicache = bool(series(samples, HOST_TOTAL))
        lost = min(evicted, dropped or 0.0) if hicache else evicted
        out = []
        for offloaded, tokens in ((False, lost), (True, evicted - lost)):
            blocks = self._blocks(f"{EVICTED}:{offloaded}", tokens, page)
            if blocks:
                out.append(ev.Eviction(ts=now, tier="gpu", blocks=blocks,
                                       bytes=blocks * self.block_bytes, age=0.0, hits=0,
                                       offloaded=offloaded, measured=False))
        return out

    def _snapshots(self, samples: Samples, page: int, now: float) -> list[ev.TierSnapshot]:
        def total(name: str) -> int | None:
            values = one_rank(series(samples, name))
            return int(sum(values.values()) // page) if values else None

        out = []
        capacity, used = total(HOST_TOTAL), total(HOST_USED)
        if capacity is not None:
            used = (used or 0) if self.report["cpu"] else None  # KV events hold the residency
            out.append(self._snapshot("cpu", capacity, used, now))
        capacity, used, evictable = total(GPU_TOTAL), total(GPU_USED), total(GPU_EVICTABLE)
        if self.report["gpu"] and capacity is not None and used is not None:
            out.append(self._snapshot("gpu", capacity, used + (evictable or 0), now))
        return out

    def _snapshot(self, tier: str, capacity: int, resident: int | None,
                  now: float) -> ev.TierSnapshot:
        bpb = self.block_bytes
        return ev.TierSnapshot(ts=now, tier=tier, capacity_blocks=capacity,
                               resident_blocks=resident, capacity_bytes=capacity * bpb,
                               resident_bytes=ev.bytes_of(resident, bpb))

    def _scheduler(self, samples: Samples, retracted: float | None,
                   now: float) -> list[ev.SchedulerStats]:
        def added(name: str) -> int | None:
            values = one_rank(series(samples, name))
            return int(sum(values.values())) if values else None

        shares = []
        totals = one_rank(series(samples, GPU_TOTAL))
        for labels, used in one_rank(series(samples, GPU_USED)).items():
            if totals.get(labels, 0) > 0:
                shares.append(min(1.0, max(0.0, used / totals[labels])))
        stats = ev.SchedulerStats(ts=now, waiting=added(WAITING), running=added(RUNNING),
                                  preemptions=None if retracted is None else int(retracted),
                                  gpu_kv_usage=max(shares) if shares else None)
        return [] if stats == ev.SchedulerStats(ts=now) else [stats]


# the token counters labelled by host pool (kv, swa, mamba, ...): the KV pool's are the blocks
_POOLED = frozenset({P + "hicache_backup_tokens_total", P + "load_back_tokens_total"})


class SglangMetricsSource(ScrapeSource):
    """Scrapes SGLang's ``url`` every ``interval`` seconds into ``pipeline`` (see the module)."""

    name = NAME
    thread_name = "kvscope-sglang-metrics"
    engine = "SGLang"
    prefix = P
    mapper_class = SglangMapper


class SglangMetricsConfig(ScrapeSection):
    """Scrape SGLang's ``/metrics`` (source ``sglang_metrics``; SGLang with ``--enable-metrics``)
    every ``interval`` seconds; ``page_size``: tokens per KV page when SGLang does not export
    ``sglang:page_size`` (0: unknown); ``block_bytes``: KV bytes per page (0: unknown)."""

    url: str = DEFAULT_URL
    page_size: int = Field(0, ge=0)
    block_bytes: int = Field(0, ge=0)


def _build(config: SglangMetricsConfig, consumer: Consumer, built: Built) -> SglangMetricsSource:
    return SglangMetricsSource(
        consumer, config.url, interval=config.interval,
        mapper=SglangMapper(config.page_size, config.block_bytes,
                            kv_events_tiers=yielded_tiers(SPEC, built.configs)))


# what the KV events source reports, this one leaves out (else counted twice)
SPEC = register(SourceSpec(
    NAME, SglangMetricsConfig, _build, describe=lambda config: NAME,
    banner=lambda config, part, base_url: f"{NAME}: {config.url} every {config.interval:g} s",
    tiers=lambda config: LOCAL_TIERS, yields_to=("kv_events",),
    engine=lambda config: "sglang"))
