"""End to end: the running demo's dashboard in headless Chromium draws all four Overview graphs.

Uses the session fixture ``demo`` (tests/conftest.py), which runs ``kvscope demo`` with its
agent, exporter and dashboard. The graphs' data are read from the page itself (plotly's
``data`` on each graph's ``.js-plotly-plot`` element), so this checks what a user sees:
agent -> HTTP API -> Dash callback -> figure -> browser.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
GRAPH_IDS = ("hit-quality", "tier-residency", "transfer-throughput", "host-memory")
WAIT_SECONDS = 60.0  # an upper bound on waiting, not a speed requirement
MIN_POINTS = 5  # points with y > 0 per graph: a drawn line, not a lone first sample
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

# For each graph id: how many points with y > 0 it holds (0 when not drawn yet).
COUNT_POSITIVE_POINTS_JS = """
const out = {};
for (const id of arguments[0]) {
  const el = document.getElementById(id);
  const plot = el && (el.classList.contains('js-plotly-plot') ? el
                      : el.querySelector('.js-plotly-plot'));
  let n = 0;
  for (const trace of (plot && plot.data) || []) {
    for (const y of Array.from(trace.y || [])) { if (Number(y) > 0) n += 1; }
  }
  out[id] = n;
}
return out;
"""


@pytest.fixture()
def browser():
    """A headless Chromium driven by chromedriver, with the browser console log enabled."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip(f"needs {CHROMIUM} and {CHROMEDRIVER} (Debian chromium, chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1400,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def test_overview_draws_all_graphs(demo, browser):
    browser.get(demo.ui_url)
    assert browser.title == "kvscope"
    counts: dict[str, int] = {}
    deadline = time.monotonic() + WAIT_SECONDS
    try:
        while time.monotonic() < deadline:
            counts = browser.execute_script(COUNT_POSITIVE_POINTS_JS, list(GRAPH_IDS))
            if all(counts.get(gid, 0) >= MIN_POINTS for gid in GRAPH_IDS):
                break
            time.sleep(0.5)
        status = browser.find_element("id", "status").text
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "dashboard-overview.png"))

    short = [gid for gid in GRAPH_IDS if counts.get(gid, 0) < MIN_POINTS]
    assert not short, (f"graphs with fewer than {MIN_POINTS} points y > 0 after "
                       f"{WAIT_SECONDS:.0f} s: {short}; counts {counts}; status {status!r}")
    assert "unreachable" not in status, status
    severe = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    assert not severe, f"browser console errors: {severe}"
