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

Parsing (:func:`parse`) and mapping (:class:`MetricsMapper`) do no I/O. The source scrapes with
httpx every ``interval`` seconds; a failed scrape sets ``kvscope_source_up{source="vllm_metrics"}``
to 0 and the next good one back to 1.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable

import httpx

from kvscope import events as ev
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.worker import Worker

log = logging.getLogger(__name__)
NAME = "vllm_metrics"
SOURCE_TIER = {"device": "gpu", "host": "cpu", "disk": "disk", "p2p": "cpu",
               "external_unspecified": "cpu"}
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, frozenset], float]
# A vLLM /metrics body is tens of kB; a far larger one is not vLLM's, and read whole it would be
# held in memory many times over while parsed.
MAX_BODY = 16 << 20
MAX_SERIES = 10_000  # counter series whose last value is kept (vLLM exposes a few hundred)


class BodyError(ValueError):
    """A scrape's answer was too slow or too large to read."""


def parse(text: str) -> Samples:
    """Prometheus text exposition -> {(name, frozenset(labels)): value}, one entry per series
    (a repeated line: the last); comments, blank and unparsable lines, and values that are not
    finite numbers (NaN, +-Inf: no counter holds one) are skipped. Pure."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line.strip())
        if not match:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            out[(match.group(1), frozenset(_LABEL.findall(match.group(2) or "")))] = value
    return out


def _series(samples: Samples, name: str, **labels) -> dict[frozenset, float]:
    """The series of ``name`` that carry ``labels``: {labels: value}."""
    want = set(labels.items())
    return {ls: v for (n, ls), v in samples.items() if n == name and want <= ls}


BUCKET = "vllm:time_to_first_token_seconds_bucket"
SUM = "vllm:time_to_first_token_seconds_sum"


class MetricsMapper:
    """Turns successive scrapes into kvscope events. ``block_bytes``: KV bytes per block (0:
    unknown). ``gpu_snapshot``: report GPU usage as a TierSnapshot. ``stores``: report
    gpu->cpu offloads. Not thread-safe.

    A counter's increase is taken per series (one per vLLM engine and label set) and then
    added up, so a series missing from a scrape is no reset of the sum. Baselines are kept for
    :data:`MAX_SERIES` series; past that, only the latest scrape's (a series that comes back
    then starts over from its value)."""

    def __init__(self, block_bytes: int = 0, gpu_snapshot: bool = True,
                 stores: bool = True) -> None:
        self.block_bytes = block_bytes
        self.gpu_snapshot = gpu_snapshot
        self.stores = stores
        self._last: dict[tuple, float] = {}
        self._seen: dict[tuple, float] = {}
        # cached prompt tokens not yet matched by vllm:prompt_tokens (<= 0): see _lookup
        self._unmatched = 0
        # per engine (labels but le), its TTFT bucket bounds, and other bounds seen once: _ttft
        self._ttft_bounds: dict[frozenset, frozenset] = {}
        self._ttft_pending: dict[frozenset, frozenset] = {}

    def _increase(self, samples: Samples, name: str, **labels) -> float | None:
        """The sum over ``name``'s series carrying ``labels`` of their increase since the last
        scrape (a series seen for the first time: 0, its baseline; one that went down: reset,
        its value); None when there is no such series."""
        return self._increase_of(name, _series(samples, name, **labels))

    def _increase_of(self, name: str, series: dict[frozenset, float]) -> float | None:
        if not series:
            return None
        total = 0.0
        for ls, value in series.items():
            key = (name, ls)
            last = self._last.get(key)
            self._seen[key] = value
            if last is not None:
                total += value if value < last else value - last
        return total

    def map(self, samples: Samples, ts: float) -> list:
        self._seen = {}
        out: list = []
        lookup = self._lookup(samples, ts)
        if lookup is not None:
            out.append(lookup)
        out += self._transfers(samples, ts)
        hist = self._ttft(samples, ts)
        if hist is not None:
            out.append(hist)
        if self.gpu_snapshot:
            out += self._gpu(samples, ts)
        self._last.update(self._seen)
        if len(self._last) > MAX_SERIES:  # series come and go by label: keep the current ones
            self._last = self._seen
        return out

    def _lookup(self, samples: Samples, ts: float) -> ev.Lookup | None:
        prompt = self._increase(samples, "vllm:prompt_tokens_total") or 0.0
        tokens: dict[str, int] = {}
        cached = "vllm:prompt_tokens_cached_by_source_total"
        by_source = _series(samples, cached)
        if by_source:
            for ls, value in by_source.items():  # one series per engine and source
                tier = SOURCE_TIER.get(dict(ls).get("source", "external_unspecified"), "cpu")
                tokens[tier] = tokens.get(tier, 0) + int(self._increase_of(cached, {ls: value}))
        else:
            tokens["gpu"] = int(self._increase(samples, "vllm:prefix_cache_hits_total") or 0)
            tokens["cpu"] = int(self._increase(
                samples, "vllm:external_prefix_cache_hits_total") or 0)
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
        tokens = {k: v for k, v in tokens.items() if v > 0}
        if not tokens:
            return None
        return ev.Lookup(ts=ts, request_id="", tokens=tokens)

    def _transfers(self, samples: Samples, ts: float) -> list:
        out = []
        for kind, src, dst in (("store", "gpu", "cpu"), ("load", "cpu", "gpu")):
            if kind == "store" and not self.stores:
                continue
            value = self._increase(samples, f"vllm:kv_offload_{kind}_bytes_total")
            if value is None:  # vLLM before the per-direction names
                legacy = {"store": "GPU_to_CPU", "load": "CPU_to_GPU"}[kind]
                value = self._increase(samples, "vllm:kv_offload_total_bytes_total",
                                       transfer_type=legacy)
            nbytes = int(value or 0)
            if nbytes > 0:
                blocks = nbytes // self.block_bytes if self.block_bytes else 0
                out.append(ev.Transfer(ts=ts, src=src, dst=dst, blocks=blocks, bytes=nbytes,
                                       duration=0.0, timed=False))
        return out

    def _ttft(self, samples: Samples, ts: float) -> ev.LatencyHistogram | None:
        engines: dict[frozenset, dict[float, frozenset]] = {}  # labels but le -> le -> series
        for ls in _series(samples, BUCKET):
            labels = dict(ls)
            try:
                bound = float(labels.pop("le", "+Inf"))
            except ValueError:  # not a bucket bound: not a histogram we can read
                return None
            if math.isnan(bound):
                return None
            engines.setdefault(frozenset(labels.items()), {})[bound] = ls
        sums = _series(samples, SUM)  # by engine: its labels are the buckets' but le
        by_bound: dict[float, dict[frozenset, float]] = {}  # le -> its series (one per engine)
        counted: dict[frozenset, float] = {}  # the sums of the engines counted
        for engine, series in engines.items():
            if self._read_as_before(engine, series, samples):
                for bound, ls in series.items():
                    by_bound.setdefault(bound, {})[ls] = samples[(BUCKET, ls)]
                if engine in sums:
                    counted[engine] = sums[engine]
        if len(self._ttft_bounds) > MAX_SERIES:  # engines come and go: keep the current ones
            self._ttft_bounds = {e: b for e, b in self._ttft_bounds.items() if e in engines}
            self._ttft_pending = {e: b for e, b in self._ttft_pending.items() if e in engines}
        if not by_bound:
            return None
        bounds = sorted(by_bound)
        deltas = [self._increase_of(BUCKET, by_bound[b]) or 0.0 for b in bounds]
        total = self._increase_of(SUM, counted) or 0.0
        counts, previous = [], 0.0
        for d in deltas:  # cumulative deltas -> per-bucket counts
            counts.append(int(max(0.0, d - previous)))
            previous = max(previous, d)
        if not any(counts):
            return None
        finite = [b for b in bounds if not math.isinf(b)]
        return ev.LatencyHistogram(ts=ts, metric="ttft", bounds=finite,
                                   counts=counts[:len(finite)] + [sum(counts[len(finite):])],
                                   sum=total)

    def _read_as_before(self, engine: frozenset, series: dict[float, frozenset],
                        samples: Samples) -> bool:
        """Whether ``engine``'s TTFT buckets this scrape are the ones it had before (or it is
        new), so their increases count. Cumulative buckets are read against the last scrape's:
        one missing (a NaN is dropped) would count its observations in the next bucket up,
        then again once it is back. Such a scrape counts nothing of that engine and leaves its
        baselines (and its sum's); the same other buckets twice in a row (vLLM restarted with
        other buckets) become its new baselines."""
        bounds, before = frozenset(series), self._ttft_bounds.get(engine)
        if before is None or bounds == before:
            self._ttft_bounds[engine] = bounds
            self._ttft_pending.pop(engine, None)
            return True
        if self._ttft_pending.get(engine) != bounds:
            self._ttft_pending[engine] = bounds
            return False
        # baselines only: nothing counted
        self._increase_of(BUCKET, {ls: samples[(BUCKET, ls)] for ls in series.values()})
        if (SUM, engine) in samples:  # its sum's baseline too
            self._increase_of(SUM, {engine: samples[(SUM, engine)]})
        self._ttft_bounds[engine] = bounds
        del self._ttft_pending[engine]
        return False

    def _gpu(self, samples: Samples, ts: float) -> list:
        """The GPU tier over every engine: each engine's usage share of its own blocks."""
        def engine(labels: frozenset) -> str | None:  # vLLM labels only some series by model
            return dict(labels).get("engine")

        blocks: dict[str | None, int] = {}
        for ls in _series(samples, "vllm:cache_config_info"):
            try:
                blocks[engine(ls)] = int(float(dict(ls).get("num_gpu_blocks", "None")))
            except (ValueError, OverflowError):  # "None" (not known yet), or not a number
                continue
        usage = {engine(ls): v for ls, v in _series(samples, "vllm:kv_cache_usage_perc").items()
                 if blocks.get(engine(ls), 0) > 0}
        if not usage:
            return []
        capacity = sum(blocks[e] for e in usage)
        used = sum(int(round(min(1.0, max(0.0, u)) * blocks[e])) for e, u in usage.items())
        return [ev.TierSnapshot(ts=ts, tier="gpu", capacity_bytes=capacity * self.block_bytes,
                                resident_bytes=used * self.block_bytes, capacity_blocks=capacity,
                                resident_blocks=used)]


class VllmMetricsSource(Worker):
    """Scrapes ``url`` (vLLM's ``/metrics``) every ``interval`` seconds into ``pipeline``.
    ``timeout``: seconds a scrape may take in all, headers included.
    ``span_ttft``, ``span_wait``: see the module (TTFT from spans or from the histogram).
    ``start()`` returns at once; ``shutdown()`` is safe twice and without start."""

    def __init__(self, pipeline: Pipeline, url: str = "http://127.0.0.1:8000/metrics", *,
                 interval: float = 5.0, timeout: float = 3.0, mapper: MetricsMapper | None = None,
                 clock: Callable[[], float] = time.time,
                 span_ttft: Callable[[], float] | None = None, span_wait: float = 6.0) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.url = url
        self.interval = interval
        self.mapper = mapper or MetricsMapper()
        self.failures = 0
        self._timeout = timeout
        self._invalid_logged = False
        self._clock = clock
        self._span_ttft = span_ttft
        self._span_wait = span_wait
        # (monotonic seconds of the scrape before, of this one, its TTFT histogram), oldest first
        self._held: deque[tuple[float, float, ev.LatencyHistogram]] = deque()
        self._scraped = -math.inf

    def scrape_once(self) -> bool:
        """Scrape and map once; False (and source down) when vLLM did not answer with 200 within
        ``timeout`` seconds, with a body of at most :data:`MAX_BODY` bytes holding some
        ``vllm:`` series (an HTML page, or another server's metrics, once kept the source up
        while nothing was read), or when its answer could not be mapped. Mapped events are
        checked like an emitter's (:func:`kvscope.events.validate`): one out of bounds is
        dropped and counted as invalid."""
        try:
            samples = parse(self._fetch())
            if not any(name.startswith("vllm:") for name, _ in samples):  # another server's
                return self._failed("no vllm: series in the answer; is the url vLLM's "
                                    "/metrics?")
            events = self.mapper.map(samples, self._clock())
        except (httpx.HTTPError, BodyError) as exc:
            return self._failed(f"unavailable: {exc}")
        except Exception as exc:  # a body the mapping cannot read: the next scrape may do
            return self._failed(f"unreadable ({type(exc).__name__}: {exc})")
        self.failures = 0
        checked = []
        for event in events:
            try:
                checked.append(ev.validate(event))
            except ev.SchemaError as exc:
                self.pipeline.drop(NAME, "invalid")
                if not self._invalid_logged:
                    self._invalid_logged = True
                    log.warning("vLLM metrics at %s: dropped a %s out of bounds: %s (logged "
                                "once)", self.url, type(event).__name__, exc)
        events = checked
        now = time.monotonic()
        if self._span_ttft is not None:
            held = [e for e in events if isinstance(e, ev.LatencyHistogram)]
            events = [e for e in events if not isinstance(e, ev.LatencyHistogram)]
            self._held.extend((self._scraped, now, hist) for hist in held)
            events += self._released(now)
        self._scraped = now
        if events:
            self.pipeline.ingest(NAME, events)
        self.pipeline.set_source_up(NAME, True)
        return True

    def _fetch(self) -> str:
        """The body of ``url``; raises :class:`BodyError` past ``timeout`` seconds in all (a
        server trickling bytes, of its headers too, would otherwise hold the scrape, and the
        agent's stop, forever: httpx's timeouts are per read) or past :data:`MAX_BODY` bytes,
        httpx's errors otherwise."""
        # asyncio cancels the request at the deadline wherever it waits on the server; a host
        # name's lookup runs in a thread asyncio.run waits for (vLLM's is an address as a rule)
        try:
            return asyncio.run(asyncio.wait_for(self._fetch_async(), self._timeout))
        except TimeoutError:
            raise BodyError(f"no whole answer within {self._timeout:g} s") from None

    async def _fetch_async(self) -> str:
        chunks, size = [], 0
        async with httpx.AsyncClient(timeout=self._timeout, trust_env=False) as client:
            async with client.stream("GET", self.url) as response:
                response.raise_for_status()
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > MAX_BODY:
                        raise BodyError(f"a body over {MAX_BODY} bytes")
                    chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")

    def _failed(self, why: str) -> bool:
        self.failures += 1
        if self.failures == 1:
            log.warning("vLLM metrics at %s %s", self.url, why)
        self.pipeline.set_source_up(NAME, False)
        return False

    def _released(self, now: float) -> list[ev.LatencyHistogram]:
        """The held TTFT histograms whose spans had time to come, but did not."""
        out = []
        while self._held and now - self._held[0][1] >= self._span_wait:
            since, _scraped, hist = self._held.popleft()
            if self._span_ttft() < since:
                out.append(hist)
        return out

    thread_name = "kvscope-vllm-metrics"

    def prepare(self) -> None:
        self.pipeline.expect_drops(NAME, ("invalid",))
        self.pipeline.set_source_up(NAME, False)

    def run(self) -> None:
        self.scrape_once()
        while not self.stopping.wait(self.interval):
            self.scrape_once()
