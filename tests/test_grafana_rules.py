"""The Prometheus rule file is valid (`promtool check rules`) and behaves as its unit tests say
(`promtool test rules grafana/tests/kvscope-test.yaml`). promtool ships with Debian's `prometheus`."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import REPO_ROOT

PROMTOOL = shutil.which("promtool")
RULES = REPO_ROOT / "grafana" / "rules" / "kvscope.rules.yml"
RULE_TESTS = sorted((REPO_ROOT / "grafana" / "tests").glob("*-test.yaml"))

pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian `prometheus`); run `bash scripts/setup.sh --test`"
)


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PROMTOOL, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )


def test_rules_check() -> None:
    r = _promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout, r.stdout


def test_rules_unit_tests_exist() -> None:
    assert "kvscope-test.yaml" in [p.name for p in RULE_TESTS], RULE_TESTS


@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_rules_unit(test_file) -> None:
    r = _promtool("test", "rules", str(test_file))
    assert r.returncode == 0, r.stdout + r.stderr
