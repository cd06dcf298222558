"""The mixin's rule files are valid (`promtool check rules`) and behave as their unit tests say
(`promtool test rules grafana/tests/*-test.yaml`); every alert has a firing case and a near miss.
promtool ships with Debian's `prometheus`."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from conftest import REPO_ROOT

PROMTOOL = shutil.which("promtool")
GRAFANA = REPO_ROOT / "grafana"
RULES = GRAFANA / "rules" / "kvscope.rules.yml"
ALERTS = GRAFANA / "alerts" / "kvscope.alerts.yml"
RULE_TESTS = sorted((GRAFANA / "tests").glob("*-test.yaml"))

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian `prometheus`); run `bash scripts/setup.sh --test`"
)


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PROMTOOL, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )


def _alert_names() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [r["alert"] for g in groups for r in g["rules"]]


@needs_promtool
@pytest.mark.parametrize("rule_file", [RULES, ALERTS], ids=lambda p: p.name)
def test_rules_check(rule_file) -> None:
    r = _promtool("check", "rules", str(rule_file))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout, r.stdout


def test_rules_unit_tests_exist() -> None:
    assert {p.name for p in RULE_TESTS} >= {"kvscope-rules-test.yaml", "kvscope-alerts-test.yaml"}, RULE_TESTS


@needs_promtool
@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_rules_unit(test_file) -> None:
    r = _promtool("test", "rules", str(test_file))
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_recording_rule_is_unit_tested() -> None:
    tested = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("promql_expr_test", []):
                tested.add(t["expr"].split("{")[0])
    records = {r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert records - tested == set()


def test_every_alert_fires_and_has_a_near_miss() -> None:
    """Each alert has a case where it fires and one where the same test's series keep it silent."""
    fires, silent = set(), set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                (fires if t.get("exp_alerts") else silent).add(t["alertname"])
                # A firing case names fewer alerts than the test has instances: the rest are near misses.
    names = set(_alert_names())
    assert names - fires == set(), f"alerts never shown firing: {sorted(names - fires)}"
    assert names - silent == set(), f"alerts never shown silent: {sorted(names - silent)}"
