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
from kvscope.mixin.dashboards.common import NO_TRAFFIC
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
    "kvscope / Node / GPU memory budget (GPU only)",
    "kvscope / Node / GPU memory used against total (GPU only)",
    "kvscope / Node / GPU topology (GPU only)",
    "kvscope / Node / PCIe link utilisation (GPU only)",
    "kvscope / Node / PCIe throughput against link maximum (GPU only)",
]


def test_committed_files_match_the_generator() -> None:
    stale = [rel for rel, text in render(CFG).items()
             if not (GRAFANA / rel).is_file() or (GRAFANA / rel).read_text(encoding="utf-8") != text]
    assert stale == [], f"regenerate with `python -m kvscope.mixin`: {stale}"


def test_check_flag_reports_drift(tmp_path, capsys) -> None:
    """Up to date: one line says so (it printed nothing). A file changed is stale, one gone
    is missing (both read "stale")."""
    assert main(["--output", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["--check", "--output", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(f"up to date: the {len(render(CFG))} generated")
    (tmp_path / "alerts" / "kvscope.alerts.yml").write_text("groups: []\n")
    (tmp_path / "rules" / "kvscope.rules.yml").unlink()
    assert main(["--check", "--output", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"stale: {tmp_path / 'alerts' / 'kvscope.alerts.yml'}" in err
    assert f"missing: {tmp_path / 'rules' / 'kvscope.rules.yml'}" in err


def test_check_reports_a_board_the_generator_does_not_make(tmp_path, capsys) -> None:
    """A board renamed away stays in dashboards/, where Grafana's provisioning loads it beside
    the new one: --check fails naming it (it passed); a README there is no board (a near
    miss), and writing says so but removes nothing."""
    assert main(["--output", str(tmp_path)]) == 0
    (tmp_path / "dashboards" / "README.md").write_text("boards")
    assert main(["--check", "--output", str(tmp_path)]) == 0
    old = tmp_path / "dashboards" / "kvscope-old.json"
    old.write_text("{}")
    capsys.readouterr()
    assert main(["--check", "--output", str(tmp_path)]) == 1
    assert f"not generated: {old}" in capsys.readouterr().err
    assert main(["--output", str(tmp_path)]) == 0 and old.is_file()
    assert f"not generated: {old}" in capsys.readouterr().err


_WITHOUT_YAML = """
import sys
sys.modules["yaml"] = None  # as in an environment installed without the mixin extra
from kvscope.mixin.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("args,code", [(["--help"], 0), (["--check"], 2)], ids=["help", "run"])
def test_without_the_mixin_extra_help_works_and_a_run_says_what_to_install(args, code) -> None:
    """Without pyyaml (the mixin extra) ``--help`` printed a traceback; now it helps, and a
    run is one line naming the extra."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _WITHOUT_YAML, *args], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == code, done.stderr
    if code:
        assert done.stderr.count("\n") == 1 and "pip install -e '.[mixin]'" in done.stderr
    else:
        assert "--check" in done.stdout and not done.stderr


def test_config_overrides_without_forking(tmp_path) -> None:
    f = tmp_path / "mixin.toml"
    f.write_text('selector = \'job="vllm-nodes"\'\nttft_budget_seconds = 1\nttft_budget_for = "30m"\n')
    cfg = load_config(f)
    assert cfg.ttft_budget_seconds == 1.0 and cfg.ttft_budget_for == "30m"
    files = render(cfg)
    ttft = next(r for g in yaml.safe_load(files["alerts/kvscope.alerts.yml"])["groups"]
                for r in g["rules"] if r["alert"] == "KvscopeTTFTBudgetBreach")
    assert ttft["expr"].startswith('kvscope:ttft_seconds:quantile_rate5m{quantile="0.99"} > 1\n')
    assert ttft["for"] == "30m"
    assert 'job="vllm-nodes"' in files["rules/kvscope.rules.yml"]
    assert 'job="kvscope"' not in files["rules/kvscope.rules.yml"]
    assert 'job=\\"vllm-nodes\\"' in files["dashboards/kvscope-overview.json"]
    assert main(["--config", str(f), "--output", str(tmp_path / "out")]) == 0
    assert dataclasses.replace(CFG, headroom_min_ratio=0.02).headroom_min_ratio == 0.02


@pytest.mark.parametrize("text, says", [
    ("no_such_key = 1\n", "unknown"), ('ttft_budget_seconds = "fast"\n', "want float"),
    # each made rules promtool refuses ("bad duration syntax") or alerts that always fire
    ('rate_window = "banana"\n', "'rate_window': want a Prometheus duration"),
    ('ttft_budget_for = "15"\n', "'ttft_budget_for': want a Prometheus duration"),
    ("ttft_budget_seconds = -1\n", "'ttft_budget_seconds': want a finite number, 0 or more"),
    ("ttft_budget_seconds = 0\n", "'ttft_budget_seconds': want a budget above 0 seconds"),
    ("itl_budget_quantile = 1.5\n", "'itl_budget_quantile': want a quantile between 0 and 1"),
    ("thrash_unused_share = nan\n", "'thrash_unused_share': want a finite number"),
    ("headroom_min_ratio = 5.0\n", "'headroom_min_ratio': want a share between 0 and 1"),
    ("tier_full_reused_share = 1.2\n", "'tier_full_reused_share': want a share between 0 and"),
    # a critical alert at < 20% headroom and its warning at < 5%: the critical one came first
    ("headroom_min_ratio = 0.2\nheadroom_warning_ratio = 0.05\n",
     "'headroom_min_ratio' .0.2, critical. is not below 'headroom_warning_ratio'"),
    # equal: both fire together, the warning never first (docs/grafana.md's example did)
    ("headroom_min_ratio = 0.05\n",
     "'headroom_min_ratio' .0.05, critical. is not below 'headroom_warning_ratio' .0.05"),
    # written into every rule: promtool refused the rules ("unexpected identifier")
    ("selector = 'job=kvscope'\n", "'selector': must be PromQL label matchers.*; got "
                                    "job=kvscope$"),  # said once (it ended ", got 'job=...'")
    # a file that is not TOML: its error named a line, not the file
    ("a = \n", r"bad.toml: not TOML: Invalid value \(at line 1, column 5\)"),
    ("ttft_budget_warning_ratio = 0.0\n", "'ttft_budget_warning_ratio': want a share of the")])
def test_config_rejects_bad_overrides(tmp_path, text, says) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(MixinConfigError, match=says):
        load_config(f)
    assert main(["--config", str(f), "--check"]) == 2


def test_config_takes_durations_prometheus_reads() -> None:
    """Near misses of the refusals above: compound durations, a 0 floor, a tiny budget, a
    ratio above 1 that is a multiple (150% above the baseline), a share of exactly 1, a
    critical headroom below its warning's."""
    cfg = dataclasses.replace(CFG, rate_window="1h30m", ttft_budget_for="90s",
                              regression_baseline_offset="1w", swap_in_bytes_per_second=0.0,
                              itl_budget_seconds=0.001, regression_ratio=1.5,
                              headroom_min_ratio=0.1, headroom_warning_ratio=0.2,
                              tier_full_reused_share=1.0)
    assert (cfg.rate_window, cfg.itl_budget_seconds) == ("1h30m", 0.001)


def _runbook_anchors() -> set[str]:
    return {line[3:].strip().lower() for line in RUNBOOKS.read_text().splitlines() if line.startswith("## ")}


def test_alerts_carry_severity_summary_description_and_runbook() -> None:
    names = [a.name for a in alerts(CFG)]
    assert REQUIRED_ALERTS <= set(names)
    keys = [(a.name, a.severity) for a in alerts(CFG)]
    assert len(keys) == len(set(keys))
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
    ttft = {a.severity: a for a in alerts(CFG) if a.name == "KvscopeTTFTBudgetBreach"}
    assert set(ttft) == {"critical", "warning"}
    assert "disable the newest offload tier" in ttft["critical"].description
    assert f"> {CFG.ttft_budget_seconds:g}\n" in ttft["critical"].expr
    assert 'quantile="0.99"' in ttft["critical"].expr
    warning = CFG.ttft_budget_seconds * CFG.ttft_budget_warning_ratio
    assert f"> {warning:g}\n" in ttft["warning"].expr


def test_a_threshold_prints_without_the_floats_rounding() -> None:
    """grafana.md's example budget, 1.5 s: its warning at 0.8 of it read "> 1.2000000000000002"
    in the generated rule (valid PromQL, but not what anyone typed)."""
    cfg = dataclasses.replace(CFG, ttft_budget_seconds=1.5)
    (warning,) = [a for a in alerts(cfg)
                  if a.name == "KvscopeTTFTBudgetBreach" and a.severity == "warning"]
    assert "> 1.2\n" in warning.expr, warning.expr


def test_the_default_ttft_thresholds_are_bucket_bounds() -> None:
    """histogram_quantile interpolates inside a bucket: with the warning (2 s) inside (1, 2.5],
    three requests a hundred at 1.05 s read as a p99 of 1 + 1.5 * 0.8 = 2.2 s and warned (found
    by a fresh-user tryout; grafana/tests' near miss e). On a bound the comparison is exact."""
    from kvscope.catalog import LATENCY_SECONDS_BUCKETS

    warning = CFG.ttft_budget_seconds * CFG.ttft_budget_warning_ratio
    assert {CFG.ttft_budget_seconds, warning} <= set(LATENCY_SECONDS_BUCKETS)


def test_severity_pairs_and_traffic_floors() -> None:
    by_name: dict[str, set[str]] = {}
    for a in alerts(CFG):
        by_name.setdefault(a.name, set()).add(a.severity)
    assert by_name["KvscopeHostMemoryHeadroomLow"] == {"warning", "critical"}
    floors = {"KvscopeTTFTBudgetBreach": CFG.min_requests_per_second,
              "KvscopeITLBudgetBreach": CFG.min_requests_per_second,
              "KvscopeTransferFailures": CFG.min_transfers_per_second}
    for a in alerts(CFG):
        if a.name in floors:
            assert a.expr.endswith(f">= {floors[a.name]:g}"), a.expr
    cfg = dataclasses.replace(CFG, min_requests_per_second=5.0)
    assert all(a.expr.endswith(">= 5") for a in alerts(cfg) if a.name == "KvscopeITLBudgetBreach")


def test_cluster_label_and_variable() -> None:
    assert CFG.by == "cluster, job, instance"
    assert "sum by (cluster, job, instance" in render(CFG)["rules/kvscope.rules.yml"]
    assert dataclasses.replace(CFG, cluster_label="").by == "job, instance"
    multi = dataclasses.replace(CFG, show_multi_cluster=True, cluster_label="k8s_cluster")
    for board in dashboards(multi).values():
        names = [v["name"] for v in board["templating"]["list"]]
        assert names[:5] == ["datasource", "cluster", "engine", "model", "instance"]
        for panel in _panels(board):
            for target in panel["targets"]:
                assert 'k8s_cluster=~"$cluster"' in target["expr"], (panel["title"], target["expr"])


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
    for name, board in boards.items():
        traces = ["traces"] if name == "kvscope-requests.json" else []
        assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "engine", "model", "instance",
                                                                     *traces]
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        for panel in _panels(board):
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["description"], panel["title"]
            for target in panel["targets"]:
                assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])


def test_exemplars_on_ttft_and_transfer_time_panels() -> None:
    exemplar = {q.where for q in all_queries(CFG) if q.exemplar}
    assert any("Requests & SLO / TTFT" in w for w in exemplar), exemplar
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


def test_a_namespace_kubernetes_refuses_is_a_usage_error(capsys) -> None:
    """An empty or upper-case namespace made a manifest the API server refuses."""
    for bad in ("", "Monitoring", "-obs", "a" * 64):
        with pytest.raises(SystemExit) as exited:
            main(["--prometheus-rule", f"--namespace={bad}"])
        assert exited.value.code == 2
        assert "is not a Kubernetes namespace" in capsys.readouterr().err
    assert main(["--prometheus-rule", "--namespace", "kube-obs-2"]) == 0


@pytest.mark.parametrize("args,said", [
    (["--check", "--prometheus-rule"], "--check checks the files in --output; "
                                       "--prometheus-rule prints a manifest to stdout: give one"),
    (["--namespace", "obs"], "--namespace names the PrometheusRule's namespace: give it with "
                             "--prometheus-rule")])
def test_flags_one_mode_would_ignore_are_usage_errors(args, said, capsys) -> None:
    """A tryout's --check beside --prometheus-rule checked nothing (exit 0), and --namespace
    without --prometheus-rule was dropped unsaid."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2 and said in capsys.readouterr().err


def test_a_stale_file_names_the_command_that_writes_it(tmp_path, capsys) -> None:
    """--check of another --output said to run the generator bare, which writes grafana/."""
    assert main(["--check", "--output", str(tmp_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err and all(line.endswith(f"(run python -m kvscope.mixin --output {tmp_path})")
                       for line in err), err


def test_an_output_that_is_not_a_directory_is_one_error_line(tmp_path, capsys) -> None:
    """--output naming a file ended in NotADirectoryError's traceback."""
    (tmp_path / "board.json").write_text("{}")
    assert main(["--output", str(tmp_path / "board.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope.mixin: error: cannot create ") and len(err.splitlines()) == 1
    assert f"{tmp_path / 'board.json'} is a file, not a directory" in err


def test_a_file_in_the_way_of_one_folder_leaves_nothing_written(tmp_path, capsys) -> None:
    """A file named like one of the output's folders (dashboards) came after the rules and
    alerts were written: half a mixin, and the error said "File exists" of the dashboard's
    path. Now nothing is written and the error names the file in the way."""
    (tmp_path / "dashboards").write_text("")
    assert main(["--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"{tmp_path / 'dashboards'} is a file" in err
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["dashboards"]


def test_a_config_that_cannot_be_read_is_named_as_the_agent_names_it(tmp_path, capsys) -> None:
    """It read "error: [Errno 2] No such file or directory: 'x.toml'"."""
    assert main(["--config", str(tmp_path / "x.toml"), "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"kvscope.mixin: error: cannot read config {tmp_path / 'x.toml'}: "
                   "No such file or directory\n")


def test_provisioning_files() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "kvscope.yml").read_text())
    prom = next(d for d in ds["datasources"] if d["type"] == "prometheus")
    assert prom["jsonData"]["exemplarTraceIdDestinations"][0]["name"] == "trace_id"
    dash = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kvscope.yml").read_text())
    assert dash["providers"][0]["type"] == "file"


def _panels(board: dict) -> list[dict]:
    """A board's PromQL panels (not rows, not the Tempo trace list)."""
    return [p for p in board["panels"] if p["type"] != "row" and p["datasource"]["type"] == "prometheus"]


def _trace_panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p.get("datasource", {}).get("type") == "tempo"]


def test_trace_list_reads_the_traces_variable_and_goes_with_it() -> None:
    """The Requests board lists slow requests' traces from the $traces Tempo datasource; with
    show_traces off (no Tempo provisioned) neither the panel nor the variable is there."""
    board = dashboards(CFG)["kvscope-requests.json"]
    (panel,) = _trace_panels(board)
    (target,) = panel["targets"]
    assert target["datasource"] == {"type": "tempo", "uid": "${traces}"} and target["queryType"] == "traceql"
    slow = CFG.ttft_budget_seconds * CFG.ttft_budget_warning_ratio
    assert target["query"] == f'{{ name = "kv.request" && span.kv.ttft_seconds >= {slow:g} }}'
    assert sum(len(_trace_panels(b)) for b in dashboards(CFG).values()) == 1
    off = dashboards(dataclasses.replace(CFG, show_traces=False))["kvscope-requests.json"]
    assert not _trace_panels(off)
    assert "traces" not in [v["name"] for v in off["templating"]["list"]]


def _normal(expr: str) -> str:
    return " ".join(expr.split())


def test_each_board_carries_each_query_once() -> None:
    """Two panels with the same query answer one question twice; a query repeated across
    boards is the same panel twice (Overview keeps one number per concern, the boards the rest)."""
    seen: dict[str, str] = {}
    for board in dashboards(CFG).values():
        for panel in _panels(board):
            for target in panel["targets"]:
                where = f"{board['title']} / {panel['title']}"
                expr = _normal(target["expr"])
                assert expr not in seen, f"{where} repeats {seen.get(expr)}: {expr}"
                seen[expr] = where


def test_the_duplicate_check_catches_a_repeat() -> None:
    board = dashboards(CFG)["kvscope-tiers.json"]
    board["panels"].append(dict(_panels(board)[0], title="copy"))
    exprs = [_normal(t["expr"]) for p in _panels(board) for t in p["targets"]]
    assert len(exprs) != len(set(exprs))


# Grafana units that print "/s" (bytes/s, requests/s, counts/s, ops/s); custom units end in "/s".
PER_SECOND_UNITS = {"Bps", "binBps", "bps", "reqps", "cps", "ops", "rps", "wps", "iops"}
_RECORDED_RATE = re.compile(r"kvscope:[a-z0-9_]+:rate\d")


def shows_rate(expr: str) -> bool:
    """A query whose values are per-second rates: a rate() or a recorded rate, not divided into a
    ratio or a mean and not a quantile."""
    rate = "rate(" in expr or _RECORDED_RATE.search(expr) is not None
    return rate and "/" not in expr and "quantile" not in expr


def _unit_per_second(unit: str) -> bool:
    return unit in PER_SECOND_UNITS or unit.endswith("/s")


def test_rate_panels_have_per_second_units() -> None:
    checked = 0
    for board in dashboards(CFG).values():
        for panel in _panels(board):
            if any(shows_rate(t["expr"]) for t in panel["targets"]):
                checked += 1
                unit = panel["fieldConfig"]["defaults"].get("unit", "")
                assert _unit_per_second(unit), f"{board['title']} / {panel['title']}: unit {unit!r}"
    assert checked >= 10
    assert shows_rate('sum by (src) (rate(x_total{job="kvscope"}[5m]))')
    assert shows_rate("sum(kvscope:events_dropped:rate5m)")
    assert not shows_rate("kvscope:transfer_failures:ratio_rate5m")
    assert not shows_rate("sum(rate(a_sum[5m])) / sum(rate(a_count[5m]))")
    assert not _unit_per_second("short") and not _unit_per_second("s")


def test_rate_panels_start_at_zero() -> None:
    """A rate is never negative; an axis that starts at the data's minimum makes a flat rate
    look like swings (a heatmap's axis is its buckets, not the rate)."""
    for board in dashboards(CFG).values():
        for panel in _panels(board):
            if panel["type"] != "heatmap" and any(shows_rate(t["expr"]) for t in panel["targets"]):
                assert panel["fieldConfig"]["defaults"].get("min") == 0, f"{board['title']} / {panel['title']}"


def test_fleet_panels_have_table_legends() -> None:
    """A time series per agent: the legend is a table of mean, max and last, sorted by max."""
    checked = 0
    for board in dashboards(CFG).values():
        for panel in _panels(board):
            if any("{{instance}}" in t.get("legendFormat", "") for t in panel["targets"]):
                if panel["type"] != "timeseries":
                    continue
                checked += 1
                legend = panel["options"]["legend"]
                assert legend["displayMode"] == "table", panel["title"]
                assert legend["calcs"] == ["mean", "max", "lastNotNull"], panel["title"]
                assert (legend["sortBy"], legend["sortDesc"]) == ("Max", True), panel["title"]
    assert checked >= 10


def _defaults(title: str) -> dict:
    for board in dashboards(CFG).values():
        for panel in _panels(board):
            if panel["title"] == title:
                return panel["fieldConfig"]["defaults"]
    raise KeyError(title)


def _color_at(defaults: dict, value: float) -> str:
    color = None
    for step in defaults["thresholds"]["steps"]:
        if step["value"] is None or value >= step["value"]:
            color = step["color"]
    return color


@pytest.mark.parametrize("title", ["Sources up", "Collectors up"])
def test_up_panels_are_red_at_zero(title) -> None:
    d = _defaults(title)
    assert _color_at(d, 0) == "red" and _color_at(d, 1) == "green"
    mapped = {k: v for m in d["mappings"] for k, v in m["options"].items()}
    assert mapped["0"]["color"] == "red" and mapped["0"]["text"] == "down"


@pytest.mark.parametrize("title", ["Headroom", "Headroom ratio", "Lowest host RAM headroom"])
def test_low_headroom_is_bad(title) -> None:
    d = _defaults(title)
    assert _color_at(d, -0.01) == "red" and _color_at(d, 0.5) == "green"


def test_ratio_panels_guard_their_denominator() -> None:
    """A ratio divides by ``(... > 0)`` so an idle system shows "no traffic", not NaN (and
    a ratio of a signal some engines do not send says that too: "no traffic, or not
    measured")."""
    for board in dashboards(CFG).values():
        for panel in _panels(board):
            for target in panel["targets"]:
                expr = target["expr"]
                if "/" in expr:
                    assert re.search(r"/ (ignoring \(\w+\) group_left \(\) )?\(.*> 0\)$", _normal(expr)), (
                        panel["title"], expr)
                    assert panel["fieldConfig"]["defaults"].get("noValue") in (
                        NO_TRAFFIC, f"{NO_TRAFFIC}, or not measured"), panel["title"]


def test_engines_table_is_one_row_per_engine() -> None:
    board = dashboards(CFG)["kvscope-overview.json"]
    panel = next(p for p in _panels(board) if p["title"] == "Engines")
    (target,) = panel["targets"]
    assert target["format"] == "table" and target["instant"] is True
    assert target["expr"].startswith("count by (engine, model) (kvscope_engine_info{")


def test_same_quantity_panels_say_which() -> None:
    """TTFT quantiles of the worst instance and of the fleet differ; titles say which, and
    legends read p99, not p0.99."""
    titles = [p["title"] for b in dashboards(CFG).values() for p in _panels(b)]
    assert len(titles) == len(set(titles)), titles
    ttft = [t for t in titles if t.startswith("TTFT")]
    assert all("worst instance" in t or "fleet" in t or "by instance" in t for t in ttft), ttft
    for board in dashboards(CFG).values():
        for panel in _panels(board):
            for target in panel["targets"]:
                assert "{{quantile}}" not in target.get("legendFormat", ""), panel["title"]


def test_instance_all_follows_the_engine_and_model_selection() -> None:
    """No allValue on $instance: All expands to the listed instances (those of the selected
    engines and models), where ".*" would show every agent."""
    for board in dashboards(CFG).values():
        var = {v["name"]: v for v in board["templating"]["list"]}
        assert var["instance"].get("allValue") in (None, "")
        assert 'engine=~"$engine"' in var["instance"]["query"]
        assert 'model=~"$model"' in var["instance"]["query"]
