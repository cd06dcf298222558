"""The TensorRT-LLM source: observes ``trtllm-serve`` through its own two interfaces.

1. **KV cache events** (``events``, on by default): every ``interval`` seconds a ``POST
   /kv_cache_events`` (``tensorrt_llm/serve/openai_server.py``, the route TensorRT-LLM's own
   KV-aware router polls). Each call drains the engine's event queue (it answers once the queue
   is empty, or after waiting up to 2 s for a first event), so only one consumer may poll it:
   turn ``events`` off when a router drains them. Folded by
   :mod:`~kvscope.agent.sources.trtllm_events` into residency and capacity per tier, offloads
   and promotions (untimed ``Transfer``), evictions (with their age below the GPU) and the host
   tier's ``Admission`` (GPU blocks offloaded vs. dropped). A drain that breaks after the
   engine answered (the connection cut, ``timeout`` passed, a body over ``max_body_bytes``,
   JSON that does not parse) lost what it held: counted at once as one dropped event
   (``cut``, ``too_large``, ``malformed``), and, when the next drain's first ``event_id``
   shows how many were lost, the rest under the same reason rather than as ``gap``.
2. **Prometheus metrics** (``metrics``, off by default; ``trtllm-serve`` serves them at
   ``/prometheus/metrics`` with ``return_perf_metrics``; ``tensorrt_llm/metrics/
   collector.py``). Mapped by :class:`TrtllmMetrics`, each figure from one interface only:

   - ``trtllm_prompt_cache_hit_tokens_total{cache_level,cache_tier}`` (main, 1.3 candidates:
     tokens served per tier, counted as requests are scheduled) with
     ``trtllm_prompt_tokens_total`` and ``trtllm_prompt_cached_tokens_total`` (both counted
     when a request finishes) -> one aggregate ``Lookup`` per scrape: ``cache_tier`` gpu ->
     gpu, host -> cpu, disk -> disk, remote (a KV connector's store) -> cpu, as vLLM's
     external hits are; a ``cache_tier`` left empty takes its level's tier from ``levels``;
     ``none`` (tokens skipped outside every sliding window, neither loaded nor computed) is
     left out. Recomputed: prompt tokens less cached ones (the aggregate, else the tiers'
     sum). The events cannot see hits, so this is never counted twice.
   - ``trtllm_num_requests_waiting`` / ``..._running`` (main; added up) and
     ``trtllm_kv_cache_utilization`` (1.2 and main; a share, the largest) -> ``SchedulerStats``
     (each absent when the engine has no such series; no preemption count).
   - ``trtllm_time_to_first_token_seconds`` -> ``LatencyHistogram`` (bucket increases).
   - Only with ``events`` off (the events see the same copies, block by block):
     ``trtllm_kv_cache_offload_bytes_total`` / ``..._onboard_bytes_total`` (main) -> untimed
     ``Transfer`` gpu -> cpu / cpu -> gpu (blocks from ``block_bytes`` when known), and
     ``trtllm_kv_cache_max_blocks`` / ``..._used_blocks`` (main) -> ``TierSnapshot`` gpu
     (used: blocks held by requests, as vLLM's usage is).

   Left out: ``trtllm_kv_cache_hit_rate`` and the ``*_reuse_rate`` gauges (ratios: kvscope
   exports counters), ``trtllm_kv_cache_host_utilization`` (a share of a host pool whose
   size /prometheus/metrics does not give; the events' ``created`` does, and their residency
   is counted), ``trtllm_kv_cache_config_info`` (its labels are settings, no figure), the
   reused/missed block counters (blocks of one lookup, without the tier the tokens above give).

Gauges carry a ``pid`` label (prometheus_client's multiprocess mode, which ``trtllm-serve``
uses); one server process writes them. The source is up while each interface it uses answers.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from urllib.parse import urlsplit

import httpx
import msgspec
from pydantic import Field, field_validator

from kvscope import events as ev
from kvscope.agent.sections import EngineSection, http_url
from kvscope.agent.sources.base import Built, Consumer, SourceSpec, register
from kvscope.agent.sources.scrape import BodyError, Counters, Samples, ScrapeSource, series
from kvscope.agent.sources.trtllm_events import Decoded, TrtllmResidency, check_levels, decode
from kvscope.errors import describe
from kvscope.vocabulary import TRTLLM_CACHE_TIER_SOURCE

log = logging.getLogger(__name__)
NAME = "trtllm"
EVENTS_PATH, METRICS_PATH = "/kv_cache_events", "/prometheus/metrics"
# what a drain may lose, and why (see the module)
DRAIN_DROPS = ("cut", "too_large", "malformed", "gap", "unknown_kind", "invalid", "untracked")

HIT_TOKENS = "trtllm_prompt_cache_hit_tokens_total"
PROMPT_TOKENS, CACHED_TOKENS = "trtllm_prompt_tokens_total", "trtllm_prompt_cached_tokens_total"
OFFLOAD_BYTES = "trtllm_kv_cache_offload_bytes_total"
ONBOARD_BYTES = "trtllm_kv_cache_onboard_bytes_total"
WAITING, RUNNING = "trtllm_num_requests_waiting", "trtllm_num_requests_running"
KV_USAGE = "trtllm_kv_cache_utilization"
MAX_BLOCKS, USED_BLOCKS = "trtllm_kv_cache_max_blocks", "trtllm_kv_cache_used_blocks"
TTFT = "trtllm_time_to_first_token_seconds"


class TrtllmMetrics:
    """Turns successive scrapes of ``/prometheus/metrics`` into kvscope events (see the
    module). ``levels``: the tier of each cache level; ``events``: whether the events drain
    reports the copies and the GPU tier; ``block_bytes``: KV bytes per block (0: unknown).
    Not thread-safe."""

    def __init__(self, levels: tuple[str, ...] = ("gpu", "cpu"), events: bool = True,
                 block_bytes: int = 0) -> None:
        self.levels, self.events, self.block_bytes = levels, events, block_bytes
        self.counters = Counters()

    def map(self, samples: Samples, ts: float) -> list:
        self.counters.begin(samples)
        out: list = []
        lookup = self._lookup(samples, ts)
        if lookup is not None:
            out.append(lookup)
        out += self._scheduler(samples, ts) + self._ttft(samples, ts)
        if not self.events:
            out += self._transfers(samples, ts) + self._gpu(samples, ts)
        self.counters.commit()
        return out

    def _increase(self, samples: Samples, name: str) -> float | None:
        return self.counters.increase(name, series(samples, name))

    def _lookup(self, samples: Samples, ts: float) -> ev.Lookup | None:
        """Prompt tokens since the last scrape by source (each tier the server reports, 0
        included, and recompute); None without prompt tokens, and without the per-tier counter
        or the prompt tokens (absent, not 0)."""
        groups: dict[str, dict[frozenset, float]] = {}
        for ls, value in series(samples, HIT_TOKENS).items():
            labels = dict(ls)
            level = labels.get("cache_level", "")
            tier = labels.get("cache_tier") or (
                self.levels[int(level)] if level.isdigit() and int(level) < len(self.levels)
                else "")
            groups.setdefault(tier, {})[ls] = value
        hits = {tier: self.counters.increase(HIT_TOKENS, values) or 0.0
                for tier, values in groups.items()}
        prompt, cached = self._increase(samples, PROMPT_TOKENS), self._increase(samples,
                                                                              CACHED_TOKENS)
        if not hits or prompt is None:
            return None
        tokens: Counter[str] = Counter()
        for tier, n in hits.items():
            source = TRTLLM_CACHE_TIER_SOURCE.get(tier)
            if source is not None:
                tokens[source] += int(n)
        if cached is None:
            cached = sum(tokens.values())
        tokens["recompute"] = max(0, int(prompt - cached))
        if not any(tokens.values()):
            return None
        # every tier the server reports is named, 0 included: the agent then shows it measured
        return ev.Lookup(ts=ts, request_id="", tokens=dict(tokens))

    def _scheduler(self, samples: Samples, ts: float) -> list[ev.SchedulerStats]:
        def added(name: str) -> int | None:
            values = series(samples, name)
            return int(sum(values.values())) if values else None

        usage = series(samples, KV_USAGE).values()
        stats = ev.SchedulerStats(ts=ts, waiting=added(WAITING), running=added(RUNNING),
                                  gpu_kv_usage=min(1.0, max(usage)) if usage else None)
        return [] if stats == ev.SchedulerStats(ts=ts) else [stats]

    def _ttft(self, samples: Samples, ts: float) -> list[ev.LatencyHistogram]:
        """TTFT observations since the last scrape, per bucket (every series with the same
        ``le`` added up); [] without the histogram or new observations."""
        by_bound: dict[float, dict[frozenset, float]] = {}
        for ls, value in series(samples, f"{TTFT}_bucket").items():
            try:
                bound = float(dict(ls).get("le", "+Inf"))
            except ValueError:
                return []
            by_bound.setdefault(bound, {})[ls] = value
        total = self._increase(samples, f"{TTFT}_sum") or 0.0
        bounds = sorted(by_bound)
        if not bounds or not math.isinf(bounds[-1]):
            return []
        cumulative = [self.counters.increase(f"{TTFT}_bucket", by_bound[b]) or 0.0
                      for b in bounds]
        counts = [int(max(0.0, c - before)) for c, before in zip(cumulative,
                                                                   [0.0, *cumulative])]
        if not any(counts):
            return []
        return [ev.LatencyHistogram(ts=ts, metric="ttft", bounds=bounds[:-1], counts=counts,
                                    sum=max(0.0, total))]

    def _transfers(self, samples: Samples, ts: float) -> list[ev.Transfer]:
        if len(self.levels) < 2:
            return []
        gpu, host = self.levels[:2]
        out = []
        for name, src, dst in ((OFFLOAD_BYTES, gpu, host), (ONBOARD_BYTES, host, gpu)):
            moved = int(self._increase(samples, name) or 0)
            if moved:
                blocks = moved // self.block_bytes if self.block_bytes else 0
                out.append(ev.Transfer(ts=ts, src=src, dst=dst, blocks=blocks, bytes=moved,
                                       duration=0.0, timed=False, sees_failures=False))
        return out

    def _gpu(self, samples: Samples, ts: float) -> list[ev.TierSnapshot]:
        capacity, used = series(samples, MAX_BLOCKS), series(samples, USED_BLOCKS)
        if not capacity or not used:
            return []
        cap, held = int(sum(capacity.values())), int(sum(used.values()))
        bpb = self.block_bytes
        return [ev.TierSnapshot(ts=ts, tier=self.levels[0], capacity_bytes=cap * bpb,
                                resident_bytes=ev.bytes_of(held, bpb), capacity_blocks=cap,
                                resident_blocks=held)]


class TrtllmSource(ScrapeSource):
    """Drains ``url`` + ``/kv_cache_events`` (when ``residency`` is given) and scrapes ``url``
    + ``/prometheus/metrics`` (when ``metrics`` is given) every ``interval`` seconds.
    ``timeout``: seconds one call may take in all; ``max_body``: bytes a drain may answer.
    ``start()`` returns at once; ``shutdown()`` is safe twice and without start."""

    name = NAME
    thread_name = "kvscope-trtllm"
    engine = "TensorRT-LLM"
    prefix = "trtllm_"
    not_found = ("trtllm-serve serves it with return_perf_metrics: true in its "
                 "--extra_llm_api_options file (or set [trtllm] metrics = false)")

    def __init__(self, pipeline: Consumer, url: str = "http://127.0.0.1:8000", *,
                 residency: TrtllmResidency | None = None, metrics: TrtllmMetrics | None = None,
                 interval: float = 2.0, timeout: float = 5.0, max_body: int = 64 << 20,
                 **kwargs) -> None:
        super().__init__(pipeline, url.rstrip("/") + METRICS_PATH, interval=interval,
                         timeout=timeout, **kwargs)
        self.events_url = url.rstrip("/") + EVENTS_PATH
        self.residency, self.metrics, self.max_body = residency, metrics, max_body
        self._drained = self._scraped = False
        self._answered = False  # the drain under way got its 200
        self._lost: str | None = None  # why the last drain lost its events, until the next
        self._drain_failures = 0

    def map(self, samples: Samples, now: float) -> list:
        return self.metrics.map(samples, now)

    def report_up(self, up: bool) -> None:
        """The scrape's state (ScrapeSource reports it here); the source is up while each
        interface in use works."""
        self._scraped = up
        self._report()

    def _report(self) -> None:
        super().report_up((self._drained or self.residency is None)
                          and (self._scraped or self.metrics is None))

    def drain_once(self) -> bool:
        """One ``POST /kv_cache_events``, folded into events; False when it lost its events
        (counted, see the module) or the engine did not answer 200 (then nothing was taken)."""
        self._answered = False
        try:
            body = asyncio.run(asyncio.wait_for(self._drain_async(), self._timeout))
            decoded = decode(body)
        except BodyError as exc:
            return self._drain_failed(f"answered more than {self.max_body} bytes", "too_large",
                                      exc)
        except (httpx.HTTPError, TimeoutError) as exc:
            if not self._answered:
                return self._drain_failed("unavailable", None, exc)
            return self._drain_failed("cut its answer short", "cut", exc)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError,
                UnicodeDecodeError) as exc:
            return self._drain_failed("answered no JSON array of events", "malformed", exc)
        self.guarded(self._fold, decoded)  # a bug in the fold costs this drain alone
        self._drain_failures = 0
        self._drained = True
        self._report()
        return True

    def _fold(self, decoded: Decoded) -> None:
        """One drain's events into the pipeline, and what it lost counted."""
        events, drops = self.residency.apply(self._clock(), decoded)
        if self._lost is not None:  # the next event_id tells how many that drain lost
            drops[self._lost] += max(0, drops.pop("gap", 0) - 1)
            self._lost = None
        for reason, n in (+drops).items():
            self.pipeline.drop(NAME, reason, n)
        self.deliver([e for e in events if self._valid(e)])

    async def _drain_async(self) -> bytes:
        chunks, size = [], 0
        async with httpx.AsyncClient(timeout=self._timeout, trust_env=False) as client:
            async with client.stream("POST", self.events_url) as response:
                response.raise_for_status()
                self._answered = True  # from here on, the engine's queue was taken
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_body:
                        raise BodyError(f"a body over {self.max_body} bytes")
                    chunks.append(chunk)
        return b"".join(chunks)

    def _drain_failed(self, what: str, lost: str | None, exc: Exception) -> bool:
        """Log the first failure in a row; a drain that ``lost`` its events counts one now."""
        self._drain_failures += 1
        if self._drain_failures == 1:
            why = (f"no whole answer within {self._timeout:g} s"
                   if isinstance(exc, TimeoutError) and not str(exc) else describe(exc))
            log.warning("TensorRT-LLM KV cache events at %s: %s (%s)", self.events_url, what, why)
        if lost is not None:
            self.pipeline.drop(NAME, lost)
            self._lost = lost
        self._drained = lost is not None  # the engine answered: it works
        self._report()
        return False

    def prepare(self) -> None:
        super().prepare()
        if self.residency is not None:
            self.pipeline.expect_drops(NAME, DRAIN_DROPS)
        self._report()

    def run(self) -> None:
        while True:
            if self.residency is not None:
                self.drain_once()
            if self.metrics is not None:
                self.scrape_once()
            if self.stopping.wait(self.interval):
                return


class TrtllmConfig(EngineSection):
    """``trtllm-serve`` (source ``trtllm``) at ``url`` every ``interval`` seconds: its KV cache
    events (``events``; needs ``kv_cache_config.event_buffer_max_size`` > 0) and its Prometheus
    metrics (``metrics``; needs ``return_perf_metrics``). ``levels``: the tier of each cache
    level, the GPU's first; ``block_bytes``: KV bytes of one block (0: unknown);
    ``max_tracked``: blocks remembered; ``max_body_bytes``: the largest drain read;
    ``timeout``: seconds a call may take (a drain waits up to 2 s for a first event)."""

    enabled: bool = False
    url: str = "http://127.0.0.1:8000"
    events: bool = True
    metrics: bool = False
    interval: float = Field(2.0, ge=0.1, le=3600, allow_inf_nan=False)
    timeout: float = Field(5.0, gt=0, le=600, allow_inf_nan=False)
    levels: list[str] = ["gpu", "cpu"]
    block_bytes: int = Field(0, ge=0)
    max_tracked: int = Field(1_000_000, ge=0)
    max_body_bytes: int = Field(64 << 20, ge=1 << 10, le=1 << 30)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        value = http_url(value, "http://127.0.0.1:8000")
        path = urlsplit(value).path.rstrip("/")
        if path.endswith((METRICS_PATH, EVENTS_PATH)):
            raise ValueError(f"is trtllm-serve's base URL, without {path}: kvscope adds "
                             f"{METRICS_PATH} and {EVENTS_PATH} to it (e.g. "
                             "http://127.0.0.1:8000)")
        return value

    @field_validator("levels")
    @classmethod
    def _levels(cls, value: list[str]) -> list[str]:
        return list(check_levels(value))


def _build(config: TrtllmConfig, consumer: Consumer, built: Built) -> TrtllmSource:
    levels = tuple(config.levels)
    return TrtllmSource(
        consumer, config.url, interval=config.interval, timeout=config.timeout,
        max_body=config.max_body_bytes,
        residency=TrtllmResidency(levels, config.block_bytes, config.max_tracked)
        if config.events else None,
        metrics=TrtllmMetrics(levels, config.events, config.block_bytes)
        if config.metrics else None)


def _banner(config: TrtllmConfig, part: TrtllmSource, base_url: str) -> str:
    parts = [f"POST {part.events_url}"] if config.events else []
    parts += [f"GET {part.url}"] if config.metrics else []
    return f"{NAME}: {' and '.join(parts) or 'nothing (events and metrics off)'} every " \
           f"{config.interval:g} s; reports tiers {', '.join(config.levels)}"


register(SourceSpec(NAME, TrtllmConfig, _build,
                    describe=lambda config: f"trtllm-serve at {config.url}", banner=_banner,
                    tiers=lambda config: config.levels if config.events or config.metrics
                    else (), engine=lambda config: "tensorrt-llm"))
