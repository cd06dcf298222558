"""The agent's HTTP API through FastAPI's TestClient (handlers; the real server is covered by
the end-to-end tests)."""

import time
import tracemalloc

import pytest
from fastapi.testclient import TestClient
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from kvscope import events as ev
from kvscope.agent.config import AgentSettings
from kvscope.agent.requests import RequestRecord
from kvscope.service.agent import Agent
from kvscope.service.api import create_app

TRACE = "0123456789abcdef" * 2


def _agent(**settings):
    agent = Agent(AgentSettings(**settings), with_ingest=False)
    for i, ttft in enumerate([0.5, 0.1, 0.3]):
        rid = f"r{i}"
        agent.pipeline.ingest("engine", [
            ev.RequestStarted(ts=100.0 + i, request_id=rid, prompt_tokens=48,
                              trace_id=TRACE if i == 0 else ""),
            ev.Lookup(ts=100.0 + i, request_id=rid, tokens={"cpu": 32, "recompute": 16}, blocks=3,
                      block_hits={"cpu": 2}),
            ev.Transfer(ts=100.0 + i, src="cpu", dst="gpu", blocks=2, bytes=65536,
                        duration=0.0004, request_id=rid),
            ev.RequestFinished(ts=100.0 + i + ttft, request_id=rid, ttft=ttft, prompt_tokens=48),
        ])
    agent.sample()
    return agent


@pytest.fixture
def client():
    with TestClient(create_app(_agent())) as c:
        yield c


def test_health_and_readiness(client):
    assert client.get("/healthz").text == "ok\n"
    assert client.get("/readyz").status_code == 503  # the agent was never started
    # load balancers probe with HEAD
    assert client.head("/healthz").status_code == 200 and client.head("/healthz").text == ""
    assert client.head("/readyz").status_code == 503
    assert client.head("/metrics").status_code == 200


def test_summary(client):
    body = client.get("/api/v1/summary").json()
    assert body["requests"] == 3
    # no lookup measures gpu or disk (named in neither tokens nor hits, no tier reported)
    assert body["prompt_tokens"] == {"cpu": 96, "recompute": 48}
    assert body["transfer_bytes"] == {"cpu->gpu": 3 * 65536}
    assert body["ttft_seconds"]["p50"] == pytest.approx(0.3)


def test_summary_tiers_say_null_for_what_no_source_measured():
    """KV events without block_bytes: a gpu tier of 200 blocks holding 144, bytes unknown; the
    summary said capacity_bytes 0 and resident_bytes 0 (/metrics left the capacity out), an
    empty tier of no size. Now null, as /metrics leaves them out."""
    agent = Agent(AgentSettings(), with_ingest=False)
    agent.pipeline.ingest("kv_events", [ev.TierSnapshot(
        ts=100.0, tier="gpu", capacity_bytes=0, resident_bytes=None, capacity_blocks=200,
        resident_blocks=144)])
    with TestClient(create_app(agent)) as client:
        tiers = client.get("/api/v1/summary").json()["tiers"]
    assert tiers == {"gpu": {"capacity_bytes": None, "resident_bytes": None,
                             "capacity_blocks": 200, "resident_blocks": 144}}


def test_summary_ttft_percentiles_from_vllms_histogram_alone():
    """Metrics-only mode: vLLM's TTFT histogram (4 requests: 2 in (0, 0.1], 2 in (0.1, 0.25])
    and no request records; the summary said null. Bucket interpolation, as PromQL's:
    p50 is rank 2 of 4, the top of the first bucket: 0.1; p95 is rank 3.8, in the second
    bucket: 0.1 + 0.15 x 1.8 / 2 = 0.235."""
    agent = Agent(AgentSettings(), with_ingest=False)
    agent.pipeline.ingest("vllm_metrics", [ev.LatencyHistogram(
        ts=100.0, metric="ttft", bounds=[0.1, 0.25], counts=[2, 2, 0], sum=0.5)])
    with TestClient(create_app(agent)) as client:
        ttft = client.get("/api/v1/summary").json()["ttft_seconds"]
    assert ttft["p50"] == pytest.approx(0.1) and ttft["p95"] == pytest.approx(0.235)


def test_requests_sorted_filtered_and_bounded(client):
    body = client.get("/api/v1/requests", params={"sort": "ttft", "limit": 2}).json()
    assert body["total"] == 3
    assert [r["request_id"] for r in body["requests"]] == ["r0", "r2"]
    asc = client.get("/api/v1/requests", params={"sort": "ttft", "order": "asc"}).json()
    assert [r["ttft"] for r in asc["requests"]] == [0.1, 0.3, 0.5]
    slow = client.get("/api/v1/requests", params={"min_ttft": 0.25, "limit": 1}).json()
    assert [r["request_id"] for r in slow["requests"]] == ["r2"] and slow["total"] == 2
    other = client.get("/api/v1/requests", params={"source": "vllm"}).json()
    assert other == {"total": 0, "requests": []}  # total counted the whole table: 3
    assert client.get("/api/v1/requests", params={"limit": 10_001}).status_code == 422
    assert client.get("/api/v1/requests", params={"sort": "id"}).status_code == 422


def test_the_newest_requests_cost_in_proportion_to_limit_not_to_the_table():
    """Issue 26, item 9: each call sorted the whole table, then cut it (76 ms for 100,000
    records). The default order's 10 newest of 50,000 now take memory for about 10: a full sort
    copies the table's list and its keys (2 MB)."""
    agent = Agent(AgentSettings(), with_ingest=False)
    agent.pipeline.requests.add([RequestRecord(f"r{i}", "", "engine", float(i), finished=i + 1.0)
                                 for i in range(50_000)])
    assert len(agent.pipeline.requests) == 50_000  # the index, built on the first read
    with TestClient(create_app(agent)) as c:
        c.get("/api/v1/requests", params={"limit": 10})  # the app's first answer sets it up
        tracemalloc.start()
        try:
            body = c.get("/api/v1/requests", params={"limit": 10}).json()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 512_000
    assert body["total"] == 50_000
    assert [r["request_id"] for r in body["requests"]] == [f"r{i}" for i in range(49_999, 49_989, -1)]


def test_one_request_with_its_transfers(client):
    body = client.get("/api/v1/requests/r0").json()
    assert body["trace_id"] == TRACE and body["ttft"] == 0.5
    assert body["transfers"] == [{"src": "cpu", "dst": "gpu", "blocks": 2, "bytes": 65536,
                                  "start": 100.0, "duration": 0.0004, "ok": True}]
    assert client.get("/api/v1/requests/nope").status_code == 404


def test_timeseries_metric_filter(client):
    body = client.get("/api/v1/timeseries", params={"metric": "prompt_tokens"}).json()
    (sample,) = body["samples"]
    assert set(sample) == {"ts", "prompt_tokens"}
    assert client.get("/api/v1/timeseries", params={"metric": "nope"}).status_code == 422
    assert client.get("/api/v1/timeseries", params={"since": 1e12}).json()["samples"] == []
    for bad in ("nan", "inf"):  # NaN once answered 200 with no samples, unlike window=nan
        assert client.get("/api/v1/timeseries", params={"since": bad}).status_code == 422


def test_summary_gives_host_memory_as_metrics_does(tmp_path):
    """16 GiB of RAM, 9 GiB available, no cgroup limit (an empty cgroup root), a 1 GiB reserve
    and a 4 GiB cpu budget: limit 16 GiB, headroom 9 - 1 = 8 GiB (the summary once left out
    the limit, reserve and budgets that /metrics exports)."""
    from kvscope.agent.collectors import CollectorSet

    class VM:
        total, available = 16 * 2**30, 9 * 2**30

    collectors = CollectorSet(["host"], {"host": {
        "virtual_memory": lambda: VM, "cgroup_root": tmp_path, "reserve_bytes": 2**30,
        "budgets": {"cpu": 4 * 2**30}}})
    with TestClient(create_app(Agent(with_ingest=False, collectors=collectors))) as c:
        host = c.get("/api/v1/summary").json()["host"]
    assert host["memory_limit_bytes"] == 16 * 2**30 and host["memory_reserve_bytes"] == 2**30
    assert host["memory_headroom_bytes"] == 8 * 2**30
    assert host["offload_budget_bytes"] == {"cpu": 4 * 2**30}


def test_a_trailing_slash_is_not_redirected_to_where_the_host_header_says(client):
    """Starlette redirected /api/v1/summary/ (307) to a Location built from the client's Host
    header, before the token was checked."""
    response = client.get("/api/v1/summary/", headers={"Host": "evil.example"},
                          follow_redirects=False)
    assert response.status_code == 404 and "location" not in response.headers


def test_openmetrics_carries_trace_id_exemplars(client):
    text = client.get("/metrics", headers={"Accept": "application/openmetrics-text"}).text
    exemplars = [s.exemplar for f in text_string_to_metric_families(text) for s in f.samples
                 if s.exemplar and s.name == "kvscope_transfer_seconds_bucket"]
    # all three transfers share a bucket, which keeps the latest: r2's (a generated trace id)
    r2 = client.get("/api/v1/requests/r2").json()["trace_id"]
    assert [e.labels for e in exemplars] == [{"trace_id": r2}] and r2 != TRACE
    # TTFTs 0.1 s (r1) and 0.5 s, 0.3 s (r0, r2): buckets le=0.1 and le=0.5, the latter
    # keeping the later request's trace, r2's
    ttft = {s.labels["le"]: s.exemplar.labels["trace_id"]
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.exemplar and s.name == "kvscope_ttft_seconds_bucket"}
    r1 = client.get("/api/v1/requests/r1").json()["trace_id"]
    assert ttft == {"0.1": r1, "0.5": r2}
    plain = client.get("/metrics").text
    assert "# {" not in plain and "kvscope_transfer_seconds_bucket" in plain


def test_bearer_token_guards_the_api_but_not_metrics(caplog):
    """... and the first refusal is logged (a tryout's OTLP exporter without the token was
    refused in silence), once."""
    with caplog.at_level("WARNING", logger="kvscope.service.api"), \
            TestClient(create_app(_agent(token="s3cret"))) as c:
        assert c.get("/api/v1/summary").status_code == 401
        assert c.get("/api/v1/summary", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/v1/summary", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        # the scheme is case-insensitive (RFC 9110, section 11.1); the token is not
        assert c.get("/api/v1/summary", headers={"Authorization": "bearer s3cret"}).status_code == 200
        assert c.get("/api/v1/summary", headers={"Authorization": "Bearer S3CRET"}).status_code == 401
        assert c.get("/metrics").status_code == 200
        schemes = c.get("/openapi.json").json()["components"]["securitySchemes"]
        assert [s["scheme"] for s in schemes.values()] == ["bearer"]
        # an OTLP exporter refused after an API client is logged too (its own first)
        assert c.post("/v1/traces", content=b"{}",
                      headers={"Content-Type": "application/json"}).status_code == 401
        assert c.post("/v1/traces", content=b"{}",
                      headers={"Content-Type": "application/json"}).status_code == 401
    lines = [r.getMessage() for r in caplog.records if r.name == "kvscope.service.api"]
    assert [line.split(" from ")[0] for line in lines] == [
        "refused /api/v1/summary", "refused /v1/traces"], lines


def test_a_request_id_with_a_slash_can_be_fetched():
    agent = _agent()
    agent.pipeline.ingest("engine", [ev.RequestFinished(ts=1.0, request_id="tenant/7", ttft=0.2,
                                                        prompt_tokens=8)])
    with TestClient(create_app(agent)) as c:
        assert c.get("/api/v1/requests/tenant/7").json()["request_id"] == "tenant/7"
        assert c.get("/api/v1/requests/tenant%2F7").json()["request_id"] == "tenant/7"


def test_a_request_id_with_a_newline_can_be_fetched():
    """An OTLP span's id may hold any character: "a\nb" answered the router's bare 404, and
    "nl\n" was looked up as "nl". An empty ``?source=`` is no filter."""
    agent = _agent()
    agent.pipeline.ingest("engine", [
        ev.RequestFinished(ts=1.0, request_id=rid, ttft=0.2, prompt_tokens=8)
        for rid in ("a\nb", "nl\n")])
    with TestClient(create_app(agent)) as c:
        assert c.get("/api/v1/requests/a%0Ab").json()["request_id"] == "a\nb"
        assert c.get("/api/v1/requests/nl%0A").json()["request_id"] == "nl\n"
        assert c.get("/api/v1/requests/nl").status_code == 404
        # an empty ?source= filters nothing (it matched no record)
        assert c.get("/api/v1/requests/nl%0A?source=").status_code == 200
        every = c.get("/api/v1/requests").json()["total"]
        assert every >= 2 and c.get("/api/v1/requests?source=").json()["total"] == every


def test_a_long_request_id_is_cut_as_its_sender_cut_it():
    """Senders keep the first 256 characters of an id (events.MAX_REQUEST_ID): asking with the
    whole id finds the record, and a 10,000-character id not found is not echoed whole."""
    agent = _agent()
    long_id = "x" * 300
    agent.pipeline.ingest("engine", [ev.RequestFinished(ts=1.0, request_id=long_id[:256],
                                                        ttft=0.2, prompt_tokens=8)])
    with TestClient(create_app(agent)) as c:
        assert c.get(f"/api/v1/requests/{long_id}").json()["request_id"] == long_id[:256]
        missing = c.get("/api/v1/requests/" + "y" * 10_000)
        assert missing.status_code == 404 and len(missing.text) < 400


def test_a_completions_response_id_is_pointed_to_its_first_prompt():
    """vLLM 0.32's completions API runs prompt i of response "cmpl-ab" as request "cmpl-ab-i"
    (vllm/entrypoints/openai/completion/serving.py), choice j of it (n > 1) as "j_cmpl-ab-i":
    the response id alone is not in the table, and its 404 names the id that is; an id with
    no such record gets no hint."""
    agent = _agent()
    agent.pipeline.ingest("engine", [ev.RequestFinished(ts=1.0, request_id="cmpl-ab-0",
                                                        ttft=0.2, prompt_tokens=8)])
    with TestClient(create_app(agent)) as c:
        missing = c.get("/api/v1/requests/cmpl-ab")
        assert missing.status_code == 404
        assert "its first is 'cmpl-ab-0'" in missing.json()["detail"]
        assert c.get("/api/v1/requests/cmpl-ab-0").json()["request_id"] == "cmpl-ab-0"
        other = c.get("/api/v1/requests/cmpl-cd")
        assert other.status_code == 404 and "first is" not in other.json()["detail"]
        # n = 2: each choice is "<choice>_" before the prompt's id (docs/vllm.md)
        agent.pipeline.ingest("engine", [ev.RequestFinished(ts=2.0, request_id=f"{i}_cmpl-cd-0",
                                                            ttft=0.2, prompt_tokens=8)
                                         for i in range(2)])
        assert "its first is '0_cmpl-cd-0'" in c.get("/api/v1/requests/cmpl-cd").json()["detail"]


def test_a_request_is_fetched_by_source_when_two_engines_share_its_id():
    agent = _agent()
    agent.pipeline.ingest("other", [ev.RequestFinished(ts=500.0, request_id="r1", ttft=0.9,
                                                       prompt_tokens=8)])
    with TestClient(create_app(agent)) as c:
        assert c.get("/api/v1/requests/r1").json()["source"] == "other"  # finished last
        assert c.get("/api/v1/requests/r1", params={"source": "engine"}).json()["ttft"] == 0.1
        listed = c.get("/api/v1/requests", params={"source": "other"}).json()["requests"]
        assert [(r["request_id"], r["source"]) for r in listed] == [("r1", "other")]
        missing = c.get("/api/v1/requests/r1", params={"source": "nope"})
        assert missing.status_code == 404 and "from source 'nope'" in missing.json()["detail"]


def test_request_bodies_are_bounded():
    with TestClient(create_app(_agent(), max_body_bytes=100)) as c:
        assert c.post("/api/v1/summary", content=b"x" * 101).status_code == 413


def test_openapi_is_published(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/api/v1/summary", "/api/v1/requests", "/api/v1/requests/{request_id}",
            "/api/v1/timeseries"} <= set(paths)


_PARTIAL_POST = (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"resourceSpans\"")  # 16 of 1,000 bytes


@pytest.fixture
def served():
    """(port, server, uvicorn's error log records): the API on a real socket."""
    import logging

    from kvscope.service.server import ApiServer, bind

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    sock = bind("127.0.0.1", 0, "--port")
    server = ApiServer(create_app(_agent()), sock)
    logging.getLogger("uvicorn.error").addHandler(handler)
    server.start()
    try:
        yield sock.getsockname()[1], server, records
    finally:
        server.shutdown()
        logging.getLogger("uvicorn.error").removeHandler(handler)


def _send_partial_body(port: int):
    import socket

    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(_PARTIAL_POST)
    client.settimeout(0.5)
    try:
        client.recv(1)  # no answer: the server waits for the rest of the body
    except TimeoutError:
        pass
    return client


def test_a_client_stalled_inside_its_body_does_not_keep_the_server_from_stopping(served):
    """A client sends 16 of the 1,000 body bytes it declared, then nothing (a stalled OTLP
    exporter): shutdown() gives it the grace period and returns, where uvicorn once waited for
    it for good and the agent ignored every SIGTERM; uvicorn's line says so, without the
    cancelled request's traceback. 60 s only bounds a hang."""
    import threading

    port, server, records = served
    with _send_partial_body(port):
        stopping = threading.Thread(target=server.shutdown, daemon=True)
        stopping.start()
        stopping.join(60)
        assert not stopping.is_alive(), "shutdown() waited for the stalled client"
    assert any("graceful shutdown" in r.getMessage() for r in records)
    assert not [r for r in records if r.exc_info], "a traceback was logged"


def test_a_client_leaving_inside_its_body_logs_no_traceback(served):
    """Five clients close mid-body (an exporter giving up on a slow POST): each was a
    50-line "Exception in ASGI application" traceback (ClientDisconnect); now nothing."""
    import urllib.request

    port, server, records = served
    for _ in range(5):
        _send_partial_body(port).close()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as answer:
        assert answer.status == 200  # served on, and the closed requests were handled by now
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]


def test_node_gives_the_collectors_series_as_on_metrics():
    """``/api/v1/node``: the node collectors read now, on this machine's real /sys and /proc
    (this test process as the engine), in the exposition's names and labels; ``metric`` picks
    some, an unknown one is refused."""
    import os
    from pathlib import Path

    from kvscope.agent.collectors.numa import parse_node_list

    agent = Agent(AgentSettings(collectors={"numa": {"engine_pid": os.getpid()}}),
                  with_ingest=False)
    with TestClient(create_app(agent)) as c:
        series = c.get("/api/v1/node").json()["series"]
        up = {s["labels"]["collector"]: s["value"] for s in series
              if s["name"] == "kvscope_collector_up"}
        assert up["numa"] == 1.0 and up["host"] == 1.0
        online = Path("/sys/devices/system/node/online")
        if online.is_file():
            (nodes,) = [s["value"] for s in series if s["name"] == "kvscope_host_numa_nodes"]
            assert nodes == len(parse_node_list(online.read_text()))
            placed = {s["labels"]["numa_node"]: s["value"] for s in series
                      if s["name"] == "kvscope_process_numa_bytes"}
            assert sum(placed.values()) > 0  # this process has memory somewhere
        gpus = [s for s in series if s["name"] == "kvscope_gpu_topology_info"]
        assert bool(gpus) == (up.get("gpu") == 1.0)  # no driver: no GPU series, never zeros
        picked = c.get("/api/v1/node", params={"metric": ["kvscope_collector_up"]}).json()
        assert {s["name"] for s in picked["series"]} == {"kvscope_collector_up"}
        bad = c.get("/api/v1/node", params={"metric": "kvscope_nope"})
        assert bad.status_code == 422 and "kvscope_nope" in bad.json()["detail"]


def test_without_engine_pid_the_node_places_the_memory_of_the_process_a_tap_runs_in(tmp_path):
    """The agent's numa collector, with no engine_pid configured, reads the process a tap's
    batches come from (here this one, through a real emitter and the agent's real ingest):
    kvscope_process_numa_bytes appears once the tap has sent, and leaves when it closes."""
    import os

    from conftest import wait_until
    from kvscope.agent.taps.emitter import Emitter

    endpoint = f"ipc://{tmp_path}/ingest.sock"
    agent = Agent(AgentSettings(ingest={"endpoint": endpoint}, collectors={"gpu": {
        "enabled": False}}))

    def placed(c):
        return {s["labels"]["numa_node"]: s["value"] for s in c.get(
            "/api/v1/node", params={"metric": "kvscope_process_numa_bytes"}).json()["series"]}

    agent.start()
    try:
        with TestClient(create_app(agent)) as c:
            assert placed(c) == {}  # no engine_pid, no tap yet: not known, not 0
            emitter = Emitter(endpoint, source="engine", flush_interval=0.01)
            emitter.emit(ev.Lookup(ts=1.0, request_id="r", tokens={"recompute": 16}))
            assert wait_until(lambda: agent.ingest.engine_pids() == (os.getpid(),))
            assert sum(placed(c).values()) > 0
            emitter.close()
            assert wait_until(lambda: placed(c) == {})
    finally:
        agent.shutdown()


@pytest.mark.parametrize("stall", [b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n",
                                   b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n"
                                   b"Content-Type: application/json\r\nContent-Length: 100\r\n"
                                   b"\r\n{\"resource"],
                         ids=["nothing", "part-of-the-headers", "part-of-the-body"])
def test_clients_that_stall_are_closed_so_scrapes_are_served_again(stall):
    """Two clients stall under a cap of 3 connections: sending nothing, part of their
    headers, or part of a body (their headers reach the app: 2 connections are under the cap).
    A probe makes 3, the cap: 503. uvicorn closed none of the stalled, so every scrape and
    health probe after them was answered 503 for as long as they stayed (a tryout held 256
    sockets open for minutes against the agent's default cap). With a read timeout of 0.5 s
    they are closed and /healthz answers 200 again while they still hold their sockets; a
    request whose response takes longer than the timeout (a slow handler, 1.5 s) is not cut."""
    import asyncio
    import socket

    import httpx

    from kvscope.service.server import ApiServer, bind

    app = create_app(_agent())

    @app.get("/slow")
    async def slow():
        await asyncio.sleep(1.5)
        return {"slow": True}

    sock = bind("127.0.0.1", 0, "--port")
    server = ApiServer(app, sock, max_connections=3, read_timeout=0.5)
    server.start()
    port = sock.getsockname()[1]
    stalled = []
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/slow", timeout=30).json() == {"slow": True}
        stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        for client in stalled:
            client.sendall(stall)
        codes = []
        for _ in range(1200):  # until the server has closed them (0.5 s after they connected)
            codes.append(httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code)
            if codes[-1] == 200:
                break
            time.sleep(0.05)
        assert codes[0] == 503 and codes[-1] == 200, codes
        for client in stalled:  # closed by the server, unanswered
            client.settimeout(30)
            assert client.recv(1024) == b""
    finally:
        for client in stalled:
            client.close()
        server.shutdown()


def test_clients_past_the_connection_cap_get_503_and_the_server_stays_up():
    """Two clients connect and send nothing (a stalled exporter, or a slow-loris one); with a
    cap of 2 the next one is answered 503 at once, not left to pile up sockets and tasks, and
    once they leave it is served again."""
    import socket

    import httpx

    from kvscope.service.server import ApiServer, bind

    sock = bind("127.0.0.1", 0, "--port")
    server = ApiServer(create_app(_agent()), sock, max_connections=2)
    server.start()
    port = sock.getsockname()[1]
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        try:
            assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 503
        finally:
            for client in idle:
                client.close()
        for _ in range(100):  # the server notices the closed sockets on its loop
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200:
                break
        else:
            raise AssertionError("still 503 after the idle clients left")
    finally:
        server.shutdown()


def test_a_sample_that_raises_costs_that_sample_alone(monkeypatch, caplog):
    """The sampler thread had no guard: one exception while recording a sample (a bug in a
    listener or the capture) ended it, and the dashboard's samples stopped for good. The
    first of three calls raises: it is logged, and the next two are made."""
    import threading

    from conftest import wait_until

    agent = Agent(AgentSettings(sample_interval=0.1), with_ingest=False)
    calls = []

    def sample():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a listener's bug")

    monkeypatch.setattr(agent, "sample", sample)
    sampler = threading.Thread(target=agent.run)
    sampler.start()
    try:
        assert wait_until(lambda: len(calls) >= 3)
    finally:
        agent.stopping.set()
        sampler.join(30)
    assert not sampler.is_alive()
    assert "recording a sample failed" in caplog.text
