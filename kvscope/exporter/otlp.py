"""OTLP span export: each finished request becomes a ``kv.request`` trace over OTLP/HTTP.

One :class:`RequestSpanExporter` per agent, built only when an OTLP endpoint is configured. It
reads finished :class:`~kvscope.agent.requests.RequestRecord` s (a sink: it never writes back)
and hands spans to the OpenTelemetry SDK: a ``TracerProvider`` with a ``BatchSpanProcessor``
over the SDK's OTLP/HTTP protobuf ``OTLPSpanExporter``. The batch processor's worker thread
does all network I/O; :meth:`RequestSpanExporter.export` only appends to its bounded queue.
Every span ends in one of :attr:`RequestSpanExporter.spans`: ``sent``, ``failed`` or
``dropped`` (``kvscope_otlp_spans_total{result}``).

Span shapes (times are Unix nanoseconds, from the record's Unix seconds, see :func:`unix_ns`):

- ``kv.request`` (root; trace id = ``record.trace_id``), from ``arrival`` to ``arrival + ttft``
  (or to ``finished`` when ``ttft`` is None; zero-length when both are None). Attributes:
  ``kv.request_id`` str, ``kv.source`` str (the emitter's name, ``RequestRecord.source``),
  ``kv.prompt_tokens`` / ``kv.output_tokens`` int, ``kv.tokens.<source>`` int prompt tokens per
  token source (``gpu``, ``cpu``, ``disk``, ``recompute`` present, 0 when absent, plus any other
  key of ``record.tokens``, where the record has tokens by source: none for vLLM's span
  alone, which measures none), ``kv.ttft_seconds`` float (only when ttft is known),
  ``kv.queueing_seconds``, ``kv.prefill_seconds`` float seconds, ``kv.lookup_seconds``,
  ``kv.promotion_wait_seconds`` float seconds (only when measured: vLLM's spans alone carry
  neither), ``kv.itl_seconds`` float (only when known: > 0),
  ``kv.transfers_omitted`` int (only when some were: > 0). Every field of the request schema
  (:class:`~kvscope.agent.record_data.RecordData`) is an attribute
  (:data:`REQUEST_ATTRIBUTES`) or carried by the span's shape (:data:`REQUEST_SPAN_SHAPE`).
- ``kv.transfer`` (child of ``kv.request``, one per ``record.transfers`` entry), from ``start``
  to ``start + duration``. Attributes: ``kv.route`` str ``"<src>-><dst>"``, ``kv.src`` and
  ``kv.dst`` str tiers, ``kv.blocks`` int, ``kv.bytes`` int bytes, ``kv.ok`` bool. A failed
  transfer (``ok`` False) has status ERROR, a successful one status UNSET.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvscope import __version__
from kvscope.agent.requests import RequestRecord, TransferRecord
from kvscope.events import TOKEN_SOURCES

log = logging.getLogger(__name__)
_SDK_LOG = logging.getLogger(OTLPSpanExporter.__module__)  # where the SDK logs failed sends

TRACES_PATH = "/v1/traces"  # OTLP/HTTP traces path (OTLP specification, "OTLP/HTTP Request")
_TRACE_ID = re.compile(r"[0-9a-fA-F]{32}")
# The request schema on the kv.request span: each RecordData field's attribute ...
REQUEST_ATTRIBUTES: dict[str, str] = {
    "request_id": "kv.request_id", "source": "kv.source", "prompt_tokens": "kv.prompt_tokens",
    "output_tokens": "kv.output_tokens", "tokens": "kv.tokens.{source}",
    "ttft": "kv.ttft_seconds", "queueing": "kv.queueing_seconds", "lookup": "kv.lookup_seconds",
    "promotion_wait": "kv.promotion_wait_seconds", "prefill": "kv.prefill_seconds",
    "itl": "kv.itl_seconds", "transfers_omitted": "kv.transfers_omitted",
}
# None (not measured) is left out, and for these 0 too (unknown or none)
_WHEN_KNOWN = ("ttft", "itl", "transfers_omitted")
# ... or, for the rest, the part of the span's shape that carries it
REQUEST_SPAN_SHAPE: dict[str, str] = {
    "trace_id": "the trace id", "arrival": "the span's start",
    "finished": "the span's end when the TTFT is unknown",
    "transfers": "a kv.transfer child span each",
}
SPAN_RESULTS = ("sent", "failed", "dropped")  # what becomes of a span (RequestSpanExporter.spans)


def unix_ns(seconds: float) -> int:
    """Unix seconds (float) -> Unix nanoseconds (int): the float's exact value rounded to the
    nearest nanosecond.

    ``round(seconds * 1e9)`` would not do: at today's timestamps (~1.7e18 ns) doubles are 256 ns
    apart, so the product itself is rounded. Splitting off the whole seconds first is exact
    (``seconds - floor(seconds)`` has no rounding error), and the fraction times 1e9 is below
    1e9, where doubles resolve far below 1 ns. The only error left is the input float's own:
    a Unix time near 1.7e9 s is a multiple of 2**-22 s (~238 ns).

    Raises ValueError for NaN and for a time before 1970 (OTLP's times are unsigned: one such
    span would fail its whole batch), OverflowError for infinities.
    """
    if seconds < 0:
        raise ValueError(f"{seconds} s is before 1970, which OTLP cannot carry")
    whole = math.floor(seconds)
    return whole * 1_000_000_000 + round((seconds - whole) * 1e9)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for ``endpoint``: ``http(s)://host:port`` (the collector's base,
    as ``OTEL_EXPORTER_OTLP_ENDPOINT``) gets ``/v1/traces`` appended; a URL whose path already
    ends in ``/v1/traces`` is used as it is.

    Raises ValueError when ``endpoint`` is not an http or https URL with a host.
    """
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"OTLP endpoint {endpoint!r} is not an http(s)://host[:port] URL")
    if parts.path.rstrip("/").endswith(TRACES_PATH):
        return endpoint
    return endpoint.rstrip("/") + TRACES_PATH


class _RecordIdGenerator(RandomIdGenerator):
    """Span ids at random; the trace id of the next root span from the record being exported.

    The SDK asks its ``IdGenerator`` for a trace id exactly when it starts a span without a valid
    parent, i.e. a root. :meth:`RequestSpanExporter.export` sets :attr:`_pending` (per thread, so
    concurrent exports cannot swap ids) right before it starts ``kv.request``; the next
    ``generate_trace_id`` call takes it and clears it. The alternative, a remote parent
    ``SpanContext`` carrying the trace id, would give ``kv.request`` a parent span id that no
    backend ever receives (a dangling parent); this way ``kv.request`` stays a true root.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def set_next_trace_id(self, trace_id: int | None) -> None:
        self._local.pending = trace_id

    def generate_trace_id(self) -> int:
        pending = getattr(self._local, "pending", None)
        if pending is not None:
            self._local.pending = None
            return pending
        return super().generate_trace_id()

    def is_trace_id_random(self) -> bool:
        # Trace ids may come from engines (W3C traceparent); we cannot vouch for their randomness.
        return False


class _Throttle(logging.Filter):
    """Lets one of the SDK exporter's log lines through per ``interval`` seconds, naming the
    endpoint and how many lines it held back: an endpoint that refuses every batch (a wrong
    URL, a 404) would otherwise log an anonymous error every ``schedule_delay``."""

    def __init__(self, endpoint: str, interval: float = 60.0) -> None:
        super().__init__()
        self._prefix = f"kvscope OTLP export to {endpoint}: ".replace("%", "%%")
        self._interval = interval
        self._last = -math.inf
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self._last < self._interval:
            self._held += 1
            return False
        held = f" ({self._held} more such lines held back)" if self._held else ""
        record.msg = self._prefix + str(record.msg) + held
        self._last, self._held = now, 0
        return True


class _CountingExporter(SpanExporter):
    """The SDK's span exporter, telling ``on_done(spans, sent)`` what became of each batch it
    was given (``sent``: the endpoint accepted it; the SDK has retried a refusal by then)."""

    def __init__(self, inner: SpanExporter, on_done: Callable[[int, bool], None]) -> None:
        self._inner = inner
        self._on_done = on_done

    def export(self, spans: Sequence) -> SpanExportResult:
        result = SpanExportResult.FAILURE
        try:
            result = self._inner.export(spans)
        finally:
            self._on_done(len(spans), result is SpanExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._inner.force_flush(timeout_millis)


class RequestSpanExporter:
    """Sends one ``kv.request`` span per finished request, with ``kv.transfer`` children.

    ``endpoint``: the OTLP/HTTP collector, ``http(s)://host:port`` (``/v1/traces`` is appended,
    see :func:`traces_url`). ``service_name``: the ``service.name`` resource attribute.
    ``timeout``: seconds one batch may take to send, retries included (the SDK retries refused
    connections and 429/502/503/504 with backoff within it); also how long :meth:`shutdown`
    waits for the final send. ``max_queue_size``: spans (a record is ``1 + len(transfers)``
    spans) handed to the SDK and not yet sent; a record that would pass it is dropped whole, and
    counted, before the SDK's own queue would drop its oldest span silently.
    ``schedule_delay``: seconds between sends (the SDK also sends as soon as
    ``max_export_batch_size`` spans wait).
    ``max_export_batch_size``: spans per OTLP request. Every record is sampled (ALWAYS_ON: the
    ``OTEL_TRACES_SAMPLER`` variable is not read; a span another sampler dropped would never
    leave the count of those queued).

    Counters (read them from any thread): ``exported`` records handed to the SDK; ``failed``
    records that could not be turned into spans (e.g. a NaN time) and were dropped;
    ``invalid_trace_ids`` records whose ``trace_id`` was not 32 hex digits (or all zeros) and
    that were sent under a fresh random trace id instead; ``spans``: dict[result, spans] with
    ``sent`` (the endpoint accepted them), ``failed`` (refused, or unreachable within
    ``timeout`` and the SDK's retries) and ``dropped`` (never queued: the queue was full, or
    the record could not become spans). Spans still queued are in none of them.

    Raises ValueError from the constructor for a bad endpoint or a timeout <= 0. Thread-safe.
    """

    def __init__(self, endpoint: str, service_name: str = "kvscope-agent", timeout: float = 5.0,
                 *, max_queue_size: int = 2048, schedule_delay: float = 5.0,
                 max_export_batch_size: int = 512) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        self.endpoint = traces_url(endpoint)
        self.timeout = timeout
        self._ids = _RecordIdGenerator()
        # Built here rather than in a start(): the SDK processor starts its worker thread in its
        # constructor, and the worker sleeps until spans arrive.
        self._throttle = _Throttle(self.endpoint)
        _SDK_LOG.addFilter(self._throttle)
        self._lock = threading.Lock()
        self._max_queued = max_queue_size
        self._queued = 0  # spans handed to the SDK that no export call has finished with
        self.spans = dict.fromkeys(SPAN_RESULTS, 0)
        self._processor = BatchSpanProcessor(
            _CountingExporter(OTLPSpanExporter(endpoint=self.endpoint, timeout=timeout),
                              self._done),
            max_queue_size=max_queue_size, schedule_delay_millis=schedule_delay * 1000,
            max_export_batch_size=max_export_batch_size)
        # shutdown_on_exit=False: the agent's lifespan owns shutdown (house rule 11); an atexit
        # hook would also keep every exporter ever built alive until exit.
        self._provider = TracerProvider(
            sampler=ALWAYS_ON, resource=Resource.create({SERVICE_NAME: service_name}),
            shutdown_on_exit=False, id_generator=self._ids)
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("kvscope.exporter.otlp", __version__)
        self._closed = False
        self.exported = 0
        self.failed = 0
        self.invalid_trace_ids = 0

    def export(self, record: RequestRecord) -> None:
        """Queue ``record`` as one ``kv.request`` span and its ``kv.transfer`` children.

        Never blocks on the network and never raises: it only appends to the SDK's bounded
        queue. A record that cannot be converted is counted in ``failed`` and logged; after
        :meth:`shutdown` records are ignored.
        """
        if self._closed:
            return
        transfers = record.transfers  # one tuple: a late load may replace it meanwhile
        spans = 1 + len(transfers)
        with self._lock:
            if self._queued + spans > self._max_queued:  # the endpoint is slow or away
                self.spans["dropped"] += spans
                return
            self._queued += spans
        try:
            self._export(record, transfers)
        except Exception:  # boundary: a sink never raises into the pipeline (house rule 8)
            self._ids.set_next_trace_id(None)
            with self._lock:
                self.failed += 1
                self._queued -= spans
                self.spans["dropped"] += spans
            log.warning("OTLP export of request %r failed", getattr(record, "request_id", None),
                        exc_info=True)
        else:
            with self._lock:
                self.exported += 1

    def _export(self, record: RequestRecord, transfers: tuple[TransferRecord, ...]) -> None:
        start = unix_ns(record.arrival)
        if record.ttft is not None:
            end = start + round(record.ttft * 1e9)
        elif record.finished is not None:
            end = unix_ns(record.finished)
        else:
            end = start
        transfers = [(t, unix_ns(t.start), round(t.duration * 1e9)) for t in transfers]
        attributes = _request_attributes(record)
        if _TRACE_ID.fullmatch(record.trace_id) and int(record.trace_id, 16):
            self._ids.set_next_trace_id(int(record.trace_id, 16))
        else:
            with self._lock:
                self.invalid_trace_ids += 1
        try:
            # An empty Context: kv.request is a root even when the caller has a current span.
            root = self._tracer.start_span("kv.request", context=Context(), kind=SpanKind.INTERNAL,
                                           attributes=attributes, start_time=start)
        finally:
            self._ids.set_next_trace_id(None)
        parent = trace_api.set_span_in_context(root)
        for transfer, t_start, t_duration in transfers:
            child = self._tracer.start_span("kv.transfer", context=parent, kind=SpanKind.INTERNAL,
                                            attributes=_transfer_attributes(transfer),
                                            start_time=t_start)
            if not transfer.ok:
                child.set_status(Status(StatusCode.ERROR, "transfer failed"))
            child.end(end_time=t_start + max(t_duration, 0))
        root.end(end_time=max(end, start))

    def _done(self, spans: int, sent: bool) -> None:
        with self._lock:
            self._queued -= spans
            self.spans["sent" if sent else "failed"] += spans

    def force_flush(self) -> bool:
        """Send what is queued now (blocks up to about ``timeout`` seconds per batch); True when
        the SDK reports it done, False after shutdown."""
        if self._closed:
            return False
        return self._processor.force_flush()

    def shutdown(self) -> None:
        """Send what is queued, then stop the SDK's worker. Returns within about ``timeout``
        seconds: the SDK's own shutdown (which waits up to 30 s, fixed) runs in a daemon thread
        that is joined for ``timeout`` seconds; spans it still sends after that may be lost if
        the process exits. Safe twice, and without any export."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        stopper = threading.Thread(target=self._provider.shutdown, name="kvscope-otlp-shutdown",
                                   daemon=True)
        stopper.start()
        stopper.join(self.timeout)
        if stopper.is_alive():
            log.warning("OTLP exporter still sending to %s after %.1f s; not waiting longer",
                        self.endpoint, self.timeout)
        else:
            _SDK_LOG.removeFilter(self._throttle)


def _request_attributes(record: RequestRecord) -> dict[str, str | int | float]:
    attributes: dict[str, str | int | float] = {}
    for field, name in REQUEST_ATTRIBUTES.items():
        value = getattr(record, field)
        if field == "tokens":  # none by source (vLLM's span alone): not measured, left out
            sources = (*TOKEN_SOURCES, *sorted(set(value) - set(TOKEN_SOURCES))) if value else ()
            for source in sources:
                attributes[name.format(source=source)] = int(value.get(source, 0))
        elif value is not None and not (field in _WHEN_KNOWN and not value):
            attributes[name] = value
    return attributes


def _transfer_attributes(transfer: TransferRecord) -> dict[str, str | int | bool]:
    return {"kv.route": f"{transfer.src}->{transfer.dst}", "kv.src": transfer.src,
            "kv.dst": transfer.dst, "kv.blocks": transfer.blocks, "kv.bytes": transfer.bytes,
            "kv.ok": transfer.ok}
