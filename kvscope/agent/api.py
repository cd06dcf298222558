"""The agent's HTTP API (FastAPI): /metrics, /healthz, /api/v1/summary, /api/v1/timeseries."""

from __future__ import annotations

import numpy as np
from fastapi import FastAPI, Query, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from kvscope import __version__
from kvscope.agent.agent import Agent


def percentiles(values: list[float], qs=(50, 95, 99)) -> dict[str, float | None]:
    """``{"p50": ..., ...}`` of ``values`` (linear interpolation); None when empty."""
    if not values:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(v) for q, v in zip(qs, np.percentile(values, qs))}


def create_app(agent: Agent) -> FastAPI:
    """The FastAPI app serving ``agent``. The caller owns the agent's start and shutdown."""
    app = FastAPI(title="kvscope agent", version=__version__)

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        # OpenMetrics when the scraper asks for it (it carries exemplars), else the text format
        if "application/openmetrics-text" in request.headers.get("accept", ""):
            return Response(generate_openmetrics(agent.registry), media_type=OPENMETRICS_TYPE)
        return Response(generate_latest(agent.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> Response:
        return Response("ok\n", media_type="text/plain")

    @app.get("/api/v1/summary")
    def summary() -> dict:
        snap = agent.pipeline.snapshot()
        host = agent.host.collect()
        return {
            "version": __version__,
            "started_at": agent.started_at,
            "requests": snap.requests,
            "prompt_tokens": snap.prompt_tokens,
            "transfer_bytes": snap.transfer_bytes,
            "transfer_blocks": snap.transfer_blocks,
            "evicted_blocks": snap.evicted_blocks,
            "tiers": {t: {"capacity_bytes": s.capacity_bytes, "resident_bytes": s.resident_bytes,
                          "capacity_blocks": s.capacity_blocks,
                          "resident_blocks": s.resident_blocks} for t, s in snap.tiers.items()},
            "host": {"memory_total_bytes": host.total, "memory_available_bytes": host.available},
            "ttft_seconds": percentiles(snap.recent_ttft),
        }

    @app.get("/api/v1/timeseries")
    def timeseries(since: float | None = Query(None, description="Unix seconds; samples after it")) -> dict:
        return {"interval": agent.sample_interval, "samples": agent.pipeline.samples(since)}

    return app
