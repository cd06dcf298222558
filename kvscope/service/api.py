"""The agent's HTTP API (FastAPI).

``/metrics`` (Prometheus text, or OpenMetrics with exemplars when asked), ``/healthz``,
``/readyz``, and under ``/api/v1``: ``summary``, ``timeseries``, ``node``, ``requests``,
``requests/{id}``. OpenAPI at ``/openapi.json`` and ``/docs``. With a token configured,
``/api`` and ``/v1/traces`` need ``Authorization: Bearer <token>`` (declared in the OpenAPI
document, so ``/docs`` can send it). Request bodies over ``max_body_bytes`` are refused with 413,
whether their length is declared or they come chunked, and list sizes are bounded.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

import msgspec
from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.requests import ClientDisconnect

from kvscope import __version__, events as ev
from kvscope.agent.collectors.metrics import NODE_METRICS, collector_samples
from kvscope.agent.memory_budget import offload_budgets
from kvscope.agent.requests import SORT_KEYS
from kvscope.agent.sources import otlp_receiver as otlp_in
from kvscope.percentiles import bucket_percentiles, value_percentiles
from kvscope.samples import NAMES as SAMPLE_FIELDS  # the fields of a sample (kvscope/samples.py)
from kvscope.service.agent import Agent

MAX_LIMIT = 10_000
log = logging.getLogger(__name__)


class _AnyPath(PathConvertor):
    """A path that may hold any character: Starlette's ``path`` (``.*``) stops at a newline,
    which a request id may hold (an OTLP span's attribute), and drops a trailing one."""

    regex = r"[\s\S]*"


register_url_convertor("any_path", _AnyPath())


def _json(value) -> Response:
    return Response(msgspec.json.encode(value), media_type="application/json")


class BodyTooLarge(Exception):
    """A request body over the limit (answered with 413)."""


def declared_too_large(request: Request, limit: int) -> bool:
    """Whether the request declares a body over ``limit`` bytes (or a Content-Length that is
    no number), so it can be refused before a byte of it is read."""
    length = request.headers.get("content-length")
    return length is not None and (not length.isdigit() or int(length) > limit)


async def bounded_body(request: Request, limit: int) -> bytes:
    """The request's body, read as it arrives; raises :class:`BodyTooLarge` as soon as it
    passes ``limit`` bytes (a chunked body declares no length for the middleware to check)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge()
    return bytes(body)


def create_app(agent: Agent, max_body_bytes: int = 1 << 20) -> FastAPI:
    """The FastAPI app serving ``agent``. The caller owns the agent's start and shutdown."""
    # no redirect of "/api/v1/summary/": Starlette's builds its Location from the client's
    # Host header, and answered it before the token was checked
    app = FastAPI(title="kvscope agent", version=__version__, redirect_slashes=False,
                  description="KV-cache offload observability: metrics, requests, time series.")
    token = agent.settings.token
    too_large = {"detail": f"request body over {max_body_bytes} bytes"}

    @app.middleware("http")
    async def bound_body(request: Request, call_next):
        # an OTLP export is bounded by its route, after the token check, so that its refusal
        # is counted as a dropped export
        if (request.url.path != otlp_in.TRACES_PATH
                and declared_too_large(request, max_body_bytes)):
            return JSONResponse(too_large, 413)
        return await call_next(request)

    bearer = HTTPBearer(auto_error=False, description="the agent's `token` setting")

    # the first refusal of each kind of sender (an OTLP exporter, an API client), logged: a
    # sender without the token is otherwise silent
    refused: set[bool] = set()

    def authorize(request: Request,
                  credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if token is None:
            return
        if credentials is None or not hmac.compare_digest(credentials.credentials.encode(),
                                                          token.encode()):
            spans = request.url.path == otlp_in.TRACES_PATH
            if spans not in refused:
                refused.add(spans)
                log.warning("refused %s from %s: missing or wrong bearer token (send the "
                            "agent's token as \"Authorization: Bearer <token>\"; an OTLP "
                            "exporter as a header); logged once for spans, once for the API",
                            request.url.path,
                            request.client.host if request.client else "?")
            raise HTTPException(401, "missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    @app.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
    def metrics(request: Request) -> Response:
        body, content_type = agent.exposition.render(request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    @app.api_route("/healthz", methods=["GET", "HEAD"], include_in_schema=False)
    def healthz() -> Response:
        return Response("ok\n", media_type="text/plain")

    if agent.otlp_receiver is not None:
        receiver = agent.otlp_receiver
        parsing = asyncio.Lock()

        @app.post(otlp_in.TRACES_PATH, dependencies=[Depends(authorize)], include_in_schema=False)
        async def otlp_traces(request: Request) -> Response:
            """OTLP/HTTP trace export (protobuf or JSON); see ``agent/sources/otlp_receiver.py``.
            Answers in the request's encoding, errors included (a ``google.rpc.Status`` to a
            protobuf export, as the OTLP/HTTP specification asks)."""
            content_type = request.headers.get("content-type", "")
            protobuf = content_type.split(";")[0].strip().lower() == "application/x-protobuf"

            def error(detail: str, status: int, **headers) -> Response:
                if protobuf:
                    return Response(otlp_in.error_status(detail, status), status,
                                    headers=headers, media_type="application/x-protobuf")
                return JSONResponse({"detail": detail}, status, headers=headers)

            if agent.restoring:  # a span for a stored request would make a second one
                return error("restoring stored requests; retry", 503, **{"Retry-After": "1"})
            encoding = request.headers.get("content-encoding", "")
            try:
                if declared_too_large(request, max_body_bytes):
                    raise BodyTooLarge()
                body = await bounded_body(request, max_body_bytes)
                async with parsing:  # off the event loop, one body at a time (memory)
                    rejected, why = await run_in_threadpool(lambda: receiver.handle(
                        otlp_in.parse(body, content_type, encoding)))
            except BodyTooLarge:
                receiver.refused(otlp_in.OtlpError(too_large["detail"], 413))
                return error(too_large["detail"], 413)
            except ClientDisconnect:  # gone mid-body (an exporter giving up): nobody to answer
                return Response(status_code=400)
            except otlp_in.OtlpError as exc:
                receiver.refused(exc)
                return error(str(exc), exc.status)
            answer = otlp_in.partial_success(rejected, why, protobuf)
            if protobuf:
                return Response(answer, media_type="application/x-protobuf")
            return JSONResponse(answer)

    @app.api_route("/readyz", methods=["GET", "HEAD"], include_in_schema=False)
    def readyz() -> Response:
        if agent.ready:
            return Response("ready\n", media_type="text/plain")
        return Response("starting or stopping\n", status_code=503, media_type="text/plain")

    @app.get("/api/v1/summary", dependencies=[Depends(authorize)])
    def summary() -> dict:
        """Totals since the agent started, tier state, host memory, recent TTFT percentiles."""
        snap = agent.pipeline.snapshot()
        host = agent.collectors.reading("host")
        by_pair = lambda d: {"->".join(k): v for k, v in d.items()}  # noqa: E731
        evicted: dict[str, int] = {}
        for (tier, _reason), n in snap.evicted_blocks.items():
            evicted[tier] = evicted.get(tier, 0) + n
        return {
            "version": __version__,
            "started_at": agent.started_at,
            "requests": snap.requests,
            "prompt_tokens": snap.prompt_tokens,
            "transfer_bytes": by_pair(snap.transfer_bytes),
            "transfer_blocks": by_pair(snap.transfer_blocks),
            "evicted_blocks": evicted,
            # null: not measured (a capacity of 0 is one no source knows, as on /metrics)
            "tiers": {t: {"capacity_bytes": s.capacity_bytes or None,
                          "resident_bytes": s.resident_bytes,
                          "capacity_blocks": s.capacity_blocks or None,
                          "resident_blocks": s.resident_blocks} for t, s in snap.tiers.items()},
            "host": ({"memory_total_bytes": host.total, "memory_available_bytes": host.available,
                      "memory_limit_bytes": host.limit, "memory_reserve_bytes": host.reserve,
                      "memory_headroom_bytes": host.headroom, "swap_used_bytes": host.swap_used,
                      "offload_budget_bytes": offload_budgets(
                          host.budgets, agent.pipeline.engine_memory())} if host else None),
            # exact over the last requests; where none are known, only vLLM's histogram
            # (metrics-only mode): estimated from its buckets
            "ttft_seconds": (value_percentiles(snap.recent_ttft) if snap.recent_ttft else
                             bucket_percentiles(snap.ttft_seconds.buckets,
                                                snap.ttft_seconds.counts)),
            "events_received": snap.events_received,
            "events_dropped": by_pair(snap.events_dropped),
        }

    @app.get("/api/v1/timeseries", dependencies=[Depends(authorize)])
    def timeseries(
        since: float | None = Query(None, allow_inf_nan=False,
                                    description="Unix seconds; only samples after it"),
        window: float | None = Query(None, ge=0, description="seconds; only samples no older "
                                     "than this before the newest one"),
        metric: list[str] | None = Query(None, max_length=len(SAMPLE_FIELDS),
                                         description=f"fields to return: {', '.join(SAMPLE_FIELDS)}"),
    ) -> dict:
        """One-second samples, oldest first; counters are cumulative, since the agent's
        start (``started_at``, Unix seconds: a client that caches samples starts again when it
        changes, as the counters did)."""
        samples = agent.pipeline.samples(since, window)
        if metric:
            unknown = sorted(set(metric) - set(SAMPLE_FIELDS))
            if unknown:
                raise HTTPException(422, f"unknown metric {unknown[0]!r}; use {', '.join(SAMPLE_FIELDS)}")
            samples = [{"ts": s["ts"], **{m: s.get(m) for m in metric}} for s in samples]
        return {"interval": agent.sample_interval, "started_at": agent.started_at,
                "samples": samples}

    node_metrics = {spec.name: spec for spec in NODE_METRICS}

    @app.get("/api/v1/node", dependencies=[Depends(authorize)])
    def node(metric: list[str] | None = Query(
            None, max_length=len(node_metrics),
            description=f"metrics to return: {', '.join(node_metrics)}")) -> dict:
        """The node collectors' metrics now (host, GPU, NUMA; docs/collectors.md), as on
        ``/metrics``: ``{"series": [{"name", "labels": {label: value}, "value"}]}``, only the
        named metrics with ``metric``. An info label NVML or the kernel does not give is ""
        (absent to Prometheus); a series that is not known is not listed. Runs the collectors
        once."""
        unknown = sorted(set(metric or ()) - set(node_metrics))
        if unknown:
            raise HTTPException(422, f"unknown metric {unknown[0]!r}; use {', '.join(node_metrics)}")
        samples = collector_samples(agent.collectors.collect())
        return {"series": [
            {"name": spec.name, "labels": dict(zip(spec.labels, values)), "value": value}
            for spec, series in samples.items() if not metric or spec.name in metric
            for values, value in series]}

    @app.get("/api/v1/requests", dependencies=[Depends(authorize)])
    def requests(limit: int = Query(100, ge=1, le=MAX_LIMIT),
                 sort: str = Query("finished", description=f"one of {', '.join(SORT_KEYS)}"),
                 order: str = Query("desc", pattern="^(asc|desc)$"),
                 min_ttft: float | None = Query(None, ge=0, description="seconds"),
                 source: str | None = Query(None, max_length=64,
                                            description="only this source's requests")) -> Response:
        """Recent finished requests, sorted and filtered; ``total`` counts those the filters
        match (``limit`` of them are returned). A request without a value of ``sort`` (a
        promotion wait not measured) comes last in either order. The default order costs
        about ``limit`` records' work, any other one pass over the table (see
        RequestTable.page)."""
        if sort not in SORT_KEYS:
            raise HTTPException(422, f"unknown sort key {sort!r}; use one of {', '.join(SORT_KEYS)}")
        records, total = agent.pipeline.requests.page(limit, sort, order == "desc", min_ttft,
                                                      source or None)  # "": no filter
        return _json({"total": total, "requests": [r.data() for r in records]})

    # a request id may hold a slash (vLLM takes the client's X-Request-Id), or a newline
    @app.get("/api/v1/requests/{request_id:any_path}", dependencies=[Depends(authorize)])
    def request(request_id: str, source: str | None = Query(
            None, max_length=64, description="the source that reported it; without it, the "
            "one finished last (two engines may use the same ids)")) -> Response:
        """One request with its transfers and the parts of its TTFT."""
        request_id = request_id[:ev.MAX_REQUEST_ID]  # as every sender cuts it
        source = source or None  # an empty ?source= names none: no filter
        record = agent.pipeline.requests.get(request_id, source)
        if record is None:
            where = f" from source {source!r}" if source is not None else ""
            hint = ""
            # vLLM's completions API runs each prompt as "<response id>-<index>", and with
            # n > 1 each choice as "<choice>_" before that: a client holding the response id
            # finds its first prompt's (first choice's) record under one of these
            first = next((rid for rid in (f"{request_id}-0", f"0_{request_id}-0")
                          if agent.pipeline.requests.get(rid, source) is not None), None)
            if first is not None:
                hint = f"; vLLM numbers a completion's prompts and choices: its first is {first!r}"
            raise HTTPException(404, f"no request {request_id!r}{where} in the table{hint}")
        return _json(record.data())

    return app
