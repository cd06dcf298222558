"""The OTLP/HTTP trace receiver served by uvicorn on a loopback socket: the answer to a
protobuf export is protobuf whatever the case of its media type."""

from __future__ import annotations

import http.client
from contextlib import contextmanager

from kvscope.agent.config import AgentSettings
from kvscope.service.agent import Agent
from kvscope.service.api import create_app
from kvscope.service.server import ApiServer, bind


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


def send(port: int, body: bytes, headers: dict[str, str], method: str = "POST",
         path: str = "/v1/traces") -> tuple[int, dict[str, str], bytes]:
    """One request on a new connection: (status, lowercase headers, body). A connection the
    server drops raises here (http.client's RemoteDisconnected, ConnectionResetError)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=False, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        conn.close()


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
