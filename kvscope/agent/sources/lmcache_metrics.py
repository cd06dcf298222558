"""The LMCache metrics source: scrapes the ``/metrics`` of LMCache's multiprocess server
(``lmcache server``: its HTTP server, ``--http-host``/``--http-port``, 127.0.0.1:8080 by default)
and maps its ``lmcache_mp_*`` series onto kvscope's tiers: L1 (the server's host memory;
``backend`` ``dram``, ``devdax``) -> ``cpu``, an L1 on GPUDirect storage (``gds``) -> ``disk``;
L2 -> ``disk`` or ``remote`` by its adapter (:data:`L2_TIERS`, ``l2_tiers`` beside it); the
engine's GPU (LMCache's L0) -> ``gpu``.

Names and meanings are LMCache 0.5.6's (``lmcache/v1/mp_observability/subscribers/metrics/
{l1,l2,lookup,engine,l1_lifecycle}.py``, ``lmcache/v1/distributed/{l1_manager,storage_manager}
.py``; OpenTelemetry counters exported through its Prometheus fallback: dots become ``_``, the
unit is appended and counters end in ``_total``). LMCache counts chunks (``--chunk-size``
tokens, 256 by default): ``chunk_blocks`` (engine blocks per chunk, 1 unless told) turns them
into kvscope's blocks and ``chunk_bytes`` (KV bytes per chunk, 0: unknown, and so are the bytes)
into bytes. Counters are increases between scrapes (:class:`~kvscope.agent.sources.scrape.
Counters`, over every label set: ``l1_tag``, ``cache_salt``, ``model_name`` ...); LMCache makes a
counter's series at its first increment, so one that appears on a server scraped before counts
from 0.

- ``l1_write_chunks_total`` less ``l2_prefetch_load_completed_chunks_total`` -> ``Transfer``
  gpu -> L1: every write into L1, the engine's stores and the L2 loads alike, less the loads
  (the two events reach the counters apart: a scrape whose loads outrun its writes carries the
  difference to the next).
- ``num_chunks_loaded_total`` (chunks retrieved into the engine) -> ``Transfer`` L1 -> gpu.
- ``l2_store_completed_objects_chunks_total`` -> ``Transfer`` L1 -> L2;
  ``l2_prefetch_load_completed_chunks_total`` -> ``Transfer`` L2 -> L1 (LMCache promotes
  through L1). Every transfer is untimed: LMCache exports throughput histograms, not times.
- ``l1_evicted_chunks_total`` -> ``Eviction`` of L1, unmeasured (LMCache does not say each
  chunk's age or hits), ``offloaded`` when the server has an L2 (LMCache writes every chunk L1
  admits through to its L2 adapters, so an evicted chunk keeps its copy there);
  ``l2_evicted_objects_chunks_total`` -> ``Eviction`` of L2, dropped.
- ``l1_chunk_idle_before_evict_seconds`` (seconds from a chunk's last touch to its eviction,
  over the share ``--metrics-sample-rate`` of chunks, 1% by default, not on /metrics) ->
  ``IdleHistogram`` of L1's tier, bucket increases: the shape of idle times, not their number.
- ``lookup_requested_tokens_total`` with ``lookup_hit_l1_tokens_total`` and
  ``lookup_hit_l2_tokens_total`` -> one aggregate ``Lookup`` per scrape (no request id): L1's
  tier and L2's (a remote L2, or one kvscope cannot place, counts as ``cpu``: kvscope's token
  sources name no remote tier, and those tokens reach the GPU through L1) and ``recompute``,
  the rest. LMCache counts only chunk-aligned tokens and never the engine's own GPU prefix
  hits, so these lookups are what the engine asked LMCache, not whole prompts: ``lookups``
  off when ``vllm_metrics`` scrapes the vLLM that LMCache serves (vLLM counts every prompt
  token, LMCache's hits as external).
- ``l1_memory_usage_bytes`` and ``l1_usage_ratio`` (per L1 manager) -> ``TierSnapshot`` of L1's
  tier: resident bytes, capacity = bytes / ratio (kept from the last scrape with a ratio above
  0: an empty L1 says nothing of its size, and until one has, no snapshot; forgotten when
  ``target_info``'s ``service_instance_id`` says another server process answers), blocks from
  ``chunk_bytes`` (0 when unknown).

Left out: L2 residency (``l2_usage_bytes`` has no capacity beside it, and a capacity of 0 would
read as a full tier), L1 lifetime and reuse-gap histograms (per-chunk reuse is not rebuilt
from totals), throughput histograms, request counts, failures, the event bus's health. Names a
given LMCache lacks are absent, never 0. Parsing and mapping (:class:`LMCacheMapper`) do no
I/O; the scrape loop is :class:`~kvscope.agent.sources.scrape.ScrapeSource`'s.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field, field_validator

from kvscope import events as ev
from kvscope.agent.sections import ScrapeSection
from kvscope.agent.sources.base import Built, Consumer, SourceSpec, register
from kvscope.agent.sources.scrape import Counters, Samples, ScrapeSource, series
from kvscope.vocabulary import OFFLOAD_TIERS, Tier

NAME = "lmcache_metrics"
DEFAULT_URL = "http://127.0.0.1:8080/metrics"
_P = "lmcache_mp_"
L1_WRITES, L1_EVICTED = _P + "l1_write_chunks_total", _P + "l1_evicted_chunks_total"
L2_STORED = _P + "l2_store_completed_objects_chunks_total"
L2_LOADED = _P + "l2_prefetch_load_completed_chunks_total"
L2_EVICTED = _P + "l2_evicted_objects_chunks_total"
RETRIEVED = _P + "num_chunks_loaded_total"
REQUESTED = _P + "lookup_requested_tokens_total"
HIT_L1, HIT_L2 = _P + "lookup_hit_l1_tokens_total", _P + "lookup_hit_l2_tokens_total"
L1_BYTES, L1_RATIO, L2_BYTES = (_P + "l1_memory_usage_bytes", _P + "l1_usage_ratio",
                                _P + "l2_usage_bytes")
IDLE = _P + "l1_chunk_idle_before_evict_seconds"
COUNTERS = (L1_WRITES, L1_EVICTED, L2_STORED, L2_LOADED, L2_EVICTED, RETRIEVED, REQUESTED,
            HIT_L1, HIT_L2)
# An L1 manager's ``backend`` label (l1_manager.py) -> tier
L1_BACKENDS = {"dram": "cpu", "devdax": "cpu", "dram+devdax": "cpu", "gds": "disk"}
# LMCache 0.5.6's registered L2 adapter types (``l2_adapters/*``, the ``l2_name`` label) ->
# tier: local files and block devices are disk; stores over the network remote. Others
# (``mock``, ``fault_inject``, ``plugin``, the NIXL ones, whose medium is their own
# configuration's) are placed by the ``l2_tiers`` setting, or left out.
L2_TIERS = {"fs": "disk", "fs_native": "disk", "raw_block": "disk", "dax": "disk",
            "hf3fs": "remote", "s3": "remote", "resp": "remote", "valkey": "remote",
            "mooncake_store": "remote", "bigtable": "remote", "aerospike": "remote",
            "p2p": "remote", "hfbucket": "remote", "sagemaker-hyperpod": "remote"}
L2_PLACES = ("disk", "remote")  # the tiers an L2 can be: below L1, the cpu tier


def level_tier(samples: Samples, gauge: str, label: str,
               tiers: Mapping[str, str]) -> str | None:
    """The one tier every series of ``gauge`` names by ``label`` (``tiers``: label value ->
    tier); None when there is no such series, or they name none or several (LMCache's chunk
    counters carry no adapter label: they can be placed only when every adapter is in one
    tier)."""
    names = {dict(labels).get(label) for labels in series(samples, gauge)}
    placed = {tiers.get(name) for name in names}
    return placed.pop() if len(placed) == 1 and None not in placed else None


class LMCacheMapper:
    """Successive scrapes of LMCache's ``/metrics`` -> kvscope events (see the module).
    ``chunk_blocks``: engine blocks per LMCache chunk (1: a chunk counts as one block);
    ``chunk_bytes``: KV bytes per chunk (0: unknown); ``l2_tiers``: L2 adapter types -> tier,
    beside :data:`L2_TIERS`; ``lookups``: map the lookups. Not thread-safe."""

    def __init__(self, chunk_blocks: int = 1, chunk_bytes: int = 0,
                 l2_tiers: Mapping[str, str] | None = None, lookups: bool = True) -> None:
        self.chunk_blocks, self.chunk_bytes, self.lookups = chunk_blocks, chunk_bytes, lookups
        self.l2_tiers = {**L2_TIERS, **(l2_tiers or {})}
        self.counters = Counters()
        self._scraped = False  # a scrape before this one was kept: new series count from 0
        self._deficit = 0.0  # L2 loads counted before the L1 writes they made
        self._capacity: dict[frozenset, float] = {}  # an L1 manager's bytes, once known
        self._instance: str | None = None  # the server process's OTel service.instance.id
        # the last scrape came from another server process than the one before (see the source)
        self.restarted = False

    def map(self, samples: Samples, now: float) -> list:
        instance = next((dict(labels).get("service_instance_id")
                         for labels in series(samples, "target_info")), None)
        self.restarted = instance != self._instance and self._instance is not None
        if self.restarted:  # its counters count from 0: 100 then 150 read 50, not 150
            self.counters.forget()
        if instance != self._instance:  # another server process: its L1 may be another size
            self._instance, self._capacity, self._deficit = instance, {}, 0.0
        self.counters.begin(samples)
        l1 = level_tier(samples, L1_BYTES, "backend", L1_BACKENDS) or "cpu"
        l2 = level_tier(samples, L2_BYTES, "l2_name", self.l2_tiers)
        scraped = self._scraped
        up = {name: self.counters.increase(name, series(samples, name),
                                           lambda labels: scraped)
              for name in COUNTERS}
        idle = self.counters.observed(IDLE, samples, lambda labels: scraped)
        self._scraped = not self.counters.commit()
        events: list = []
        stores = self._stores(up[L1_WRITES], up[L2_LOADED])
        for chunks, src, dst in ((stores, "gpu", l1), (up[RETRIEVED], l1, "gpu"),
                                 (up[L2_STORED], l1, l2), (up[L2_LOADED], l2, l1)):
            if chunks and dst is not None and src is not None:
                events.append(ev.Transfer(ts=now, src=src, dst=dst, duration=0.0, timed=False,
                                          sees_failures=False, **self._size(chunks)))
        has_l2 = bool(series(samples, L2_BYTES))
        for chunks, tier, offloaded in ((up[L1_EVICTED], l1, has_l2),
                                        (up[L2_EVICTED], l2, False)):
            if chunks and tier is not None:
                events.append(ev.Eviction(ts=now, tier=tier, age=0.0, hits=0, measured=False,
                                          offloaded=offloaded, **self._size(chunks)))
        if idle is not None:
            events.append(ev.IdleHistogram(ts=now, tier=l1, bounds=idle[0], counts=idle[1],
                                           sum=idle[2]))
        if self.lookups:
            events += self._lookup(up, l1, l2, now)
        return events + self._l1_snapshot(samples, l1, now)

    def _size(self, chunks: float) -> dict[str, int]:
        return {"blocks": int(chunks) * self.chunk_blocks, "bytes": int(chunks) * self.chunk_bytes}

    def _stores(self, writes: float | None, loads: float | None) -> float:
        """Chunks the engine stored into L1 this scrape: L1's writes less its L2 loads (see
        the module); 0 without the writes counter."""
        if writes is None:
            return 0.0
        stored = writes - (loads or 0.0) - self._deficit
        self._deficit = max(0.0, -stored)
        return max(0.0, stored)

    def _lookup(self, up: dict, l1: str, l2: str | None, now: float) -> list[ev.Lookup]:
        requested, l1_hits, l2_hits = up[REQUESTED], up[HIT_L1], up[HIT_L2]
        if not requested or l1_hits is None or l2_hits is None:
            return []
        # its tiers and recompute, 0 included (measured); never gpu: LMCache is asked only
        # for the tokens vLLM's own prefix cache lacked, so the GPU's hits are not measured
        tokens: dict[str, int] = {}
        for source, n in ((l1, l1_hits), ("disk" if l2 == "disk" else "cpu", l2_hits),
                          ("recompute", requested - l1_hits - l2_hits)):
            tokens[source] = tokens.get(source, 0) + max(0, int(n))
        return [ev.Lookup(ts=now, request_id="", tokens=tokens)]

    def _l1_snapshot(self, samples: Samples, tier: str, now: float) -> list[ev.TierSnapshot]:
        ratios = series(samples, L1_RATIO)
        resident = capacity = 0.0
        known = False
        for labels, used in series(samples, L1_BYTES).items():
            ratio = ratios.get(labels, 0.0)
            if ratio > 0:
                self._capacity[labels] = used / ratio
            if labels in self._capacity:
                known = True
                resident += used
                capacity += self._capacity[labels]
        if not known:
            return []
        capacity = round(capacity)
        per_block = self.chunk_bytes / self.chunk_blocks
        return [ev.TierSnapshot(
            ts=now, tier=tier, capacity_bytes=capacity, resident_bytes=int(resident),
            capacity_blocks=int(capacity // per_block) if per_block else 0,
            resident_blocks=int(resident // per_block) if per_block else None)]


class LMCacheMetricsSource(ScrapeSource):
    """Scrapes LMCache's ``url`` every ``interval`` seconds into ``pipeline`` (see the
    module)."""

    name = NAME
    thread_name = "kvscope-lmcache-metrics"
    engine = "LMCache"
    prefix = _P
    mapper_class = LMCacheMapper

    def map(self, samples: Samples, now: float) -> list:
        """The mapper's events; a restarted server's L1 leaves the tier gauges until its size
        is known again (the old process's fill and size are no longer true)."""
        events = super().map(samples, now)
        if self.mapper.restarted:
            self.pipeline.forget_tiers(self.name)
        return events


class LMCacheMetricsConfig(ScrapeSection):
    """Scrape LMCache's multiprocess server's ``/metrics`` (source ``lmcache_metrics``) every
    ``interval`` seconds. ``chunk_blocks``: engine blocks per LMCache chunk (its chunk size over
    the engine's block size; 1: count chunks as blocks); ``chunk_bytes``: KV bytes per chunk (0:
    unknown); ``l2_tiers``: L2 adapter types -> tier, for those kvscope does not place;
    ``lookups``: map LMCache's lookups (unset: unless ``[vllm_metrics]`` is enabled)."""

    url: str = DEFAULT_URL
    chunk_blocks: int = Field(1, ge=1, le=1 << 20)
    chunk_bytes: int = Field(0, ge=0)
    l2_tiers: dict[str, Tier] = {}
    lookups: bool | None = None

    @field_validator("l2_tiers")
    @classmethod
    def _l2_tiers(cls, value: dict[str, str]) -> dict[str, str]:
        above = [name for name, tier in value.items() if tier not in L2_PLACES]
        if above:
            raise ValueError(f"{above[0]} = {value[above[0]]!r}: an L2 adapter holds what "
                             f"LMCache's L1 (the cpu tier) evicts, so its tier is "
                             f"{' or '.join(L2_PLACES)}")
        return value


def _build(config: LMCacheMetricsConfig, consumer: Consumer,
           built: Built) -> LMCacheMetricsSource:
    lookups = config.lookups
    if lookups is None:  # vLLM's own counters hold every prompt token: LMCache's would add
        lookups = not built.configs["vllm_metrics"].enabled
    return LMCacheMetricsSource(
        consumer, config.url, interval=config.interval,
        mapper=LMCacheMapper(config.chunk_blocks, config.chunk_bytes, config.l2_tiers, lookups))


# L1 is host memory (or GDS storage), L2 disk or remote
SPEC = register(SourceSpec(
    NAME, LMCacheMetricsConfig, _build, describe=lambda config: NAME,
    banner=lambda config, part, base_url: f"{NAME}: {config.url} every {config.interval:g} s",
    tiers=lambda config: OFFLOAD_TIERS, engine=lambda config: "lmcache"))
