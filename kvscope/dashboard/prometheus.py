"""The Prometheus backend: a fleet of agents, read through a Prometheus server's HTTP API.

Time series come from PromQL range queries over the catalog's metrics
(:mod:`kvscope.catalog`) and are turned into samples of the agent's shape, so every
figure works unchanged: one query per field of the sample's declaration
(:data:`kvscope.samples.FIELDS`, see :func:`queries`), over its metric's series, by its key's
labels:

- counters: ``sum by (labels) (rate(metric[rate_window]))`` at each step, accumulated as
  ``rate x step``; the figures' per-step rate is then exactly PromQL's rate, and restarts of
  single agents in the fleet are handled by ``rate()`` itself;
- percentiles: ``histogram_quantile(q, sum by (le, ...) (rate(metric_bucket[rate_window])))``;
- histogram buckets: ``sum by (..., le) (rate(metric_bucket[rate_window]))``, accumulated
  like counters and turned into per-bucket counts;
- gauges: ``sum by (labels) (metric)`` (``max by (instance, gpu)`` for the PCIe link); a
  host's memory (:attr:`kvscope.samples.SampleField.host`) from the fleet's host with the
  least headroom, ``metric and on (instance) bottomk(1, kvscope_host_memory_headroom_bytes)``.

Requests live in the agents, not in Prometheus: each scrape target's URL (from
``/api/v1/targets``) is an agent whose ``/api/v1/requests`` is read directly.
``instance``: one target's ``instance`` label, or None for the whole fleet.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

from kvscope.dashboard.backend import AgentBackend, BackendUnavailable, RequestPage, by_value
from kvscope.samples import FIELDS, HOST_MEMORY_HEADROOM_BYTES, PERCENTILES, Kind, join_key


LISTED_FOR = "1h"  # how long an agent that stopped answering stays in the fleet (named unread)


class PrometheusBackend:
    """Reads ``base_url`` (e.g. ``http://127.0.0.1:9090``).

    ``selector``: extra label matchers for every query (e.g. ``job="kvscope"``).
    ``rate_window``: PromQL range of ``rate()`` (at least twice the scrape interval).
    ``max_points``: points per series at most (sets the query step, at least 1 s).
    ``clock``: Unix seconds (injectable for tests). Thread-safe.
    """

    kind = "prometheus"

    def __init__(self, base_url: str, selector: str = "", rate_window: str = "1m",
                 max_points: int = 450, timeout: float = 5.0,
                 clock: Callable[[], float] = time.time, agent_timeout: float = 2.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.selector = selector.strip().strip("{}")
        self.rate_window = rate_window
        self.max_points = max_points
        self._clock = clock
        self._client = httpx.Client(timeout=timeout)
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="kvscope-promql")
        self._agent_timeout = agent_timeout
        self._agents: dict[str, AgentBackend] = {}
        self._targets: tuple[float, dict[str, str]] = (0.0, {})
        self._lock = threading.Lock()

    # --- PromQL -------------------------------------------------------------------------

    def _matchers(self, instance: str | None) -> str:
        parts = [self.selector] if self.selector else []
        if instance:
            parts.append(f'instance="{_escape(instance)}"')
        return "{" + ",".join(parts) + "}"

    def _api(self, path: str, params: dict) -> object:
        try:
            response = self._client.get(self.base_url + path, params=params)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(self.base_url, str(exc) or type(exc).__name__,
                                     "prometheus") from exc
        try:
            body = response.json()
        except ValueError as exc:
            raise BackendUnavailable(self.base_url, f"HTTP {response.status_code}, not JSON, "
                                     f"from {path}", "prometheus") from exc
        if response.status_code != 200 or body.get("status") != "success":
            raise BackendUnavailable(self.base_url, f"HTTP {response.status_code} from {path}: "
                                     f"{body.get('error', '')}"[:200], "prometheus")
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """``/api/v1/query_range``: list of {metric: labels, values: [[ts, "v"], ...]}."""
        data = self._api("/api/v1/query_range",
                         {"query": expr, "start": start, "end": end, "step": step})
        return data.get("result", []) if isinstance(data, dict) else []

    def query(self, expr: str) -> list[dict]:
        """``/api/v1/query`` (instant): list of {metric: labels, value: [ts, "v"]}."""
        data = self._api("/api/v1/query", {"query": expr})
        return data.get("result", []) if isinstance(data, dict) else []

    # --- Backend interface --------------------------------------------------------------

    def instances(self) -> list[str]:
        """Instances that exported kvscope metrics (their ``kvscope_build_info``) within
        :data:`LISTED_FOR`: an agent that went down stays listed, so the pages name it as not
        read rather than show the rest as the whole fleet."""
        result = self.query(f"count by (instance) (last_over_time("
                            f"kvscope_build_info{self._matchers(None)}[{LISTED_FOR}]))")
        return sorted(r["metric"].get("instance", "") for r in result)

    def timeseries(self, window_seconds: float = 900.0, instance: str | None = None) -> list[dict]:
        """Samples on a regular grid over the last ``window_seconds`` (see module doc).
        Raises :class:`BackendUnavailable` when any query fails."""
        end = math.floor(self._clock())
        step = max(1.0, math.ceil(window_seconds / self.max_points))
        start = end - step * math.floor(window_seconds / step)
        grid = [start + i * step for i in range(int((end - start) / step) + 1)]
        jobs = queries(self._matchers(instance), self.rate_window, step)
        futures = [(field, fill, self._pool.submit(self.query_range, expr, start, end, step))
                   for field, expr, fill in jobs]
        samples = {t: {"ts": float(t)} for t in grid}
        present: set[float] = set()
        for field, fill, future in futures:
            fill(samples, field, future.result(), present)
        _fallback_dropped(samples)
        return [samples[t] for t in grid if t in present]

    def _agent_urls(self) -> dict[str, str]:
        """instance -> agent base URL, from the active scrape targets (cached 30 s)."""
        with self._lock:
            fetched, urls = self._targets
            if self._clock() - fetched < 30 and urls:
                return urls
        data = self._api("/api/v1/targets", {"state": "active"})
        urls = {}
        for target in data.get("activeTargets", []) if isinstance(data, dict) else []:
            instance = target.get("labels", {}).get("instance")
            parts = urlsplit(target.get("scrapeUrl", ""))
            if instance and parts.scheme and parts.netloc:
                urls[instance] = f"{parts.scheme}://{parts.netloc}"
        with self._lock:
            self._targets = (self._clock(), urls)
        return urls

    def _agent(self, instance: str) -> AgentBackend:
        url = self._agent_urls().get(instance)
        if url is None:
            raise BackendUnavailable(self.base_url, f"no scrape target {instance!r}", "prometheus",
                                     f"{instance} is not a scrape target of prometheus "
                                     f"{self.base_url}")
        with self._lock:
            if url not in self._agents:
                self._agents[url] = AgentBackend(url, timeout=self._agent_timeout)
            return self._agents[url]

    def _pick(self, instance: str | None) -> list[str]:
        if instance:
            return [instance]
        wanted = set(self.instances())
        return sorted(i for i in self._agent_urls() if i in wanted)

    def requests(self, limit: int = 500, sort: str = "finished", descending: bool = True,
                 min_ttft: float | None = None,
                 instance: str | None = None) -> RequestPage:
        """Recent requests from each selected agent, merged and cut to ``limit``; each record
        gains ``instance``. Agents that cannot be read are skipped and named in ``unread``;
        raises :class:`BackendUnavailable` only when none can."""
        names = self._pick(instance)
        futures = {name: self._pool.submit(
            lambda n: self._agent(n).requests(limit, sort, descending, min_ttft), name)
            for name in names}
        total, records, errors = 0, [], {}
        for name, future in futures.items():
            try:
                page = future.result()
            except BackendUnavailable as exc:
                errors[name] = exc
                continue
            total += page.total
            records += [{**r, "instance": name} for r in page.records]
        if errors and len(errors) == len(names):
            raise next(iter(errors.values()))
        records.sort(key=by_value(sort, descending), reverse=descending)
        return RequestPage(total, records[:limit],
                           tuple(f"{name} ({exc.reason})" for name, exc in errors.items()))

    def request(self, request_id: str, instance: str | None = None,
                source: str | None = None) -> dict | None:
        """The record from ``instance``'s agent (or the first agent holding it), of
        ``source`` when given."""
        for name in self._pick(instance):
            try:
                record = self._agent(name).request(request_id, source=source)
            except BackendUnavailable:
                if instance:
                    raise
                continue
            if record is not None:
                return {**record, "instance": name}
        return None

    def node(self, metrics: Sequence[str], instance: str | None = None) -> list[dict]:
        """The latest series of ``metrics`` (one instant query over their names), in the
        agent's ``/api/v1/node`` shape; ``labels`` hold ``instance`` (and ``job``). Raises
        :class:`BackendUnavailable`."""
        names = "|".join(metrics)  # catalog names: [a-z_] only
        matchers = self._matchers(instance)[1:-1]
        expr = "{" + ",".join(filter(None, (f'__name__=~"{names}"', matchers))) + "}"
        out = []
        for r in self.query(expr):
            labels = dict(r.get("metric", {}))
            name = labels.pop("__name__", "")
            out.append({"name": name, "labels": labels, "value": float(r["value"][1])})
        return out

    def close(self) -> None:
        """Close every client; safe to call twice."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        for agent in list(self._agents.values()):
            agent.close()


# --- the queries, and turning their results into sample fields (pure) ------------------

def queries(sel: str, rw: str, step: float) -> list[tuple[str, str, Callable]]:
    """``(field, PromQL, fill)`` for every field of :data:`kvscope.samples.FIELDS`: ``sel``
    the label matchers (``{...}``), ``rw`` the range of ``rate()``, ``step`` the grid's step in
    seconds (a counter's rate becomes ``rate x step`` per step)."""
    jobs: list[tuple[str, str, Callable]] = []
    lowest = f"bottomk(1, {HOST_MEMORY_HEADROOM_BYTES.series}{sel})"
    for f in FIELDS:
        series = f"{f.series}{sel}"
        if f.host:  # one host's memory: the host with the least headroom's
            series = f"({series} and on (instance) {lowest})"
        if f.kind in (Kind.COUNTER, Kind.SUM):
            jobs.append((f.name, f"sum by ({', '.join(f.key)}) (rate({f.series}{sel}[{rw}]))",
                         _counter_into(f.key, step)))
        elif f.kind is Kind.BUCKETS:
            jobs.append((f.name, f"sum by ({', '.join((*f.key, 'le'))}) "
                                 f"(rate({f.series}{sel}[{rw}]))", _buckets_into(f.key, step)))
        elif f.kind is Kind.GAUGE:
            by = (*f.fleet_by, *f.key)
            jobs.append((f.name, f"{f.fleet} by ({', '.join(by)}) ({series})", _gauge_into(by)))
        elif f.kind is Kind.SCALAR:
            jobs.append((f.name, f"{f.fleet}({series})", _scalar_into))
        elif f.kind is Kind.PERCENTILES:
            by = ", ".join(("le", *f.key))
            for p, q in PERCENTILES.items():
                jobs.append((f.name, f"histogram_quantile({q}, sum by ({by}) "
                                     f"(rate({f.series}{sel}[{rw}])))", _quantile_into(p, f.key)))
        else:  # pragma: no cover - a new kind needs its query here
            raise ValueError(f"no query for {f.kind} ({f.name})")
    return jobs


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _key(metric: dict, labels) -> str:
    return join_key([metric.get(label, "") for label in labels])


def _points(series: dict):
    for ts, value in series.get("values", []):
        v = float(value)
        if not math.isnan(v):
            yield float(ts), v


def _counter_into(labels, step: float) -> Callable:
    def fill(samples, field, result, present):
        for series in result:
            key = _key(series["metric"], labels)
            rates = dict(_points(series))
            total = 0.0
            for t, sample in samples.items():
                total += rates.get(t, 0.0) * step
                if t in rates:
                    present.add(t)
                if labels:
                    sample.setdefault(field, {})[key] = total
                else:
                    sample[field] = total
    return fill


def _buckets_into(labels, step: float) -> Callable:
    def fill(samples, field, result, present):
        by_key: dict[str, list[tuple[float, dict]]] = {}
        for series in result:
            le = series["metric"].get("le", "+Inf")
            by_key.setdefault(_key(series["metric"], labels), []).append(
                (math.inf if le == "+Inf" else float(le), dict(_points(series))))
        for key, buckets in by_key.items():
            buckets.sort(key=lambda b: b[0])
            totals = [0.0] * len(buckets)
            for t, sample in samples.items():
                cumulative = [rates.get(t, 0.0) for _le, rates in buckets]
                for i, c in enumerate(cumulative):
                    totals[i] += (c - (cumulative[i - 1] if i else 0.0)) * step
                sample.setdefault(field, {})[key] = list(totals)
    return fill


def _gauge_into(labels) -> Callable:
    def fill(samples, field, result, present):
        for series in result:
            key = _key(series["metric"], labels)
            for t, v in _points(series):
                if t in samples:
                    samples[t].setdefault(field, {})[key] = v
                    present.add(t)
    return fill


def _scalar_into(samples, field, result, present):
    for series in result:
        for t, v in _points(series):
            if t in samples:
                samples[t][field] = v


def _quantile_into(p: str, labels) -> Callable:
    def fill(samples, field, result, present):
        for series in result:
            for t, v in _points(series):
                if t not in samples:
                    continue
                if labels:
                    per_key = samples[t].setdefault(field, {})
                    per_key.setdefault(_key(series["metric"], labels), {})[p] = v
                else:
                    samples[t].setdefault(field, {})[p] = v
    return fill


def _fallback_dropped(samples: dict) -> None:
    """Without ``kvscope_dropped_blocks_total``, count every eviction from the lowest tier as
    dropped (nothing lies below it); upper tiers' drops stay unknown (0)."""
    if any("dropped_blocks" in s for s in samples.values()):
        return
    rank = {"gpu": 0, "cpu": 1, "disk": 2, "remote": 3}
    for sample in samples.values():
        evicted = sample.get("evicted_blocks") or {}
        if evicted:
            lowest = max(evicted, key=lambda t: rank.get(t, 9))
            sample["dropped_blocks"] = {lowest: evicted[lowest]}
