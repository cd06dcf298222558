"""Unit tests of the dashboard's pure parts (figure builders, Overview rendering) and of the
agent backend against a real local HTTP server.

Timestamps: T = 1764410000 is 2025-11-29 09:53:20 UTC; the time axis shows naive UTC times.
"""

from __future__ import annotations

import json
import socket
import threading
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvscope.dashboard import figures
from kvscope.dashboard.app import create_app
from kvscope.dashboard.backend import AgentBackend, BackendUnavailable
from kvscope.dashboard.pages import overview

T = 1764410000.0


def at(seconds: int) -> datetime:
    """The time axis value of the sample at T + seconds."""
    return datetime(2025, 11, 29, 9, 53, 20 + seconds)


def sample(dt: float, **fields) -> dict:
    return {"ts": T + dt, **fields}


def annotation_texts(fig) -> list[str]:
    return [a.text for a in fig.layout.annotations]


# --- counter rates -------------------------------------------------------------------------

def test_rate_between_two_samples():
    """gpu 100 -> 400 over 1 s: (400 - 100) / 1 = 300 tokens/s, drawn at the later sample."""
    rates = figures.counter_rates(
        [sample(0, prompt_tokens={"gpu": 100}), sample(1, prompt_tokens={"gpu": 400})],
        "prompt_tokens")
    assert rates == {"gpu": ([at(1)], [300.0])}


def test_rate_divides_by_elapsed_seconds():
    """cpu 1000 -> 1600 over 2 s: 600 / 2 = 300 tokens/s."""
    rates = figures.counter_rates(
        [sample(0, prompt_tokens={"cpu": 1000}), sample(2, prompt_tokens={"cpu": 1600})],
        "prompt_tokens")
    assert rates["cpu"][1] == [300.0]


def test_counter_reset_counts_new_value_as_increase():
    """gpu 100, 400, 50, 150 at 1 s steps. 100->400: 300/s. 400->50 went down, so the agent
    restarted and 50 tokens came after the reset: 50/s (PromQL rate()). 50->150: 100/s."""
    samples = [sample(i, prompt_tokens={"gpu": v}) for i, v in enumerate([100, 400, 50, 150])]
    assert figures.counter_rates(samples, "prompt_tokens")["gpu"][1] == [300.0, 50.0, 100.0]


def test_missing_key_counts_as_zero_and_keys_keep_canonical_order():
    """disk absent, then 20: 20 tokens/s. recompute 10 -> absent (a reset to 0): 0/s.
    Order is gpu, cpu, disk, recompute whatever the dict order."""
    samples = [
        sample(0, prompt_tokens={"recompute": 10, "gpu": 0}),
        sample(1, prompt_tokens={"disk": 20, "cpu": 5, "gpu": 7}),
    ]
    rates = figures.counter_rates(samples, "prompt_tokens")
    assert list(rates) == ["gpu", "cpu", "disk", "recompute"]
    assert {k: ys for k, (_xs, ys) in rates.items()} == {
        "gpu": [7.0], "cpu": [5.0], "disk": [20.0], "recompute": [0.0]}


def test_samples_without_time_progress_give_no_rate():
    """Two samples with the same ts (or going back) have no defined rate: no point."""
    samples = [sample(0, prompt_tokens={"gpu": 1}), sample(0, prompt_tokens={"gpu": 9})]
    assert figures.counter_rates(samples, "prompt_tokens") == {}


# --- figures -------------------------------------------------------------------------------

def test_hit_quality_stacks_tokens_per_second_by_source():
    """gpu 0 -> 300 -> 900 and recompute 0 -> 100 -> 100 at 1 s steps:
    gpu 300, 600 tokens/s; recompute 100, 0 tokens/s."""
    samples = [
        sample(0, prompt_tokens={"gpu": 0, "recompute": 0}),
        sample(1, prompt_tokens={"gpu": 300, "recompute": 100}),
        sample(2, prompt_tokens={"gpu": 900, "recompute": 100}),
    ]
    fig = figures.hit_quality(samples)
    assert [t.name for t in fig.data] == ["gpu", "recompute"]
    assert list(fig.data[0].y) == [300.0, 600.0]
    assert list(fig.data[1].y) == [100.0, 0.0]
    assert list(fig.data[0].x) == [at(1), at(2)]
    assert {t.stackgroup for t in fig.data} == {"tokens"}
    assert fig.layout.yaxis.title.text == "tokens/s"
    assert fig.layout.xaxis.title.text == "time (UTC)"
    assert fig.layout.xaxis.type == "date"


def test_transfer_throughput_in_bytes_per_second_per_direction():
    """gpu->cpu 0 -> 123456 over 1 s: 123456 B/s; cpu->gpu 65536 -> 196608 over 1 s: 131072 B/s."""
    samples = [
        sample(0, transfer_bytes={"gpu->cpu": 0, "cpu->gpu": 65536}),
        sample(1, transfer_bytes={"gpu->cpu": 123456, "cpu->gpu": 196608}),
    ]
    fig = figures.transfer_throughput(samples)
    assert {t.name: list(t.y) for t in fig.data} == {"gpu->cpu": [123456.0], "cpu->gpu": [131072.0]}
    assert fig.layout.yaxis.ticksuffix == "B/s"
    assert fig.layout.yaxis.tickformat == "~s"


def test_tier_residency_draws_resident_solid_and_capacity_dashed_in_one_colour():
    samples = [
        sample(0, tier_resident_bytes={"gpu": 1024}, tier_capacity_bytes={"gpu": 8388608}),
        sample(1, tier_resident_bytes={"gpu": 4096, "cpu": 512},
               tier_capacity_bytes={"gpu": 8388608, "cpu": 33554432}),
    ]
    fig = figures.tier_residency(samples)
    traces = {t.name: t for t in fig.data}
    assert list(traces) == ["gpu resident", "gpu capacity", "cpu resident", "cpu capacity"]
    assert list(traces["gpu resident"].y) == [1024.0, 4096.0]
    assert list(traces["cpu resident"].x) == [at(1)]  # cpu appeared only in the second sample
    assert list(traces["cpu capacity"].y) == [33554432.0]
    assert traces["gpu capacity"].line.dash == "dash"
    assert traces["gpu resident"].line.dash is None
    assert traces["gpu resident"].line.color == traces["gpu capacity"].line.color
    assert fig.layout.yaxis.ticksuffix == "B"


def test_host_memory_skips_samples_without_the_value():
    samples = [sample(0, host_memory_available_bytes=2.1e10), sample(1),
               sample(2, host_memory_available_bytes=2.0e10)]
    fig = figures.host_memory(samples)
    assert list(fig.data[0].x) == [at(0), at(2)]
    assert list(fig.data[0].y) == [2.1e10, 2.0e10]
    assert fig.layout.yaxis.ticksuffix == "B"


@pytest.mark.parametrize("build", [figures.hit_quality, figures.tier_residency,
                                   figures.transfer_throughput, figures.host_memory])
def test_no_samples_gives_a_readable_empty_state(build):
    fig = build([])
    assert len(fig.data) == 0
    assert annotation_texts(fig) == ["no data yet"]
    assert fig.layout.title.text


def test_one_sample_is_not_enough_for_a_rate():
    fig = figures.hit_quality([sample(0, prompt_tokens={"gpu": 5})])
    assert annotation_texts(fig) == ["no data yet"]


def test_unreachable_figure_names_the_url():
    fig = figures.unreachable_figure("Host RAM available", "http://127.0.0.1:9400")
    assert annotation_texts(fig) == ["agent unreachable: http://127.0.0.1:9400"]
    assert fig.layout.title.text == "Host RAM available"


def test_last_window_counts_back_from_the_newest_sample():
    samples = [sample(i) for i in range(10)]
    assert [s["ts"] - T for s in figures.last_window(samples, 3)] == [6, 7, 8, 9]
    assert figures.last_window([], 3) == []


# --- Overview page (pure parts) ------------------------------------------------------------

def test_render_returns_four_figures_and_a_status_line():
    samples = [sample(0, prompt_tokens={"gpu": 0}, host_memory_available_bytes=1e9),
               sample(1, prompt_tokens={"gpu": 300}, host_memory_available_bytes=1e9)]
    *figs, status = overview.render(samples, "http://agent:9400", window_seconds=900)
    assert len(figs) == 4
    assert list(figs[0].data[0].y) == [300.0]
    assert status == "agent http://agent:9400 · 2 samples · last 09:53:21 UTC"
    for fig in figs:
        json.loads(fig.to_json())  # what Dash sends must serialise


def test_pause_toggles_on_odd_clicks():
    assert overview.pause_state(0) == (False, "Pause")
    assert overview.pause_state(None) == (False, "Pause")
    assert overview.pause_state(1) == (True, "Resume")
    assert overview.pause_state(2) == (False, "Pause")


def test_create_app_twice_builds_independent_apps():
    apps = [create_app("http://127.0.0.1:9"), create_app("http://127.0.0.1:9")]
    for app in apps:
        assert app.title == "kvscope"
        ids = set(app.layout)  # a Dash component iterates over the ids in its tree
        assert {"hit-quality", "tier-residency", "transfer-throughput", "host-memory",
                "refresh", "pause", "status"} <= ids
    assert apps[0].callback_map.keys() == apps[1].callback_map.keys()
    assert len(apps[0].callback_map) == 2


# --- backend against a real HTTP server ----------------------------------------------------

class _Agent(BaseHTTPRequestHandler):
    """Answers every GET with the server's ``reply`` = (status, body bytes)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.server.paths.append(self.path)
        status, body = self.server.reply
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        return


@pytest.fixture()
def agent():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Agent)
    server.paths = []
    server.reply = (200, b"{}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_backend_reads_samples_and_passes_since(agent):
    agent.reply = (200, json.dumps({"interval": 1.0, "samples": [{"ts": T}]}).encode())
    backend = AgentBackend(_url(agent) + "/")
    assert backend.timeseries() == [{"ts": T}]
    assert backend.timeseries(since=T) == [{"ts": T}]
    assert agent.paths == ["/api/v1/timeseries", f"/api/v1/timeseries?since={T}"]
    backend.close()


@pytest.mark.parametrize(("reply", "reason"), [
    ((500, b"{}"), "HTTP 500 from /api/v1/timeseries"),
    ((200, b"not json"), "bad JSON from /api/v1/timeseries"),
    ((200, b'{"samples": [{"no_ts": 1}]}'), "unexpected timeseries payload"),
    ((200, b"[]"), "unexpected timeseries payload"),
])
def test_backend_raises_typed_error_on_bad_answers(agent, reply, reason):
    agent.reply = reply
    with pytest.raises(BackendUnavailable) as info:
        AgentBackend(_url(agent)).timeseries()
    assert info.value.url == _url(agent)
    assert info.value.reason == reason


def test_backend_raises_typed_error_when_nothing_listens():
    with socket.socket() as sock:  # a port that was free a moment ago and is closed now
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(BackendUnavailable) as info:
        AgentBackend(url, timeout=1.0).timeseries()
    assert info.value.url == url


def test_refresh_shows_unreachable_agent_instead_of_failing():
    backend = AgentBackend("http://127.0.0.1:9", timeout=1.0)
    *figs, status = overview.refresh(backend, window_seconds=900)
    assert status.startswith("agent unreachable: http://127.0.0.1:9 (")
    assert [annotation_texts(f) for f in figs] == [["agent unreachable: http://127.0.0.1:9"]] * 4
