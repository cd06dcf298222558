"""Fuzzing the agent's HTTP API (issue 26) through the real app served by uvicorn on a loopback
socket: random methods, paths, path segments and query strings (unicode, percent-encoding
broken or not, numbers past float's range, over-long values), bodies on GET, and, with a token
configured, random Authorization headers.

One server per test, driven by an inner ``@given`` function so that the test can check after
the fuzz that the server still answers a valid request. Requests stay within what HTTP/1.1
allows (token methods, printable targets, header values of visible characters) and under h11's
16 KiB bound on a request head, beyond which uvicorn itself answers a plain-text 400: what is
fuzzed is the app, not h11. Hypothesis picks new examples each run, as the repository's other
property tests do.
"""

from __future__ import annotations

import json
import re
import string
from contextlib import contextmanager
from urllib.parse import quote

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope import events as ev
from kvscope.agent.config import AgentSettings
from kvscope.service.agent import Agent
from kvscope.service.api import create_app
from kvscope.service.server import ApiServer, bind

from conftest import http_exchange

TOKEN = "s3cret-Tok3n"
HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
PROTECTED = ["/api/v1/summary", "/api/v1/timeseries", "/api/v1/requests",
             "/api/v1/requests/r1", "/api/v1/requests/tenant/7"]


def _agent(**settings) -> Agent:
    """An agent (not started: no collectors, no store) holding three finished requests and one
    sample."""
    agent = Agent(AgentSettings(collectors={"gpu": {"enabled": False}}, **settings),
                  with_ingest=False)
    for i, rid in enumerate(["r0", "r1", "tenant/7"]):
        agent.pipeline.ingest("engine", [
            ev.RequestStarted(ts=100.0 + i, request_id=rid, prompt_tokens=48),
            ev.Transfer(ts=100.0 + i, src="cpu", dst="gpu", blocks=2, bytes=65536,
                        duration=0.0004, request_id=rid),
            ev.RequestFinished(ts=100.5 + i, request_id=rid, ttft=0.1 * (i + 1),
                               prompt_tokens=48)])
    agent.sample()
    return agent


@contextmanager
def served(**settings):
    """(agent, port): the API of :func:`_agent` on 127.0.0.1."""
    agent = _agent(**settings)
    sock = bind("127.0.0.1", 0, "--port")
    server = ApiServer(create_app(agent, max_body_bytes=4096), sock)
    server.start()
    try:
        yield agent, sock.getsockname()[1]
    finally:
        server.shutdown()


def _still_answers(port: int, headers: dict[str, str] | None = None) -> None:
    status, _, body = http_exchange(port, "GET", "/api/v1/requests?sort=ttft&order=asc", headers)
    assert status == 200, (status, body[:300])
    assert [r["request_id"] for r in json.loads(body)["requests"]] == ["r0", "r1", "tenant/7"]


# --- requests -------------------------------------------------------------------------------

# mostly GET, so that most examples reach the handlers' parameters
methods = st.one_of(st.just("GET"), st.just("GET"), st.just("GET"), st.just("GET"),
                    st.sampled_from(["HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"]),
                    st.text(string.ascii_letters + "!#$%&'*+-.^_`|~", min_size=1, max_size=10))
numbers = st.one_of(st.integers(-3, 3).map(str), st.integers(-2**70, 2**70).map(str),
                    st.floats().map(repr),
                    st.sampled_from(["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "-0",
                                     "0x10", "1_000", " 5", "5 ", "", "true", "1" * 5000]))
words = st.one_of(st.text(max_size=30), st.text(max_size=3000),
                  st.sampled_from(["finished", "ttft", "started", "asc", "desc", "engine",
                                   "ttft_seconds", "%", "%zz", "%ff%fe", "%00", "%2F", "..",
                                   "a/b", "?", "#", "&&", "=="]))
values = st.one_of(numbers, numbers, words)  # the parameters are mostly numbers
# each route's own parameters, so that most examples reach a handler's checks
PARAMS = {"/api/v1/requests": ["limit", "sort", "order", "min_ttft", "source"],
          "/api/v1/timeseries": ["since", "window", "metric", "metric"],
          "/api/v1/requests/r1": ["source"]}
ALL_PARAMS = sorted({key for keys in PARAMS.values() for key in keys})


def _encode(text: str, safe: str) -> str:
    """``text`` percent-encoded as UTF-8 (``safe`` left as is, so "%zz" arrives broken)."""
    return quote(text, safe=safe + "%")


@st.composite
def targets(draw):
    """A request target: a route (its own parameters or others) or a random path, with a random
    query string."""
    segment = draw(st.one_of(words, numbers))
    safe = draw(st.sampled_from(["", "/", "/?&=#"]))
    path = draw(st.one_of(st.sampled_from(sorted(PARAMS)), st.sampled_from([
        "/api/v1/requests/" + _encode(segment, safe), "/api/v1/requests/tenant/7",
        "/api/v1/requests/tenant%2F7", "/api/v1/requests/", "/api/v1/summary",
        "/api/v1/" + _encode(segment, safe), "/api/v1/summary/", "/api", "/metrics",
        "/healthz", "/openapi.json", "/v1/traces", "/" + _encode(segment, safe),
        "//api//v1//requests", "/api/v1/requests/../summary"])))
    own = PARAMS.get(path, ["source"])
    keys = st.one_of(st.sampled_from(own), st.sampled_from(own), st.sampled_from(own),
                     st.sampled_from(ALL_PARAMS), st.text(max_size=10))
    pairs = draw(st.lists(st.tuples(keys, values), max_size=5))
    joiner = draw(st.sampled_from(["&", "&", ";", "&&"]))
    query = joiner.join(f"{_encode(k, safe)}={_encode(v, safe)}" for k, v in pairs)
    target = path + ("?" + query if pairs or draw(st.booleans()) else "")
    return target[:12_000]  # under h11's 16 KiB request head


header_text = st.text(st.characters(codec="latin-1", exclude_categories=["Cc"]), max_size=60)


@st.composite
def requests(draw):
    """(method, target, headers, body): bodies on GET too, random Accept headers."""
    headers = {}
    if draw(st.booleans()):
        headers["Accept"] = draw(st.one_of(st.sampled_from([
            "application/openmetrics-text; version=1.0.0", "application/json", "*/*",
            "text/plain;q=0"]), header_text))
    body = draw(st.one_of(st.none(), st.none(), st.none(), st.binary(max_size=64),
                          st.sampled_from([b"{}", b'{"limit": 5}',
                                           b"x" * 5000])))  # 5,000 > the 4,096 allowed
    if body is not None and draw(st.booleans()):
        headers["Content-Type"] = draw(st.one_of(
            st.sampled_from(["application/json", "application/x-protobuf"]), header_text))
    return draw(methods), draw(targets()), headers, body


def _check(method: str, target: str, status: int, headers: dict[str, str],
           body: bytes) -> None:
    # /readyz, 503 until the agent starts by design, is not among the paths
    assert status < 500, (status, body[:300])
    if 400 <= status and method != "HEAD":
        assert headers.get("content-type", "").startswith("application/json"), (status, body)
        assert isinstance(json.loads(body)["detail"], (str, list)), body[:300]
    if status == 200 and method == "GET" and target.startswith("/api/"):
        json.loads(body)


def test_random_requests_are_never_answered_with_5xx():
    """Promise, on every example (random method, path, query string and body, no token): no 5xx
    and no dropped connection; every 4xx but a HEAD's carries a JSON ``detail``; a 200 from
    /api is JSON. After the fuzz the server still answers a valid request."""
    with served() as (_, port):
        @settings(max_examples=800, deadline=None, suppress_health_check=HEALTH)
        @given(case=requests())
        def fuzz(case):
            method, target, headers, body = case
            status, answer_headers, answer = http_exchange(port, method, target, headers, body)
            _check(method, target, status, answer_headers, answer)

        fuzz()
        _still_answers(port)


# --- tokens ---------------------------------------------------------------------------------

def _flip_case(text: str, mask: list[bool]) -> str:
    return "".join(c.swapcase() if flip else c for c, flip in zip(text, mask + [False] * 99))


@st.composite
def authorizations(draw):
    """An Authorization header: the right one in its allowed spellings, near misses of it (the
    token cut, extended, in another case, under another scheme) or anything."""
    spaces = st.text(" \t", max_size=3)
    scheme = draw(st.one_of(st.sampled_from(["Bearer", "bearer", "BEARER", "Basic", "Token",
                                             "Bearer:", "", "Bearers"]),
                            st.lists(st.booleans(), max_size=6).map(
                                lambda mask: _flip_case("Bearer", mask))))
    token = draw(st.one_of(
        st.just(TOKEN), st.just(TOKEN),
        st.integers(0, len(TOKEN) - 1).map(lambda n: TOKEN[:n]),
        st.builds(lambda a, b: a + TOKEN + b, header_text, header_text),
        st.lists(st.booleans(), min_size=1, max_size=len(TOKEN)).map(
            lambda mask: _flip_case(TOKEN, mask)),
        header_text))
    separator = draw(st.sampled_from([" ", " ", "  ", "\t", "", ":", "\xa0"]))
    return draw(spaces) + scheme + separator + token + draw(spaces)


def _is_the_token(header: str) -> bool:
    """Whether ``header`` is ``Bearer <the token>`` up to white space and the case of the
    scheme (RFC 9110, 11.1: the scheme is case-insensitive, the credentials are not)."""
    compact = re.sub(r"\s", "", header)
    return compact[:6].lower() == "bearer" and compact[6:] == TOKEN


def test_with_a_token_nothing_but_the_token_opens_the_api():
    """Promise, on every example (a protected route and a random Authorization header, or
    none): a 200 only when the header is ``Bearer <token>`` (any case of the scheme, any white
    space around it), and that header always gets one; otherwise 401 with a JSON ``detail``
    and ``WWW-Authenticate: Bearer``; never a 5xx. After the fuzz the server still answers."""
    with served(token=TOKEN) as (_, port):
        @settings(max_examples=400, deadline=None, suppress_health_check=HEALTH)
        @given(path=st.sampled_from(PROTECTED), authorization=st.one_of(
            st.none(), authorizations()))
        def fuzz(path, authorization):
            headers = {} if authorization is None else {"Authorization": authorization}
            status, answer_headers, answer = http_exchange(port, "GET", path, headers)
            canonical = (authorization is not None
                         and re.fullmatch(r"[ \t]*(?i:bearer) +" + re.escape(TOKEN) + r"[ \t]*",
                                          authorization) is not None)
            if status == 200:
                assert authorization is not None and _is_the_token(authorization), authorization
            else:
                assert not canonical, (status, authorization, answer[:200])
                assert status == 401, (status, answer[:300])
                assert answer_headers.get("www-authenticate") == "Bearer"
                assert isinstance(json.loads(answer)["detail"], str)

        fuzz()
        _still_answers(port, {"Authorization": f"Bearer {TOKEN}"})
