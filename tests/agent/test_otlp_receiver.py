"""The OTLP/HTTP receiver at /v1/traces: protobuf and JSON bodies through the real FastAPI app,
bad bodies refused, and vLLM request spans joined with the tap's request records."""

from __future__ import annotations

import gzip
import json
import time
import zlib

import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from kvscope import events as ev
from kvscope.agent.config import AgentSettings
from kvscope.agent.sources.otlp_receiver import OtlpError, Span as ReceivedSpan, parse
from kvscope.catalog import LATENCY_SECONDS_BUCKETS
from kvscope.service.agent import Agent
from kvscope.service.api import create_app

TRACE = "0af7651916cd43dd8448eb211c80319c"
T0 = 1_700_000_000.0  # Unix seconds the spans below start (and end 1 s later)
ATTRS = {"gen_ai.request.id": "cmpl-1-0", "gen_ai.usage.prompt_tokens": 300,
         "gen_ai.usage.completion_tokens": 4, "gen_ai.latency.time_to_first_token": 0.25,
         "gen_ai.latency.time_in_queue": 0.05, "gen_ai.latency.time_in_model_prefill": 0.15}


def _any(value):
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    return AnyValue(double_value=value)


def protobuf_body(attrs=ATTRS, trace=TRACE) -> bytes:
    span = Span(trace_id=bytes.fromhex(trace), span_id=bytes.fromhex("b7ad6b7169203331"),
                name="llm_request", start_time_unix_nano=1_700_000_000_000_000_000,
                end_time_unix_nano=1_700_000_001_000_000_000,
                attributes=[KeyValue(key=k, value=_any(v)) for k, v in attrs.items()])
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        scope_spans=[ScopeSpans(spans=[span])])]).SerializeToString()


def json_body(attrs=ATTRS) -> bytes:
    def value(v):
        if isinstance(v, str):
            return {"stringValue": v}
        if isinstance(v, int):
            return {"intValue": str(v)}
        return {"doubleValue": v}

    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": TRACE.upper(), "spanId": "b7ad6b7169203331", "name": "llm_request",
        "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000001000000000",
        "attributes": [{"key": k, "value": value(v)} for k, v in attrs.items()]}]}]}]}).encode()


def otlp_span(attrs, trace=TRACE):
    """A span as the receiver parses it (no HTTP), ``trace`` as sent."""
    return ReceivedSpan(trace.lower(), "b7ad6b7169203331", "llm_request",
                        1_700_000_000_000_000_000, 1_700_000_001_000_000_000, attrs)


def _agent():
    return Agent(AgentSettings(ingest={"enabled": False}, collectors={"gpu": {"enabled": False}},
                               otlp_receiver={"source": "vllm"}))


def test_spans_received_read_0_before_the_first():
    """A tryout's "are spans arriving?" panel read "no data" until the first span, beside the
    drop reasons exported at 0 from the start."""
    agent = _agent()
    agent.otlp_receiver.start()
    text = agent.exposition.render()[0].decode()
    assert 'kvscope_events_received_total{source="otlp"} 0.0' in text, text


def _spans_arrive(agent):
    """What the receiver's first span does: from then on the source's records wait for theirs
    (without spans nothing waits)."""
    agent.pipeline.join("vllm", agent.otlp_receiver.wait)


def test_protobuf_spans_become_requests_with_vllm_latencies():
    agent = _agent()
    with TestClient(create_app(agent)) as client:
        response = client.post("/v1/traces", content=protobuf_body(),
                               headers={"content-type": "application/x-protobuf"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-protobuf"
    record = agent.pipeline.requests.get("cmpl-1-0")
    assert record.trace_id == TRACE and record.ttft == 0.25 and record.queueing == 0.05
    assert record.prompt_tokens == 300 and record.output_tokens == 4
    # counted once it waited for what may join it (6 s; spans come, so it waits)
    assert agent.pipeline.snapshot().requests == 0
    agent.pipeline.publish_settled(everything=True)
    assert agent.pipeline.snapshot().requests == 1
    # one span received, counted once: the 2 events it became were not sent by the vllm source
    assert agent.pipeline.snapshot().events_received == {"otlp": 1}


def test_a_span_alone_measures_no_promotion_wait_and_no_lookup():
    """vLLM's span has neither: the record says so (None) and the promotion-wait histogram
    has no observation of it. Read as 0, every zero-code request counted a wait of 0 s (p99 0)
    and the "Should I offload here?" tail check read promotions as 0% of TTFT."""
    agent = _agent()
    with TestClient(create_app(agent)) as client:
        client.post("/v1/traces", content=protobuf_body(),
                    headers={"content-type": "application/x-protobuf"})
        agent.pipeline.publish_settled(everything=True)
        (row,) = client.get("/api/v1/requests").json()["requests"]
    record = agent.pipeline.requests.get("cmpl-1-0")
    assert record.promotion_wait is None and record.lookup is None
    assert (row["promotion_wait"], row["lookup"], row["queueing"]) == (None, None, 0.05)
    snap = agent.pipeline.snapshot()
    assert snap.requests == 1 and snap.ttft_seconds.count == 1
    assert snap.promotion_wait_seconds.count == 0


def test_json_and_gzip_bodies_are_accepted():
    agent = _agent()
    with TestClient(create_app(agent)) as client:
        r1 = client.post("/v1/traces", content=json_body(),
                         headers={"content-type": "application/json"})
        body = gzip.compress(json_body({**ATTRS, "gen_ai.request.id": "cmpl-2-0"}))
        r2 = client.post("/v1/traces", content=body, headers={
            "content-type": "application/json", "content-encoding": "gzip"})
    assert r1.status_code == r2.status_code == 200 and r1.json() == {}
    assert agent.pipeline.requests.get("cmpl-1-0").trace_id == TRACE
    assert agent.pipeline.requests.get("cmpl-2-0") is not None


def test_a_gzip_body_of_two_members_gives_both_and_trailing_bytes_are_refused():
    """`cat a.gz b.gz` is one gzip body (RFC 1952, 2.2): its second member's span was dropped
    uncounted, with a 200; protobuf messages one after another merge, so both requests come.
    Bytes after the last member are a 400, as after a deflate body's end."""
    agent = _agent()
    two = gzip.compress(protobuf_body()) + gzip.compress(protobuf_body(
        {**ATTRS, "gen_ai.request.id": "cmpl-2-0"}))
    with TestClient(create_app(agent)) as client:
        headers = {"content-type": "application/x-protobuf", "content-encoding": "gzip"}
        assert client.post("/v1/traces", content=two, headers=headers).status_code == 200
        junk = client.post("/v1/traces", content=gzip.compress(protobuf_body()) + b"JUNK",
                           headers=headers)
        deflated = zlib.compress(protobuf_body()) + b"JUNK"
        after_deflate = client.post("/v1/traces", content=deflated, headers={
            "content-type": "application/x-protobuf", "content-encoding": "deflate"})
    assert agent.pipeline.requests.get("cmpl-1-0") is not None
    assert agent.pipeline.requests.get("cmpl-2-0") is not None
    assert junk.status_code == after_deflate.status_code == 400
    assert "after its end" in after_deflate.text
    # zero padding after the end is no junk (gzip.decompress allows it); members are bounded,
    # as each copies the rest of the body (52,428 empty ones took 0.4 s of CPU)
    assert len(parse(gzip.compress(protobuf_body()) + b"\0" * 8, "application/x-protobuf",
                     "gzip")) == 1
    with pytest.raises(OtlpError, match="4 bytes after its end"):  # no padding for deflate
        parse(zlib.compress(protobuf_body()) + b"\0" * 4, "application/x-protobuf", "deflate")
    with pytest.raises(OtlpError, match="more than 64 members"):
        parse(gzip.compress(b"") * 65, "application/x-protobuf", "gzip")


def test_json_nulls_are_defaults_as_in_the_proto3_json_mapping():
    """"attributes": null (and null lists, ids and names) once refused the whole export with
    a 400; the proto3 JSON mapping reads null as the field's default, as if absent."""
    doc = json.loads(json_body())
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    doc["resourceSpans"].append({"scopeSpans": None})
    doc["resourceSpans"][0]["scopeSpans"].append({"spans": [
        {**span, "attributes": None, "name": None, "spanId": None}]})
    spans = parse(json.dumps(doc).encode(), "application/json")
    assert len(spans) == 2 and spans[1].attributes == {} and spans[1].name == ""
    span["attributes"].append({"key": "x", "value": {"intValue": None}})  # a null value too
    assert parse(json.dumps(doc).encode(), "application/json")[0].attributes["x"] is None


def test_bad_bodies_are_refused_counted_and_spans_without_request_ids_ignored(caplog):
    """Four bodies refused (two 400s, two 415s) count 4 dropped as malformed, each reason
    logged once; a span without a request id is ignored, not dropped. A protobuf export's
    error answer is protobuf too (it was JSON)."""
    from google.rpc.status_pb2 import Status

    agent = _agent()
    with TestClient(create_app(agent)) as client:
        refused = client.post("/v1/traces", content=b"\xff\x00garbage",
                              headers={"content-type": "application/x-protobuf"})
        # a protobuf export's error is a google.rpc.Status (OTLP/HTTP), not JSON
        assert refused.status_code == 400
        assert refused.headers["content-type"] == "application/x-protobuf"
        status = Status.FromString(refused.content)
        assert status.code == 3 and status.message, status
        assert client.post("/v1/traces", content=b"{",
                           headers={"content-type": "application/json"}).status_code == 400
        assert client.post("/v1/traces", content=b"x",
                           headers={"content-type": "text/plain"}).status_code == 415
        assert client.post("/v1/traces", content=b"x", headers={
            "content-type": "application/json", "content-encoding": "br"}).status_code == 415
        ok = client.post("/v1/traces", content=protobuf_body({"other": "span"}),
                         headers={"content-type": "application/x-protobuf"})
    assert ok.status_code == 200
    assert agent.otlp_receiver.ignored == 1 and len(agent.pipeline.requests) == 0
    assert {k: n for k, n in agent.pipeline.snapshot().events_dropped.items() if n} == {
        ("otlp", "malformed"): 4}
    assert caplog.text.count("refused an export (malformed)") == 1


def test_an_export_with_rejected_spans_says_how_many_in_its_partial_success():
    """OTLP's partial success ("OTLP/HTTP Response"): an export of three spans, one whose TTFT
    is no number of seconds for a request nobody else finished and one whose end is unset, is
    answered 200 with rejected_spans 2 and the first reason (protobuf: the
    ExportTraceServiceResponse; JSON: its proto3 JSON mapping, an int64 as a string); a
    clean export with the empty response. The same two count as dropped, invalid."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import \
        ExportTraceServiceResponse

    agent = _agent()
    with TestClient(create_app(agent)) as client:
        spans = [protobuf_body(a) for a in (
            {**ATTRS, "gen_ai.request.id": "ok-1"},
            {**ATTRS, "gen_ai.request.id": "bad-1", "gen_ai.latency.time_to_first_token": "x"})]
        request = ExportTraceServiceRequest()
        for one in spans:
            request.MergeFromString(one)
        unset = request.resource_spans.add().scope_spans.add().spans.add()
        unset.CopyFrom(request.resource_spans[0].scope_spans[0].spans[0])
        unset.attributes[0].value.string_value = "bad-2"
        unset.end_time_unix_nano = 0
        answer = client.post("/v1/traces", content=request.SerializeToString(),
                             headers={"content-type": "application/x-protobuf"})
        assert answer.status_code == 200
        partial = ExportTraceServiceResponse.FromString(answer.content).partial_success
        assert partial.rejected_spans == 2
        assert partial.error_message.startswith("the span of request 'bad-1': ")
        doc = json.loads(json_body({**ATTRS, "gen_ai.request.id": "bad-3",
                                    "gen_ai.latency.time_to_first_token": "x"}))
        answer = client.post("/v1/traces", content=json.dumps(doc).encode(),
                             headers={"content-type": "application/json"})
        assert answer.status_code == 200 and answer.json()["partialSuccess"]["rejectedSpans"] \
            == "1", answer.json()
        clean = client.post("/v1/traces", content=json_body(),
                            headers={"content-type": "application/json"})
        assert clean.status_code == 200 and clean.json() == {}
    assert agent.pipeline.snapshot().events_dropped[("otlp", "invalid")] == 3


def test_a_json_export_of_the_wrong_shape_is_refused_in_words_not_python():
    """A 400 whose detail says what OTLP/JSON expects, not Python's "'list' object has no
    attribute 'get'"."""
    for doc in ({"resourceSpans": [[]]}, {"resourceSpans": ["x"]},
                {"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": "soon"}]}]}]}):
        with pytest.raises(OtlpError) as refused:
            parse(json.dumps(doc).encode(), "application/json")
        assert "a field of the wrong type (expected resourceSpans[]" in str(refused.value)
    with pytest.raises(OtlpError, match="^not JSON: "):
        parse(b"{", "application/json")


def test_a_span_for_a_request_the_tap_finished_enriches_that_record():
    """The tap reported the request (lookup with CPU tokens, promotion wait); the later span
    gives it vLLM's trace id and TTFT instead of creating a second request. The store and the
    OTLP exporter get the record only after it waited for its span, so they get it joined."""
    agent = _agent()
    stored = []
    agent.pipeline.subscribe(stored.append)
    agent.otlp_receiver.start()
    _spans_arrive(agent)
    agent.pipeline.ingest("vllm", [
        ev.RequestStarted(ts=T0, request_id="cmpl-1-0", prompt_tokens=300),
        ev.Lookup(ts=T0 + 0.1, request_id="cmpl-1-0", tokens={"cpu": 256, "recompute": 44}),
        ev.RequestFinished(ts=T0 + 0.4, request_id="cmpl-1-0", ttft=0.3, prompt_tokens=300,
                           promotion_wait=0.02)])
    with TestClient(create_app(agent)) as client:
        client.post("/v1/traces", content=protobuf_body(),
                    headers={"content-type": "application/x-protobuf"})
    assert stored == []  # still waiting (6 s) when the span came
    agent.pipeline.publish_settled(everything=True)
    record = agent.pipeline.requests.get("cmpl-1-0")
    assert stored == [record]
    assert record.trace_id == TRACE and record.ttft == 0.25
    assert record.tokens == {"cpu": 256, "recompute": 44} and record.promotion_wait == 0.02
    assert agent.pipeline.snapshot().requests == 1 and agent.otlp_receiver.joined == 1
    # the histogram counts the request once it waited, as joined: vLLM's 0.25 s, not the 0.3
    # the tap reported first
    assert agent.pipeline.snapshot().ttft_seconds.sum == 0.25


@pytest.mark.parametrize("span_first", [False, True])
def test_a_span_without_queue_or_prefill_times_keeps_the_taps(span_first):
    """vLLM's span without ``time_in_queue`` and ``time_in_model_prefill`` (0: unknown) joins
    the tap's record (queueing 0.02 s, promotion wait 0.03 s, prefill 0.1 s): its TTFT, 0.21
    s, is taken, and the tap's parts stand, whichever came first. Span after the tap, they
    read 0 and 0 (a review), and the waterfall lost its queue and prefill."""
    agent = _agent()
    agent.otlp_receiver.start()
    _spans_arrive(agent)
    tap = [ev.RequestStarted(ts=T0, request_id="cmpl-1-0", prompt_tokens=300),
           ev.RequestFinished(ts=T0 + 0.4, request_id="cmpl-1-0", ttft=0.2, prompt_tokens=300,
                              queueing=0.02, promotion_wait=0.03, prefill=0.1)]
    if not span_first:
        agent.pipeline.ingest("vllm", tap)
    agent.otlp_receiver.handle([_span("cmpl-1-0", T0, ttft=0.21)])
    if span_first:
        agent.pipeline.ingest("vllm", tap)
    agent.pipeline.publish_settled(everything=True)
    record = agent.pipeline.requests.get("cmpl-1-0")
    assert (record.ttft, record.queueing, record.promotion_wait, record.prefill) == \
        (0.21, 0.02, 0.03, 0.1)
    assert agent.pipeline.snapshot().requests == 1


def test_a_span_for_a_request_whose_finish_the_tap_lost_still_counts_it():
    """The tap's finish never came (its emitter dropped it): the span finishes the open
    record, which counts once it waited."""
    agent = _agent()
    agent.otlp_receiver.start()
    agent.pipeline.ingest("vllm", [
        ev.RequestStarted(ts=T0, request_id="cmpl-1-0", prompt_tokens=300),
        ev.Lookup(ts=T0 + 0.1, request_id="cmpl-1-0", tokens={"cpu": 256, "recompute": 44})])
    agent.otlp_receiver.handle([otlp_span(ATTRS)])
    agent.pipeline.publish_settled(everything=True)
    record = agent.pipeline.requests.get("cmpl-1-0")
    assert record.ttft == 0.25 and record.tokens == {"cpu": 256, "recompute": 44}
    assert agent.pipeline.snapshot().requests == 1


def test_a_span_joins_a_request_restored_after_a_restart(tmp_path):
    """The agent restarted between the tap's finish and vLLM's span (5 s later): the span
    joins the restored record (found in the table) instead of making a second request that
    replaces it without the tap's tokens and transfers."""
    settings = AgentSettings(ingest={"enabled": False}, collectors={"gpu": {"enabled": False}},
                             otlp_receiver={"source": "vllm"}, store_dir=str(tmp_path))
    agent = Agent(settings)
    agent.start()
    now = time.time()  # the store restores what finished within a day
    agent.pipeline.ingest("vllm", [
        ev.RequestStarted(ts=now, request_id="cmpl-1-0", prompt_tokens=300),
        ev.Lookup(ts=now, request_id="cmpl-1-0", tokens={"cpu": 256, "recompute": 44}),
        ev.RequestFinished(ts=now + 0.4, request_id="cmpl-1-0", ttft=0.3, prompt_tokens=300)])
    agent.shutdown()
    restarted = Agent(settings)
    restarted.start()
    try:
        restarted.otlp_receiver.handle([_span("cmpl-1-0", now)])
        record = restarted.pipeline.requests.get("cmpl-1-0")
        assert record.tokens == {"cpu": 256, "recompute": 44} and record.ttft == 0.25
        assert record.trace_id == TRACE and restarted.otlp_receiver.joined == 1
        assert restarted.pipeline.snapshot().requests == 0  # counted before the restart
    finally:
        restarted.shutdown()


def test_a_json_request_id_that_is_not_text_is_an_invalid_span():
    """JSON may carry a lone surrogate ("\\ud800"), which no sink can write: the store lost
    its flush, the capture every pending row, and /api/v1/requests answered 500. That span is
    invalid (1); the other span of the body makes its request, and the API answers."""
    agent = _agent()
    with TestClient(create_app(agent)) as client:
        body = json.loads(json_body())
        spans = body["resourceSpans"][0]["scopeSpans"][0]["spans"]
        bad = json.loads(json.dumps(spans[0]))
        bad["attributes"][0]["value"]["stringValue"] = "bad-\ud800"
        spans.append(bad)
        response = client.post("/v1/traces", content=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
        assert response.status_code == 200
        assert client.get("/api/v1/requests").json()["total"] == 1
    assert agent.pipeline.snapshot().events_dropped[("otlp", "invalid")] == 1


def _span(request_id, start, ttft=0.25, trace=TRACE):
    """vLLM's span of a request that arrived at ``start`` (Unix seconds) and ended 1 s later."""
    return ReceivedSpan(trace, "b7ad6b7169203331", "llm_request", int(start * 1e9),
                        int((start + 1) * 1e9), {"gen_ai.request.id": request_id,
                                                 "gen_ai.latency.time_to_first_token": ttft})


def test_without_spans_the_taps_requests_wait_for_none():
    """The receiver is on by default; with no span ever received (vLLM without
    --otlp-traces-endpoint) the tap's requests count and reach the sinks at once, not 6 s
    later."""
    agent = _agent()
    stored = []
    agent.pipeline.subscribe(stored.append)
    agent.otlp_receiver.start()
    agent.pipeline.ingest("vllm", [
        ev.RequestStarted(ts=T0, request_id="cmpl-1-0", prompt_tokens=300),
        ev.RequestFinished(ts=T0 + 0.4, request_id="cmpl-1-0", ttft=0.3, prompt_tokens=300)])
    assert agent.pipeline.snapshot().requests == 1 and len(stored) == 1


def test_spans_of_a_reused_request_id_are_two_requests():
    """Spans only (no tap): two requests of one client id, 60 s apart, are 2 requests, each
    with its own TTFT; the second span once amended the first's record (1 request)."""
    agent = _agent()
    agent.otlp_receiver.handle([_span("cmpl-1-0", T0, ttft=0.25)])
    agent.otlp_receiver.handle([_span("cmpl-1-0", T0 + 60, ttft=2.0, trace="1" * 32)])
    agent.pipeline.publish_settled(everything=True)
    snap = agent.pipeline.snapshot()
    assert snap.requests == 2 and snap.ttft_seconds.sum == 2.25


@pytest.mark.parametrize("order", ["AB", "BA"])
def test_spans_of_two_finished_requests_of_one_id_join_their_own(order):
    """The tap finished A (arrived T0) and B (arrived T0 + 10), both id x, before vLLM's
    spans came (two short requests in one 5 s batch; two API servers send in either order).
    A span names its request by its start, vLLM's arrival time (the tap's start too): each
    span amends its own record (an earlier span once amended the newer record)."""
    agent = _agent()
    handed_over = []  # what the OTLP exporter and the capture get (the table keeps B alone)
    agent.pipeline.subscribe(handed_over.append)
    _spans_arrive(agent)
    for start, ttft in ((T0, 0.3), (T0 + 10, 0.7)):
        agent.pipeline.ingest("vllm", [
            ev.RequestStarted(ts=start, request_id="x", prompt_tokens=10),
            ev.RequestFinished(ts=start + 1, request_id="x", ttft=ttft, prompt_tokens=10)])
    spans = {"A": _span("x", T0, ttft=0.25, trace="a" * 32),
             "B": _span("x", T0 + 10, ttft=0.65, trace="b" * 32)}
    agent.otlp_receiver.handle([spans[name] for name in order])
    agent.pipeline.publish_settled(everything=True)
    assert agent.otlp_receiver.joined == 2 and agent.pipeline.snapshot().requests == 2
    assert [(r.arrival, r.trace_id, r.ttft) for r in handed_over] == [
        (T0, "a" * 32, 0.25), (T0 + 10, "b" * 32, 0.65)]


@pytest.mark.parametrize("spans_first", [False, True], ids=["tap first", "spans first"])
def test_the_spans_of_a_requests_parallel_samples_join_the_taps_samples(spans_first):
    """A request asking for n = 3 samples (a tryout's curl with "n": 3): vLLM's scheduler, and
    so the tap, runs and names each sample <i>_<id>, while vLLM sends a span for each named
    after the request, with gen_ai.request.n 3 and no word of which sample it is. The spans
    made a fourth request of that id (requests_total 4 for 3, vLLM's TTFT counted on top);
    they now give the three samples their trace id, and each keeps the TTFT the tap measured,
    also when the spans come while the samples are in flight (vLLM's span batch sent before
    the tap's next one: it then made the fourth request still). Without the tap's samples
    (spans alone) the spans still make a request."""
    agent = _agent()
    _spans_arrive(agent)
    for i in range(3):
        agent.pipeline.ingest("vllm", [
            ev.RequestStarted(ts=T0, request_id=f"{i}_cmpl-9-0", prompt_tokens=10)])

    def finish_samples():
        for i, ttft in enumerate((0.3, 0.31, 0.32)):
            agent.pipeline.ingest("vllm", [
                ev.RequestFinished(ts=T0 + 0.5, request_id=f"{i}_cmpl-9-0", ttft=ttft,
                                   prompt_tokens=10)])
    if not spans_first:
        finish_samples()
    spans = [ReceivedSpan(TRACE, "b7ad6b7169203331", "llm_request", int(T0 * 1e9),
                          int((T0 + 1) * 1e9), {"gen_ai.request.id": request_id,
                                                "gen_ai.request.n": 3,
                                                "gen_ai.latency.time_to_first_token": 0.2})
             for request_id in ("cmpl-9-0",) * 3 + ("cmpl-8-0",)]
    agent.otlp_receiver.handle(spans)
    if spans_first:
        finish_samples()
    agent.pipeline.publish_settled(everything=True)
    snap = agent.pipeline.snapshot()
    assert snap.requests == 4 and agent.otlp_receiver.joined == 3  # the three samples, cmpl-8-0
    assert snap.ttft_seconds.sum == pytest.approx(0.3 + 0.31 + 0.32 + 0.2)
    samples = [agent.pipeline.requests.get(f"{i}_cmpl-9-0") for i in range(3)]
    assert [(r.trace_id, r.ttft) for r in samples] == [(TRACE, 0.3), (TRACE, 0.31),
                                                       (TRACE, 0.32)]
    assert agent.pipeline.requests.get("cmpl-9-0") is None
    assert agent.pipeline.requests.get("cmpl-8-0").ttft == 0.2  # spans alone: a request


def test_a_span_claiming_countless_samples_looks_for_a_bounded_number(monkeypatch):
    """gen_ai.request.n is the client's number: a span claiming 10**6 samples (10**15 held
    the pipeline's lock for good, and with it ingest and /metrics) looks for the first
    MAX_SAMPLES (1024) <i>_<id> records only, and still joins the samples the tap ran."""
    from kvscope.agent.pipeline import MAX_SAMPLES

    agent = _agent()
    _spans_arrive(agent)
    for i in range(2):
        agent.pipeline.ingest("vllm", [
            ev.RequestStarted(ts=T0, request_id=f"{i}_many", prompt_tokens=10),
            ev.RequestFinished(ts=T0 + 0.5, request_id=f"{i}_many", ttft=0.3, prompt_tokens=10)])
    looked_for = []
    finished_as = agent.pipeline._finished_as
    monkeypatch.setattr(agent.pipeline, "_finished_as",
                        lambda source, rid, *times: looked_for.append(rid)
                        or finished_as(source, rid, *times))
    span = _span("many", T0 - 0.1)
    span.attributes["gen_ai.request.n"] = 10**6
    agent.otlp_receiver.handle([span])
    assert len(looked_for) == 1 + MAX_SAMPLES  # the request's own id, then its samples'
    assert agent.otlp_receiver.joined == 1
    assert [agent.pipeline.requests.get(f"{i}_many").trace_id for i in range(2)] == [TRACE] * 2


def test_five_requests_of_one_id_in_one_span_batch_join_their_own():
    """A client reusing one id (a fixed X-Request-Id) sent 5 requests, 0.8 s apart, within one
    of vLLM's 5 s span batches: each span joins its own tap record, 5 requests. With 4 records
    kept per id, the oldest span made a new request, which pushed out the next record, and so
    on: all 5 counted twice."""
    agent = _agent()
    _spans_arrive(agent)
    starts = [T0 + 0.8 * i for i in range(5)]
    for start in starts:
        agent.pipeline.ingest("vllm", [
            ev.RequestStarted(ts=start, request_id="x", prompt_tokens=10),
            ev.RequestFinished(ts=start + 0.5, request_id="x", ttft=0.1, prompt_tokens=10)])
    agent.otlp_receiver.handle([_span("x", start) for start in starts])
    agent.pipeline.publish_settled(everything=True)
    assert agent.otlp_receiver.joined == 5 and agent.pipeline.snapshot().requests == 5


@pytest.mark.parametrize("together", [False, True], ids=["A started before", "one batch"])
def test_a_request_reusing_an_id_back_to_back_in_one_batch_stays_apart(together):
    """A client reusing id x sends B as A finishes: one tap batch (250 ms) holds A's finish,
    then B's start (10 ms later; with A's start too, or A started in an earlier batch). Folded
    kind by kind, B's start landed on A's open record (A took B's arrival, 0.5 s after its
    finish) and A's and B's spans found no record: 4 requests. Now: 2, each with its span."""
    agent = _agent()
    handed_over = []  # the table keeps the newest record of an id alone
    agent.pipeline.subscribe(handed_over.append)
    _spans_arrive(agent)
    a_start = ev.RequestStarted(ts=T0, request_id="x", prompt_tokens=10)
    if not together:
        agent.pipeline.ingest("vllm", [a_start])
    agent.pipeline.ingest("vllm", [a_start] * together + [
        ev.RequestFinished(ts=T0 + 0.5, request_id="x", ttft=0.1, prompt_tokens=10),
        ev.RequestStarted(ts=T0 + 0.51, request_id="x", prompt_tokens=99),
        ev.Lookup(ts=T0 + 0.52, request_id="x", tokens={"cpu": 99})])
    agent.pipeline.ingest("vllm", [
        ev.RequestFinished(ts=T0 + 1.01, request_id="x", ttft=0.1, prompt_tokens=99)])
    agent.otlp_receiver.handle([_span("x", T0, trace="a" * 32),
                                _span("x", T0 + 0.51, trace="b" * 32)])
    agent.pipeline.publish_settled(everything=True)
    assert agent.otlp_receiver.joined == 2 and agent.pipeline.snapshot().requests == 2
    a, b = sorted(handed_over, key=lambda r: r.arrival)
    assert (a.arrival, a.prompt_tokens, a.tokens, a.trace_id) == (T0, 10, {}, "a" * 32)
    assert (b.arrival, b.prompt_tokens, b.tokens, b.trace_id) == (T0 + 0.51, 99, {"cpu": 99},
                                                                  "b" * 32)


def test_a_back_to_back_reuse_after_the_span_finished_the_first_stays_apart():
    """As above, but vLLM's span of A finished A before the tap's batch [A's finish, B's
    start] came: A was no longer in flight, so the batch went unsplit, and A's finish took B's
    new record (4 requests for 2). A's record also keeps the tap's prompt tokens, which the
    span's start (a span without usage counts) once set to 0."""
    agent = _agent()
    handed_over = []
    agent.pipeline.subscribe(handed_over.append)
    _spans_arrive(agent)
    agent.pipeline.ingest("vllm", [ev.RequestStarted(ts=T0, request_id="x", prompt_tokens=10)])
    agent.otlp_receiver.handle([_span("x", T0, trace="a" * 32)])
    agent.pipeline.ingest("vllm", [
        ev.RequestFinished(ts=T0 + 1.0, request_id="x", ttft=0.1, prompt_tokens=10,
                           promotion_wait=0.02),
        ev.RequestStarted(ts=T0 + 1.01, request_id="x", prompt_tokens=99)])
    agent.pipeline.ingest("vllm", [
        ev.RequestFinished(ts=T0 + 2.0, request_id="x", ttft=0.1, prompt_tokens=99)])
    agent.otlp_receiver.handle([_span("x", T0 + 1.01, trace="b" * 32)])
    agent.pipeline.publish_settled(everything=True)
    assert agent.pipeline.snapshot().requests == 2
    a, b = sorted(handed_over, key=lambda r: r.arrival)
    assert (a.prompt_tokens, a.promotion_wait, a.trace_id) == (10, 0.02, "a" * 32)
    assert (b.arrival, b.prompt_tokens, b.finished, b.trace_id) == (T0 + 1.01, 99, T0 + 2.0,
                                                                    "b" * 32)


@pytest.mark.parametrize("order", ["AB", "BA"])
def test_spans_only_two_requests_of_one_id_in_one_body_stay_apart(order):
    """No tap: one body carries two requests of id x (A at T0, B at T0 + 10), in either order
    (API servers send on their own timers): 2 requests, each with its own trace and arrival
    (B's start once merged into A's record, and B's span, sent first, absorbed A's)."""
    agent = _agent()
    handed_over = []
    agent.pipeline.subscribe(handed_over.append)
    spans = {"A": _span("x", T0, ttft=0.25, trace="a" * 32),
             "B": _span("x", T0 + 10, ttft=0.65, trace="b" * 32)}
    agent.otlp_receiver.handle([spans[name] for name in order])
    agent.pipeline.publish_settled(everything=True)
    assert agent.pipeline.snapshot().requests == 2
    assert sorted((r.arrival, r.trace_id, r.ttft) for r in handed_over) == [
        (T0, "a" * 32, 0.25), (T0 + 10, "b" * 32, 0.65)]


@pytest.mark.parametrize("lookup", [False, True], ids=["finish alone", "lookup first"])
def test_a_span_joins_a_request_whose_start_the_tap_lost(lookup):
    """The tap's start went missing (the agent restarted mid-request, or the emitter dropped
    it): the record's arrival came from its finish (less the TTFT: 0.3 s later than the true
    arrival T0 + 1 s of decode) or from its lookup (0.05 s late), and vLLM's span, which starts
    at the true arrival, made a second request. The finish gives the arrival back exactly:
    T0 + 1.3 - 10 x 0.1 (ITL between 11 tokens) - 0.3 = T0, so the span joins: 1 request."""
    agent = _agent()
    _spans_arrive(agent)
    events = [ev.Lookup(ts=T0 + 0.05, request_id="x", tokens={"gpu": 16})] if lookup else []
    agent.pipeline.ingest("vllm", events + [ev.RequestFinished(
        ts=T0 + 1.3, request_id="x", ttft=0.3, prompt_tokens=16, output_tokens=11, itl=0.1)])
    assert abs(agent.pipeline.requests.get("x").arrival - T0) < 1e-6
    agent.otlp_receiver.handle([_span("x", T0)])
    agent.pipeline.publish_settled(everything=True)
    assert agent.pipeline.snapshot().requests == 1 and agent.otlp_receiver.joined == 1


def test_the_span_of_an_open_request_reusing_an_id_finishes_it_not_the_old_one():
    """Request A (id X) finished; request B, the same id 60 s later, is open in the tap when
    its span comes: the span finishes B (the tap's finish lost), not A: 2 requests, A's TTFT
    unchanged."""
    agent = _agent()
    _spans_arrive(agent)
    agent.pipeline.ingest("vllm", [
        ev.RequestStarted(ts=T0, request_id="x", prompt_tokens=10),
        ev.RequestFinished(ts=T0 + 0.4, request_id="x", ttft=0.3, prompt_tokens=10)])
    first = agent.pipeline.requests.get("x")
    agent.pipeline.ingest("vllm", [ev.RequestStarted(ts=T0 + 60, request_id="x", prompt_tokens=10)])
    agent.otlp_receiver.handle([_span("x", T0 + 60, ttft=2.0)])
    agent.pipeline.publish_settled(everything=True)
    assert agent.pipeline.snapshot().requests == 2 and first.ttft == 0.3
    assert agent.pipeline.requests.get("x").ttft == 2.0


def test_a_reused_id_finishing_twice_in_one_batch_is_two_requests():
    """A joined source's batch finishes request X, then a later request of the same id (it
    arrived after the first finished): 2 requests, not a second finish of the first."""
    agent = _agent()
    _spans_arrive(agent)
    agent.pipeline.ingest("vllm", [
        ev.RequestFinished(ts=T0 + 0.4, request_id="x", ttft=0.3, prompt_tokens=10),
        ev.RequestFinished(ts=T0 + 61, request_id="x", ttft=0.5, prompt_tokens=20)])
    agent.pipeline.publish_settled(everything=True)
    assert agent.pipeline.snapshot().requests == 2


def test_a_span_for_an_open_request_moves_its_transfer_exemplar_and_keeps_the_parts_in_ttft():
    """The tap has the request open with a load (exemplar: the made-up trace); the span
    finishes it with vLLM's trace, which the transfer's exemplar then names. The tap's finish
    adds its promotion wait (0.1 s): queueing 0.05 + wait 0.1 + prefill stays within the
    span's TTFT of 0.25 (prefill cut from 0.15 to 0.1; it added up to 0.3)."""
    agent = _agent()
    _spans_arrive(agent)
    agent.pipeline.ingest("vllm", [
        ev.RequestStarted(ts=T0, request_id="cmpl-1-0", prompt_tokens=300),
        ev.Transfer(ts=T0, src="cpu", dst="gpu", blocks=1, bytes=1, duration=0.002,
                    request_id="cmpl-1-0")])
    agent.otlp_receiver.handle([otlp_span(ATTRS)])
    snap = agent.pipeline.snapshot()
    assert [e[0] for e in snap.transfer_seconds[("cpu", "gpu")].exemplars.values()] == [TRACE]
    agent.pipeline.ingest("vllm", [
        ev.RequestFinished(ts=T0 + 0.4, request_id="cmpl-1-0", ttft=0.3, prompt_tokens=300,
                           promotion_wait=0.1)])
    record = agent.pipeline.requests.get("cmpl-1-0")
    assert (record.ttft, record.queueing, record.promotion_wait) == (0.25, 0.05, 0.1)
    assert abs(record.prefill - 0.1) < 1e-12


def _storing_agent(tmp_path):
    """(settings, started agent) storing in ``tmp_path``, spans arriving, a wait of 0 s."""
    settings = AgentSettings(ingest={"enabled": False}, collectors={"gpu": {"enabled": False}},
                             otlp_receiver={"source": "vllm", "wait_seconds": 0},
                             store_dir=str(tmp_path))
    agent = Agent(settings)
    agent.start()
    _spans_arrive(agent)
    return settings, agent


def _restored(settings, request_id):
    """The record of ``request_id`` an agent restarted with ``settings`` serves."""
    restarted = Agent(settings)
    restarted.start()
    try:
        return restarted.pipeline.requests.get(request_id)
    finally:
        restarted.shutdown()


def test_a_span_after_the_wait_is_stored_again(tmp_path):
    """The record had waited and been stored with the tap's TTFT (0.3) and a made-up trace;
    vLLM's span comes later: the record is amended and stored again, so a restarted agent
    serves vLLM's TTFT (0.25) and trace, not the first version."""
    settings, agent = _storing_agent(tmp_path)  # with a wait of 0: handed over at once
    now = time.time()
    agent.pipeline.ingest("vllm", [
        ev.RequestStarted(ts=now, request_id="cmpl-1-0", prompt_tokens=300),
        ev.RequestFinished(ts=now + 0.4, request_id="cmpl-1-0", ttft=0.3, prompt_tokens=300)])
    agent.store.flush()  # the first version is on disk
    agent.otlp_receiver.handle([_span("cmpl-1-0", now)])
    agent.shutdown()
    record = _restored(settings, "cmpl-1-0")
    assert record.ttft == 0.25 and record.trace_id == TRACE


@pytest.mark.parametrize("late", ["finish", "transfer"])
def test_the_taps_events_after_the_wait_are_stored_again(tmp_path, late):
    """vLLM's span finished the request and, the wait over (0 s here), it was stored with no
    promotion wait and no transfer; the tap's finish (promotion wait 0.02 s) or the worker's
    load of 4 blocks comes later: the record is amended and stored again, so a restarted agent
    serves them (it once served the first version)."""
    settings, agent = _storing_agent(tmp_path)
    now = time.time()
    agent.otlp_receiver.handle([_span("cmpl-1-0", now)])
    agent.pipeline.publish_settled()
    agent.store.flush()  # the span's version is on disk
    agent.pipeline.ingest("vllm", [
        ev.RequestFinished(ts=now + 1, request_id="cmpl-1-0", ttft=0.3, prompt_tokens=300,
                           promotion_wait=0.02)
        if late == "finish" else
        ev.Transfer(ts=now + 0.1, src="cpu", dst="gpu", blocks=4, bytes=4096, duration=0.01,
                    request_id="cmpl-1-0")])
    agent.shutdown()
    record = _restored(settings, "cmpl-1-0")
    assert record.ttft == 0.25 and record.trace_id == TRACE
    if late == "finish":
        assert record.promotion_wait == 0.02
    else:
        assert [t.blocks for t in record.transfers] == [4]


def test_a_sample_counts_the_requests_that_settled_just_before_it():
    """The sampler hands over settled records, then samples: the sample counts them (it once
    sampled first, one interval behind the summary)."""
    agent = _agent()
    agent.pipeline.join("vllm", 0.05)
    agent.pipeline.ingest("vllm", [
        ev.RequestFinished(ts=T0 + 0.4, request_id="cmpl-1-0", ttft=0.3, prompt_tokens=300)])
    time.sleep(0.1)  # its wait is over; nothing has handed it over yet
    agent.sample()
    assert agent.pipeline.samples()[-1]["requests"] == 1


def test_a_span_joins_only_the_records_of_the_receivers_source():
    """Another engine ("load") finished a request of the same id: the span leaves that record
    alone and makes the vllm source's own request."""
    agent = _agent()
    agent.pipeline.ingest("load", [ev.RequestFinished(ts=T0 + 0.4, request_id="cmpl-1-0",
                                                      ttft=0.3, prompt_tokens=10)])
    with TestClient(create_app(agent)) as client:
        client.post("/v1/traces", content=protobuf_body(),
                    headers={"content-type": "application/x-protobuf"})
    other = agent.pipeline.requests.get("cmpl-1-0", "load")
    assert other.trace_id != TRACE and other.ttft == 0.3
    assert agent.pipeline.requests.get("cmpl-1-0", "vllm").trace_id == TRACE
    assert agent.otlp_receiver.joined == 0


@pytest.mark.parametrize("span_first", [False, True], ids=["tap-first", "span-first"])
@pytest.mark.parametrize("tap_queueing,queueing", [(0.065, 0.065), (0.085, 0.085)],
                         ids=["async-load", "sync-load"])
def test_vllms_queue_time_loses_the_promotion_wait_it_holds(span_first, tap_queueing,
                                                            queueing):
    """vLLM counts a request as scheduled once its KV is in place (it records SCHEDULED only
    after a WAITING_FOR_REMOTE_KVS request's load): an asynchronous load's wait falls in its
    queue time, a synchronous one's in its prefill. vLLM's span says 0.085 s queued; the tap
    measured a 0.02 s promotion wait and its own queue time to the load's start. At 0.065 s
    the span's queue held the wait (0.085 - 0.02): the record says 0.065 (the waterfall drew
    the load inside the queue, and the wait again after it); at 0.085 it held none, and stays.
    Either order of the two reports gives the same record."""
    agent = _agent()
    tap_finish = ev.RequestFinished(ts=T0 + 0.4, request_id="cmpl-1-0", ttft=0.3,
                                    prompt_tokens=300, queueing=tap_queueing,
                                    promotion_wait=0.02)
    span = otlp_span({**ATTRS, "gen_ai.latency.time_in_queue": 0.085,
                      "gen_ai.latency.time_in_model_prefill": 0.1})
    agent.pipeline.ingest("vllm", [ev.RequestStarted(ts=T0, request_id="cmpl-1-0",
                                                     prompt_tokens=300)])
    if span_first:
        agent.otlp_receiver.handle([span])
        agent.pipeline.ingest("vllm", [tap_finish])
    else:
        agent.pipeline.ingest("vllm", [tap_finish])
        agent.otlp_receiver.handle([span])
    record = agent.pipeline.requests.get("cmpl-1-0")
    assert (record.ttft, record.promotion_wait, record.prefill) == (0.25, 0.02, 0.1)
    assert record.queueing == pytest.approx(queueing, abs=1e-12)


def test_a_span_that_comes_before_the_taps_finish_still_makes_one_request():
    """vLLM sent the span while the tap still had the request open: the span finishes the
    record (vLLM's trace id and TTFT), and the tap's finish, arriving second, completes it
    with the promotion wait: one request, not two, and the histograms observe what the record
    says (the promotion wait once observed the span's 0 s, in the first bucket, <= 1 ms)."""
    agent = _agent()
    agent.otlp_receiver.start()
    agent.pipeline.ingest("vllm", [
        ev.RequestStarted(ts=T0, request_id="cmpl-1-0", prompt_tokens=300),
        ev.Lookup(ts=T0 + 0.1, request_id="cmpl-1-0", tokens={"cpu": 256, "recompute": 44})])
    with TestClient(create_app(agent)) as client:
        client.post("/v1/traces", content=protobuf_body(),
                    headers={"content-type": "application/x-protobuf"})
    agent.pipeline.ingest("vllm", [
        ev.RequestFinished(ts=T0 + 0.4, request_id="cmpl-1-0", ttft=0.3, prompt_tokens=300,
                           queueing=0.05, promotion_wait=0.02)])
    record = agent.pipeline.requests.get("cmpl-1-0")
    assert record.trace_id == TRACE and record.ttft == 0.25 and record.promotion_wait == 0.02
    assert record.tokens == {"cpu": 256, "recompute": 44}
    # prefill 0.15 from the span, within TTFT 0.25 - queueing 0.05 - promotion wait 0.02
    assert record.queueing == 0.05 and record.prefill == 0.15
    assert agent.pipeline.snapshot().requests == 0  # counted once joined, after the wait (6 s)
    agent.pipeline.publish_settled(everything=True)
    snap = agent.pipeline.snapshot()
    assert snap.requests == 1 and len(agent.pipeline.requests) == 1
    assert snap.promotion_wait_seconds.sum == 0.02 and snap.ttft_seconds.sum == 0.25
    assert snap.ttft_seconds.exemplars[LATENCY_SECONDS_BUCKETS.index(0.25)][0] == TRACE


def test_a_span_before_any_of_the_taps_events_still_makes_one_request():
    """The tap's events were late: the span made the request; the tap's start, lookup and
    finish then complete that record (its tokens, its promotion wait) instead of opening a
    second one."""
    agent = _agent()
    agent.otlp_receiver.start()
    with TestClient(create_app(agent)) as client:
        client.post("/v1/traces", content=protobuf_body(),
                    headers={"content-type": "application/x-protobuf"})
    agent.pipeline.ingest("vllm", [
        ev.RequestStarted(ts=T0, request_id="cmpl-1-0", prompt_tokens=300),
        ev.Lookup(ts=T0 + 0.1, request_id="cmpl-1-0", tokens={"cpu": 256, "recompute": 44}),
        ev.RequestFinished(ts=T0 + 0.4, request_id="cmpl-1-0", ttft=0.3, prompt_tokens=300,
                           promotion_wait=0.02)])
    record = agent.pipeline.requests.get("cmpl-1-0")
    assert record.trace_id == TRACE and record.ttft == 0.25 and record.promotion_wait == 0.02
    assert record.tokens == {"cpu": 256, "recompute": 44}
    agent.pipeline.publish_settled(everything=True)
    assert agent.pipeline.snapshot().requests == 1 and len(agent.pipeline.requests) == 1
    assert agent.pipeline.snapshot().promotion_wait_seconds.sum == 0.02


def test_a_span_joins_a_finished_request_the_table_no_longer_holds():
    """With a table of 1 request, the tap's first request has left it when its span comes
    (5 s late, as vLLM sends them): the span still joins it (the agent keeps the source's
    last 10,000 finished requests for that) instead of counting it again: 2 requests, not 3."""
    agent = Agent(AgentSettings(ingest={"enabled": False}, collectors={"gpu": {"enabled": False}},
                                otlp_receiver={"source": "vllm"}, requests_capacity=1))
    agent.otlp_receiver.start()
    for rid in ("cmpl-1-0", "cmpl-2-0"):
        agent.pipeline.ingest("vllm", [
            ev.RequestStarted(ts=T0, request_id=rid, prompt_tokens=300),
            ev.RequestFinished(ts=T0 + 0.4, request_id=rid, ttft=0.3, prompt_tokens=300)])
    with TestClient(create_app(agent)) as client:
        client.post("/v1/traces", content=protobuf_body(),
                    headers={"content-type": "application/x-protobuf"})
    agent.pipeline.publish_settled(everything=True)
    assert agent.pipeline.snapshot().requests == 2 and agent.otlp_receiver.joined == 1
    assert agent.pipeline.snapshot().ttft_seconds.count == 2


def test_a_joined_span_moves_the_exemplars_to_the_trace_it_names():
    """A request without a traceparent gets a made-up trace id, which its transfer's exemplar
    carries; vLLM's span names vLLM's trace, which the record (and its exported kv.request
    span) then carries: the exemplars name it too, not a trace nobody exports. The TTFT is
    observed once the record waited, with the span's trace; a span later than that wait moves
    the TTFT exemplar as well."""
    agent = _agent()
    agent.otlp_receiver.start()
    _spans_arrive(agent)

    def exemplars():
        snap = agent.pipeline.snapshot()
        return ([e[0] for e in snap.ttft_seconds.exemplars.values()],
                [e[0] for e in snap.transfer_seconds[("cpu", "gpu")].exemplars.values()])

    def tap(request_id, ts):
        agent.pipeline.ingest("vllm", [
            ev.RequestStarted(ts=ts, request_id=request_id, prompt_tokens=300),
            ev.Transfer(ts=ts, src="cpu", dst="gpu", blocks=1, bytes=1, duration=0.002,
                        request_id=request_id),
            ev.RequestFinished(ts=ts + 0.4, request_id=request_id, ttft=0.3, prompt_tokens=300)])
        return agent.pipeline.requests.get(request_id).trace_id

    made_up = tap("cmpl-1-0", T0)
    assert exemplars() == ([], [made_up])
    with TestClient(create_app(agent)) as client:
        client.post("/v1/traces", content=protobuf_body(),
                    headers={"content-type": "application/x-protobuf"})
        agent.pipeline.publish_settled(everything=True)
        assert agent.pipeline.requests.get("cmpl-1-0").trace_id == TRACE
        assert exemplars() == ([TRACE], [TRACE])
        made_up = tap("cmpl-2-0", T0)  # its wait over before its span comes
        agent.pipeline.publish_settled(everything=True)
        # its TTFT of 0.3 s has the 0.5 s bucket's exemplar; its transfer replaced the first's
        assert exemplars() == ([TRACE, made_up], [made_up])
        late = "1" * 32
        client.post("/v1/traces", content=protobuf_body({**ATTRS, "gen_ai.request.id": "cmpl-2-0"},
                                                        trace=late),
                    headers={"content-type": "application/x-protobuf"})
    assert exemplars() == ([TRACE, late], [late])


def test_a_token_protects_the_receiver_too():
    agent = Agent(AgentSettings(ingest={"enabled": False}, collectors={"gpu": {"enabled": False}},
                                token="s3cret"))
    with TestClient(create_app(agent)) as client:
        headers = {"content-type": "application/x-protobuf"}
        assert client.post("/v1/traces", content=protobuf_body(), headers=headers).status_code == 401
        assert client.post("/v1/traces", content=protobuf_body(), headers={
            **headers, "authorization": "Bearer s3cret"}).status_code == 200


def test_a_chunked_body_over_the_limit_is_refused_without_a_declared_length():
    """A chunked POST declares no Content-Length for the middleware to check: the receiver
    stops reading once the body passes the limit (64 chunks of 1 KiB against 16 KiB)."""
    agent = Agent(AgentSettings(ingest={"enabled": False}, collectors={"gpu": {"enabled": False}}))
    chunks = (b"\0" * 1024 for _ in range(64))
    with TestClient(create_app(agent, max_body_bytes=16 << 10)) as client:
        response = client.post("/v1/traces", content=chunks,
                               headers={"content-type": "application/x-protobuf"})
        assert response.status_code == 413
        assert client.post("/v1/traces", content=protobuf_body(), headers={
            "content-type": "application/x-protobuf"}).status_code == 200
    assert agent.pipeline.snapshot().events_dropped[("otlp", "too_large")] == 1


def test_a_declared_body_over_the_limit_is_counted_too_and_only_once_authorized():
    """An OTLP exporter sends a Content-Length: the app's body bound answered 413 from it
    before the receiver saw the export, so the usual refusal was never counted (only chunked
    ones were). Now it is, once per export, and an export without the token is a 401, not a
    drop (as for a chunked body). Nothing of the 32 KiB is needed to refuse it."""
    agent = Agent(AgentSettings(ingest={"enabled": False}, collectors={"gpu": {"enabled": False}},
                                token="s3cret"))
    headers = {"content-type": "application/x-protobuf"}
    authorized = {**headers, "authorization": "Bearer s3cret"}
    with TestClient(create_app(agent, max_body_bytes=16 << 10)) as client:
        assert client.post("/v1/traces", content=b"\0" * (32 << 10),
                           headers=headers).status_code == 401
        for _ in range(2):
            response = client.post("/v1/traces", content=b"\0" * (32 << 10), headers=authorized)
            assert response.status_code == 413
        assert client.post("/api/v1/summary", content=b"x" * (32 << 10)).status_code == 413
    assert agent.pipeline.snapshot().events_dropped == {("otlp", "too_large"): 2}


def test_a_span_without_ttft_for_an_unknown_request_makes_no_request():
    """An aborted request's span has no first token: counting it would add a TTFT of 0 to the
    histogram. It is ignored (counted), and a span with a negative latency reads as unknown the
    same way; that one had a TTFT, so it is also counted as an invalid drop (1)."""
    agent = _agent()
    no_ttft = {k: v for k, v in ATTRS.items() if k != "gen_ai.latency.time_to_first_token"}
    negative = {**ATTRS, "gen_ai.request.id": "cmpl-2-0",
                "gen_ai.latency.time_to_first_token": -1.0}
    with TestClient(create_app(agent)) as client:
        for attrs in (no_ttft, negative):
            assert client.post("/v1/traces", content=protobuf_body(attrs), headers={
                "content-type": "application/x-protobuf"}).status_code == 200
    assert agent.otlp_receiver.ignored == 2 and len(agent.pipeline.requests) == 0
    assert agent.pipeline.snapshot().ttft_seconds.count == 0
    assert agent.pipeline.snapshot().events_dropped == {("otlp", "invalid"): 1}


def test_spans_with_values_no_emitter_could_send_are_dropped_as_invalid(caplog):
    """An emitter's batch with 2**64 tokens or a TTFT of 1e15 s is refused (counts stop at
    2**53, durations at 1e9 s); spans get the same checks: both are dropped and counted as
    invalid, make no request, and the first is logged (a 2**64 count once stopped the store's
    thread, which cannot write it)."""
    agent = _agent()
    huge_count = {**ATTRS, "gen_ai.usage.prompt_tokens": 2**64}
    huge_ttft = {**ATTRS, "gen_ai.request.id": "cmpl-2-0",
                 "gen_ai.latency.time_to_first_token": 1e15}
    with TestClient(create_app(agent)) as client:
        for attrs in (huge_count, huge_ttft):
            assert client.post("/v1/traces", content=json_body(attrs), headers={
                "content-type": "application/json"}).status_code == 200
    assert len(agent.pipeline.requests) == 0
    assert agent.pipeline.snapshot().events_dropped == {("otlp", "invalid"): 2}
    assert caplog.text.count("kvscope OTLP receiver: dropped the span of request 'cmpl-1-0'") == 1


def test_a_span_ending_hours_ahead_leaves_the_taps_open_request_alone():
    """A span of a request the tap has open ends 2 h ahead of the agent's clock (a corrupt
    time): it is dropped as the OTLP receiver's invalid span before it finishes anything. It
    once finished the tap's record, which the pipeline then dropped as a corrupt time, counted
    under the tap's source; the tap's own finish filled in that dropped record: 0 requests."""
    agent = _agent()
    now = time.time()
    agent.pipeline.ingest("vllm", [ev.RequestStarted(ts=now, request_id="x", prompt_tokens=10)])
    agent.otlp_receiver.handle([ReceivedSpan(TRACE, "b7ad6b7169203331", "llm_request",
                                             int(now * 1e9), int((now + 7200) * 1e9),
                                             {"gen_ai.request.id": "x",
                                              "gen_ai.latency.time_to_first_token": 0.1})])
    agent.pipeline.ingest("vllm", [ev.RequestFinished(ts=now + 0.5, request_id="x", ttft=0.3,
                                                      prompt_tokens=10)])
    agent.pipeline.publish_settled(everything=True)
    snap = agent.pipeline.snapshot()
    assert snap.requests == 1 and agent.pipeline.requests.get("x").ttft == 0.3
    assert snap.events_dropped == {("otlp", "invalid"): 1}


def test_a_span_whose_start_or_end_is_unset_is_invalid_not_dated_1970():
    """OTLP reads a time of 0 as unset (``start_time_unix_nano``'s comment in trace.proto):
    spans with a start or an end of 0, one for a request the tap has open, are dropped as
    invalid; the tap's request keeps its own times and no request is dated 1970."""
    agent = _agent()
    now = time.time()
    agent.pipeline.ingest("vllm", [ev.RequestStarted(ts=now, request_id="x", prompt_tokens=10)])
    attrs = {"gen_ai.latency.time_to_first_token": 0.1}
    agent.otlp_receiver.handle([
        ReceivedSpan(TRACE, "b7ad6b7169203331", "llm_request", 0, int(now * 1e9),
                     {**attrs, "gen_ai.request.id": "x"}),
        ReceivedSpan(TRACE, "b7ad6b7169203331", "llm_request", int(now * 1e9), 0,
                     {**attrs, "gen_ai.request.id": "y"})])
    agent.pipeline.ingest("vllm", [ev.RequestFinished(ts=now + 0.5, request_id="x", ttft=0.3,
                                                      prompt_tokens=10)])
    agent.pipeline.publish_settled(everything=True)
    snap = agent.pipeline.snapshot()
    record = agent.pipeline.requests.get("x")
    assert snap.requests == 1 and record.ttft == 0.3 and record.arrival == now
    assert agent.pipeline.requests.get("y") is None
    assert snap.events_dropped == {("otlp", "invalid"): 2}


def test_hostile_json_and_gzip_bodies_are_refused_with_400_not_500():
    """JSON nested 200,000 deep (RecursionError), an Infinity time (OverflowError in int()),
    and a gzip body cut short (decoded only in part before): each is a 400, and the agent
    answers the next request."""
    agent = _agent()
    infinite = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [
        {"startTimeUnixNano": float("inf")}]}]}]}).encode()  # json.dumps writes Infinity
    truncated = gzip.compress(json_body())[:-12]
    with TestClient(create_app(agent)) as client:
        for body, encoding in ((b"[" * 200_000 + b"]" * 200_000, ""), (infinite, ""),
                               (truncated, "gzip")):
            r = client.post("/v1/traces", content=body, headers={
                "content-type": "application/json", "content-encoding": encoding})
            assert r.status_code == 400, (r.status_code, r.text[:200])
        assert client.post("/v1/traces", content=json_body(), headers={
            "content-type": "application/json"}).status_code == 200
        # numbers past float's range in a span: that span is invalid, the export still 200
        huge = json.loads(json_body({**ATTRS, "gen_ai.request.id": "big-ttft"}))
        spans = huge["resourceSpans"][0]["scopeSpans"][0]["spans"]
        spans[0]["attributes"][3]["value"] = {"intValue": "1" + "0" * 400}  # the TTFT
        late = json.loads(json_body({**ATTRS, "gen_ai.request.id": "late"}))
        spans.append({**late["resourceSpans"][0]["scopeSpans"][0]["spans"][0],
                      "startTimeUnixNano": "9" * 4000})
        assert client.post("/v1/traces", content=json.dumps(huge).encode(), headers={
            "content-type": "application/json"}).status_code == 200
    assert agent.pipeline.requests.get("cmpl-1-0") is not None
    assert agent.pipeline.snapshot().events_dropped == {("otlp", "malformed"): 3,
                                                        ("otlp", "invalid"): 2}


def test_a_boolean_ttft_and_a_trace_id_that_is_not_hex_are_not_taken(caplog):
    """``time_to_first_token: true`` once became a TTFT of 1.0 s, and a trace id "ZZ..." went
    into the API and exemplars. Now the first is no TTFT (the span of an unknown request
    without one makes no request, and is counted invalid since one was sent); for the second
    the record has no trace id (an all-zero id, OTLP's invalid one, neither), and both are
    counted, the first logged."""
    agent = _agent()
    pipeline = agent.pipeline
    pipeline.ingest("vllm", [ev.RequestFinished(ts=1.0, request_id=rid, ttft=0.5,
                                                prompt_tokens=8) for rid in ("z-0", "zero-0")])
    spans = [otlp_span({**ATTRS, "gen_ai.latency.time_to_first_token": True}),
             otlp_span({**ATTRS, "gen_ai.request.id": "z-0"}, trace="Z" * 32),
             otlp_span({**ATTRS, "gen_ai.request.id": "zero-0"}, trace="0" * 32)]
    agent.otlp_receiver.handle(spans)
    assert pipeline.requests.get("cmpl-1-0") is None
    assert pipeline.snapshot().events_dropped == {("otlp", "invalid"): 1}
    assert pipeline.requests.get("z-0", "vllm").trace_id != "z" * 32
    assert pipeline.requests.get("zero-0", "vllm").trace_id != "0" * 32
    assert agent.otlp_receiver.untraced == 2
    assert [r.message for r in caplog.records].count(
        "kvscope OTLP receiver: the span of request 'z-0' has trace id 'zz"
        + "z" * 30 + "', not a W3C one (32 lowercase hex digits, not all 0): its request "
        "counts, under a trace id of the agent's own instead; logged once") == 1


def _varint(n: int) -> bytes:
    out = b""
    while n >= 0x80:
        out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
    return out + bytes([n])


def _empty_spans_body(n: int) -> bytes:
    """An export of ``n`` empty spans in one scope, encoded by hand (field 2 of ScopeSpans, 2
    bytes each): what took 880 MiB to parse for 2M spans."""
    scope = b"\x12\x00" * n
    resource = b"\x12" + _varint(len(scope)) + scope
    return b"\x0a" + _varint(len(resource)) + resource


def test_spans_are_counted_on_the_wire_before_a_body_is_parsed():
    """MAX_SPANS empty spans are accepted (and ignored: no request id); one more is a 413,
    refused before protobuf builds anything, as is the same in JSON, and so is a body of
    millions of other fields. The count agrees with protobuf's own parse:
    ExportTraceServiceRequest reads the hand-made body as n spans."""
    from kvscope.agent.sources.otlp_receiver import MAX_SPANS

    parsed = ExportTraceServiceRequest()
    parsed.ParseFromString(_empty_spans_body(3))
    assert len(parsed.resource_spans[0].scope_spans[0].spans) == 3
    agent = _agent()
    json_spans = json.dumps({"resourceSpans": [{"scopeSpans": [
        {"spans": [{}] * (MAX_SPANS + 1)}]}]}).encode()
    with TestClient(create_app(agent)) as client:
        def post(body, kind="application/x-protobuf", encoding=""):
            return client.post("/v1/traces", content=body, headers={
                "content-type": kind, "content-encoding": encoding}).status_code

        assert post(_empty_spans_body(MAX_SPANS)) == 200
        assert post(_empty_spans_body(MAX_SPANS + 1)) == 413
        assert post(gzip.compress(_empty_spans_body(2_000_000)), encoding="gzip") == 413
        # 2M fields of no use (field 15, varint 0) would cost the walk seconds: refused early
        assert post(gzip.compress(b"\x78\x00" * 2_000_000), encoding="gzip") == 413
        assert post(json_spans, "application/json") == 413
        assert post(_empty_spans_body(3)[:-1]) == 400  # cut short
        # 7,000 spans, each in a resource and scope of its own (7 fields a span): accepted
        spread = ExportTraceServiceRequest(resource_spans=[
            ResourceSpans(scope_spans=[ScopeSpans(spans=[Span(name="s")])])] * 7000)
        assert post(spread.SerializeToString()) == 200
    assert agent.otlp_receiver.ignored == MAX_SPANS + 7000  # no request ids


def test_a_spans_decode_time_gives_the_inter_token_latency():
    """vLLM's span: 4 completion tokens decoded in 0.3 s (``time_in_model_decode``, first token
    to last) -> mean ITL 0.3 / 3 = 0.1 s, for a request only the span reports (a GPU-only
    vLLM's baseline) and for one the tap finished with its own, step-late 0.12 s (vLLM's
    replaces it). A single token has no ITL: 0, left out of the histogram. The span's ITL
    comes with the span's output tokens it is the mean over: a tap that saw none (cmpl-8-0)
    kept 0 output tokens beside an ITL of 0.1 s."""
    agent = _agent()
    agent.otlp_receiver.start()
    _spans_arrive(agent)
    for rid, output, itl in (("cmpl-9-0", 4, 0.12), ("cmpl-8-0", 0, 0.0)):
        agent.pipeline.ingest("vllm", [
            ev.RequestStarted(ts=T0, request_id=rid, prompt_tokens=300),
            ev.RequestFinished(ts=T0 + 0.9, request_id=rid, ttft=0.3, prompt_tokens=300,
                               output_tokens=output, itl=itl)])
    decode = {**ATTRS, "gen_ai.latency.time_in_model_decode": 0.3}
    agent.otlp_receiver.handle([
        otlp_span(decode),
        otlp_span({**decode, "gen_ai.request.id": "cmpl-9-0"}),
        otlp_span({**decode, "gen_ai.request.id": "cmpl-8-0"}),
        otlp_span({**decode, "gen_ai.request.id": "cmpl-one-0",
                   "gen_ai.usage.completion_tokens": 1})])
    agent.pipeline.publish_settled(everything=True)
    rids = ("cmpl-1-0", "cmpl-9-0", "cmpl-8-0", "cmpl-one-0")
    itl = {rid: agent.pipeline.requests.get(rid).itl for rid in rids}
    assert itl == {"cmpl-1-0": pytest.approx(0.1), "cmpl-9-0": pytest.approx(0.1),
                   "cmpl-8-0": pytest.approx(0.1), "cmpl-one-0": 0.0}, itl
    output = {rid: agent.pipeline.requests.get(rid).output_tokens for rid in rids}
    assert output == {"cmpl-1-0": 4, "cmpl-9-0": 4, "cmpl-8-0": 4, "cmpl-one-0": 1}, output
    hist = agent.pipeline.snapshot().itl_seconds
    assert sum(hist.counts) == 3 and hist.sum == pytest.approx(0.3)
