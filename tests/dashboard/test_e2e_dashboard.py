"""End to end: the running demo's dashboard in headless Chromium, page by page.

Uses the session fixture ``demo`` (tests/conftest.py), which runs ``kvscope demo`` with its
agent, exporter and dashboard. The graphs' data are read from the page itself (plotly's data
on each graph's ``.js-plotly-plot`` element), so this checks what a user sees:
agent -> HTTP API -> Dash callback -> figure -> browser. A second dashboard, served in-process
against the demo's agent with ``sizing_trace``, covers the Sizing page with data. Screenshots
of every page go to test-artifacts/dashboard-*.png.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from urllib.parse import parse_qs, urlencode, urlsplit
from pathlib import Path

import pytest

from conftest import REPO_ROOT, artifacts_dir, http_status, running_demo

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_SECONDS = 90.0  # an upper bound on waiting, not a speed requirement
MIN_POINTS = 5  # points with y > 0 per graph: a drawn line, not a lone first sample
TRACE = Path(os.environ.get("KVSCOPE_TRACE_DIR", REPO_ROOT.parent / "shared"
                            / "traces")) / "mooncake_conversation_trace.jsonl"

OVERVIEW_GRAPHS = ("hit-quality", "hit-share", "ttft", "promotion-latency",
                   "transfer-throughput", "tier-residency", "host-memory", "evictions", "savings",
                   "concurrency", "prompt-lengths")
TIERS_GRAPHS = ("tier-gpu", "tier-cpu", "block-flow", "eviction-age", "eviction-hits")

# For each graph id: how many values > 0 it holds (y of lines and bars, Sankey link values).
COUNT_POSITIVE_JS = """
const out = {};
for (const id of arguments[0]) {
  const el = document.getElementById(id);
  const plot = el && (el.classList.contains('js-plotly-plot') ? el
                      : el.querySelector('.js-plotly-plot'));
  let n = 0;
  for (const trace of (plot && (plot._fullData || plot.data)) || []) {
    const values = trace.type === 'sankey' ? (trace.link && trace.link.value)
                 : trace.orientation === 'h' ? trace.x : trace.y;
    for (const v of Array.from(values || [])) { if (Number(v) > 0) n += 1; }
  }
  out[id] = n;
}
return out;
"""
ANNOTATIONS_JS = """
const el = document.getElementById(arguments[0]);
const plot = el && el.querySelector('.js-plotly-plot');
return ((plot && plot.layout && plot.layout.annotations) || []).map(
  a => a.text.replace(/<br>/g, ' '));  // a message figure wraps its lines
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
                "--window-size=1400,1800"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait_for(browser, check, what: str, seconds: float = WAIT_SECONDS):
    """Poll ``check()`` until it returns a truthy value; fail naming ``what`` and the last value."""
    deadline = time.monotonic() + seconds
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"{what} not seen within {seconds:.0f} s; last: {value!r}")


def wait_for_points(browser, graph_ids, minimum: int = MIN_POINTS) -> dict:
    counts: dict = {}

    def full():
        nonlocal counts
        counts = browser.execute_script(COUNT_POSITIVE_JS, list(graph_ids))
        return all(counts.get(g, 0) >= minimum for g in graph_ids)

    wait_for(browser, lambda: full() and counts, f"{minimum}+ points in {list(graph_ids)}")
    return counts


def screenshot(browser, name: str) -> None:
    browser.save_screenshot(str(artifacts_dir() / f"{name}.png"))


def fill_in(browser, values: dict[str, str]) -> None:
    """Type each ``{input id: text}`` and check, half a second later, that every input holds
    its text whole. Dash may still be rendering the page when the inputs first appear, and a
    keystroke that lands during that re-render goes astray (seen in CI: "/tmp/x/baseline"
    arrived as "/tp/x/baselinem"), so then type them all again. What an input held is selected
    and typed over: WebDriver's clear() does not empty a React input (a typed "80" stayed, and
    the new text came after it)."""
    from selenium.webdriver.common.keys import Keys

    held: dict = {}
    for _ in range(5):
        for element_id, text in values.items():
            element = browser.find_element("id", element_id)
            element.send_keys(Keys.CONTROL, "a")
            element.send_keys(Keys.DELETE, text)
        time.sleep(0.5)
        held = {i: browser.find_element("id", i).get_attribute("value") for i in values}
        if held == values:
            return
    pytest.fail(f"typed {values}, the inputs hold {held}")


def click_first(browser, selector: str) -> None:
    """Click the first element matching ``selector`` once the page shows one. The Requests
    grid redraws its rows on every refresh, so a row found may be gone by the click (stale):
    then find it again."""
    from selenium.common.exceptions import StaleElementReferenceException

    def click():
        try:
            found = browser.find_elements("css selector", selector)
            if found:
                found[0].click()
                return True
        except StaleElementReferenceException:
            pass
        return False

    wait_for(browser, click, f"a {selector} to click")


def console_errors(browser) -> list:
    return [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]


def status_text(browser, status_id: str) -> str:
    """The status line's text, "" while the page is not drawn yet."""
    found = browser.find_elements("id", status_id)
    return found[0].text if found else ""


@pytest.fixture(scope="module")
def sizing_dashboard(demo):
    """A second dashboard, in-process, on the demo's agent, with a trace for the Sizing page."""
    if not TRACE.is_file():
        pytest.skip(f"trace {TRACE} not found (set KVSCOPE_TRACE_DIR)")
    from kvscope.dashboard.app import create_app, serve

    app = create_app(demo.api_url, sizing_trace=str(TRACE), sizing_preset="llama-3-8b")
    handle = serve(app, "127.0.0.1", 0)
    yield handle
    handle.shutdown()
    app.kvscope.backend.close()


def test_overview_draws_every_graph(demo, browser):
    browser.get(demo.ui_url)
    assert browser.title == "kvscope"
    try:
        counts = wait_for_points(browser, OVERVIEW_GRAPHS)
        status = status_text(browser, "overview-status")
    finally:
        screenshot(browser, "dashboard-overview")
    assert "unreachable" not in status, (status, counts)
    assert not console_errors(browser)


def test_tiers_page_draws_residency_flow_and_histograms(demo, browser):
    browser.get(demo.ui_url + "tiers")
    try:
        wait_for_points(browser, TIERS_GRAPHS, minimum=2)
        # the demo runs without a disk tier
        wait_for(browser, lambda: browser.execute_script(ANNOTATIONS_JS, "tier-disk")
                 == ["no disk tier configured"], "the disk panel's empty state")
    finally:
        screenshot(browser, "dashboard-tiers")
    assert not console_errors(browser)


# The topology panel's parts as drawn: {class name: [data-state, text]}.
TOPOLOGY_JS = """
const out = {};
for (const el of document.querySelectorAll('#topology [data-state]')) {
  out[el.className] = [el.getAttribute('data-state'), el.innerText];
}
return out;
"""


def test_tiers_page_shows_transfers_beside_their_topology(demo, browser):
    """The transfer charts on the Tiers page carry data, and beside them the topology the
    agent's collectors read on this machine: the GPUs' links (here, without an NVIDIA driver,
    "no GPU", never a 0), the host's NUMA nodes as /sys shows them, and the demo process's
    memory by NUMA node as its numa_maps does (the demo sets engine_pid to itself)."""
    from kvscope.agent.collectors.numa import parse_node_list

    with urllib.request.urlopen(f"{demo.api_url}/api/v1/node", timeout=5) as resp:
        series = json.load(resp)["series"]
    gpus = [s for s in series if s["name"] == "kvscope_gpu_topology_info"]
    engine_nodes = sorted(s["labels"]["numa_node"] for s in series
                          if s["name"] == "kvscope_process_numa_bytes")
    online = Path("/sys/devices/system/node/online")
    browser.get(demo.ui_url + "tiers")
    try:
        wait_for_points(browser, ("tiers-transfer-throughput", "tiers-promotion-latency"),
                        minimum=2)
        drawn = wait_for(browser, lambda: (t := browser.execute_script(TOPOLOGY_JS))
                         and len(t) == 3 and t["topology-engine-numa"][0] == "measured"
                         and t, "the topology panel with the demo's memory by node")
    finally:
        screenshot(browser, "dashboard-tiers-topology")
    state, text = drawn["topology-gpus"]
    if gpus:
        assert state == "measured" and "Gen" in text, text
    else:
        assert state == "no-gpu" and "no GPU" in text and "not measured" in text, text
    state, text = drawn["topology-numa-nodes"]
    if online.is_file():
        assert (state, text) == ("measured", "host NUMA nodes online: "
                                 f"{len(parse_node_list(online.read_text()))}")
    state, text = drawn["topology-engine-numa"]
    assert engine_nodes, "the demo's agent reads its own numa_maps"
    assert state == "measured" and [part.split(":")[0] for part in text.split(": ", 1)[1]
                                    .split(" · ")] == [f"node {n}" for n in engine_nodes], text
    assert not console_errors(browser)


def _first_request(demo) -> dict:
    with urllib.request.urlopen(f"{demo.api_url}/api/v1/requests?limit=1", timeout=5) as resp:
        return json.load(resp)["requests"][0]


def test_selecting_a_request_opens_its_waterfall(demo, browser):
    browser.get(demo.ui_url + "requests")
    cell = '.ag-cell[col-id="request_id"]'  # AG Grid's cells
    try:
        click_first(browser, cell)
        wait_for(browser, lambda: "?id=" in browser.current_url, "the deep link URL")
        request_id = parse_qs(urlsplit(browser.current_url).query)["id"][0]
        wait_for_points(browser, ["waterfall"], minimum=2)
        wait_for(browser, lambda: request_id in browser.find_element("id", "request-details").text,
                 "the request's details")
        details = browser.find_element("id", "request-details").text
    finally:
        screenshot(browser, "dashboard-requests")
    assert request_id in details and "trace id" in details
    assert not console_errors(browser)


def test_deep_link_opens_a_request(demo, browser):
    record = _first_request(demo)
    browser.get(f"{demo.ui_url}requests?id={record['request_id']}")
    try:
        wait_for_points(browser, ["waterfall"], minimum=2)
        trace = wait_for(browser, lambda: browser.find_elements("id", "trace-id"), "trace id")
    finally:
        screenshot(browser, "dashboard-request-deep-link")
    assert trace[0].text == record["trace_id"]
    assert not console_errors(browser)


# The Requests grid as the page shows it: the page the paginator is on, its page size, the
# rows drawn, and each row after AG Grid's filter and sort as [request id, TTFT (ms)].
GRID_JS = """
let api;
try { api = dash_ag_grid.getApi('requests-table'); } catch (e) { return null; }  // not drawn yet
const rows = [];
api.forEachNodeAfterFilterAndSort(n => rows.push([n.data.request_id, n.data.ttft_ms]));
const shown = Array.from(document.querySelectorAll(
  '#requests-table .ag-center-cols-container .ag-row'));
return {page: api.paginationGetCurrentPage(), pageSize: api.paginationGetPageSize(),
        rows: rows, shown: shown.length};
"""
# The grid's row style for the request arguments[0] (its background), and the ids of the other
# rows that have one.
ROW_STYLE_JS = """
let api;
try { api = dash_ag_grid.getApi('requests-table'); } catch (e) { return null; }  // not drawn yet
const style = api.getGridOption('getRowStyle');
const out = {yes: null, others: []};
api.forEachNode(n => {
  const s = style ? style({data: n.data, node: n, api: api}) : null;
  const bg = s && s.backgroundColor;
  if (n.data.request_id === arguments[0]) { out.yes = bg || null; }
  else if (bg) { out.others.push(n.data.request_id); }
});
return out;
"""

# The background the grid draws for request arguments[0]'s row ("" unmarked, null not drawn).
DRAWN_STYLE_JS = """
for (const row of document.querySelectorAll('#requests-table .ag-center-cols-container .ag-row')) {
  const cell = row.querySelector('[col-id="request_id"]');
  if (cell && cell.textContent === arguments[0]) { return getComputedStyle(row).backgroundColor; }
}
return null;
"""


def _grid(browser) -> dict:
    return browser.execute_script(GRID_JS)


def type_filter(browser, column: str, text: str) -> None:
    """Type ``text`` into the Requests grid's filter row under ``column``."""
    header = browser.find_element("css selector",
                                  f'#requests-table .ag-header-cell[col-id="{column}"]')
    index = header.get_attribute("aria-colindex")
    browser.find_element("css selector", f'#requests-table .ag-floating-filter'
                                         f'[aria-colindex="{index}"] input').send_keys(text)


# The drawn text of the Requests grid's cells in column arguments[0].
COLUMN_TEXT_JS = """
return Array.from(document.querySelectorAll(
  '#requests-table .ag-center-cols-container .ag-cell[col-id="' + arguments[0] + '"]'),
  c => c.textContent);
"""


def test_requests_grid_says_no_tier_where_the_tiers_page_does(demo, browser):
    """The demo runs without a disk tier: the Tiers page says "no disk tier configured", and
    the grid's disk tokens cells said "not measured" beside it. They read "no tier" now; the
    cpu tier's read numbers."""
    browser.get(demo.ui_url + "requests")
    disk = wait_for(browser, lambda: browser.execute_script(COLUMN_TEXT_JS, "tokens_disk"),
                    "the grid's disk tokens cells")
    assert set(disk) == {"no tier"}, disk
    cpu = browser.execute_script(COLUMN_TEXT_JS, "tokens_cpu")
    assert cpu and all(text.isdigit() for text in cpu), cpu


def test_the_min_ttft_box_applies_once_typing_stops(demo, browser):
    """Typing a minimum TTFT filters the table without Enter (it waited for Enter, or for the
    box to lose focus: a tryout typed 5, waited, and saw every row still listed)."""
    browser.get(demo.ui_url + "requests")
    wait_for(browser, lambda: "requests" in status_text(browser, "requests-status"),
             "the Requests page's status line")
    browser.find_element("id", "min-ttft").send_keys("5")
    wait_for(browser, lambda: "with TTFT ≥ 5 ms" in status_text(browser, "requests-status"),
             "the table filtered to TTFT >= 5 ms, without Enter")


def test_requests_grid_sorts_filters_pages_and_highlights(demo, browser):
    """The Requests grid keeps what the DataTable did: 15 rows a page, the page kept across
    refreshes; sorting by TTFT asks the agent (the first row is the slowest of its whole
    table); "> X" under TTFT (ms) filters the rows; the deep-linked request's row is marked."""
    browser.get(demo.ui_url + "requests")
    try:
        grid = wait_for(browser, lambda: (g := _grid(browser)) and len(g["rows"]) > 30 and g,
                        "more than two pages of rows")
        assert grid["pageSize"] == 15 and grid["shown"] == 15 and grid["page"] == 0
        newest = grid["rows"][0][0]  # still in the latest 500 when the deep link opens it
        browser.find_element("css selector", '#requests-table [aria-label="Next Page"]').click()
        time.sleep(5)  # two refreshes (every 2 s) bring new rows
        assert _grid(browser)["page"] == 1

        ttft_header = '#requests-table .ag-header-cell[col-id="ttft_ms"] .ag-header-cell-label'
        browser.find_element("css selector", ttft_header).click()  # ascending
        browser.find_element("css selector", ttft_header).click()  # descending

        def slowest_first():
            with urllib.request.urlopen(f"{demo.api_url}/api/v1/requests?limit=1&sort=ttft"
                                        f"&order=desc", timeout=5) as resp:
                slowest = json.load(resp)["requests"][0]
            rows = _grid(browser)["rows"]
            return rows and rows[0][1] == round(slowest["ttft"] * 1000, 2) and rows

        rows = wait_for(browser, slowest_first, "the agent's slowest request first")
        ttfts = [t for _, t in rows]
        assert ttfts == sorted(ttfts, reverse=True)

        cut = ttfts[len(ttfts) // 2]
        type_filter(browser, "ttft_ms", f"> {cut}")
        filtered = wait_for(browser, lambda: (r := _grid(browser)["rows"]) and
                            all(t is not None and t > cut for _, t in r) and r,
                            f"only rows with TTFT > {cut} ms")
        assert 0 < len(filtered) < len(rows)

        browser.get(f"{demo.ui_url}requests?id={newest}")
        wait_for(browser, lambda: browser.execute_script(ROW_STYLE_JS, newest)
                 == {"yes": "#fff3c4", "others": []},
                 "the deep-linked request's row marked, and no other")
        # and drawn so: filter the request column to it, and its row shows marked
        type_filter(browser, "request_id", newest)
        wait_for(browser, lambda: browser.execute_script(DRAWN_STYLE_JS, newest)
                 == "rgb(255, 243, 196)", "the deep-linked request's row drawn marked")
    finally:
        screenshot(browser, "dashboard-requests-grid")
    assert not console_errors(browser)


def test_the_demos_sizing_page_sizes_the_workload_it_replays(demo, browser):
    """Without --trace the demo's Sizing page sized nothing ("no trace to size from") beside
    the workload it generates itself: it analyses that workload's first 10 minutes, 12,000
    requests at its 20 a second, with the demo's model (tiny) and GPU tier (256 blocks of 16
    tokens: 4,096 tokens); the model's bytes per block are its preset's, and the option it
    names is the demo's own --preset (a tryout was sent to the dashboard's --sizing-preset,
    which the demo does not have)."""
    browser.get(demo.ui_url + "sizing")
    try:
        wait_for_points(browser, ["sizing-curves", "sizing-cost"])
        text = status_text(browser, "sizing-status")
    finally:
        screenshot(browser, "dashboard-sizing-demo")
    assert "the synthetic workload's first 12,000 requests (10 minutes)" in text, text
    assert "12,000 requests, " in text and "GPU prefix cache 4,096 tokens" in text, text
    assert "(preset tiny; --preset for your model)" in text, text
    assert not console_errors(browser)


def test_sizing_page_plots_the_analysis(sizing_dashboard, browser):
    browser.get(sizing_dashboard.url + "/sizing")
    try:
        wait_for_points(browser, ["sizing-curves", "sizing-cost"])
        verdict = browser.find_element("id", "sizing-verdict").text
    finally:
        screenshot(browser, "dashboard-sizing")
    assert "Offload" in verdict and "--kv-offloading-size" in verdict
    assert "No GPU prefix cache assumed" in verdict  # the dashboard sizes without one
    assert not console_errors(browser)


def test_dead_agent_shows_unreachable_not_a_traceback(browser):
    from kvscope.dashboard.app import create_app, serve

    app = create_app("http://127.0.0.1:9", refresh_seconds=1.0)
    handle = serve(app, "127.0.0.1", 0)
    try:
        for path, status_id in (("/", "overview-status"), ("/requests", "requests-status"),
                                ("/tiers", "tiers-status")):
            browser.get(handle.url + path)
            wait_for(browser, lambda s=status_id: "agent unreachable: http://127.0.0.1:9"
                     in status_text(browser, s), f"unreachable status on {path}")
        screenshot(browser, "dashboard-agent-unreachable")
        assert not console_errors(browser)
    finally:
        handle.shutdown()


def test_a_token_in_the_address_bar_is_taken_out_and_the_cookie_opens_the_page(browser):
    """A protected dashboard opened as /requests?token=T&id=r1 in Chromium: redirected to
    /requests?id=r1 (the token out of the address bar and history), and the page's callbacks
    run on the cookie alone (the status line reads the dead agent, not a 401)."""
    from kvscope.dashboard.app import create_app, serve

    handle = serve(create_app("http://127.0.0.1:9", refresh_seconds=1.0,
                              require_token="visitor-tok-81"), "127.0.0.1", 0)
    try:
        browser.get(handle.url + "/requests?token=visitor-tok-81&id=r1")
        wait_for(browser, lambda: "agent unreachable: http://127.0.0.1:9"
                 in status_text(browser, "requests-status"), "the page's status line")
        assert browser.current_url == handle.url + "/requests?id=r1"
        assert not console_errors(browser)
    finally:
        handle.shutdown()


def test_a_demo_with_a_token_shows_its_overview(browser):
    """With KVSCOPE_TOKEN set the demo's agent demands the token (401 without it), and its own
    dashboard sends it: the Overview draws, not "agent unreachable: HTTP 401"."""
    with running_demo(env={"KVSCOPE_TOKEN": "demo-token-4f2a"}, log_name="demo-token.log") as d:
        assert http_status(f"{d.api_url}/api/v1/summary") == 401
        browser.get(d.ui_url)
        try:
            wait_for_points(browser, ["hit-quality", "tier-residency"])
        finally:
            screenshot(browser, "dashboard-demo-token")
        assert "unreachable" not in status_text(browser, "overview-status")


def _compare_captures(tmp_path) -> tuple[str, str]:
    """Two captures made by the agent's capture writer: the baseline's 200 requests take
    100 ms, the candidate's 50 ms (so with a 80 ms p99 budget the verdict is to keep)."""
    from known_runs import write_capture

    return (str(write_capture(tmp_path / "baseline", [0.1] * 200)),
            str(write_capture(tmp_path / "candidate", [0.05] * 200, cpu_tokens=32)))


def _verdict(browser) -> str:
    wait_for_points(browser, ["compare-ttft"], minimum=1)
    return wait_for(browser, lambda: browser.find_element("id", "compare-verdict").text,
                    "the verdict")


@pytest.fixture
def compare_dashboard(demo, tmp_path):
    """A dashboard, in-process, on the demo's agent, whose Compare page may read ``tmp_path``
    (the demo's own reads only its capture directory: it has none)."""
    from kvscope.dashboard.app import create_app, serve

    app = create_app(demo.api_url, capture_roots=[tmp_path])
    handle = serve(app, "127.0.0.1", 0)
    yield handle
    handle.shutdown()
    app.kvscope.backend.close()


def test_the_compare_page_reads_nothing_outside_its_capture_roots(demo, browser):
    """The demo's dashboard has no capture directory to read: a link naming /etc/shadow and one
    naming a missing path get the same line, which says nothing about either."""
    lines = []
    for path in ("/etc/shadow", "/no/such/capture"):
        browser.get(f"{demo.ui_url}compare?{urlencode({'baseline': path, 'candidate': path})}")
        lines.append(wait_for(browser, lambda: "cannot compare" in status_text(
            browser, "compare-status") and status_text(browser, "compare-status"),
            f"the refusal of {path}"))
    assert lines[0] == lines[1] == (
        "cannot compare: this dashboard reads no captures; give it a directory it may read "
        "(kvscope dashboard --capture-root DIR; the demo reads its --capture-dir and any "
        "--capture-root)")
    assert not console_errors(browser)


def test_the_demo_compares_captures_under_its_capture_root(browser, tmp_path):
    """A tryout captured two demo runs and could compare neither in a third demo's dashboard,
    which read only its own --capture-dir. With --capture-root DIR its Compare page reads the
    captures under DIR: the baseline's 200 requests at 100 ms, the candidate's at 50 ms, keep
    (as the dashboard's own --capture-root gives)."""
    baseline, candidate = _compare_captures(tmp_path)
    with running_demo(log_name="demo-capture-root.log",
                      args=["--capture-root", str(tmp_path)]) as demo:
        browser.get(f"{demo.ui_url}compare?"
                    f"{urlencode({'baseline': baseline, 'candidate': candidate})}")
        try:
            verdict = _verdict(browser)
        finally:
            screenshot(browser, "demo-compare-capture-root")
        assert "keep" in verdict.lower()
        assert f"compare page reads under: {tmp_path}" in demo.log_tail()


def test_compare_page_shows_two_captures_and_a_verdict(compare_dashboard, browser, tmp_path):
    """The form, filled and Compare pressed: the verdict, and the comparison's link in the
    address bar (the budget in seconds, as kvscope compare --ttft-budget)."""
    baseline, candidate = _compare_captures(tmp_path)
    browser.get(compare_dashboard.url + "/compare")
    try:
        wait_for(browser, lambda: browser.find_elements("id", "compare-run"), "the form")
        fill_in(browser, {"compare-baseline": baseline,
                          "compare-candidate": candidate, "compare-budget": "80"})
        browser.find_element("id", "compare-run").click()
        verdict = _verdict(browser)
        wait_for(browser, lambda: "ttft_budget" in browser.current_url, "the link in the URL")
    finally:
        screenshot(browser, "dashboard-compare")
    assert "keep" in verdict.lower()
    url = urlsplit(browser.current_url)
    assert url.path.endswith("/compare")
    assert parse_qs(url.query) == {"baseline": [baseline], "candidate": [candidate],
                                   "ttft_budget": ["0.08"]}
    # a budget relative to the baseline's p99, as kvscope compare --ttft-budget +10% (the
    # field took numbers only)
    fill_in(browser, {"compare-budget": "+10%"})
    browser.find_element("id", "compare-run").click()
    wait_for(browser, lambda: "ttft_budget=%2B10%25" in browser.current_url, "the new link")
    verdict = wait_for(browser, lambda: "+10%" in _verdict(browser) and _verdict(browser),
                       "the verdict against the relative budget")
    assert "the baseline's p99" in verdict
    assert not console_errors(browser)


def test_compare_link_opens_the_verdict_without_a_click(compare_dashboard, browser, tmp_path):
    """/compare?baseline=...&candidate=...&ttft_budget=0.08 fills the form (80 ms) and
    compares at once; a malformed budget in a link is one status line, not a traceback."""
    baseline, candidate = _compare_captures(tmp_path)
    browser.get(f"{compare_dashboard.url}/compare?"
                f"{urlencode({'baseline': baseline, 'candidate': candidate})}&ttft_budget=0.08")
    try:
        verdict = _verdict(browser)
        form = {i: browser.find_element("id", i).get_attribute("value")
                for i in ("compare-baseline", "compare-candidate", "compare-budget")}
    finally:
        screenshot(browser, "dashboard-compare-link")
    assert "keep" in verdict.lower() and "80 ms budget" in verdict
    assert form == {"compare-baseline": baseline, "compare-candidate": candidate,
                    "compare-budget": "80"}
    browser.get(f"{compare_dashboard.url}/compare?baseline={baseline}&candidate={candidate}"
                f"&ttft_budget=abc")
    status = wait_for(browser, lambda: "ttft_budget" in status_text(browser, "compare-status")
                      and status_text(browser, "compare-status"), "the bad-budget status")
    assert status.startswith("cannot compare: ttft_budget='abc'")
    assert not console_errors(browser)


# The memory budget figure's bars as drawn: {part id (the trace's legendgroup) or trace name:
# [y per whole]}, and its wholes.
MEMORY_BUDGET_JS = """
const el = document.getElementById('memory-budget');
const plot = el && el.querySelector('.js-plotly-plot');
const out = {};
for (const t of (plot && plot.data) || []) {
  const key = t.legendgroup || t.name;
  out[key] = Array.from(t.y || []);
  out['x:' + key] = Array.from(t.x || []);
}
return out;
"""


def test_overview_memory_budget_shows_the_engines_own_host_budget(demo, browser):
    """The demo types no cpu budget: the reference engine reports its cpu tier's size
    (1024 blocks x its block bytes by default) as its host KV budget, and the host bar's
    kv_offload part is that, exactly the cpu tier's capacity; the agent's summary agrees. The
    bar has its limit mark, and the engine's other memory is measured (the demo names its own
    process as the engine)."""
    with urllib.request.urlopen(demo.api_url + "/api/v1/summary", timeout=10) as resp:
        summary = json.load(resp)
    capacity = summary["tiers"]["cpu"]["capacity_bytes"]
    assert capacity > 0 and summary["host"]["offload_budget_bytes"] == {"cpu": capacity}
    browser.get(demo.ui_url)
    try:
        drawn = wait_for(browser, lambda: (lambda d: d if d.get("kv_offload") else None)(
            browser.execute_script(MEMORY_BUDGET_JS)), "the memory budget's host bar")
    finally:
        browser.execute_script("document.getElementById('memory-budget').scrollIntoView()")
        screenshot(browser, "dashboard-memory-budget")
    host = drawn["x:kv_offload"].index("host")
    assert drawn["kv_offload"][host] == capacity
    assert drawn["x:total"][0] == "host" and drawn["total"][0] > capacity
    assert "engine_other" in drawn and "free" in drawn
    assert not console_errors(browser)
