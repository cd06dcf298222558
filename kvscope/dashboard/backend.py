"""Data backends: the dashboard's only I/O.

Two backends share one interface (:class:`Backend`), chosen at start: :class:`AgentBackend`
reads one node agent's ``/api/v1`` (the default); :class:`~kvscope.dashboard.prometheus.
PrometheusBackend` reads a Prometheus server for a fleet. Both return samples in the agent's
shape (see :mod:`kvscope.dashboard.series`) and requests as the agent's JSON records, and
both raise :class:`BackendUnavailable` — never anything else — when the data cannot be read.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol
from urllib.parse import quote

import httpx


class BackendUnavailable(Exception):
    """The backend at ``url`` could not be read; ``reason`` says why, in a few words;
    ``what``: "agent" or "prometheus". Its text, for a status line: "<what> unreachable:
    <url> (<reason>)", or ``summary`` when given (what failed was not reaching the backend)."""

    def __init__(self, url: str, reason: str, what: str = "agent",
                 summary: str | None = None) -> None:
        super().__init__(summary or f"{what} unreachable: {url} ({reason})")
        self.url = url
        self.reason = reason
        self.what = what


class RequestPage(NamedTuple):
    """What :meth:`Backend.requests` read: ``total`` requests in the table(s), up to the limit
    of their ``records``, and ``unread``: the agents of a fleet whose records could not be read
    (each "instance (reason)"), so that a page never shows part of a fleet as the whole."""

    total: int
    records: list[dict]
    unread: tuple[str, ...] = ()


def by_value(field: str, descending: bool) -> Callable[[Mapping], object]:
    """A sort key of request records (mappings) by ``field`` (its number or text) that puts a
    record without a value (None or absent: not measured) last in either order, as the agent's
    table sorts them, for ``list.sort(key=..., reverse=descending)``."""
    unknown = -math.inf if descending else math.inf

    def key(record: Mapping) -> object:
        value = record.get(field)
        return unknown if value is None else value
    return key


class Backend(Protocol):
    """What every page reads. ``kind``: "agent" or "prometheus"; ``base_url``: its URL."""

    kind: str
    base_url: str

    def instances(self) -> list[str]:
        """Selectable instances ([] when there is only one node to show)."""

    def timeseries(self, window_seconds: float, instance: str | None = None) -> list[dict]:
        """Samples covering the last ``window_seconds`` (of data), oldest first."""

    def requests(self, limit: int = 500, sort: str = "finished", descending: bool = True,
                 min_ttft: float | None = None,
                 instance: str | None = None) -> RequestPage:
        """Up to ``limit`` request records, with the table(s)' size (sorted as :func:`by_value`
        sorts them)."""

    def request(self, request_id: str, instance: str | None = None,
                source: str | None = None) -> dict | None:
        """One request record (of ``source``, else the one that finished last), or None when no
        table holds it."""

    def node(self, metrics: Sequence[str], instance: str | None = None) -> list[dict]:
        """The node collectors' current series of ``metrics`` (catalog names), each
        ``{"name", "labels": {label: value}, "value"}``; in a fleet, ``labels`` hold the
        ``instance``. A label the collector does not know is "" or absent."""

    def close(self) -> None: ...


class AgentBackend:
    """A client for the agent's ``/api/v1`` at ``base_url`` (e.g. ``http://127.0.0.1:9400``).

    ``timeout``: seconds per request (connect and read). ``client``: an httpx client to use
    instead of a new one. ``token``: bearer token when the agent requires one. Samples are
    cached: after the first read only newer ones are fetched (``since``), so a refresh over an
    hour of history moves a few samples, not thousands. Thread-safe.
    """

    kind = "agent"

    def __init__(self, base_url: str, timeout: float = 2.0, client: httpx.Client | None = None,
                 token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._client = client or httpx.Client(timeout=timeout, headers=headers)
        self._lock = threading.Lock()
        self._cache: list[dict] = []
        self._cached_window = 0.0
        self._started_at: float | None = None  # the cached samples' agent's start

    def instances(self) -> list[str]:
        return []

    def fetch_samples(self, since: float | None = None, window: float | None = None) -> list[dict]:
        """One ``GET /api/v1/timeseries``: samples after ``since`` (Unix s) and no older than
        ``window`` seconds before the newest, oldest first.

        Raises :class:`BackendUnavailable` on a connection error or timeout, a non-200 answer,
        a body that is not JSON, or JSON without a list of samples that each carry a numeric
        ``ts``.
        """
        return self._fetch(since, window)[0]

    def _fetch(self, since: float | None = None,
               window: float | None = None) -> tuple[list[dict], object]:
        """:meth:`fetch_samples`, and the agent's ``started_at`` (None from an agent that does
        not say)."""
        params = {k: v for k, v in (("since", since), ("window", window)) if v is not None}
        body = self._get_json("/api/v1/timeseries", params)
        samples = body.get("samples") if isinstance(body, dict) else None
        if not isinstance(samples, list) or not all(
                isinstance(s, dict) and isinstance(s.get("ts"), (int, float)) for s in samples):
            raise BackendUnavailable(self.base_url, "unexpected timeseries payload")
        return samples, body.get("started_at")

    def timeseries(self, window_seconds: float = 900.0, instance: str | None = None) -> list[dict]:
        """The samples of the last ``window_seconds`` (relative to the newest), from the cache
        topped up with what is new; all fetched again when the agent restarted since (its
        ``started_at`` changed: its counters began again, and the cached samples were another
        run's). Raises :class:`BackendUnavailable` (the cache is kept)."""
        with self._lock:
            again = not self._cache or window_seconds > self._cached_window
            if not again:
                last = self._cache[-1]["ts"]
                new, started = self._fetch(since=last)
                again = started != self._started_at
                if not again:
                    self._cache.extend(s for s in new if s["ts"] > last)
            if again:
                self._cache, self._started_at = self._fetch(window=window_seconds)
                self._cached_window = window_seconds
            if self._cache:
                oldest = float(self._cache[-1]["ts"]) - self._cached_window
                drop = 0
                while drop < len(self._cache) and float(self._cache[drop]["ts"]) < oldest:
                    drop += 1
                del self._cache[:drop]
                newest = float(self._cache[-1]["ts"])
                return [s for s in self._cache if float(s["ts"]) >= newest - window_seconds]
            return []

    def requests(self, limit: int = 500, sort: str = "finished", descending: bool = True,
                 min_ttft: float | None = None,
                 instance: str | None = None) -> RequestPage:
        """``GET /api/v1/requests``. Raises :class:`BackendUnavailable`."""
        params: dict = {"limit": limit, "sort": sort, "order": "desc" if descending else "asc"}
        if min_ttft is not None:
            params["min_ttft"] = min_ttft
        body = self._get_json("/api/v1/requests", params)
        if not (isinstance(body, dict) and isinstance(body.get("requests"), list)):
            raise BackendUnavailable(self.base_url, "unexpected requests payload")
        return RequestPage(int(body.get("total", len(body["requests"]))), body["requests"])

    def request(self, request_id: str, instance: str | None = None,
                source: str | None = None) -> dict | None:
        """``GET /api/v1/requests/{id}`` (of ``source``, else the one that finished last); None
        on 404. Raises :class:`BackendUnavailable`."""
        # dots escaped too: an id "." or ".." would be a dot segment, which httpx collapses
        path = quote(request_id, safe="").replace(".", "%2E")
        body = self._get_json(f"/api/v1/requests/{path}",
                              {"source": source} if source else {}, missing_ok=True)
        return body if isinstance(body, dict) else None

    def node(self, metrics: Sequence[str], instance: str | None = None) -> list[dict]:
        """``GET /api/v1/node?metric=...``: the agent's node collectors now. Raises
        :class:`BackendUnavailable` (also on an agent too old to have the endpoint: HTTP 404)."""
        body = self._get_json("/api/v1/node", {"metric": list(metrics)})
        series = body.get("series") if isinstance(body, dict) else None
        if not isinstance(series, list) or not all(
                isinstance(s, dict) and isinstance(s.get("name"), str)
                and isinstance(s.get("labels"), dict) for s in series):
            raise BackendUnavailable(self.base_url, "unexpected node payload")
        return series

    def close(self) -> None:
        """Close the HTTP client; safe to call twice."""
        self._client.close()

    def _get_json(self, path: str, params: dict, missing_ok: bool = False) -> object:
        url = self.base_url + path
        try:
            response = self._client.get(url, params=params)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(self.base_url, str(exc) or type(exc).__name__) from exc
        if missing_ok and response.status_code == 404:
            return None
        if response.status_code == 401:  # the agent has a token (never a flag: see cli)
            raise BackendUnavailable(self.base_url, "HTTP 401: the agent wants its token; the "
                                     "dashboard sends KVSCOPE_TOKEN's (--backend agent)")
        if response.status_code != 200:
            raise BackendUnavailable(self.base_url,
                                     f"HTTP {response.status_code} from {path.split('?')[0]}")
        try:
            return response.json()
        except ValueError as exc:
            raise BackendUnavailable(self.base_url, f"bad JSON from {path}") from exc
