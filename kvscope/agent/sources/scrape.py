"""What every source that scrapes an engine's Prometheus endpoint shares: reading the text
exposition (:func:`parse`), counters as increases between scrapes (:class:`Counters`), placing a
histogram's bucket counts (:func:`spread`), and the scrape loop itself (:class:`ScrapeSource`:
a bounded, timed fetch, the events checked, the source's up/down state).

An engine's module (``vllm_metrics.py`` and the others) keeps only its mapping: which series
mean what in kvscope's vocabulary. Parsing and counting do no I/O.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Mapping

import httpx

from kvscope import events as ev
from kvscope.agent.sources.base import Consumer, SourceWorker
from kvscope.errors import describe

log = logging.getLogger(__name__)

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
# a counter's or histogram's sample suffix; ``<name>_created`` is the series' creation time
_SUFFIX = re.compile(r"_(total|bucket|sum|count)$")
_HISTOGRAM = re.compile(r"_(bucket|sum|count)$")

Samples = dict[tuple[str, frozenset], float]
# An engine's /metrics body is tens of kB; a far larger one is no engine's, and read whole it
# would be held in memory many times over while parsed.
MAX_BODY = 16 << 20
MAX_SERIES = 10_000  # counter series whose last value is kept (an engine exposes a few hundred)


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


def series(samples: Samples, name: str, **labels: str) -> dict[frozenset, float]:
    """The series of ``name`` that carry ``labels``: {labels: value}."""
    want = set(labels.items())
    return {ls: v for (n, ls), v in samples.items() if n == name and want <= ls}


def spread(bounds: list[float], counts: list[int], total: float) -> list[tuple[float, int]]:
    """``(value, n)`` standing for the observations of a histogram's buckets (``bounds``: the
    finite upper bounds, ascending; ``counts``: per bucket, the last one above every bound;
    ``total``: their sum): each value lies inside its bucket, ``lower < value <= upper``, at the
    same fraction of every finite bucket, chosen so that the values add up to ``total`` where the
    buckets allow it (what the finite buckets cannot hold goes to the ones above every bound).
    Pure."""
    lows = [0.0, *bounds]
    low_sum = sum(n * low for n, low in zip(counts, lows))
    width = sum(n * (high - low) for n, low, high in zip(counts, lows, bounds))
    share = 1.0 if width <= 0 else min(1.0, max(0.0, (total - low_sum) / width))
    out = []
    for n, low, high in zip(counts, lows, bounds):
        if n:
            out.append((min(high, max(math.nextafter(low, math.inf),
                                      low + share * (high - low))), n))
    if len(counts) > len(bounds) and counts[-1]:
        n, low = counts[-1], lows[-1]
        excess = max(0.0, total - low_sum - share * width)
        out.append((max(math.nextafter(low, math.inf), low + excess / n), n))
    return out


def _histogram_of(name: str, labels: frozenset) -> tuple[str, frozenset]:
    """The histogram a ``_bucket``/``_sum``/``_count`` series belongs to: (its name, its labels
    but ``le``)."""
    return _HISTOGRAM.sub("", name), frozenset(kv for kv in labels if kv[0] != "le")


class Counters:
    """Counter increases between scrapes, per series (one per engine process and label set)
    and then added up, so that a series missing from a scrape is no reset of the sum. A series
    seen for the first time is a baseline (its increase 0) unless it counts from 0: its
    ``_created`` sample (prometheus_client's creation time, Unix seconds; :meth:`begin` gives
    the scrape's samples) is no earlier than ``since`` (default: when these counters were
    made, so an engine that started after the agent is counted whole, though the agent's
    first scrapes found it not yet up), or ``from_zero`` says so (an engine that makes a
    series at its first observation). One that went down was reset, and its value is the
    increase. A value no counter holds (negative, or past :data:`kvscope.events.MAX_COUNT`:
    a corrupt sample) is no baseline: its increase goes into an event the agent drops as
    invalid, and the next true value counts from the last good one (as a baseline it read as a
    reset and counted whole). A histogram (``_bucket``, ``_sum``, ``_count`` series of one
    label set, ``le`` aside) one of whose series went down was reset as a whole: each of its
    series counts from 0, also one that grew past its old value meanwhile (read per series,
    a restarted engine's TTFT histogram gave counts [2, 0, 0] and sum 1.0 for [2, 5, 1] and
    6.0). A series whose ``_created`` time moved on was reset too, though it may have counted
    past its old value by the first scrape that reads it (a restarted engine's 150 read as 50
    more than its predecessor's 100). Values are kept for :data:`MAX_SERIES` series; past
    that, only the latest scrape's (a series that comes back then starts over from its value,
    and no series counts from 0 by its creation time any more). Not thread-safe: one per
    source."""

    def __init__(self, since: float | None = None) -> None:
        self._last: dict[tuple[str, frozenset], float] = {}
        self._seen: dict[tuple[str, frozenset], float] = {}
        # the series' creation times (_created samples) with their baselines, and this scrape's
        self._born: dict[tuple[str, frozenset], float] = {}
        self._born_seen: dict[tuple[str, frozenset], float] = {}
        self._since: float | None = time.time() if since is None else since
        self._samples: Samples = {}
        self._reset: set[tuple[str, frozenset]] = set()

    def begin(self, samples: Samples) -> None:
        """Start a scrape: its ``samples`` carry the series' creation times, and say which
        histograms were reset since the scrape before (see the class)."""
        self._samples = samples
        last = self._last
        self._reset = {_histogram_of(name, labels) for (name, labels), value in samples.items()
                       if (before := last.get((name, labels))) is not None and value < before
                       and _HISTOGRAM.search(name)}

    def _created(self, name: str, labels: frozenset) -> float | None:
        """When series ``name`` {``labels``} was created (its ``_created`` sample), or None."""
        base = _SUFFIX.sub("", name)
        if base == name:
            return None
        return self._samples.get((f"{base}_created",
                                  frozenset(kv for kv in labels if kv[0] != "le")))

    def increase(self, name: str, values: Mapping[frozenset, float],
                 from_zero: Callable[[frozenset], bool] | None = None) -> float | None:
        """The summed increase of counter ``name``'s series ``values`` ({labels: value}, as
        :func:`series` gives) since the scrape before; None when there is no such series."""
        if not values:
            return None
        total = 0.0
        for labels, value in values.items():
            key = (name, labels)
            last = self._last.get(key)
            created = self._created(name, labels)
            if 0.0 <= value <= ev.MAX_COUNT:
                self._seen[key] = value
                if created is not None:
                    self._born_seen[key] = created
            if last is not None:
                born = self._born.get(key)
                reset = value < last or (self._reset and _histogram_of(name, labels)
                                         in self._reset) or (
                    created is not None and born is not None and created > born)
                total += value if reset else value - last
            elif (from_zero is not None and from_zero(labels)) or (
                    created is not None and self._since is not None and created >= self._since):
                total += value
        return total

    def observed(self, name: str, samples: Samples,
                 from_zero: Callable[[frozenset], bool] | None = None,
                 ) -> tuple[list[float], list[int], float] | None:
        """Histogram ``name``'s observations since the scrape before, over every label set:
        ``(finite bounds, counts per bucket and one above them, sum)`` (seconds or whatever the
        histogram counts); None without the histogram, with a bucket bound that is no number,
        or without new observations. ``from_zero`` as for :meth:`increase`."""
        buckets: dict[float, dict[frozenset, float]] = {}
        for labels, value in series(samples, f"{name}_bucket").items():
            try:
                bound = float(dict(labels).get("le", "nan"))
            except ValueError:
                return None
            if math.isnan(bound):
                return None
            buckets.setdefault(bound, {})[labels] = value
        total = self.increase(f"{name}_sum", series(samples, f"{name}_sum"), from_zero)
        counts, below = [], 0.0
        for bound in sorted(buckets):
            cumulative = self.increase(f"{name}_bucket", buckets[bound], from_zero) or 0.0
            counts.append(int(max(0.0, cumulative - below)))
            below = max(below, cumulative)
        if not any(counts):
            return None
        bounds = [b for b in sorted(buckets) if not math.isinf(b)]
        return bounds, counts[:len(bounds)] + [sum(counts[len(bounds):])], total or 0.0

    def forget(self) -> None:
        """Drop every series' baseline: the next scrape's series are new (another process of
        the engine, known to be one: counted whole where ``from_zero`` says so)."""
        self._last.clear()
        self._born.clear()

    def commit(self) -> bool:
        """End a scrape: what it saw becomes the next one's baselines. True when more than
        :data:`MAX_SERIES` series were kept, so that only this scrape's stay (series come and go
        by label) and a series new to the next scrape may be an old one."""
        seen, self._seen = self._seen, {}
        born, self._born_seen = self._born_seen, {}
        self._last.update(seen)
        self._born.update(born)
        if len(self._last) > MAX_SERIES:
            self._last, self._born = seen, born
            self._since = None  # a series new to the next scrape may be an old one
            return True
        return False


class ScrapeSource(SourceWorker):
    """A source that scrapes ``url`` (an engine's Prometheus endpoint) every ``interval``
    seconds and maps what it reads into kvscope events for ``pipeline``. A subclass sets
    ``name``, ``thread_name``, ``engine`` (the engine's name in messages), ``prefix`` (a
    series name prefix only that engine's answer has), ``not_found`` (what to check when the
    url answers 404, "" for the default) and ``mapper_class`` (what it maps with,
    made when no ``mapper`` is given: an object with ``map(samples, now) -> events``, pure), or
    overrides :meth:`map`; it may override :meth:`deliver` to hold events back. ``timeout``:
    seconds a scrape may take in all, headers included; ``clock``: the events' Unix
    timestamps. ``start()`` returns at once; ``shutdown()`` (which scrapes a last time, unless
    the last scrape failed) is safe twice and without start."""

    engine = ""
    prefix = ""
    not_found = ""
    mapper_class: Callable[[], object] | None = None

    def __init__(self, pipeline: Consumer, url: str, *, mapper: object | None = None,
                 interval: float = 5.0, timeout: float = 3.0,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(pipeline)
        self.url = url
        self.mapper = mapper if mapper is not None or self.mapper_class is None \
            else self.mapper_class()
        self.interval = interval
        self.failures = 0
        self._timeout = timeout
        self._clock = clock
        self._invalid_logged = False

    def map(self, samples: Samples, now: float) -> list:
        """The events one scrape's ``samples`` make (``now``: Unix seconds): the mapper's. An
        exception fails that scrape alone."""
        return self.mapper.map(samples, now)

    def deliver(self, events: list) -> None:
        """Hand a scrape's checked events to the pipeline."""
        if events:
            self.pipeline.ingest(self.name, events)

    def scrape_once(self) -> bool:
        """Scrape and map once; False (and source down) when the engine did not answer with 200
        within ``timeout`` seconds, with a body of at most :data:`MAX_BODY` bytes holding some
        series named ``prefix...`` (an HTML page, or another server's metrics, would otherwise
        keep the source up while nothing is read), or when its answer could not be mapped.
        Mapped events are checked like an emitter's (:func:`kvscope.events.validate`): one out
        of bounds is dropped and counted as invalid."""
        try:
            text = self._fetch()
            samples = parse(text)
            if not any(name.startswith(self.prefix) for name, _ in samples):
                named = any(line.startswith(self.prefix) for line in text.splitlines())
                return self._failed(
                    f"its {self.prefix} series hold no finite number (unreadable values)"
                    if named else f"no {self.prefix} series in the answer; is the url "
                    f"{self.engine}'s metrics endpoint?")
            events = self.map(samples, self._clock())
        except httpx.HTTPStatusError as exc:  # its own words end in a link to MDN's status page
            status = exc.response.status_code
            hint = ((self.not_found or f"is the url {self.engine}'s metrics endpoint?")
                    if status == 404 else "")
            return self._failed(f"answered HTTP {status} {exc.response.reason_phrase}"
                                + (f"; {hint}" if hint else ""))
        except (httpx.HTTPError, BodyError) as exc:
            return self._failed(f"unavailable ({describe(exc)})")
        except Exception as exc:  # a body the mapping cannot read: the next scrape may do
            return self._failed(f"unreadable ({describe(exc)})")
        if self.failures:  # the last line logged said it failed: say it no longer does
            log.warning("%s metrics at %s: answering again, after %d failed scrapes",
                        self.engine, self.url, self.failures)
        self.failures = 0
        self.deliver([e for e in events if self._valid(e)])
        self.report_up(True)
        return True

    def _valid(self, event: object) -> bool:
        try:
            ev.validate(event)
        except ev.SchemaError as exc:
            self.pipeline.drop(self.name, "invalid")
            if not self._invalid_logged:
                self._invalid_logged = True
                log.warning("%s metrics at %s: dropped a %s out of bounds: %s (logged once)",
                            self.engine, self.url, type(event).__name__, exc)
            return False
        return True

    def _fetch(self) -> str:
        """The body of ``url``; raises :class:`BodyError` past ``timeout`` seconds in all (a
        server trickling bytes, of its headers too, would otherwise hold the scrape, and the
        agent's stop, forever: httpx's timeouts are per read) or past :data:`MAX_BODY` bytes,
        httpx's errors otherwise."""
        # asyncio cancels the request at the deadline wherever it waits on the server; a host
        # name's lookup runs in a thread asyncio.run waits for (an engine's is an address as a
        # rule)
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
            log.warning("%s metrics at %s: %s", self.engine, self.url, why)
            self.forget_gauges()
        self.report_up(False)
        return False

    def forget_gauges(self) -> None:
        """Leave this source's tiers, scheduler gauges and memory reports out until a scrape
        answers: they are as stale as Prometheus' own series of a target it cannot scrape (a
        stopped LMCache kept showing its full L1). Its counters stay."""
        self.pipeline.forget_tiers(self.name)

    def prepare(self) -> None:
        self.pipeline.expect_drops(self.name, ("invalid",))
        self.report_up(False)

    def run(self) -> None:
        self.scrape_once()
        while not self.stopping.wait(self.interval):
            self.scrape_once()
        # stopping: once more, so that what the engine counted since the last scrape (a run's
        # last seconds) reaches the agent's last sample and its capture (a capture stopped a
        # second after its traffic counted 64% of its prompt tokens), unless the engine is
        # already known to be away
        if not self.failures:
            self.scrape_once()
