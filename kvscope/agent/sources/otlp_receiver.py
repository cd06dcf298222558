"""The OTLP/HTTP trace receiver: the agent accepts spans at ``/v1/traces`` so vLLM's
``--otlp-traces-endpoint`` can point at it (with ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=
http/protobuf``; vLLM's default protocol is gRPC).

Bodies are OTLP ``ExportTraceServiceRequest`` s, binary protobuf (``application/x-protobuf``)
or OTLP/JSON (``application/json``: camelCase keys, hex trace and span ids, 64-bit integers as
strings), optionally gzip-compressed. :func:`parse` turns either into :class:`Span` s (no I/O).

vLLM's request span (0.32 ``vllm/v1/engine/output_processor.py``: name ``llm_request``,
attributes ``gen_ai.request.id``, ``gen_ai.usage.prompt_tokens`` / ``completion_tokens``,
``gen_ai.latency.time_to_first_token`` / ``time_in_queue`` / ``time_in_model_prefill`` /
``time_in_model_decode``, seconds; the mean inter-token latency is the decode time over the
completion tokens after the first) is joined with cache events by request id (vLLM's external
id, which the in-process tap also reports): when the tap finished the request (the one of that
id under way when the span starts: a client may reuse an id), the record takes the span's
trace id and vLLM's own TTFT, queueing, prefill and inter-token latency; a span of one of a
request's parallel samples (``gen_ai.request.n`` > 1: vLLM sends one per sample, each named
after the request, which its tap names ``<i>_<id>``) gives the samples the tap finished or
has in flight its trace id alone; otherwise the span becomes ``RequestStarted`` +
``RequestFinished`` events under ``source`` (so a record the tap has open joins them): see
:meth:`~kvscope.agent.pipeline.Pipeline.report`. Spans without ``gen_ai.request.id`` (a
string) are ignored, counted only among the spans received (another service's spans may share
the endpoint: they are no loss), and so are spans of requests the tap did not finish that have
no TTFT (an aborted request). A span whose values
an emitter's batch could not carry (a TTFT that is no number of seconds, a time past 2100, a
count past 2**53: :func:`kvscope.events.validate`; a start or end time of 0, which OTLP reads
as unset) is counted in
``kvscope_events_dropped_total{source="otlp", reason="invalid"}``. A span whose trace id is
not a W3C one is used without it (its request counts, under a trace id of the agent's own, as
a request without a traceparent; the first such span is logged). Every span received counts
in ``kvscope_events_received_total{source="otlp"}``, so an operator sees whether spans arrive.
vLLM sends spans in batches (every 5 s by default: ``OTEL_BSP_SCHEDULE_DELAY``), so from the
first span on, the tap's records wait ``wait`` seconds for theirs before they count in the
request metrics and the OTLP exporter and the capture get them (see
:class:`~kvscope.agent.pipeline.Pipeline`); without spans nothing waits. A span that joins a
record handed over already (after its wait, or restored after a restart) still amends it, and
the store gets it again.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import time
import zlib
from dataclasses import dataclass, field

from pydantic import Field, field_validator

from kvscope import events as ev
from kvscope.agent.requests import FUTURE
from kvscope.agent.sections import Section
from kvscope.agent.sources.base import Consumer, SourceSpec, register
from kvscope.events import source_name_problem

log = logging.getLogger(__name__)
NAME = "otlp"
# drop reasons, each exported at 0 from the start: spans that cannot be used, and bodies
# refused whole (one each)
REASONS = ("invalid", "malformed", "too_large")
REQUEST_ID = "gen_ai.request.id"
TTFT = "gen_ai.latency.time_to_first_token"
TRACES_PATH = "/v1/traces"  # OTLP/HTTP traces path (OTLP specification, "OTLP/HTTP Request")
EMPTY_RESPONSE = b""  # a serialized ExportTraceServiceResponse with no partial_success
# Bounds of one body. vLLM exports at most 512 spans a batch (the SDK's
# OTEL_BSP_MAX_EXPORT_BATCH_SIZE), well under 1 MiB. Parsed, a span takes about 400 bytes even
# when empty (2 bytes on the wire), so spans are counted on the wire before a body is parsed.
MAX_DECOMPRESSED_BYTES = 4 << 20
MAX_SPANS = 10_000


# HTTP status -> the google.rpc code of an error's Status (google/rpc/code.proto)
_RPC_CODES = {400: 3, 413: 8, 415: 3, 503: 14}  # INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE


def partial_success(rejected: int, message: str, protobuf: bool) -> bytes | dict:
    """The answer to an export some of whose spans were rejected (``rejected`` > 0: invalid,
    counted): an ``ExportTraceServiceResponse`` whose ``partial_success`` says how many and
    why (the OTLP specification, "Partial Success"), serialized for a protobuf export, else
    as its OTLP/JSON object. With none rejected, the empty response."""
    if not rejected:
        return EMPTY_RESPONSE if protobuf else {}
    if protobuf:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTracePartialSuccess, ExportTraceServiceResponse)
        return ExportTraceServiceResponse(partial_success=ExportTracePartialSuccess(
            rejected_spans=rejected, error_message=message)).SerializeToString()
    return {"partialSuccess": {"rejectedSpans": str(rejected), "errorMessage": message}}


def error_status(message: str, status: int) -> bytes:
    """The body of an error answer to a protobuf export: a serialized ``google.rpc.Status``
    with ``message`` (the OTLP specification, "OTLP/HTTP Response", Failures); its code
    follows the HTTP ``status`` (UNKNOWN for one not mapped)."""
    from google.rpc.status_pb2 import Status  # googleapis-common-protos, OTLP's exporters'

    return Status(code=_RPC_CODES.get(status, 2), message=message).SerializeToString()


class OtlpError(ValueError):
    """A body that is not an OTLP trace export; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Span:
    """One span: ids as lowercase hex, times in Unix nanoseconds, attributes by key."""

    trace_id: str
    span_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, object] = field(default_factory=dict)


MAX_GZIP_MEMBERS = 64  # gzip members in one body: exporters send one


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    encoding = (encoding or "").lower().strip()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise OtlpError(f"unsupported content-encoding {encoding!r}", 415)
    # a gzip body may hold several members, one after another (RFC 1952, section 2.2); each
    # copies the rest of the body (zlib's unused_data), so their number is bounded
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    parts, size, rest = [], 0, body
    while len(parts) < MAX_GZIP_MEMBERS:
        inflater = zlib.decompressobj(wbits)
        try:
            part = inflater.decompress(rest, limit + 1 - size)
        except (zlib.error, gzip.BadGzipFile) as exc:
            raise OtlpError(f"bad {encoding} body: {exc}") from None
        parts.append(part)
        size += len(part)
        if size > limit:
            raise OtlpError(f"decompressed body over {limit} bytes", 413)
        if not inflater.eof:
            raise OtlpError(f"bad {encoding} body: truncated")
        rest = inflater.unused_data
        # zero padding after the last gzip member, as gzip.decompress allows
        if not rest or (encoding == "gzip" and not rest.strip(b"\0")):
            return b"".join(parts)
        if encoding != "gzip":
            raise OtlpError(f"bad {encoding} body: {len(rest)} bytes after its end")
    raise OtlpError(f"bad gzip body: more than {MAX_GZIP_MEMBERS} members")


def parse(body: bytes, content_type: str, encoding: str = "",
          limit: int = MAX_DECOMPRESSED_BYTES) -> list[Span]:
    """Spans of an OTLP/HTTP traces body. Raises :class:`OtlpError` (400 malformed, 413 too
    large once decompressed, 415 unsupported content type or encoding)."""
    data = _decompress(body, encoding, limit)
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind == "application/x-protobuf":
        return _parse_protobuf(data)
    if kind == "application/json":
        return _parse_json(data)
    raise OtlpError(f"unsupported content-type {content_type!r}; use application/x-protobuf "
                    "or application/json", 415)


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    """The base-128 varint at ``buf[i]`` and the offset after it."""
    value = shift = 0
    while i < len(buf) and shift < 64:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7
    raise OtlpError("not an OTLP protobuf trace export: a varint is cut short or too long")


def _fields(buf: memoryview):
    """``(number, payload)`` of each field of a protobuf message, in order: ``payload`` the
    bytes of a length-delimited field, None for the others (keys are varints of number << 3 |
    wire type; protobuf.dev, "Encoding"). Raises OtlpError when the encoding is broken."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            _, i = _varint(buf, i)
            yield key >> 3, None
        elif wire in (1, 5):  # fixed 64 and 32 bits
            i += 8 if wire == 1 else 4
            yield key >> 3, None
        elif wire == 2:
            size, i = _varint(buf, i)
            yield key >> 3, buf[i:i + size]
            i += size
        else:
            raise OtlpError(f"not an OTLP protobuf trace export: wire type {wire}")
    if i != len(buf):
        raise OtlpError("not an OTLP protobuf trace export: cut short")


def _check_span_count(data: bytes) -> None:
    """Raise OtlpError (413) when the export holds more than MAX_SPANS spans, counted on the
    wire: ExportTraceServiceRequest.resource_spans (1) -> ResourceSpans.scope_spans (2) ->
    ScopeSpans.spans (2), as opentelemetry-proto's trace.proto numbers them. The walk visits
    every field of those three levels, which an export needs few of beside its spans: past
    8 x MAX_SPANS of them (one resource and scope per span takes 7; other fields by the
    million would cost seconds here) it stops. Groups (wire types 3 and 4), which no OTLP
    exporter sends, are refused."""
    visited = spans = 0

    def children(buf: memoryview, number: int):
        nonlocal visited
        for tag, payload in _fields(buf):
            visited += 1
            if visited > 8 * MAX_SPANS:
                raise OtlpError(f"more than {8 * MAX_SPANS} fields around the spans", 413)
            if tag == number and payload is not None:
                yield payload

    for resource_spans in children(memoryview(data), 1):
        for scope_spans in children(resource_spans, 2):
            for _ in children(scope_spans, 2):
                spans += 1
                if spans > MAX_SPANS:
                    raise OtlpError(f"more than {MAX_SPANS} spans in one export", 413)


def _parse_protobuf(data: bytes) -> list[Span]:
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    _check_span_count(data)
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(data)
    except DecodeError as exc:
        raise OtlpError(f"not an OTLP protobuf trace export: {exc}") from None
    spans = []
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                attributes = {a.key: _pb_value(a.value) for a in s.attributes}
                spans.append(Span(s.trace_id.hex(), s.span_id.hex(), s.name,
                                  s.start_time_unix_nano, s.end_time_unix_nano, attributes))
    return spans


def _pb_value(value) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "bool_value", "int_value",
                                            "double_value") else None


def _parse_json(data: bytes) -> list[Span]:
    try:
        doc = json.loads(data)
        spans = []
        # null is a field's default in the proto3 JSON mapping, as an absent field is
        for resource_spans in doc.get("resourceSpans") or []:
            for scope_spans in resource_spans.get("scopeSpans") or []:
                for s in scope_spans.get("spans") or []:
                    if len(spans) == MAX_SPANS:
                        raise OtlpError(f"more than {MAX_SPANS} spans in one export", 413)
                    attributes = {a["key"]: _json_value(a.get("value") or {})
                                  for a in s.get("attributes") or []}
                    spans.append(Span(str(s.get("traceId") or "").lower(),
                                      str(s.get("spanId") or "").lower(),
                                      str(s.get("name") or ""),
                                      int(s.get("startTimeUnixNano") or 0),
                                      int(s.get("endTimeUnixNano") or 0), attributes))
        return spans
    except OtlpError:
        raise
    except json.JSONDecodeError as exc:
        raise OtlpError(f"not JSON: {exc}") from None
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
        raise OtlpError("not an OTLP/JSON trace export: a field of the wrong type (expected "
                        "resourceSpans[].scopeSpans[].spans[] objects, times as integers of "
                        "nanoseconds, attributes as {key, value} objects)") from None
    except RecursionError:
        raise OtlpError("not an OTLP/JSON trace export: nested too deep") from None


def _json_value(value: dict) -> object:
    for key, kind in (("stringValue", str), ("intValue", int), ("doubleValue", float),
                      ("boolValue", bool)):
        if value.get(key) is not None:  # null: the default, as if absent
            return value[key] if kind is str else kind(value[key])
    return None


def _float(attributes: dict, key: str) -> float:
    """A latency attribute in seconds; 0 (unknown) unless finite and not negative."""
    value = attributes.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return 0.0
    try:
        value = float(value)
    except OverflowError:  # an integer past float's range
        return 0.0
    return value if 0 <= value < math.inf else 0.0


def _count(attributes: dict, key: str) -> int:
    """A token count attribute; 0 (unknown) unless a finite number that is not negative."""
    value = attributes.get(key)
    return (int(value) if isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 <= value < math.inf else 0)


def _utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a string from JSON may hold a lone surrogate, which
    no sink can write)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class OtlpReceiver:
    """Joins request spans with the pipeline's request records; ``source``: the engine source
    name the tap uses (``vllm``); ``wait``: seconds that source's finished records wait for
    their span before the pipeline's subscribers get them. ``received``/``ignored``/``joined``:
    span counters; ``untraced``: spans used without their trace id, which was not a valid W3C
    one (the first logged); ``last_ttft``: when a span last brought a request's TTFT (monotonic
    seconds, -inf before any)."""

    def __init__(self, pipeline: Consumer, source: str = "vllm", wait: float = 6.0) -> None:
        self.pipeline = pipeline
        self.source = source
        self.wait = wait
        self.received = 0
        self.ignored = 0
        self.joined = 0
        self.untraced = 0
        self.last_ttft = -math.inf
        self._warned = False
        self._rejected, self._reason = 0, ""  # of the body being handled
        self._refusals_logged: set[str] = set()
        self._joining = False  # the source's records wait for spans (from the first span on)

    def start(self) -> None:
        self.pipeline.expect_drops(NAME, REASONS)
        # 0 spans received is a value from the start: a panel of spans arriving read "no
        # data" until the first one
        self.pipeline.add_received(NAME, 0)
        self.pipeline.set_source_up(NAME, True)

    def refused(self, error: OtlpError) -> None:
        """Count a body refused with ``error`` (its status: 413 ``too_large``, else
        ``malformed``) as one dropped event: its spans are unknown, as for an ingest message
        whose header cannot be read. The exporter is told by the status; the operator by this
        count, and by the first refusal of each kind in the log."""
        reason = "too_large" if error.status == 413 else "malformed"
        self.pipeline.drop(NAME, reason)
        if reason not in self._refusals_logged:
            self._refusals_logged.add(reason)
            log.warning("kvscope OTLP receiver: refused an export (%s): %s; counted in "
                        "kvscope_events_dropped_total{source=\"otlp\", reason=%r}, logged once "
                        "per reason", reason, error, reason)

    def shutdown(self) -> None:
        return

    def _invalid(self, request_id: str, why: str) -> None:
        """Count a span that cannot be used (and the body's rejected spans); log the first."""
        self.pipeline.drop(NAME, "invalid")
        if not self._rejected:
            self._reason = f"the span of request {request_id[:64]!r}: {why}"
        self._rejected += 1
        if not self._warned:
            self._warned = True
            log.warning("kvscope OTLP receiver: dropped the span of request %r: %s; counted in "
                        "kvscope_events_dropped_total{source=\"otlp\"}, logged once",
                        request_id[:64], why)

    def _untraced(self, request_id: str, trace_id: str) -> None:
        """Count a span whose trace id is not a W3C one; log the first."""
        self.untraced += 1
        if self.untraced == 1:
            log.warning("kvscope OTLP receiver: the span of request %r has trace id %r, not a "
                        "W3C one (32 lowercase hex digits, not all 0): its request counts, "
                        "under a trace id of the agent's own instead; logged once",
                        request_id[:64], trace_id[:64])

    def handle(self, spans: list[Span]) -> tuple[int, str]:
        """Take one export's ``spans``; returns how many were rejected as invalid (counted in
        ``kvscope_events_dropped_total``) and why the first was, for the exporter's partial
        success (:func:`partial_success`)."""
        self._rejected, self._reason = 0, ""
        self.pipeline.add_received(NAME, len(spans))
        for span in spans:
            self.received += 1
            request_id = span.attributes.get(REQUEST_ID)
            if not isinstance(request_id, str) or not request_id:
                self.ignored += 1
                continue
            request_id = request_id[:ev.MAX_REQUEST_ID]  # as the tap cuts it
            if not _utf8(request_id):  # "\ud800" is valid JSON
                self._invalid(request_id, "the request id is not text (a lone surrogate)")
                continue
            if not (span.start_ns and span.end_ns):  # OTLP: 0 is unset; not 1970
                self._invalid(request_id, "its start or end time is unset (0)")
                continue
            a = span.attributes
            trace_id = span.trace_id
            if not ev.w3c_trace_id(trace_id):  # the request counts; no link to a bad trace
                self._untraced(request_id, trace_id)
                trace_id = ""
            ttft = _float(a, TTFT)
            prompt = _count(a, "gen_ai.usage.prompt_tokens")
            output = _count(a, "gen_ai.usage.completion_tokens")
            decode = _float(a, "gen_ai.latency.time_in_model_decode")
            try:  # as an emitter's events are checked: times, durations and counts in bounds
                started = ev.validate(ev.RequestStarted(
                    ts=span.start_ns / 1e9, request_id=request_id, prompt_tokens=prompt,
                    trace_id=trace_id))
                finished = ev.validate(ev.RequestFinished(
                    ts=max(span.end_ns, span.start_ns) / 1e9, request_id=request_id, ttft=ttft,
                    prompt_tokens=prompt, output_tokens=output,
                    queueing=_float(a, "gen_ai.latency.time_in_queue"),
                    prefill=_float(a, "gen_ai.latency.time_in_model_prefill"),
                    itl=decode / (output - 1) if output > 1 and decode > 0 else 0.0))
            except (ev.SchemaError, OverflowError) as exc:  # OverflowError: a time past float's
                self._invalid(request_id, str(exc))
                continue
            if finished.ts > time.time() + FUTURE:  # checked here, before it finishes the tap's
                self._invalid(request_id, "it ends more than an hour ahead of the agent's clock")
                continue
            if ttft:
                self.last_ttft = time.monotonic()
            if not self._joining:  # spans come: the source's requests wait for theirs
                self._joining = True
                self.pipeline.join(self.source, self.wait)
            # a request without a first token (aborted) has no TTFT to count as 0: it only
            # amends the tap's record
            if self.pipeline.report(self.source, trace_id, started, finished,
                                    new_request=bool(ttft),
                                    samples=_count(a, "gen_ai.request.n")):
                self.joined += 1
            elif not ttft:
                self.ignored += 1
                if a.get(TTFT) is not None:  # one was sent, but no usable number of seconds
                    self._invalid(request_id, f"{TTFT} {a.get(TTFT)!r} is no number of seconds")
        return self._rejected, self._reason


class OtlpReceiverConfig(Section):
    """Accept OTLP/HTTP traces at ``/v1/traces``; spans join requests of engine ``source`` (a
    tap's source name, :func:`kvscope.events.source_name_problem`), whose finished requests wait
    ``wait_seconds`` for their span, from the first span on, before they are counted and
    exported (vLLM sends spans every 5 s by default)."""

    enabled: bool = True
    source: str = "vllm"
    wait_seconds: float = Field(6.0, ge=0, le=3600, allow_inf_nan=False)

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        # it becomes a metric label and must match the engine tap's own source name, which the
        # ingest refuses unless it is such a word
        problem = source_name_problem(value)
        if problem:
            raise ValueError(f"{value!r} {problem}; use the engine tap's source name, e.g. vllm")
        return value


register(SourceSpec(
    "otlp_receiver", OtlpReceiverConfig,
    lambda config, consumer, built: OtlpReceiver(consumer, config.source, config.wait_seconds),
    describe=lambda config: "otlp_receiver",
    banner=lambda config, part, base_url: (f"otlp receiver: {base_url}/v1/traces (joins source "
                                           f"{config.source!r})")))
