"""Unit tests of the dashboard's pure parts (series transforms, Overview figures and page
rendering, the shell) and of the agent backend against a real local HTTP server.

Times: T = 1764410000 is 2025-11-29 09:53:20 UTC; series carry epoch milliseconds (plotly
draws them on a date axis), so the point of the sample at T + s is at ms(s) = (T + s) * 1000.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

from kvscope.dashboard import figures
from kvscope.dashboard import series as S
from kvscope.dashboard.app import create_app, pause_state, route
from kvscope.dashboard.backend import AgentBackend, BackendUnavailable
from kvscope.dashboard.pages import overview
from conftest import wait_until

T = 1764410000.0


def ms(seconds: float) -> float:
    return (T + seconds) * 1000.0


def sample(dt: float, **fields) -> dict:
    return {"ts": T + dt, **fields}


def annotation_texts(fig) -> list[str]:
    """The figure's annotations as one line each (a message figure wraps them with <br>)."""
    return [a.text.replace("<br>", " ") for a in fig.layout.annotations]


def ys(trace) -> list[float]:
    return [None if np.isnan(v) else float(v) for v in np.asarray(trace.y, float)]


def traces(fig) -> dict:
    return {t.name: t for t in fig.data}


# --- series transforms ---------------------------------------------------------------------

def test_rate_between_two_samples():
    """gpu 100 -> 400 over 1 s: (400 - 100) / 1 = 300 tokens/s, drawn at the later sample."""
    rates = S.counter_rates(
        [sample(0, prompt_tokens={"gpu": 100}), sample(1, prompt_tokens={"gpu": 400})],
        "prompt_tokens")
    assert list(rates) == ["gpu"]
    assert list(rates["gpu"][0]) == [ms(1)]
    assert list(rates["gpu"][1]) == [300.0]


def test_rate_divides_by_elapsed_seconds():
    """cpu 1000 -> 1600 over 2 s: 600 / 2 = 300 tokens/s."""
    rates = S.counter_rates(
        [sample(0, prompt_tokens={"cpu": 1000}), sample(2, prompt_tokens={"cpu": 1600})],
        "prompt_tokens")
    assert list(rates["cpu"][1]) == [300.0]


def test_counter_reset_counts_new_value_as_increase():
    """gpu 100, 400, 50, 150 at 1 s steps, rates over 1 s. 100->400: 300/s. 400->50 went
    down, so the agent restarted and 50 tokens came after the reset: 50/s (PromQL rate()).
    50->150: 100/s. Over the 10 s window they cover from the first sample: 300/1, 350/2,
    450/3 = 150/s."""
    samples = [sample(i, prompt_tokens={"gpu": v}) for i, v in enumerate([100, 400, 50, 150])]
    assert list(S.counter_rates(samples, "prompt_tokens", 1.0)["gpu"][1]) == [300.0, 50.0, 100.0]
    assert list(S.counter_rates(samples, "prompt_tokens")["gpu"][1]) == [300.0, 175.0, 150.0]
    assert S.window_increase(samples, "prompt_tokens") == {"gpu": 450.0}


@pytest.mark.parametrize("scrape", [5, 15])
def test_a_scraped_counter_reads_its_mean_rate_not_a_spike_per_scrape(scrape):
    """Samples every second; the counter steps by 600 tokens once per ``scrape`` seconds (a
    scraped engine's metrics). Rates between consecutive samples read 0 in all but one
    sample of each scrape and 600/s there. The window is twice the median gap between steps
    (10 s at 5 s scrapes, 30 s at 15 s), so each holds exactly two steps once it fits in the
    data: 1,200 tokens over 10 s = 120/s at 5 s scrapes, over 30 s = 40/s at 15 s, the mean
    rate 600 / scrape, at every point."""
    samples = [sample(t, prompt_tokens={"gpu": 600 * (t // scrape)}) for t in range(8 * scrape)]
    assert S.rate_window(samples, "prompt_tokens") == 2 * scrape
    xs, rates = S.counter_rates(samples, "prompt_tokens")["gpu"]
    steady = rates[xs >= ms(2 * scrape)]
    assert len(steady) == 6 * scrape and set(steady) == {600 / scrape}
    pairs = S.counter_rates(samples, "prompt_tokens", 1.0)["gpu"][1]
    assert sorted(set(pairs)) == [0.0, 600.0]


def test_missing_key_counts_as_zero_and_keys_keep_canonical_order():
    """disk absent, then 20: 20 tokens/s. recompute 10 -> absent (a reset to 0): 0/s."""
    samples = [sample(0, prompt_tokens={"recompute": 10, "gpu": 0}),
               sample(1, prompt_tokens={"disk": 20, "cpu": 5, "gpu": 7})]
    rates = S.counter_rates(samples, "prompt_tokens")
    assert list(rates) == ["gpu", "cpu", "disk", "recompute"]
    assert {k: list(v[1]) for k, v in rates.items()} == {
        "gpu": [7.0], "cpu": [5.0], "disk": [20.0], "recompute": [0.0]}


def test_samples_without_time_progress_give_no_rate():
    samples = [sample(0, prompt_tokens={"gpu": 1}), sample(0, prompt_tokens={"gpu": 9})]
    assert S.counter_rates(samples, "prompt_tokens") == {}


def test_thin_keeps_the_newest_and_bounds_the_count():
    samples = [sample(i) for i in range(3600)]
    thinned = S.thin(samples, 720)
    assert len(thinned) <= 720
    assert thinned[-1] is samples[-1]
    assert S.thin(samples[:10], 720) == samples[:10]


def test_last_window_counts_back_from_the_newest_sample():
    samples = [sample(i) for i in range(10)]
    assert [s["ts"] - T for s in S.last_window(samples, 3)] == [6, 7, 8, 9]
    assert S.last_window([], 3) == []


def test_bucket_increase_adds_each_buckets_increases_and_handles_resets():
    """cpu: [4, 2, 1] - [1, 2, 0]. gpu first appears in the last sample: it had no observations
    in the first, so all 5 are the window's (they were dropped, while window_increase counted
    the same evictions: the Tiers page said their age and hits were "not measured")."""
    samples = [sample(0, h={"cpu": [1, 2, 0]}), sample(1, h={"cpu": [4, 2, 1], "gpu": [5, 0, 0]})]
    assert {k: list(v) for k, v in S.bucket_increase(samples, "h").items()} == {
        "gpu": [5.0, 0.0, 0.0], "cpu": [3.0, 0.0, 1.0]}
    reset = [sample(0, h={"cpu": [9, 9, 9]}), sample(1, h={"cpu": [1, 0, 0]})]
    assert list(S.bucket_increase(reset, "h")["cpu"]) == [1.0, 0.0, 0.0]
    # a reset between growth: 10 -> 12 (+2), reset to 0, then 1 and 14 -> [3, 14], as
    # increase() per bucket reads it (first and last alone: [-9, 14], and a share of evicted
    # blocks never reused of -180%)
    grown = [sample(t, h={"cpu": c}) for t, c in
             enumerate(([10, 0, 0], [12, 0, 0], [0, 0, 0], [1, 14, 0]))]
    assert list(S.bucket_increase(grown, "h")["cpu"]) == [3.0, 14.0, 0.0]
    # one sample: nothing in the window yet
    assert list(S.bucket_increase(grown[:1], "h")["cpu"]) == [0.0, 0.0, 0.0]


# --- Overview figures -----------------------------------------------------------------------

def test_hit_quality_stacks_tokens_per_second_by_source():
    """gpu 0 -> 300 -> 900 and recompute 0 -> 100 -> 100 at 1 s steps; each point's window
    (10 s) reaches back to the first sample: gpu 300/1, 900/2; recompute 100/1, 100/2."""
    samples = [sample(0, prompt_tokens={"gpu": 0, "recompute": 0}),
               sample(1, prompt_tokens={"gpu": 300, "recompute": 100}),
               sample(2, prompt_tokens={"gpu": 900, "recompute": 100})]
    fig = figures.hit_quality(samples)
    assert [t.name for t in fig.data] == ["gpu", "recompute"]
    assert ys(fig.data[0]) == [300.0, 450.0]
    assert ys(fig.data[1]) == [100.0, 50.0]
    assert list(fig.data[0].x) == [ms(1), ms(2)]
    assert {t.stackgroup for t in fig.data} == {"tokens"}
    assert fig.layout.yaxis.title.text == "tokens/s"
    assert fig.layout.xaxis.title.text == "time (UTC)"
    assert fig.layout.xaxis.type == "date"


def test_hit_share_is_each_source_over_all_tokens():
    """gpu +300, cpu +100 in the first second: 0.75 and 0.25; none in the 10 s window
    before the sample 20 s later (back to the sample at 1 s): a gap. The lone point with
    tokens is drawn as markers (lines alone draw nothing for it)."""
    samples = [sample(0, prompt_tokens={"gpu": 0, "cpu": 0}),
               sample(1, prompt_tokens={"gpu": 300, "cpu": 100}),
               sample(20, prompt_tokens={"gpu": 300, "cpu": 100})]
    t = traces(figures.hit_share(samples))
    assert ys(t["gpu"]) == [0.75, None]
    assert ys(t["cpu"]) == [0.25, None]
    assert all("markers" in trace.mode for trace in t.values())
    assert figures.hit_share(samples).layout.yaxis.tickformat == ".0%"


def test_ttft_draws_the_three_percentiles_in_seconds_with_gaps():
    samples = [sample(0, ttft_seconds={"p50": 0.1, "p95": 0.4, "p99": 0.9}),
               sample(1, ttft_seconds={"p50": None, "p95": None, "p99": None}),
               sample(2, ttft_seconds={"p50": 0.2, "p95": 0.5, "p99": 1.0})]
    fig = figures.ttft(samples)
    assert list(traces(fig)) == ["TTFT p50", "TTFT p95", "TTFT p99"]
    assert ys(traces(fig)["TTFT p99"]) == [0.9, None, 1.0]
    assert fig.layout.yaxis.ticksuffix == "s"


def test_promotion_latency_shows_promotions_only():
    q = {"p50": 0.001, "p95": 0.002, "p99": 0.003}
    samples = [sample(0, transfer_seconds={"cpu->gpu": q, "gpu->cpu": q, "disk->cpu": q})]
    names = list(traces(figures.promotion_latency(samples)))
    assert names == ["cpu->gpu p50", "cpu->gpu p95", "cpu->gpu p99",
                     "disk->cpu p50", "disk->cpu p95", "disk->cpu p99"]
    only_offloads = [sample(0, transfer_seconds={"gpu->cpu": q})]
    assert annotation_texts(figures.promotion_latency(only_offloads)) == ["no promotions yet"]
    # vLLM's /metrics count promotions' bytes, untimed: they happened, their time unmeasured
    untimed = [sample(0, transfer_bytes={"cpu->gpu": 0}),
               sample(1, transfer_bytes={"cpu->gpu": 64})]
    assert annotation_texts(figures.promotion_latency(untimed)) == [
        "promotions happened, but their durations are not measured by this source"]


def test_transfer_throughput_against_the_pcie_link_maximum():
    """gpu->cpu 0 -> 123456 over 1 s: 123456 B/s; link max 32e9 B/s drawn dashed."""
    samples = [sample(0, transfer_bytes={"gpu->cpu": 0}),
               sample(1, transfer_bytes={"gpu->cpu": 123456},
                      pcie_link_max_bytes_per_second={"0": 32e9})]
    t = traces(figures.transfer_throughput(samples))
    assert ys(t["gpu->cpu"]) == [123456.0]
    assert ys(t["PCIe link max (one GPU)"]) == [32e9, 32e9]
    assert t["PCIe link max (one GPU)"].line.dash == "dash"
    no_gpu = figures.transfer_throughput(samples[:1] + [sample(1, transfer_bytes={"gpu->cpu": 1})])
    assert "PCIe link max (one GPU)" not in traces(no_gpu)
    assert figures.transfer_throughput(samples).layout.yaxis.ticksuffix == "B/s"


def test_tier_residency_draws_resident_capacity_and_budget_in_one_colour():
    samples = [sample(0, tier_resident_bytes={"gpu": 1024}, tier_capacity_bytes={"gpu": 8388608}),
               sample(1, tier_resident_bytes={"gpu": 4096, "cpu": 512},
                      tier_capacity_bytes={"gpu": 8388608, "cpu": 33554432},
                      offload_budget_bytes={"cpu": 30000000})]
    t = traces(figures.tier_residency(samples))
    assert list(t) == ["gpu resident", "gpu capacity", "cpu resident", "cpu capacity",
                       "cpu budget"]
    assert ys(t["gpu resident"]) == [1024.0, 4096.0]
    assert list(t["cpu resident"].x) == [ms(1)]
    assert t["gpu capacity"].line.dash == "dash" and t["cpu budget"].line.dash == "dot"
    assert t["gpu resident"].line.color == t["gpu capacity"].line.color


def test_tier_residency_in_blocks_where_no_tier_is_sized():
    """KV events without block_bytes: 144 of 200 gpu blocks held, bytes unknown; the chart
    read "no data yet". Drawn in blocks; beside a tier in bytes, it is named, not drawn 0 B."""
    samples = [sample(0, tier_resident_blocks={"gpu": 144}, tier_capacity_blocks={"gpu": 200})]
    fig = figures.tier_residency(samples)
    assert {n: ys(t) for n, t in traces(fig).items()} == {"gpu resident": [144.0],
                                                          "gpu capacity": [200.0]}
    assert fig.layout.yaxis.title.text == "blocks"
    # a budget is bytes, drawn on the memory budgets: not promised by the title here
    assert fig.layout.title.text == "Tier residency vs capacity (blocks: their size not measured)"
    mixed = [sample(0, tier_resident_blocks={"gpu": 144, "cpu": 3},
                    tier_resident_bytes={"cpu": 3072}, tier_capacity_bytes={"cpu": 8192})]
    fig = figures.tier_residency(mixed)
    assert list(traces(fig)) == ["cpu resident", "cpu capacity"]
    assert fig.layout.title.text.endswith("(gpu: bytes not measured)")


def test_host_memory_draws_available_reserve_and_headroom():
    samples = [sample(0, host_memory_available_bytes=2.1e10, host_memory_reserve_bytes=8e9,
                      host_memory_headroom_bytes=1.3e10), sample(1),
               sample(2, host_memory_available_bytes=2.0e10)]
    t = traces(figures.host_memory(samples))
    assert list(t["available"].x) == [ms(0), ms(2)]
    assert ys(t["available"]) == [2.1e10, 2.0e10]
    assert ys(t["reserve"]) == [8e9] and ys(t["headroom"]) == [1.3e10]


def test_evictions_with_the_share_never_reused():
    """gpu evicts 10 blocks in 1 s, 4 of them with 0 hits: 10 blocks/s, 40 % never reused."""
    samples = [sample(0, evicted_blocks={"gpu": 0}, evicted_block_hits={"gpu": [0, 0]}),
               sample(1, evicted_blocks={"gpu": 10}, evicted_block_hits={"gpu": [4, 6]})]
    t = traces(figures.evictions(samples))
    assert ys(t["gpu evicted"]) == [10.0]
    assert ys(t["gpu never reused"]) == [0.4]
    assert t["gpu never reused"].yaxis == "y2"
    # a sampled tap puts 1 eviction in 2 into the histogram (5 of 10 here, 2 with 0 hits): the
    # share is the histogram's own, 2 / 5 = 40%, as the recording rule's (over the counter's
    # 10 it read 20%)
    half = [sample(0, evicted_blocks={"gpu": 0}, evicted_block_hits={"gpu": [0, 0]}),
            sample(1, evicted_blocks={"gpu": 10}, evicted_block_hits={"gpu": [2, 3]})]
    assert ys(traces(figures.evictions(half))["gpu never reused"]) == [0.4]
    # vLLM's /metrics report no evictions: "no data yet" for good; now not measured, said
    # once two samples came
    assert annotation_texts(figures.evictions(samples[:1])) == ["no data yet"]
    assert annotation_texts(figures.evictions([sample(0), sample(1)])) == [
        "not measured: no source reports evictions"]


def test_savings_accumulate_over_the_window():
    """saved gpu 1 -> 3 s, cpu 0 -> 1 s; cpu->gpu transfers 0 -> 0.5 s; gpu->cpu 0 -> 0.25 s.
    Offload saved 1 s: the GPU prefix cache's 2 s are no transfer's doing (counted in, the
    chart read 3 s saved against 0.75 s spent where offload saved 1 s)."""
    samples = [sample(0, prefill_seconds_saved={"gpu": 1, "cpu": 0},
                      transfer_seconds_sum={"cpu->gpu": 0, "gpu->cpu": 0}),
               sample(1, prefill_seconds_saved={"gpu": 3, "cpu": 1},
                      transfer_seconds_sum={"cpu->gpu": 0.5, "gpu->cpu": 0.25})]
    t = traces(figures.savings(samples))
    assert ys(t["prefill saved by offload (est.)"]) == [0.0, 1.0]
    assert ys(t["promotion time"]) == [0.0, 0.5]
    assert ys(t["offload time"]) == [0.0, 0.25]


BUILDERS = [figures.hit_quality, figures.hit_share, figures.ttft, figures.promotion_latency,
            figures.transfer_throughput, figures.tier_residency, figures.host_memory,
            figures.evictions, figures.savings]


@pytest.mark.parametrize("build", BUILDERS)
def test_no_samples_gives_a_readable_empty_state(build):
    fig = build([])
    assert len(fig.data) == 0
    assert len(annotation_texts(fig)) == 1 and annotation_texts(fig)[0]
    assert fig.layout.title.text


def test_unreachable_figure_names_the_url():
    fig = figures.unreachable_figure("Host RAM", "http://127.0.0.1:9400")
    assert annotation_texts(fig) == ["agent unreachable: http://127.0.0.1:9400"]


def test_a_long_message_wraps_into_lines_a_narrow_chart_shows_whole():
    """Plotly does not wrap an annotation: the 75 characters of "no transfers ..." ran past a
    Tiers panel a third of the page wide. The message comes in lines of at most 44 characters
    (the longest that fits there at 16 px), every word kept in order; a word longer than a
    line, such as a URL, stays whole on a line of its own rather than being cut."""
    lines = figures.message_figure("t", figures.NO_TRANSFERS).layout.annotations[0].text
    lines = lines.split("<br>")
    # 41 characters, then " (is" would make 45
    assert lines == ["no transfers between tiers in this window",
                     "(is an offload tier configured?)"]
    url = "http://agent.example.internal:9400/api/v1/timeseries?window=300"
    text = figures.unreachable_figure("t", url).layout.annotations[0].text
    assert text.split("<br>") == ["agent unreachable:", url]
    assert annotation_texts(figures.message_figure("t", "no data yet")) == ["no data yet"]


# --- Overview page and shell ----------------------------------------------------------------

def test_render_returns_every_figure_and_they_serialise():
    samples = [sample(0, prompt_tokens={"gpu": 0}, host_memory_available_bytes=1e9),
               sample(1, prompt_tokens={"gpu": 300}, host_memory_available_bytes=1e9)]
    figs = overview.render(samples, window_seconds=900)
    assert len(figs) == len(overview.GRAPHS)
    assert ys(figs[0].data[0]) == [300.0]
    for fig in figs:
        json.loads(fig.to_json())  # what Dash sends must serialise


def test_pause_toggles_on_odd_clicks():
    assert pause_state(0) == (False, "Pause")
    assert pause_state(None) == (False, "Pause")
    assert pause_state(1) == (True, "Resume")
    assert pause_state(2) == (False, "Pause")


def test_route_finds_pages_and_explains_unknown_paths():
    assert "requests-table" in set(route("/requests/"))
    assert "hit-quality" in set(route("/"))
    assert "no page at /nope" in str(route("/nope"))


def test_create_app_twice_builds_independent_apps():
    apps = [create_app("http://127.0.0.1:9"), create_app("http://127.0.0.1:9")]
    for app in apps:
        assert app.title == "kvscope"
        ids = set(app.validation_layout)
        assert set(overview.GRAPHS) | {"refresh", "pause", "url", "page", "instance",
                                       "requests-table", "waterfall", "block-flow",
                                       "sizing-curves"} <= ids
    assert apps[0].callback_map.keys() == apps[1].callback_map.keys()


# --- agent backend against a real HTTP server ----------------------------------------------

class _Agent(BaseHTTPRequestHandler):
    """Answers GETs from the server's ``replies``: path prefix -> (status, body bytes)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.server.paths.append(self.path)
        status, body = next((v for k, v in self.server.replies.items()
                             if self.path.startswith(k)), (404, b"{}"))
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
    server.replies = {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def _samples(*seconds) -> bytes:
    return json.dumps({"interval": 1.0, "samples": [{"ts": T + s} for s in seconds]}).encode()


def test_backend_caches_samples_and_asks_only_for_new_ones(agent):
    agent.replies = {"/api/v1/timeseries": (200, _samples(0, 1))}
    backend = AgentBackend(_url(agent) + "/")
    assert [s["ts"] for s in backend.timeseries(900)] == [T, T + 1]
    agent.replies = {"/api/v1/timeseries": (200, _samples(2))}
    assert [s["ts"] for s in backend.timeseries(900)] == [T, T + 1, T + 2]
    assert [s["ts"] for s in backend.timeseries(1)] == [T + 1, T + 2]  # window from the newest
    assert agent.paths[0] == "/api/v1/timeseries?window=900"
    assert agent.paths[1] == f"/api/v1/timeseries?since={T + 1}"
    backend.close()


def test_backend_starts_its_cache_again_when_the_agent_restarted(agent):
    """Samples cached from an agent that restarted since were another run's (its counters
    began again): the dashboard kept them beside the new agent's, and judged both together
    (a restarted agent's verdict read from the old one's samples for up to 5 minutes)."""
    def reply(started, *seconds):
        body = json.loads(_samples(*seconds))
        agent.replies = {"/api/v1/timeseries": (200, json.dumps({**body,
                                                                 "started_at": started}).encode())}
    reply(T - 100, 0, 1)
    backend = AgentBackend(_url(agent))
    assert [s["ts"] for s in backend.timeseries(900)] == [T, T + 1]
    reply(T - 100, 2)
    assert [s["ts"] for s in backend.timeseries(900)] == [T, T + 1, T + 2]
    reply(T + 3, 4, 5)  # restarted at T + 3: the same answer to `since` and to `window`
    assert [s["ts"] for s in backend.timeseries(900)] == [T + 4, T + 5]
    assert agent.paths[-2:] == [f"/api/v1/timeseries?since={T + 2}",
                                "/api/v1/timeseries?window=900"]
    backend.close()


@pytest.mark.parametrize(("reply", "reason"), [
    ((500, b"{}"), "HTTP 500 from /api/v1/timeseries"),
    ((200, b"not json"), "bad JSON from /api/v1/timeseries"),
    ((200, b'{"samples": [{"no_ts": 1}]}'), "unexpected timeseries payload"),
    ((200, b"[]"), "unexpected timeseries payload"),
])
def test_backend_raises_typed_error_on_bad_answers(agent, reply, reason):
    agent.replies = {"/api/v1/timeseries": reply}
    with pytest.raises(BackendUnavailable) as info:
        AgentBackend(_url(agent)).timeseries()
    assert info.value.url == _url(agent)
    assert info.value.reason == reason


def test_the_dashboard_reads_an_agent_that_has_a_token():
    """The agent wants a bearer token on /api: the dashboard's app built with it reads the
    agent's samples; without it the status says which variable to set (it said "HTTP 401",
    and the dashboard had no way to pass a token)."""
    from kvscope.agent.config import AgentSettings
    from kvscope.service.agent import Agent
    from kvscope.service.api import create_app as create_api
    from kvscope.service.server import ApiServer, bind

    sock = bind("127.0.0.1", 0, "--port")
    agent = Agent(AgentSettings(token="s3cret"), with_ingest=False)
    agent.sample()
    server = ApiServer(create_api(agent), sock)
    server.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        assert wait_until(lambda: _answers(url))
        assert create_app(url, token="s3cret").kvscope.backend.timeseries()
        with pytest.raises(BackendUnavailable, match="sends KVSCOPE_TOKEN's"):
            create_app(url).kvscope.backend.timeseries()
    finally:
        server.shutdown()


def _answers(url) -> bool:
    try:
        return httpx.get(url + "/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def test_backend_reads_requests_and_one_request(agent):
    record = {"request_id": "r/1", "ttft": 0.1}
    dots = {"request_id": "..", "ttft": 0.2}  # a dot segment, unless escaped: /api/v1
    agent.replies = {"/api/v1/requests/r%2F1": (200, json.dumps(record).encode()),
                     "/api/v1/requests/%2E%2E": (200, json.dumps(dots).encode()),
                     "/api/v1/requests/gone": (404, b'{"detail": "no"}'),
                     "/api/v1/requests?": (200, json.dumps({"total": 7,
                                                            "requests": [record]}).encode())}
    backend = AgentBackend(_url(agent))
    assert backend.requests(10, "ttft", True, 0.05) == (7, [record], ())
    assert "sort=ttft" in agent.paths[-1] and "min_ttft=0.05" in agent.paths[-1]
    assert backend.request("r/1") == record
    assert backend.request("..") == dots
    assert backend.request("gone") is None


def test_backend_raises_typed_error_when_nothing_listens():
    with socket.socket() as sock:  # a port that was free a moment ago and is closed now
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(BackendUnavailable) as info:
        AgentBackend(url, timeout=1.0).timeseries()
    assert info.value.url == url


def test_refresh_shows_unreachable_agent_instead_of_failing():
    backend = AgentBackend("http://127.0.0.1:9", timeout=1.0)
    *figs, advice, found, status = overview.refresh(backend, window_seconds=900)
    assert found == []  # no misconfiguration banner without data
    assert status.startswith("agent unreachable: http://127.0.0.1:9 (")
    assert status in str(advice)
    assert [annotation_texts(f) for f in figs] == [
        ["agent unreachable: http://127.0.0.1:9"]] * len(overview.GRAPHS)


def test_concurrency_and_prompt_lengths_come_from_the_records():
    """Requests over [0, 2], [1, 3], [1.5, 1.6] and [3, 4] (Unix seconds): in flight 1 at 0,
    2 at 1, 3 at 1.5, 2 at 1.6, 1 at 2, 0 at 3 (the finish at 3 before the arrival at 3), 1 at
    3, 0 at 4; peak 3. Prompt lengths 100, 200, 300, 400: p50 250 and p95 385 (linear)
    marked. Without records each says so."""
    from kvscope.dashboard import figures_load as fl

    records = [{"arrival": a, "finished": f, "prompt_tokens": p} for a, f, p in
               ((0, 2, 100), (1, 3, 200), (1.5, 1.6, 300), (3, 4, 400))]
    times, counts = fl.in_flight(records + [{"arrival": 5, "finished": None}])
    assert times.tolist() == [0, 1, 1.5, 1.6, 2, 3, 3, 4]
    assert counts.tolist() == [1, 2, 3, 2, 1, 0, 1, 0]
    fig = fl.concurrency(records)
    assert fig.data[0].name == "in flight (peak 3)" and fig.data[0].x[0] == 0.0
    hist = fl.prompt_lengths(records)
    bars = hist.data[0]  # 4 bins over [100, 400]: one request each
    assert list(bars.y) == [1, 1, 1, 1] and list(bars.x) == [137.5, 212.5, 287.5, 362.5]
    assert [a.text for a in hist.layout.annotations] == ["p50 250", "p95 385"]
    for build in (fl.concurrency, fl.prompt_lengths):
        assert annotation_texts(build([])) == [fl.NO_RECORDS]
    figs = overview.render([], window_seconds=900, records=records)
    ids = list(overview.GRAPHS)
    assert figs[ids.index("concurrency")].data[0].name == "in flight (peak 3)"
    # vLLM's /metrics alone: 45 requests counted, none recorded one by one ("no finished
    # requests yet" beside the header's 45 requests)
    figs = overview.render([sample(0, requests=45)], window_seconds=900, records=[])
    for gid in ("concurrency", "prompt-lengths"):
        assert annotation_texts(figs[ids.index(gid)]) == [fl.NOT_PER_REQUEST]
    figs = overview.render([sample(0, requests=0)], window_seconds=900, records=[])
    assert annotation_texts(figs[ids.index("concurrency")]) == [fl.NO_RECORDS]


@pytest.mark.parametrize(("n", "text"), [
    (3 * 2**30, "3.00 GiB"), (2**30 - 1, "1.00 GiB"), (5 * 2**20 + 2**19, "5.5 MiB"),
    (2048, "2.0 KiB"), (1023, "1.0 KiB"), (900, "900 B"), (0, "0 B"), (-2**31, "-2.00 GiB")])
def test_bytes_text_picks_the_unit_that_shows_the_size(n, text):
    assert S.bytes_text(n) == text


def test_charts_of_transfers_say_none_came_rather_than_no_data_yet():
    """Two samples with prompt tokens but no transfer (zero-code mode on an engine without an
    offload tier): the throughput and savings charts say no transfer came in the window, and
    ask whether a tier is configured; "no data yet" (wait) is for fewer than two samples."""
    window = [sample(0, prompt_tokens={"gpu": 10}), sample(1, prompt_tokens={"gpu": 30})]
    for chart in (figures.transfer_throughput, figures.savings):
        assert annotation_texts(chart(window)) == [figures.NO_TRANSFERS], chart
        assert annotation_texts(chart(window[:1])) == [figures.NO_DATA], chart
    # blocks copied, their sizes and times unknown (KV events without block_bytes): not "no
    # transfers", which would send the reader looking for a tier that is there
    copied = [{**s, "transfer_blocks": {"gpu->cpu": 4 * i}} for i, s in enumerate(window)]
    assert annotation_texts(figures.transfer_throughput(copied)) == [
        "blocks were copied, but their sizes are not measured by this source"]
    assert annotation_texts(figures.savings(copied)) == [
        "blocks were copied, but their times are not measured by this source"]
