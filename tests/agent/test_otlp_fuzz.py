"""Fuzzing the OTLP/HTTP trace receiver (issue 26) through the real agent served by uvicorn on a
loopback socket: hostile bodies (random bytes, OTLP/JSON with wrong types, protobuf built with
opentelemetry-proto's classes then cut and bit-flipped, gzip and deflate of those, wrong headers)
and valid-looking spans with random attribute values.

One server per test, driven by an inner ``@given`` function so that the test can check after
the fuzz that the receiver still takes a valid span. Example counts keep each test to a few
seconds on a 2-core machine; hypothesis picks new examples each run, as the repository's other
property tests do. A body the receiver refuses counts one dropped event (``malformed``, or
``too_large`` for a 413) and leaves no other trace; an accepted span that cannot be used is
counted ``invalid`` or ignored.
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
import time
import zlib
from contextlib import contextmanager

from google.rpc.status_pb2 import Status as RpcStatus
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                    ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import (AnyValue, ArrayValue, KeyValue,
                                                      KeyValueList)
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from kvscope.agent.config import AgentSettings
from kvscope.service.agent import Agent
from kvscope.service.api import create_app
from kvscope.service.server import ApiServer, bind

from conftest import http_exchange

REQUEST_ID = "gen_ai.request.id"
TTFT = "gen_ai.latency.time_to_first_token"
KEYS = [REQUEST_ID, TTFT, "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens",
        "gen_ai.latency.time_in_queue", "gen_ai.latency.time_in_model_prefill",
        "gen_ai.latency.time_in_model_decode"]
TRACE = "0af7651916cd43dd8448eb211c80319c"
# deadline=None: a slow example on a loaded 2-core machine is no failure; no wall-clock checks
HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]


@contextmanager
def served_agent():
    """(agent, port): an agent with the OTLP receiver (source ``vllm``) served on 127.0.0.1."""
    agent = Agent(AgentSettings(ingest={"enabled": False}, collectors={"gpu": {"enabled": False}},
                                otlp_receiver={"source": "vllm"}))
    sock = bind("127.0.0.1", 0, "--port")
    server = ApiServer(create_app(agent, max_body_bytes=1 << 20), sock)
    server.start()
    try:
        yield agent, sock.getsockname()[1]
    finally:
        server.shutdown()


def send(port: int, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """One export POSTed on a new connection: (status, lowercase headers, body)."""
    return http_exchange(port, "POST", "/v1/traces", headers, body)


def _valid_span_body(request_id: str) -> bytes:
    now = time.time()
    span = Span(trace_id=bytes.fromhex(TRACE), span_id=bytes.fromhex("b7ad6b7169203331"),
                name="llm_request", start_time_unix_nano=int((now - 2) * 1e9),
                end_time_unix_nano=int((now - 1) * 1e9), attributes=[
                    KeyValue(key=REQUEST_ID, value=AnyValue(string_value=request_id)),
                    KeyValue(key=TTFT, value=AnyValue(double_value=0.25)),
                    KeyValue(key="gen_ai.usage.prompt_tokens", value=AnyValue(int_value=300))])
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        scope_spans=[ScopeSpans(spans=[span])])]).SerializeToString()


def _still_takes_a_valid_span(agent: Agent, port: int, request_id: str) -> None:
    status, _, body = send(port, _valid_span_body(request_id),
                           {"Content-Type": "application/x-protobuf"})
    assert status == 200, (status, body[:300])
    record = agent.pipeline.requests.get(request_id)
    assert record is not None and record.ttft == 0.25


def _counts(agent: Agent) -> tuple[int, int, int, int, int]:
    """(spans received by the receiver, spans counted in events_received{otlp}, spans dropped as
    invalid, records in the request table, bodies refused: dropped as malformed or too_large)."""
    snap = agent.pipeline.snapshot()
    return (agent.otlp_receiver.received, snap.events_received.get("otlp", 0),
            snap.events_dropped.get(("otlp", "invalid"), 0), len(agent.pipeline.requests),
            sum(snap.events_dropped.get(("otlp", reason), 0)
                for reason in ("malformed", "too_large")))


def test_a_protobuf_export_with_its_media_type_in_capitals_is_answered_in_protobuf():
    """Found by the fuzz below (minimal example: an empty body as ``APPLICATION/X-PROTOBUF``):
    media types are case-insensitive (RFC 9110, section 8.3.1) and the body was parsed as
    protobuf, but the answer was JSON ``{}``, which an exporter decoding an
    ExportTraceServiceResponse cannot read (OTLP/HTTP: the response uses the request's
    content type)."""
    with served_agent() as (_agent, port):
        for content_type in ("APPLICATION/X-PROTOBUF", "Application/x-protobuf; charset=x"):
            status, headers, answer = send(port, b"", {"Content-Type": content_type})
            assert (status, headers["content-type"], answer) == (200, "application/x-protobuf",
                                                                 b"")


# --- hostile bodies ------------------------------------------------------------------------

# JSON values of every type, numbers past int64 and float, NaN and infinities (json.dumps
# writes NaN/Infinity, which Python's json reads back)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                        st.sampled_from(["", "0", "-1", "1e5", "NaN", "9" * 400, "0x10"]))
json_any = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


def maybe(good):
    """Mostly the right shape, sometimes any JSON value in its place."""
    return st.one_of(good, good, json_any)


def optional_fields(**fields):
    """A JSON object of some of ``fields`` (each may be missing) and maybe an unknown key."""
    return st.builds(lambda chosen, extra: {**chosen, **extra},
                     st.fixed_dictionaries({}, optional=fields),
                     st.dictionaries(st.text(max_size=8), json_any, max_size=2))


nanos = st.one_of(st.integers(-2**70, 2**70).map(str), st.integers(0, 2**64), st.floats(),
                  st.just(str(int(time.time() * 1e9))))
json_attr_value = optional_fields(
    stringValue=maybe(st.text(max_size=40)),
    intValue=maybe(st.one_of(st.integers(-2**70, 2**70).map(str), st.integers())),
    doubleValue=maybe(st.floats()), boolValue=maybe(st.booleans()),
    arrayValue=json_any, kvlistValue=json_any)
json_attr = optional_fields(key=maybe(st.one_of(st.sampled_from(KEYS), st.text(max_size=10))),
                            value=maybe(json_attr_value))
json_span = optional_fields(
    traceId=maybe(st.one_of(st.just(TRACE.upper()), st.text(max_size=40))),
    spanId=maybe(st.text(max_size=20)), name=maybe(st.text(max_size=20)),
    startTimeUnixNano=maybe(nanos), endTimeUnixNano=maybe(nanos),
    attributes=maybe(st.lists(maybe(json_attr), max_size=6)))
json_doc = maybe(optional_fields(resourceSpans=maybe(st.lists(maybe(optional_fields(
    resource=json_any, scopeSpans=maybe(st.lists(maybe(optional_fields(
        scope=json_any, spans=maybe(st.lists(maybe(json_span), max_size=3)))), max_size=2)))),
    max_size=2))))


def _deep(depth: int, kind: str) -> bytes:
    return (b'{"resourceSpans":' + (b"[" * depth + b"]" * depth if kind == "list" else
                                    b'{"a":' * depth + b"1" + b"}" * depth) + b"}")


json_bodies = st.one_of(
    st.builds(lambda doc, ascii_: json.dumps(doc, ensure_ascii=ascii_).encode(
        "utf-8", "surrogatepass"), json_doc, st.booleans()),
    st.builds(_deep, st.integers(1, 100_000), st.sampled_from(["list", "object"])),
    # a lone surrogate as JSON text, and bytes that are not UTF-8
    st.sampled_from([b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"attributes":[{"key":'
                     b'"gen_ai.request.id","value":{"stringValue":"\\ud800"}}]}]}]}]}',
                     b'{"resourceSpans":"\xff\xfe"}', b"", b"null", b"[]", b"{}"]))

int64 = st.integers(-2**63, 2**63 - 1)
pb_scalar = st.one_of(st.text(max_size=30).map(lambda s: AnyValue(string_value=s)),
                      int64.map(lambda i: AnyValue(int_value=i)),
                      st.floats().map(lambda f: AnyValue(double_value=f)),
                      st.booleans().map(lambda b: AnyValue(bool_value=b)),
                      st.binary(max_size=20).map(lambda b: AnyValue(bytes_value=b)))
pb_value = st.recursive(pb_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3).map(lambda vs: AnyValue(array_value=ArrayValue(values=vs))),
    st.lists(st.tuples(st.text(max_size=8), inner), max_size=3).map(
        lambda kvs: AnyValue(kvlist_value=KeyValueList(
            values=[KeyValue(key=k, value=v) for k, v in kvs])))), max_leaves=6)
pb_attr = st.builds(KeyValue, key=st.one_of(st.sampled_from(KEYS), st.text(max_size=10)),
                    value=pb_value)
pb_span = st.builds(
    Span, trace_id=st.one_of(st.just(bytes.fromhex(TRACE)), st.binary(max_size=40)),
    span_id=st.binary(max_size=12), name=st.text(max_size=20),
    start_time_unix_nano=st.integers(0, 2**64 - 1), end_time_unix_nano=st.integers(0, 2**64 - 1),
    kind=st.integers(0, 5), attributes=st.lists(pb_attr, max_size=6),
    status=st.builds(Status, message=st.text(max_size=10), code=st.integers(0, 2)))
pb_request = st.builds(lambda groups: ExportTraceServiceRequest(resource_spans=[
    ResourceSpans(scope_spans=[ScopeSpans(spans=spans) for spans in group])
    for group in groups]).SerializeToString(),
    st.lists(st.lists(st.lists(pb_span, max_size=3), max_size=2), max_size=2))


@st.composite
def mangled(draw, bodies):
    """A body cut short, with bits flipped, or with bytes after it."""
    body = draw(bodies)
    how = draw(st.sampled_from(["as is", "cut", "flip", "append"]))
    if how == "cut" and body:
        return body[:draw(st.integers(0, len(body) - 1))]
    if how == "flip" and body:
        data = bytearray(body)
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    if how == "append":
        return body + draw(st.binary(min_size=1, max_size=16))
    return body


header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=40)
content_types = st.one_of(st.sampled_from([
    "application/x-protobuf", "application/json", "application/json; charset=utf-8",
    "APPLICATION/X-PROTOBUF", "Application/Json", "text/plain", "application/grpc",
    "application/x-protobuf; proto=foo", "", "multipart/form-data; boundary=x", None]),
    header_text)


@st.composite
def encoded(draw, bodies):
    """(body, headers): a ``(body, content type it is)`` of ``bodies``, compressed or not, mostly
    declared as what it is, sometimes with any content type and encoding."""
    body, natural_type = draw(bodies)
    compression = draw(st.sampled_from(["none", "none", "gzip", "deflate", "gzip twice"]))
    if compression == "gzip":
        body = gzip.compress(body)
    elif compression == "deflate":
        body = zlib.compress(body)
    elif compression == "gzip twice":  # two members, as `cat a.gz b.gz`
        body = gzip.compress(body) + gzip.compress(body)
    if compression != "none":
        body = draw(mangled(st.just(body)))
    natural_encoding = "" if compression == "none" else compression.split()[0]
    encoding = draw(st.one_of(st.just(natural_encoding), st.just(natural_encoding),
                              st.sampled_from(["", "identity", "gzip", "deflate", "GZIP", "br",
                                               "gzip, deflate", None]), header_text))
    content_type = draw(st.one_of(st.just(natural_type), st.just(natural_type), content_types))
    headers = {}
    if content_type is not None:
        headers["Content-Type"] = content_type
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    return body, headers


def _as(content_type: str):
    return lambda bodies: bodies.map(lambda body: (body, content_type))


hostile = encoded(st.one_of(
    st.binary(max_size=512).map(lambda b: (b, "application/x-protobuf")),
    *map(_as("application/json"), (json_bodies, mangled(json_bodies))),
    *map(_as("application/x-protobuf"), (pb_request, mangled(pb_request)))))


def test_hostile_bodies_get_2xx_or_4xx_and_a_refused_body_is_counted_once():
    """Promise, on every example: the answer is 2xx or 4xx (never 5xx, never a dropped
    connection); a 4xx carries its ``detail`` in the body's encoding (a google.rpc.Status to a
    protobuf body, JSON to the others); a refused body counts one dropped event and
    changes no other counter and no record (it was not half taken); an accepted one counts
    each of its spans in
    events_received{otlp} as the receiver counts it, and answers in the content type it was
    sent in, its partial success naming as rejected the spans dropped as invalid (an empty
    answer when none was). After the fuzz, a valid span still becomes a request."""
    with served_agent() as (agent, port):
        @settings(max_examples=600, deadline=None, suppress_health_check=HEALTH)
        @given(case=hostile)
        def fuzz(case):
            body, headers = case
            before = _counts(agent)
            status, answer_headers, answer = send(port, body, headers)
            after = _counts(agent)
            event(f"status {status}")  # --hypothesis-show-statistics: what the fuzz reached
            assert 200 <= status < 500, (status, answer[:300])
            kind = headers.get("Content-Type", "").split(";")[0].strip().lower()
            if status >= 400:
                if kind == "application/x-protobuf":
                    assert RpcStatus.FromString(answer).message
                else:
                    assert isinstance(json.loads(answer)["detail"], str)
                assert after[:4] == before[:4], "a refused body changed a counter or a record"
                assert after[4] == before[4] + 1, "a refused body was not counted once"
            else:
                assert after[4] == before[4]
                received = after[0] - before[0]
                assert after[1] - before[1] == received
                assert 0 <= after[2] - before[2] <= received
                assert answer_headers["content-type"].split(";")[0] == kind, (kind, answer[:50])
                # the spans dropped as invalid are the rejected ones of OTLP's partial success
                rejected = after[2] - before[2]
                if kind == "application/x-protobuf":
                    partial = ExportTraceServiceResponse.FromString(answer).partial_success
                    assert partial.rejected_spans == rejected
                    assert (answer == b"") == (rejected == 0)
                else:
                    doc = json.loads(answer)
                    assert int(doc.get("partialSuccess", {}).get("rejectedSpans", 0)) == rejected
                    assert (doc == {}) == (rejected == 0)

        fuzz()
        _still_takes_a_valid_span(agent, port, "after-hostile-bodies")


# --- valid-looking spans with random attribute values -------------------------------------

GOOD_TTFT = st.one_of(st.floats(1e-6, 1e6), st.integers(1, 10**6))
BAD_TTFT = st.one_of(st.floats(max_value=0.0), st.just(math.nan), st.just(math.inf),
                     st.booleans(), st.text(max_size=6), st.floats(2e9, 1e300),
                     st.integers(2 * 10**9, 2**63 - 1), st.integers(-2**63, 0))
# counts and latencies the receiver reads as 0 (unknown) or takes as they are
HARMLESS = st.one_of(st.integers(-10**6, 10**6), st.floats(-1e6, 1e3), st.just(math.nan),
                     st.just(math.inf), st.just(-math.inf), st.booleans(), st.text(max_size=6))
TOO_BIG_COUNT = st.one_of(st.integers(2**54, 2**63 - 1), st.floats(1e17, 1e300))
TOO_LONG = st.floats(2e9, 1e300)  # seconds past the schema's bound of 1e9


@st.composite
def span_case(draw):
    """(attributes, whether the span ends hours ahead, expected outcome): ``record``, ``invalid``
    (counted as an invalid drop) or ``ignored``."""
    attrs: dict[str, object] = {}
    id_kind = draw(st.sampled_from(["text", "text", "text", "absent", "empty", "number"]))
    if id_kind == "text":
        attrs[REQUEST_ID] = draw(st.text(min_size=1, max_size=300))
    elif id_kind == "empty":
        attrs[REQUEST_ID] = ""
    elif id_kind == "number":
        attrs[REQUEST_ID] = draw(st.integers(-100, 100))
    ttft_kind = draw(st.sampled_from(["good", "good", "bad", "absent"]))
    if ttft_kind != "absent":
        attrs[TTFT] = draw(GOOD_TTFT if ttft_kind == "good" else BAD_TTFT)
    too_big = False
    for key in KEYS[2:]:
        kind = draw(st.sampled_from(["absent", "harmless", "harmless", "harmless", "too big"]))
        if key == "gen_ai.latency.time_in_model_decode" and kind == "too big":
            kind = "harmless"  # divided by the output tokens: too big or not, depending
        if kind == "harmless":
            value = draw(HARMLESS)
            if key.endswith("decode") and isinstance(value, (int, float)) and value > 1e3:
                value = 1e3
            attrs[key] = value
        elif kind == "too big":
            too_big = True
            attrs[key] = draw(TOO_BIG_COUNT if "usage" in key else TOO_LONG)
    ahead = draw(st.booleans()) and draw(st.booleans())
    if id_kind != "text":
        outcome = "ignored"
    elif too_big or ahead or ttft_kind == "bad":
        outcome = "invalid"
    else:
        outcome = "record" if ttft_kind == "good" else "ignored"
    return attrs, ahead, outcome


def _pb(value) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    return AnyValue(double_value=value)


def _json(value) -> dict:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    return {"doubleValue": value}


def span_body(attrs: dict, start_ns: int, end_ns: int, as_json: bool) -> tuple[bytes, str]:
    if as_json:
        return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{
            "traceId": TRACE, "spanId": "b7ad6b7169203331", "name": "llm_request",
            "startTimeUnixNano": str(start_ns), "endTimeUnixNano": str(end_ns),
            "attributes": [{"key": k, "value": _json(v)} for k, v in attrs.items()]}]}]}]}
        ).encode(), "application/json"
    span = Span(trace_id=bytes.fromhex(TRACE), span_id=bytes.fromhex("b7ad6b7169203331"),
                name="llm_request", start_time_unix_nano=start_ns, end_time_unix_nano=end_ns,
                attributes=[KeyValue(key=k, value=_pb(v)) for k, v in attrs.items()])
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(
        spans=[span])])]).SerializeToString(), "application/x-protobuf"


def test_spans_with_random_attribute_values_become_a_request_or_are_counted():
    """Promise, on every example (one span of a request id never seen before, sent as JSON or
    protobuf): the export is taken (200); a span with a request id, a TTFT in (0, 1e6] s and
    no value past the schema's bounds becomes a request with that TTFT; one whose TTFT was
    sent but is no usable number of seconds (0, negative, NaN, infinite, a bool, text, past
    1e9 s), or with a count past 2**53, a latency past 1e9 s or an end hours ahead, makes no
    request and is counted as an invalid drop; one without a request id or without a TTFT is
    counted as ignored, not invalid. After the fuzz a valid span still becomes a request."""
    serial = itertools.count()
    with served_agent() as (agent, port):
        @settings(max_examples=500, deadline=None, suppress_health_check=HEALTH)
        @given(case=span_case(), as_json=st.booleans(), gzipped=st.booleans())
        def fuzz(case, as_json, gzipped):
            attrs, ahead, outcome = case
            if isinstance(attrs.get(REQUEST_ID), str) and attrs[REQUEST_ID]:
                attrs[REQUEST_ID] = f"f{next(serial)}-{attrs[REQUEST_ID]}"  # never seen before
            now = time.time()
            start_ns = int((now - 10) * 1e9)
            end_ns = int((now + 3 * 3600 if ahead else now - 5) * 1e9)
            body, content_type = span_body(attrs, start_ns, end_ns, as_json)
            headers = {"Content-Type": content_type}
            if gzipped:
                body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
            ignored, (_, _, invalid, _, _) = agent.otlp_receiver.ignored, _counts(agent)
            status, _, answer = send(port, body, headers)
            assert status == 200, (status, answer[:300])
            event(outcome)
            request_id = attrs.get(REQUEST_ID)
            record = (agent.pipeline.requests.get(request_id[:256])
                      if isinstance(request_id, str) and request_id else None)
            invalid_now = _counts(agent)[2] - invalid
            ignored_now = agent.otlp_receiver.ignored - ignored
            if outcome == "record":
                assert record is not None and record.ttft == float(attrs[TTFT])
                assert (invalid_now, ignored_now) == (0, 0)
            elif outcome == "invalid":
                assert record is None and invalid_now == 1
            else:
                assert record is None and (invalid_now, ignored_now) == (0, 1)

        fuzz()
        _still_takes_a_valid_span(agent, port, "after-random-spans")
