"""The monitoring mixin generator (kvscope/mixin): committed files match it, its config
overrides work, alerts carry what operators need, and it agrees with the metric catalog."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from conftest import REPO_ROOT
from kvscope.catalog import CATALOG
from kvscope.mixin import MixinConfig, MixinConfigError, load_config
from kvscope.mixin.__main__ import main
from kvscope.mixin.alerts import alerts
from kvscope.mixin.dashboards import dashboards
from kvscope.mixin.promql import le_matcher, offload_matchers, promotion_matchers
from kvscope.mixin.queries import all_queries, gpu_only_panels, metric_names, reads
from kvscope.mixin.render import prometheus_rule, render

GRAFANA = REPO_ROOT / "grafana"
RUNBOOKS = REPO_ROOT / "docs" / "runbooks.md"
CFG = MixinConfig()

REQUIRED_ALERTS = {
    "KvscopeTTFTBudgetBreach", "KvscopeHostMemoryHeadroomLow", "KvscopeOffloadThrash",
    "KvscopeTierIneffective", "KvscopePromotionLatencyHigh", "KvscopePCIeLinkSaturated",
    "KvscopeTransferFailures", "KvscopeEventsDropped", "KvscopeSourceDown",
}
# The listed exception of the end-to-end check: panels that only have data where NVML sees a GPU.
GPU_ONLY_PANELS = [
    "kvscope / Node / GPU memory used against total (GPU only)",
    "kvscope / Node / GPU topology (GPU only)",
    "kvscope / Node / PCIe link utilisation (GPU only)",
    "kvscope / Node / PCIe throughput against link maximum (GPU only)",
]


def test_committed_files_match_the_generator() -> None:
    stale = [rel for rel, text in render(CFG).items()
             if not (GRAFANA / rel).is_file() or (GRAFANA / rel).read_text(encoding="utf-8") != text]
    assert stale == [], f"regenerate with `python -m kvscope.mixin`: {stale}"


def test_check_flag_reports_drift(tmp_path) -> None:
    assert main(["--output", str(tmp_path)]) == 0
    assert main(["--check", "--output", str(tmp_path)]) == 0
    (tmp_path / "alerts" / "kvscope.alerts.yml").write_text("groups: []\n")
    assert main(["--check", "--output", str(tmp_path)]) == 1


def test_config_overrides_without_forking(tmp_path) -> None:
    f = tmp_path / "mixin.toml"
    f.write_text('selector = \'job="vllm-nodes"\'\nttft_budget_seconds = 1\nttft_budget_for = "30m"\n')
    cfg = load_config(f)
    assert cfg.ttft_budget_seconds == 1.0 and cfg.ttft_budget_for == "30m"
    files = render(cfg)
    ttft = next(r for g in yaml.safe_load(files["alerts/kvscope.alerts.yml"])["groups"]
                for r in g["rules"] if r["alert"] == "KvscopeTTFTBudgetBreach")
    assert ttft["expr"].endswith("> 1") and ttft["for"] == "30m"
    assert 'job="vllm-nodes"' in files["rules/kvscope.rules.yml"]
    assert 'job="kvscope"' not in files["rules/kvscope.rules.yml"]
    assert 'job=\\"vllm-nodes\\"' in files["dashboards/kvscope-overview.json"]
    assert main(["--config", str(f), "--output", str(tmp_path / "out")]) == 0
    assert dataclasses.replace(CFG, headroom_min_ratio=0.05).headroom_min_ratio == 0.05


@pytest.mark.parametrize("text", ["no_such_key = 1\n", 'ttft_budget_seconds = "fast"\n'])
def test_config_rejects_bad_overrides(tmp_path, text) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(MixinConfigError):
        load_config(f)
    assert main(["--config", str(f), "--check"]) == 2


def _runbook_anchors() -> set[str]:
    return {line[3:].strip().lower() for line in RUNBOOKS.read_text().splitlines() if line.startswith("## ")}


def test_alerts_carry_severity_summary_description_and_runbook() -> None:
    names = [a.name for a in alerts(CFG)]
    assert REQUIRED_ALERTS <= set(names)
    assert len(names) == len(set(names))
    anchors = _runbook_anchors()
    for alert in alerts(CFG):
        rule = alert.rule(CFG)
        assert re.fullmatch(r"Kvscope[A-Z][A-Za-z]+", alert.name)
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        ann = rule["annotations"]
        assert ann["summary"] and "{{" not in ann["summary"], alert.name  # static
        assert "{{ $labels.instance }}" in ann["description"], alert.name  # templated
        assert ann["runbook_url"] == f"{CFG.runbook_url_base}#{alert.name.lower()}"
        assert alert.name.lower() in anchors, f"docs/runbooks.md has no section for {alert.name}"
        assert alert.signals, alert.name


def test_ttft_alert_is_the_rollback_rule() -> None:
    ttft = next(a for a in alerts(CFG) if a.name == "KvscopeTTFTBudgetBreach")
    assert ttft.severity == "critical"
    assert "disable the newest offload tier" in ttft.description
    assert f"> {CFG.ttft_budget_seconds:g}" in ttft.expr and 'quantile="0.99"' in ttft.expr


def test_catalog_and_mixin_agree() -> None:
    catalog = {spec.name for spec in CATALOG}
    used: set[str] = set()
    for q in all_queries(CFG):
        named = metric_names(q.expr)
        assert named <= catalog, f"{q.where} names metrics the catalog lacks: {named - catalog}"
        used |= reads(q.expr, CFG)
    assert catalog - used == set(), f"catalog metrics no board, rule or alert uses: {sorted(catalog - used)}"


def test_metric_names_fold_histogram_series() -> None:
    assert metric_names("rate(kvscope_ttft_seconds_bucket[5m]) + kvscope:ttft_seconds:x") == {"kvscope_ttft_seconds"}
    assert metric_names("kvscope_no_such_metric_count") == {"kvscope_no_such_metric_count"}


def test_gpu_only_panels_are_listed() -> None:
    assert gpu_only_panels(CFG) == GPU_ONLY_PANELS


def test_dashboards() -> None:
    boards = dashboards(CFG)
    assert [b["title"] for b in boards.values()] == [
        "kvscope / Overview", "kvscope / Tiers", "kvscope / Requests & SLO", "kvscope / Node"]
    assert len({b["uid"] for b in boards.values()}) == 4
    for board in boards.values():
        assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "engine", "model", "instance"]
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        for panel in board["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["description"], panel["title"]
            for target in panel["targets"]:
                assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])


def test_exemplars_on_ttft_and_transfer_time_panels() -> None:
    exemplar = {q.where for q in all_queries(CFG) if q.exemplar}
    assert any("Requests & SLO / TTFT" in w for w in exemplar), exemplar
    assert any("Requests & SLO / Transfer time" in w for w in exemplar), exemplar
    assert any("Tiers / Transfer time" in w for w in exemplar), exemplar
    for q in all_queries(CFG):
        if q.exemplar:
            assert "_bucket" in q.expr, q.where


def test_promql_helpers() -> None:
    assert le_matcher(1.0) == 'le=~"1|1\\\\.0"'
    assert le_matcher(2.5) == 'le="2.5"'
    assert promotion_matchers(CFG) == ['src=~"cpu|disk|remote", dst="gpu"', 'src=~"disk|remote", dst="cpu"',
                                       'src="remote", dst="disk"']
    assert offload_matchers(CFG)[0] == 'src="gpu", dst=~"cpu|disk|remote"'


def test_prometheus_rule_manifest() -> None:
    manifest = yaml.safe_load(prometheus_rule(CFG, namespace="obs"))
    assert manifest["kind"] == "PrometheusRule" and manifest["metadata"]["namespace"] == "obs"
    assert [g["name"] for g in manifest["spec"]["groups"]] == ["kvscope.rules", "kvscope.alerts"]


def test_provisioning_files() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "kvscope.yml").read_text())
    prom = next(d for d in ds["datasources"] if d["type"] == "prometheus")
    assert prom["jsonData"]["exemplarTraceIdDestinations"][0]["name"] == "trace_id"
    dash = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kvscope.yml").read_text())
    assert dash["providers"][0]["type"] == "file"
