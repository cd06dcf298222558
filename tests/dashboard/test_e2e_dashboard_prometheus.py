"""End to end: the dashboard's Prometheus backend against a real Prometheus scraping the demo.

Debian's ``prometheus`` listens on a free loopback port, keeps its TSDB in tmp_path and scrapes
the session's ``kvscope demo`` every second. A dashboard served in-process reads it through
:class:`~kvscope.dashboard.prometheus.PrometheusBackend`; Chromium loads every page: the
Overview's graphs hold PromQL data, the instance selector lists the demo's agent, and the
Requests page reaches the agent found through Prometheus' targets. Screenshots go to
test-artifacts/dashboard-prometheus-*.png.
"""

from __future__ import annotations


import time
from contextlib import contextmanager

import pytest
from conftest import needs_prometheus, running_prometheus
from test_e2e_dashboard import (TOPOLOGY_JS, browser, click_first,  # noqa: F401
                                console_errors, screenshot, status_text, wait_for,
                                wait_for_points)


pytestmark = needs_prometheus


@pytest.fixture(scope="module")
def prometheus_url(demo, tmp_path_factory):
    """A real Prometheus scraping the demo's agent every second; yields its base URL."""
    with running_prometheus(f"127.0.0.1:{demo.metrics_port}",
                            tmp_path_factory.mktemp("prometheus-dashboard"),
                            "prometheus-dashboard.log") as url:
        yield url


@pytest.fixture(scope="module")
def fleet_dashboard(prometheus_url):
    from kvscope.dashboard.app import create_app, serve
    from kvscope.dashboard.prometheus import PrometheusBackend

    backend = PrometheusBackend(prometheus_url, rate_window="15s")
    handle = serve(create_app(backend=backend, window_seconds=300), "127.0.0.1", 0)
    yield handle
    handle.shutdown()
    backend.close()


@contextmanager
def beside_the_demo(demo, tmp_path, log_name: str, **settings):
    """A second agent (no ingest, no GPU collector, ``settings`` for the rest) serving its API
    and /metrics on a free loopback port, and a real Prometheus scraping it and the demo's,
    until both are listed: yields (the agent's instance, the demo's, the agent's server, a
    :class:`~kvscope.dashboard.prometheus.PrometheusBackend` on that Prometheus)."""
    from kvscope.agent.config import AgentSettings
    from kvscope.dashboard.prometheus import PrometheusBackend
    from kvscope.service.agent import Agent
    from kvscope.service.api import create_app
    from kvscope.service.server import ApiServer, bind

    settings["collectors"] = {"gpu": {"enabled": False}, **settings.get("collectors", {})}
    agent = Agent(AgentSettings(**settings), with_ingest=False)
    sock = bind("127.0.0.1", 0, "--port")
    server = ApiServer(create_app(agent), sock)
    server.start()
    other, shown = f"127.0.0.1:{sock.getsockname()[1]}", f"127.0.0.1:{demo.metrics_port}"
    try:
        with running_prometheus([shown, other], tmp_path, log_name) as url:
            backend = PrometheusBackend(url, rate_window="15s")
            try:
                deadline = time.monotonic() + 60
                while backend.instances() != sorted([shown, other]):
                    assert time.monotonic() < deadline, backend.instances()
                    time.sleep(0.5)
                yield other, shown, server, backend
            finally:
                backend.close()
    finally:
        server.shutdown()


def test_overview_over_prometheus(demo, fleet_dashboard, browser):
    browser.get(fleet_dashboard.url + "/")
    try:
        wait_for_points(browser, ["hit-quality", "hit-share", "ttft", "transfer-throughput",
                                  "tier-residency", "host-memory", "evictions", "savings",
                                  "concurrency", "prompt-lengths"])
        status = status_text(browser, "overview-status")
    finally:
        screenshot(browser, "dashboard-prometheus-overview")
    assert status.startswith("prometheus http://127.0.0.1:") and "all instances" in status
    assert not console_errors(browser)


def test_instance_selector_lists_the_demo(demo, fleet_dashboard, browser):
    browser.get(fleet_dashboard.url + "/")
    target = f"127.0.0.1:{demo.metrics_port}"
    (dropdown,) = wait_for(browser, lambda: browser.find_elements("id", "instance"),
                           "the instance selector")
    assert dropdown.is_displayed()
    dropdown.click()
    wait_for(browser, lambda: target in browser.page_source, f"instance {target} among the options")
    screenshot(browser, "dashboard-prometheus-instances")
    assert not console_errors(browser)


def test_tiers_and_requests_over_prometheus(demo, fleet_dashboard, browser):
    browser.get(fleet_dashboard.url + "/tiers")
    try:
        wait_for_points(browser, ["tier-gpu", "tier-cpu", "block-flow", "eviction-hits",
                                  "tiers-transfer-throughput"], minimum=2)
        # the topology from Prometheus' latest series, under the demo's instance: the demo's
        # process memory by NUMA node (it is its own engine_pid); GPUs as the agent saw them
        topology = wait_for(browser, lambda: (t := browser.execute_script(TOPOLOGY_JS))
                            and len(t) == 3 and t["topology-engine-numa"][0] == "measured"
                            and t, "the topology panel with the demo's memory by node")
    finally:
        screenshot(browser, "dashboard-prometheus-tiers")
    assert f"127.0.0.1:{demo.metrics_port}" in browser.find_element("id", "topology").text
    assert topology["topology-gpus"][0] in ("measured", "no-gpu"), topology
    browser.get(fleet_dashboard.url + "/requests")
    cell = '.ag-cell[col-id="request_id"]'  # AG Grid's cells
    try:
        click_first(browser, cell)
        wait_for_points(browser, ["waterfall"], minimum=2)
        wait_for(browser, lambda: "instance=" in browser.current_url, "instance in the deep link")
        # a fleet's grid shows which node each request ran on (ids repeat across nodes)
        wait_for(browser, lambda: browser.find_elements(
            "css selector", '.ag-header-cell[col-id="instance"]'), "the instance column")
    finally:
        screenshot(browser, "dashboard-prometheus-requests")
    assert not console_errors(browser)


def test_a_fleet_page_names_the_agents_it_could_not_read(demo, tmp_path):
    """Prometheus scrapes the demo's agent and a second agent whose API wants a token the
    dashboard lacks (its /metrics stays open). The Requests page showed the demo's records as
    "all instances" and said nothing of the other (found by a fresh-user tryout); its status
    line, and the Overview's, now name it and why. A deep link to it says why too, and one to
    an instance Prometheus does not scrape says so: both read "unreachable: <url>", the first
    naming the agent that answered, the second Prometheus, which answered too."""
    from kvscope.dashboard.pages import overview
    from kvscope.dashboard.pages import requests as requests_page

    with beside_the_demo(demo, tmp_path, "prometheus-unread.log", token="s3cret") as (
            locked, shown, _server, backend):
        url = backend.base_url
        rows, status = requests_page.table(backend, None, None, 100, None)
        *_, overview_status = overview.refresh(backend, 300.0)
        # the locked agent alone: Prometheus's figures stay (every chart read "agent
        # unreachable", found by a tryout); those drawn from requests say why not
        deadline = time.monotonic() + 60
        while not backend.timeseries(300.0, locked):
            assert time.monotonic() < deadline, "no samples of the locked agent"
            time.sleep(0.5)
        *locked_figures, _advice, _found, locked_status = overview.refresh(backend, 300.0, locked)
        _, refused = requests_page.waterfall(backend, f"?id=r1&instance={locked}", None)
        _, unknown = requests_page.waterfall(backend, "?id=r1&instance=127.0.0.1:1", None)
    assert rows and {r["instance"] for r in rows} == {shown}
    for line in (status, overview_status):
        assert f" · not read: {locked} (HTTP 401" in line, line
    messages = {gid: [a.text for a in fig.layout.annotations]
                for gid, fig in zip(overview.GRAPHS, locked_figures)}
    for gid, texts in messages.items():
        unreachable = any(t.startswith("agent unreachable") for t in texts)
        assert unreachable == (gid in overview.FROM_RECORDS), (gid, texts)
    assert f" · requests not read: agent unreachable: http://{locked} (HTTP 401" in locked_status
    assert refused.startswith(f"agent unreachable: http://{locked} (HTTP 401"), refused
    assert unknown == f"127.0.0.1:1 is not a scrape target of prometheus {url}", unknown


def test_an_agent_that_went_down_stays_in_the_fleet_and_is_named_not_read(demo, tmp_path):
    """A second agent, scraped, then stopped: the fleet's instances were those exporting
    kvscope_build_info now, so it vanished and the Requests page showed the demo's alone as
    the fleet (a tryout). It stays listed, and the requests read name it as not read."""
    with beside_the_demo(demo, tmp_path, "prometheus-down.log") as (gone, shown, server,
                                                                     backend):
        server.shutdown()
        deadline = time.monotonic() + 60
        while backend.query(f'up{{instance="{gone}"}}')[0]["value"][1] != "0":
            assert time.monotonic() < deadline, "Prometheus never saw it down"
            time.sleep(0.5)
        listed, page = backend.instances(), backend.requests(limit=10)
    assert listed == sorted([shown, gone])
    assert [name.split(" ")[0] for name in page.unread] == [gone], page.unread


def test_a_fleet_shows_its_host_with_the_least_headroom_not_the_hosts_added_up(demo, tmp_path):
    """Prometheus scrapes the demo's agent (no reserve) and a second agent whose reserve is
    the host's whole memory and whose cpu budget is 4 GiB: its headroom is below 0. The fleet
    view added the two hosts up (a tryout: "headroom 14.71 GiB" and "fits" while one host's
    alert fired); its host memory now is that agent's, every figure from it: its reserve and
    budget (its memory part kv_offload) as configured, its headroom below 0, and limit and
    parts its own; the budget-over-limit check reads that host's budget, over its limit. The
    Overview judges it for that instance, and leaves it unjudged for the fleet, whose samples
    add two hosts' settings up (pick an instance)."""
    import psutil

    from kvscope.dashboard.pages import overview

    reserve, budget = psutil.virtual_memory().total, 4 << 30
    host = {"reserve_bytes": reserve, "budgets": {"cpu": budget}}
    with beside_the_demo(demo, tmp_path, "prometheus-hosts.log", collectors={"host": host}) as (
            tight, _roomy, _server, backend):
        deadline = time.monotonic() + 60
        while True:  # both scraped at the newest step
            fleet = (backend.timeseries(300.0) or [{}])[-1]
            own = (backend.timeseries(300.0, tight) or [{}])[-1]
            if fleet.get("host_memory_reserve_bytes") == reserve == own.get(
                    "host_memory_reserve_bytes"):
                break
            assert time.monotonic() < deadline, fleet
            time.sleep(0.5)
        found = {who: overview.refresh(backend, 300.0, who)[-2] for who in (None, tight)}
    assert fleet["host_memory_part_bytes"]["kv_offload"] == budget
    assert fleet["host_memory_headroom_bytes"] < 0
    for name in ("host_memory_limit_bytes", "host_memory_part_bytes"):
        assert fleet[name] == own[name], name
    from kvscope.dashboard import misconfig

    finding = misconfig.budget_over_limit([fleet], misconfig.Settings())
    assert finding.status == misconfig.MISCONFIGURED, finding
    assert finding.wrong.startswith("cpu budget 4.00 GiB + reserve"), finding.wrong
    assert "misconfig-budget-over-limit" in str(found[tight][0])  # its banner
    assert "KV offload budget + reserve above the memory limit: not judged across 2 " \
        "instances" in str(found[None])


def test_a_selector_that_matches_no_agent_is_said(prometheus_url):
    """--prometheus-selector 'job="nope"': the Overview read "all instances: no samples yet"
    and judged "too little traffic" (a tryout); its status line now names the selector."""
    from kvscope.dashboard.pages import overview
    from kvscope.dashboard.prometheus import PrometheusBackend

    wrong, right = (PrometheusBackend(prometheus_url, selector=s, rate_window="15s")
                    for s in ('job="nope"', 'job="kvscope"'))
    try:
        *_, status = overview.refresh(wrong, 300.0)
        deadline = time.monotonic() + 60
        while not right.timeseries(300.0):  # the demo's first scrapes, for the near miss
            assert time.monotonic() < deadline
            time.sleep(0.5)
        *_, matched = overview.refresh(right, 300.0)
    finally:
        wrong.close()
        right.close()
    assert status == (f'prometheus {prometheus_url} · all instances: no agent\'s series match '
                      '{job="nope"}: check --prometheus-selector, and that this Prometheus '
                      "scrapes the agents"), status
    assert "match" not in matched and " samples · last " in matched, matched


ACCEPTED = ['job="kvscope"', '{job="kvscope",env!~"dev.*"}', ' job = "a\\"b" , x=~\'y\' ',
            "a=`b`", 'job="kvscope",', ""]
REFUSED = ["job=kvscope", 'job="x" env="y"', '1a="x"', 'job=="x"', 'job="k']


@pytest.mark.parametrize("text", ACCEPTED + REFUSED)
def test_the_selector_check_agrees_with_prometheus(prometheus_url, text):
    """--prometheus-selector is checked at start (a matcher without quotes started the
    dashboard, then every page read "prometheus unreachable", found by a fresh-user tryout):
    what the check takes, the real Prometheus takes in the queries the backend makes, and
    what it refuses, Prometheus refuses with HTTP 400."""
    import argparse

    import httpx

    from kvscope.argtypes import label_matchers
    from kvscope.dashboard.prometheus import PrometheusBackend

    try:
        label_matchers(text)
        taken = True
    except argparse.ArgumentTypeError:
        taken = False
    assert taken == (text in ACCEPTED)
    backend = PrometheusBackend(prometheus_url, selector=text)
    selector = backend.selector
    backend.close()
    answer = httpx.get(f"{prometheus_url}/api/v1/query",
                       params={"query": f"count(kvscope_build_info{{{selector}}})"})
    assert answer.status_code == (200 if taken else 400), answer.text
