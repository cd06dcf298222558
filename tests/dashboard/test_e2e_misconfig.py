"""End to end: the misconfiguration banners on the Overview, in headless Chromium, on two demo
runs: one with planted misconfigurations, one healthy near miss (issue 25, item 3's proof).

- misconfigured: every prompt a one-off (``--one-off-share 1``) into a small cpu tier
  (``--cpu-blocks 64``) over a real filesystem tier (``--disk-blocks 256``: the reference
  engine's chunk files in a temporary directory), so both keep storing blocks nobody reuses
  and serve no prompt token, and a reserve of 1 PiB (``KVSCOPE_COLLECTORS__HOST__RESERVE_BYTES``: no host
  has that much RAM) so that the cpu budget plus the reserve exceed the memory limit (here
  physical RAM; live agents in a real cgroup with a memory limit: tests/dashboard/
  test_misconfig.py).
- healthy: shared prefixes and sessions without one-off prompts (``--one-off-share 0``) and
  no reserve: the same detectors find the budget fitting, the cpu tier serving tokens and
  about 60% of its evicted blocks never reused, under the 80% line. (The default workload's
  25% one-offs leave 79% to 80% never reused, on the line: CI once read 'misconfigured'.)

Both: the demo runs no vLLM, so weight offload is "not measured" (no engine command line of
vLLM's), and the host KV pool's NUMA placement is "not measured" (no GPU). Screenshots:
test-artifacts/dashboard-misconfig-*.png.
"""

from __future__ import annotations

import pytest

from test_e2e_dashboard import browser, screenshot, wait_for  # noqa: F401 (fixture)
from test_e2e_offload_verdict import demo_with

PIB = 2 ** 50
CASES = {
    "misconfigured": (["--one-off-share", "1", "--cpu-blocks", "64", "--disk-blocks", "256"],
                      {"KVSCOPE_COLLECTORS__HOST__RESERVE_BYTES": str(PIB)}),
    "healthy": (["--gpu-blocks", "32", "--one-off-share", "0"], {}),
}
FINDINGS_JS = """
const out = {};
for (const el of document.querySelectorAll('[id^="misconfig-"][data-status]')) {
  out[el.id.slice('misconfig-'.length)] = el.getAttribute('data-status');
}
const section = document.getElementById('misconfig');
out['text'] = section ? section.innerText : '';
return out;
"""


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    args, env = CASES[request.param]
    with demo_with(args, f"demo-misconfig-{request.param}.log", env) as demo:
        yield request.param, demo


def read_findings(browser, ready_when) -> dict:
    """The findings' statuses by key and the section's text, read in one script (every
    refresh redraws them), once ``ready_when(found)`` holds."""
    found: dict = {}

    def ready():
        nonlocal found
        found = browser.execute_script(FINDINGS_JS)
        return ready_when(found) and found

    wait_for(browser, ready, "the misconfiguration findings")
    return found


def test_misconfiguration_banners(case, browser):
    name, demo = case
    browser.get(demo.ui_url)
    if name == "misconfigured":
        found = read_findings(browser, lambda f: all(
            f.get(k) == "misconfigured"
            for k in ("budget-over-limit", "tier-negligible", "stored-for-nothing")))
        text = found["text"]
        assert "What is wrong: cpu budget" in text and "GiB over" in text
        assert "What to change: shrink the budget" in text
        assert "the cpu tier holds" in text and "served 0.00% of" in text
        assert "the disk tier holds" in text  # the secondary tier that serves nothing
        assert "never reused" in text and "What to change: admit by reuse evidence" in text
    else:
        found = read_findings(browser, lambda f: f.get("tier-negligible") == "ok"
                              and f.get("budget-over-limit") == "ok")
        assert found.get("stored-for-nothing") != "misconfigured"
        # promotion-slower is left out: the reference engine's promotions are real copies on
        # this (slow, shared) CPU, timed as they ran, against prefill priced on an H100, so
        # recompute may well be the faster path here; that is the detector's to say
        assert "What is wrong: cpu budget" not in found["text"]
    screenshot(browser, f"dashboard-misconfig-{name}")
    assert found["weight-offload"] == "not measured"
    assert found["numa-remote"] == "not measured"
    assert found["swap-in"] in ("ok", "misconfigured")  # measured: psutil's sin on Linux
