"""OTLP span export against a real OTLP/HTTP endpoint on loopback.

:class:`OtlpReceiver` is a small OTLP/HTTP trace receiver: a stdlib ``ThreadingHTTPServer`` on
127.0.0.1 (port chosen by the OS) that accepts ``POST /v1/traces``, decodes the protobuf body
with opentelemetry-proto's ``ExportTraceServiceRequest`` (what an OpenTelemetry Collector does)
and keeps every span. The exporter under test talks to it through the SDK's real OTLP/HTTP
exporter over a real socket.

Expected nanoseconds, computed by hand. Unix seconds near 1.7e9 are doubles spaced 2**-22 s
(~238 ns) apart; the exporter guarantees the float's exact value rounded to the nearest ns.

- 1_700_000_000.25, .3125, 2.0, 2.5, 2.75 are exact binary fractions, so e.g.
  1_700_000_000.25 s = 1_700_000_000_250_000_000 ns exactly (naively, round(x * 1e9) gives
  1_700_000_000_249_999_872 here: the product itself is rounded to a multiple of 256 ns).
- 1_700_000_000.1 is stored as 1_700_000_000 + 209715/2**21 = 1_700_000_000.099999904632568359375
  s, which rounds to 1_700_000_000_099_999_905 ns.
- Durations: 0.5 s, 0.125 s, 0.0625 s are exact; 0.003 s is stored as 0.003000000000000000062...,
  which rounds to 3_000_000 ns. A span's end is its start plus its rounded duration.
"""

from __future__ import annotations

import gzip
import socket
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.trace import TracerProvider

from kvscope.agent.requests import RequestRecord, TransferRecord
from kvscope.exporter.otlp import RequestSpanExporter, traces_url, unix_ns

HANG_GUARD_S = 60.0  # only bounds a test that would otherwise hang; never a timing assertion
MiB = 1 << 20

RECORD_A = RequestRecord(
    request_id="req-a", trace_id="4bf92f3577b34da6a3ce929d0e0e4736", source="engine",
    arrival=1_700_000_000.25, prompt_tokens=256, output_tokens=16,
    tokens={"gpu": 64, "cpu": 128, "recompute": 64},
    transfers=(TransferRecord("cpu", "gpu", 8, 16 * MiB, 1_700_000_000.3125, 0.125),
               TransferRecord("disk", "cpu", 4, 8 * MiB, 1_700_000_000.1, 0.003)),
    ttft=0.5, queueing=0.0625, lookup=0.001, promotion_wait=0.25, prefill=0.125,
    finished=1_700_000_001.0)
RECORD_B = RequestRecord(  # no ttft: the span ends at `finished`; one failed promotion
    request_id="req-b", trace_id="a3ce929d0e0e47364bf92f3577b34da6", source="vllm",
    arrival=1_700_000_002.0, prompt_tokens=128, tokens={"gpu": 32, "disk": 96},
    transfers=(TransferRecord("disk", "cpu", 6, 12 * MiB, 1_700_000_002.5, 0.0625, ok=False),),
    finished=1_700_000_002.75)


class _Handler(BaseHTTPRequestHandler):
    server: OtlpReceiver

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.server.entered.set()
        self.server.gate.wait()
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        encoding = self.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for resource_spans in request.resource_spans:
                resource = {kv.key: kv.value.string_value
                            for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.server.spans.extend((resource, span) for span in scope_spans.spans)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


class OtlpReceiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver on 127.0.0.1. ``spans``: list[(resource attributes, Span)].
    ``gate``: cleared, it holds every request before it is read; ``entered``: set once a
    request arrived."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.spans: list[tuple[dict[str, str], Span]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def named(self, name: str) -> list[Span]:
        with self.lock:
            return [span for _, span in self.spans if span.name == name]


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    server = OtlpReceiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.gate.set()
    server.shutdown()
    server.server_close()


def attrs(span: Span) -> dict[str, object]:
    """A decoded span's attributes as plain Python values."""
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}


def shutdown_within_guard(exporter: RequestSpanExporter) -> None:
    """Call shutdown() in a thread; fail (instead of hanging) when it does not return."""
    thread = threading.Thread(target=exporter.shutdown, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "shutdown() did not return"


def test_unix_ns_is_the_floats_value_rounded_to_the_nearest_ns() -> None:
    assert unix_ns(1_700_000_000.25) == 1_700_000_000_250_000_000
    assert unix_ns(1_700_000_000.1) == 1_700_000_000_099_999_905
    assert unix_ns(0.0) == 0
    assert unix_ns(1.999_999_999_9) == 2_000_000_000


def test_traces_url() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c:4318/v1/traces") == "https://c:4318/v1/traces"
    with pytest.raises(ValueError):
        traces_url("collector:4318")
    with pytest.raises(ValueError):
        RequestSpanExporter("localhost")


def test_records_arrive_as_request_and_transfer_spans(receiver: OtlpReceiver) -> None:
    exporter = RequestSpanExporter(receiver.url, service_name="kvscope-test", timeout=10.0)
    # A span current in the caller's context must not become kv.request's parent.
    outer = TracerProvider(shutdown_on_exit=False).get_tracer("caller")
    with outer.start_as_current_span("caller-span"):
        exporter.export(RECORD_A)
    exporter.export(RECORD_B)
    shutdown_within_guard(exporter)
    assert (exporter.exported, exporter.failed, exporter.invalid_trace_ids) == (2, 0, 0)

    requests = {attrs(s)["kv.request_id"]: s for s in receiver.named("kv.request")}
    transfers = receiver.named("kv.transfer")
    assert sorted(requests) == ["req-a", "req-b"] and len(transfers) == 3
    with receiver.lock:
        assert {res["service.name"] for res, _ in receiver.spans} == {"kvscope-test"}

    a, b = requests["req-a"], requests["req-b"]
    assert a.trace_id == bytes.fromhex(RECORD_A.trace_id)
    assert b.trace_id == bytes.fromhex(RECORD_B.trace_id)
    assert a.parent_span_id == b"" and b.parent_span_id == b""
    assert (a.start_time_unix_nano, a.end_time_unix_nano) == (
        1_700_000_000_250_000_000, 1_700_000_000_750_000_000)  # arrival, arrival + ttft
    assert (b.start_time_unix_nano, b.end_time_unix_nano) == (
        1_700_000_002_000_000_000, 1_700_000_002_750_000_000)  # arrival, finished
    assert attrs(a) == {
        "kv.request_id": "req-a", "kv.source": "engine", "kv.prompt_tokens": 256,
        "kv.output_tokens": 16, "kv.tokens.gpu": 64, "kv.tokens.cpu": 128,
        "kv.tokens.disk": 0, "kv.tokens.recompute": 64, "kv.ttft_seconds": 0.5,
        "kv.queueing_seconds": 0.0625, "kv.lookup_seconds": 0.001,
        "kv.promotion_wait_seconds": 0.25, "kv.prefill_seconds": 0.125}
    assert "kv.ttft_seconds" not in attrs(b)
    assert (attrs(b)["kv.source"], attrs(b)["kv.tokens.disk"]) == ("vllm", 96)
    assert a.status.code == b.status.code == Status.STATUS_CODE_UNSET

    by_route = {(attrs(t)["kv.route"], t.trace_id): t for t in transfers}
    assert set(by_route) == {("cpu->gpu", a.trace_id), ("disk->cpu", a.trace_id),
                             ("disk->cpu", b.trace_id)}
    promotion = by_route["cpu->gpu", a.trace_id]
    staged = by_route["disk->cpu", a.trace_id]
    failed = by_route["disk->cpu", b.trace_id]
    assert promotion.parent_span_id == staged.parent_span_id == a.span_id
    assert failed.parent_span_id == b.span_id
    assert len({a.span_id, b.span_id, promotion.span_id, staged.span_id, failed.span_id}) == 5
    assert (promotion.start_time_unix_nano, promotion.end_time_unix_nano) == (
        1_700_000_000_312_500_000, 1_700_000_000_437_500_000)
    assert (staged.start_time_unix_nano, staged.end_time_unix_nano) == (
        1_700_000_000_099_999_905, 1_700_000_000_102_999_905)
    assert (failed.start_time_unix_nano, failed.end_time_unix_nano) == (
        1_700_000_002_500_000_000, 1_700_000_002_562_500_000)
    assert attrs(promotion) == {"kv.route": "cpu->gpu", "kv.src": "cpu", "kv.dst": "gpu",
                                "kv.blocks": 8, "kv.bytes": 16 * MiB, "kv.ok": True}
    assert attrs(failed) == {"kv.route": "disk->cpu", "kv.src": "disk", "kv.dst": "cpu",
                             "kv.blocks": 6, "kv.bytes": 12 * MiB, "kv.ok": False}
    assert promotion.status.code == staged.status.code == Status.STATUS_CODE_UNSET
    assert failed.status.code == Status.STATUS_CODE_ERROR


def test_a_record_without_tokens_by_source_exports_none(receiver: OtlpReceiver) -> None:
    """vLLM's span alone (zero-code mode) measures no tokens by source: its record's span
    carried kv.tokens.gpu/cpu/disk/recompute = 0, prompt tokens "served by nothing". Now
    none of them; the prompt tokens it did measure stay."""
    exporter = RequestSpanExporter(receiver.url, timeout=10.0)
    exporter.export(RequestRecord(request_id="span-only", trace_id=RECORD_A.trace_id,
                                  source="vllm", arrival=1_700_000_000.0, prompt_tokens=259,
                                  tokens={}, ttft=0.02, finished=1_700_000_000.5))
    shutdown_within_guard(exporter)
    (span,) = receiver.named("kv.request")
    assert not [name for name in attrs(span) if name.startswith("kv.tokens.")]
    assert attrs(span)["kv.prompt_tokens"] == 259


def test_export_does_not_wait_for_a_stalled_endpoint(receiver: OtlpReceiver) -> None:
    """While the SDK's worker is stuck in a POST the receiver holds, export() still returns."""
    receiver.gate.clear()
    exporter = RequestSpanExporter(receiver.url, timeout=HANG_GUARD_S, schedule_delay=0.01)
    exporter.export(RECORD_A)
    assert receiver.entered.wait(HANG_GUARD_S), "the worker never sent the first batch"
    second = threading.Thread(target=exporter.export, args=(RECORD_B,), daemon=True)
    second.start()
    second.join(HANG_GUARD_S)
    assert not second.is_alive(), "export() waited for the network"
    receiver.gate.set()
    shutdown_within_guard(exporter)
    assert {s.trace_id.hex() for s in receiver.named("kv.request")} == {
        RECORD_A.trace_id, RECORD_B.trace_id}


def test_bad_records_never_raise(receiver: OtlpReceiver) -> None:
    exporter = RequestSpanExporter(receiver.url)
    exporter.export(RequestRecord("bad-time", RECORD_A.trace_id, "engine", float("nan")))
    # before 1970: protobuf refuses a negative fixed64, which once failed the whole batch
    exporter.export(RequestRecord("before-1970", RECORD_A.trace_id, "engine", -5.0))
    exporter.export(RequestRecord("bad-id", "not-a-trace-id", "engine", 1_700_000_000.0))
    exporter.export(RequestRecord("zero-id", "0" * 32, "engine", 1_700_000_000.0))
    shutdown_within_guard(exporter)
    assert (exporter.exported, exporter.failed, exporter.invalid_trace_ids) == (2, 2, 2)
    assert exporter.spans == {"sent": 2, "failed": 0, "dropped": 2}  # one span per record
    spans = receiver.named("kv.request")
    assert sorted(attrs(s)["kv.request_id"] for s in spans) == ["bad-id", "zero-id"]
    assert all(len(s.trace_id) == 16 and any(s.trace_id) for s in spans)  # fresh random ids


def test_closed_port_never_raises_and_shutdown_returns() -> None:
    with socket.socket() as s:  # a port that was just free; nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exporter = RequestSpanExporter(f"http://127.0.0.1:{port}", timeout=0.5)
    exporter.export(RECORD_A)
    assert exporter.force_flush() in (True, False)  # a refused send is not an exception
    exporter.export(RECORD_B)
    shutdown_within_guard(exporter)
    assert (exporter.exported, exporter.failed) == (2, 0)
    # nothing listens: A's 3 spans and B's 2 failed (the SDK's retries end within the timeout)
    assert exporter.spans == {"sent": 0, "failed": 5, "dropped": 0}
    exporter.export(RECORD_A)  # after shutdown: ignored, not raised
    assert exporter.exported == 2


def test_shutdown_is_safe_twice_and_without_export(receiver: OtlpReceiver) -> None:
    exporter = RequestSpanExporter(receiver.url)
    shutdown_within_guard(exporter)
    shutdown_within_guard(exporter)
    assert exporter.force_flush() is False
    assert receiver.named("kv.request") == []


def test_an_endpoint_that_refuses_every_batch_is_logged_once_with_its_url(
        receiver: OtlpReceiver, caplog) -> None:
    """The receiver answers 404 off /v1/traces: five sends fail, the SDK logs each, and one
    line naming the URL gets through (the next is held for a minute)."""
    url = receiver.url + "/wrong/v1/traces"
    exporter = RequestSpanExporter(url, timeout=2.0)
    for _ in range(5):
        exporter.export(RECORD_A)
        exporter.force_flush()
    shutdown_within_guard(exporter)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")]
    assert len(lines) == 1 and lines[0].startswith(f"kvscope OTLP export to {url}: "), lines
    assert "404" in lines[0]


def test_a_full_queue_drops_whole_records_and_counts_their_spans(receiver: OtlpReceiver) -> None:
    """max_queue_size 5 and the endpoint holding the first POST: A (3 spans) is taken by the
    worker and sent once the gate opens; while it hangs B (2) fills the queue to 5, and the next
    A (3 more, 8 > 5) is dropped whole rather than have the SDK drop spans silently. Every span
    ends in one result: 5 sent, 3 dropped."""
    receiver.gate.clear()
    exporter = RequestSpanExporter(receiver.url, timeout=HANG_GUARD_S, schedule_delay=0.01,
                                   max_queue_size=5, max_export_batch_size=3)
    exporter.export(RECORD_A)
    assert receiver.entered.wait(HANG_GUARD_S), "the worker never sent the first batch"
    exporter.export(RECORD_B)
    exporter.export(RECORD_A)
    assert exporter.spans == {"sent": 0, "failed": 0, "dropped": 3}
    receiver.gate.set()
    shutdown_within_guard(exporter)
    assert exporter.spans == {"sent": 5, "failed": 0, "dropped": 3}
    assert len(receiver.named("kv.request")) == 2 and len(receiver.named("kv.transfer")) == 3


def test_a_transfer_joining_during_export_keeps_the_queue_count(
        receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """A late worker load joins a handed-over record (the ingest thread) while the sampling
    thread exports it. The exporter counted the record's spans from its transfers, then made
    spans from them again: one more span went out than was counted, and the count of spans in
    the SDK's queue, the exporter's bound on it, ended at -1 (looser by one each time).
    The race is forced at the seam between the two reads, ``unix_ns``."""
    import kvscope.exporter.otlp as otlp

    exporter = RequestSpanExporter(receiver.url, timeout=10.0)
    record = RequestRecord("x", "a" * 32, "vllm", 1_700_000_000.0, ttft=0.1,
                           finished=1_700_000_001.0)
    late = TransferRecord("cpu", "gpu", 1, 4096, 1_700_000_000.01, 0.001)

    def joining(seconds: float) -> int:
        if not record.transfers:
            record.transfers += (late,)
        return unix_ns(seconds)

    monkeypatch.setattr(otlp, "unix_ns", joining)
    exporter.export(record)
    shutdown_within_guard(exporter)
    assert exporter.spans["sent"] == len(receiver.named("kv.request")) + len(
        receiver.named("kv.transfer"))
    assert exporter._queued == 0  # what the bound compares with: every queued span came back


def test_an_agent_with_an_otlp_endpoint_exports_what_its_taps_send(receiver: OtlpReceiver,
                                                                    tmp_path) -> None:
    """The whole path: a tap's emitter -> ZMQ -> the agent's pipeline -> its OTLP exporter ->
    a receiver on loopback decoding the protobuf. One request with one promotion makes one
    kv.request span under the request's trace id, its kv.transfer child at the transfer's time,
    and the agent counts 2 spans sent."""
    from conftest import wait_until

    from kvscope import events as ev
    from kvscope.agent.config import AgentSettings
    from kvscope.agent.taps.emitter import Emitter
    from kvscope.service.agent import Agent

    endpoint = f"ipc://{tmp_path}/ingest.sock"
    agent = Agent(AgentSettings(otlp_endpoint=receiver.url, ingest={"endpoint": endpoint}))
    agent.start()
    emitter = Emitter(endpoint, source="engine", flush_interval=0.01)
    try:
        trace = "ab" * 16
        for event in (
                ev.RequestStarted(ts=1_700_000_000.0, request_id="r1", prompt_tokens=32,
                                  trace_id=trace),
                ev.Transfer(ts=1_700_000_000.25, src="cpu", dst="gpu", blocks=2, bytes=4096,
                            duration=0.125, request_id="r1"),
                ev.RequestFinished(ts=1_700_000_000.5, request_id="r1", ttft=0.5,
                                   prompt_tokens=32)):
            emitter.emit(event)
        assert wait_until(lambda: agent.otlp.spans["sent"] == 2)
    finally:
        emitter.close()
        agent.shutdown()
    (request,), (transfer,) = receiver.named("kv.request"), receiver.named("kv.transfer")
    assert request.trace_id == transfer.trace_id == bytes.fromhex(trace)
    assert transfer.parent_span_id == request.span_id
    assert (transfer.start_time_unix_nano, transfer.end_time_unix_nano) == (
        1_700_000_000_250_000_000, 1_700_000_000_375_000_000)
    assert agent.exposition.registry.get_sample_value("kvscope_otlp_spans_total", {"result": "sent"}) == 2
