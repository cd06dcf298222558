"""Reads the node agent's HTTP API for the dashboard (the dashboard's only I/O)."""

from __future__ import annotations

import httpx


class BackendUnavailable(Exception):
    """The agent at ``url`` could not be read; ``reason`` says why, in a few words."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"agent unreachable: {url} ({reason})")
        self.url = url
        self.reason = reason


class AgentBackend:
    """A client for the agent's ``/api/v1`` at ``base_url`` (e.g. ``http://127.0.0.1:9400``).

    ``timeout``: seconds per request (connect and read). ``client``: an httpx client to use
    instead of a new one (tests may inject one with a mock transport). Safe to share between
    threads (httpx clients are).
    """

    def __init__(self, base_url: str, timeout: float = 2.0,
                 client: httpx.Client | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = client or httpx.Client(timeout=timeout)

    def timeseries(self, since: float | None = None) -> list[dict]:
        """``GET /api/v1/timeseries``: the samples, oldest first (see
        :mod:`kvscope.dashboard.figures` for their shape).

        ``since``: Unix seconds; only samples at or after it (the agent filters).
        Raises :class:`BackendUnavailable` on a connection error or timeout, a non-200
        answer, a body that is not JSON, or JSON without a list of samples that each
        carry a numeric ``ts``.
        """
        params = {} if since is None else {"since": since}
        body = self._get_json("/api/v1/timeseries", params)
        samples = body.get("samples") if isinstance(body, dict) else None
        if not isinstance(samples, list) or not all(
                isinstance(s, dict) and isinstance(s.get("ts"), (int, float)) for s in samples):
            raise BackendUnavailable(self.base_url, "unexpected timeseries payload")
        return samples

    def close(self) -> None:
        """Close the HTTP client; safe to call twice."""
        self._client.close()

    def _get_json(self, path: str, params: dict) -> object:
        url = self.base_url + path
        try:
            response = self._client.get(url, params=params)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(self.base_url, str(exc) or type(exc).__name__) from exc
        if response.status_code != 200:
            raise BackendUnavailable(self.base_url, f"HTTP {response.status_code} from {path}")
        try:
            return response.json()
        except ValueError as exc:
            raise BackendUnavailable(self.base_url, f"bad JSON from {path}") from exc
