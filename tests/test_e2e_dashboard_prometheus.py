"""End to end: the dashboard's Prometheus backend against a real Prometheus scraping the demo.

Debian's ``prometheus`` listens on a free loopback port, keeps its TSDB in tmp_path and scrapes
the session's ``kvscope demo`` every second. A dashboard served in-process reads it through
:class:`~kvscope.dashboard.prometheus.PrometheusBackend`; Chromium loads every page: the
Overview's graphs hold PromQL data, the instance selector lists the demo's agent, and the
Requests page reaches the agent found through Prometheus' targets. Screenshots go to
test-artifacts/dashboard-prometheus-*.png.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import artifacts_dir, free_port, http_status, log_tail
from test_e2e_dashboard import (browser, console_errors, screenshot, status_text,  # noqa: F401
                                wait_for, wait_for_points)

PROMETHEUS = "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else shutil.which("prometheus")
START_TIMEOUT_S = 60.0

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="Prometheus is not installed")


@pytest.fixture(scope="module")
def prometheus_url(demo, tmp_path_factory):
    """A real Prometheus scraping the demo's agent every second; yields its base URL."""
    tmp = tmp_path_factory.mktemp("prometheus-dashboard")
    port = free_port()
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
              "scrape_configs": [{"job_name": "kvscope", "static_configs": [
                  {"targets": [f"127.0.0.1:{demo.metrics_port}"]}]}]}
    (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    log_path = artifacts_dir() / "prometheus-dashboard.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={tmp / 'data'}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while http_status(f"{url}/-/ready") != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus not ready:\n{log_tail(log_path)}")
            time.sleep(0.25)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def fleet_dashboard(prometheus_url):
    from kvscope.dashboard.app import create_app, serve
    from kvscope.dashboard.prometheus import PrometheusBackend

    backend = PrometheusBackend(prometheus_url, rate_window="15s")
    handle = serve(create_app(backend=backend, window_seconds=300), "127.0.0.1", 0)
    yield handle
    handle.shutdown()
    backend.close()


def test_overview_over_prometheus(demo, fleet_dashboard, browser):
    browser.get(fleet_dashboard.url + "/")
    try:
        wait_for_points(browser, ["hit-quality", "hit-share", "ttft", "transfer-throughput",
                                  "tier-residency", "host-memory", "evictions", "savings"])
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
        wait_for_points(browser, ["tier-gpu", "tier-cpu", "block-flow", "eviction-hits"],
                        minimum=2)
    finally:
        screenshot(browser, "dashboard-prometheus-tiers")
    browser.get(fleet_dashboard.url + "/requests")
    cell = 'td[data-dash-column="request_id"]'
    try:
        wait_for(browser, lambda: browser.find_elements("css selector", cell), "table rows")
        browser.find_elements("css selector", cell)[0].click()
        wait_for_points(browser, ["waterfall"], minimum=2)
        wait_for(browser, lambda: "instance=" in browser.current_url, "instance in the deep link")
    finally:
        screenshot(browser, "dashboard-prometheus-requests")
    assert not console_errors(browser)
