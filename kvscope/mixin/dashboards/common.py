"""Panel and board helpers over grafana-foundation-sdk, so each board reads as a list of panels.

Every panel reads the ``$datasource`` variable; every query filters with the config selector and
``instance=~"$instance"`` (and ``$cluster`` with ``show_multi_cluster``). The ``engine`` and
``model`` variables narrow the instance list (chained variables over ``kvscope_engine_info``),
so panel queries need no joins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import heatmap as heatmapb
from grafana_foundation_sdk.builders import prometheus as pb
from grafana_foundation_sdk.builders import stat as statb
from grafana_foundation_sdk.builders import table as tableb
from grafana_foundation_sdk.builders import tempo as tempob
from grafana_foundation_sdk.builders import timeseries as tsb
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from kvscope.mixin.config import MixinConfig
from kvscope.mixin.promql import sel

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
TRACES = dm.DataSourceRef(type_val="tempo", uid="${traces}")
TRACE_LIMIT = 20
FLEET_LEGEND = "{{instance}}"  # a legend naming the instance: one series per agent
LEGEND_CALCS = ["mean", "max", "lastNotNull"]
INSTANCE = 'instance=~"$instance"'
ENGINE = 'engine=~"$engine"'
MODEL = 'model=~"$model"'
RATE = "$__rate_interval"
NO_TRAFFIC = "no traffic"  # what a ratio shows when its denominator is 0 (guarded by > 0)
# 1/0 gauges (sources, collectors): red at 0 whatever the colour scheme.
UP_DOWN = (("0", "down", "red"), ("1", "up", "green"))
RED_BELOW_ONE = ((None, "red"), (1, "green"))


def cluster_matcher(cfg: MixinConfig) -> str:
    return f'{cfg.cluster_label}=~"$cluster"' if cfg.show_multi_cluster else ""


def s(cfg: MixinConfig, *matchers: str) -> str:
    """A board selector: the config selector, the cluster and instance variables, and extra
    matchers."""
    return sel(cfg, cluster_matcher(cfg), INSTANCE, *matchers)


@dataclass(frozen=True)
class Q:
    """One query of a panel: PromQL, legend, and whether Grafana should fetch exemplars."""

    expr: str
    legend: str = ""
    exemplar: bool = False
    instant: bool = False
    table: bool = False  # an instant query in table format: one row per series


@dataclass(frozen=True)
class P:
    """One panel. ``kind``: timeseries, stat, table, heatmap (of a histogram's buckets, by
    ``le``: ``unit`` is the cells', ``y_unit`` the bucket bounds') or traces (a table of the
    traces a TraceQL query finds, from the ``$traces`` Tempo datasource). ``width`` in grid
    columns (of 24)."""

    title: str
    description: str
    queries: tuple[Q, ...]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 12
    height: int = 8
    stack: str = ""  # "", "normal" or "percent"
    # queries (by ref id, "B") kept out of the stack: a dashed line, such as the total the
    # stacked parts add up to
    unstacked: tuple[str, ...] = ()
    max: float | None = None
    min: float | None = None
    # (value, colour) steps; a first step with value None is the base (else green).
    thresholds: tuple[tuple[float | None, str], ...] = ()
    mappings: tuple[tuple[str, str, str], ...] = ()  # (value, text, colour)
    no_value: str = ""
    hide_columns: tuple[str, ...] = ()  # table columns to drop (e.g. Time)
    y_unit: str = ""


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[P, ...] = field(default_factory=tuple)


def _target(q: Q, ref: str, heatmap: bool) -> pb.Dataquery:
    t = pb.Dataquery().expr(q.expr).ref_id(ref).datasource(DATASOURCE)
    if heatmap:  # Grafana turns cumulative le buckets into per-bucket counts, sorted by le
        t = t.format(PromQueryFormat.HEATMAP)
    if q.legend:
        t = t.legend_format(q.legend)
    if q.exemplar:
        t = t.exemplar(True)
    if q.table:
        t = t.format(PromQueryFormat.TABLE)
    return t.instant() if q.instant or q.table else t.range()


def _thresholds(steps: tuple[tuple[float | None, str], ...]) -> db.ThresholdsConfig:
    if steps[0][0] is not None:
        steps = ((None, "green"), *steps)
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=v, color=c) for v, c in steps])


def _panel(p: P):
    if p.kind == "timeseries":
        legend = cb.VizLegendOptions().show_legend(True).placement(cm.LegendPlacement.BOTTOM)
        if any(FLEET_LEGEND in q.legend for q in p.queries):
            # a series per agent: a table of mean, max and last, sorted by max, tells the
            # outlier from the fleet
            legend = (legend.display_mode(cm.LegendDisplayMode.TABLE).calcs(LEGEND_CALCS)
                      .sort_by("Max").sort_desc(True))
        else:
            legend = legend.display_mode(cm.LegendDisplayMode.LIST)
        b = (tsb.Panel().legend(legend)
             .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI)
                      .sort(cm.SortOrder.DESCENDING))
             .fill_opacity(10).line_width(1))
        if p.stack:
            b = b.stacking(cb.StackingConfig().mode(cm.StackingMode(p.stack))).fill_opacity(60)
        for ref in p.unstacked:
            b = b.override_by_query(ref, [
                dm.DynamicConfigValue("custom.stacking", {"mode": "none", "group": ref}),
                dm.DynamicConfigValue("custom.fillOpacity", 0),
                dm.DynamicConfigValue("custom.lineStyle", {"fill": "dash", "dash": [10, 10]})])
        if p.thresholds:
            b = b.thresholds_style(cb.GraphThresholdsStyleConfig()
                                   .mode(cm.GraphTresholdsStyleMode.DASHED))
    elif p.kind == "stat":
        b = (statb.Panel().graph_mode(cm.BigValueGraphMode.AREA)
             .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"])))
    elif p.kind in ("table", "traces"):
        b = tableb.Panel()
    elif p.kind == "heatmap":
        # buckets as Prometheus computed them, not re-bucketed by Grafana
        b = (heatmapb.Panel().calculate(False).y_axis(heatmapb.YAxisConfig().unit(p.y_unit))
             .cell_values(heatmapb.CellValues().unit(p.unit))
             .color(heatmapb.HeatmapColorOptions().mode(hm.HeatmapColorMode.SCHEME)
                    .scheme("Oranges").scale(hm.HeatmapColorScale.EXPONENTIAL).exponent(0.5)
                    .steps(64).fill("dark-orange"))
             .rows_frame(heatmapb.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.LE))
             .show_tooltip())
    else:
        raise ValueError(f"unknown panel kind {p.kind!r}")
    traces = p.kind == "traces"
    b = (b.title(p.title).description(p.description).datasource(TRACES if traces else DATASOURCE)
         .unit(p.unit).span(p.width).height(p.height))
    if p.min is not None:
        b = b.min(p.min)
    if p.max is not None:
        b = b.max(p.max)
    if p.thresholds:
        b = b.thresholds(_thresholds(p.thresholds))
    if p.mappings:
        b = b.mappings([dm.ValueMap({v: dm.ValueMappingResult(text=text, color=color, index=i)})
                        for i, (v, text, color) in enumerate(p.mappings)])
    if p.no_value:
        b = b.no_value(p.no_value)
    if p.hide_columns:
        b = b.with_transformation(dm.DataTransformerConfig(
            "organize", options={"excludeByName": {c: True for c in p.hide_columns}}))
    for i, q in enumerate(p.queries):
        ref = chr(ord("A") + i)
        b = b.with_target(
            tempob.TempoQuery().ref_id(ref).datasource(TRACES).query_type("traceql")
            .query(q.expr).limit(TRACE_LIMIT) if traces
            else _target(q, ref, p.kind == "heatmap"))
    return b


def variables(cfg: MixinConfig) -> list:
    info = "kvscope_engine_info"
    cluster = cluster_matcher(cfg)

    def query_var(name: str, label: str, query: str, description: str, all_value: str | None):
        v = (db.QueryVariable(name).label(label).description(description)
             .datasource(DATASOURCE).query(query).multi(True).include_all(True)
             .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
             .sort(dm.VariableSort.ALPHABETICAL_ASC)
             .current(dm.VariableOption(selected=True, text="All", value="$__all")))
        return v.all_value(all_value) if all_value is not None else v

    out = [db.DatasourceVariable("datasource").label("Data source").type("prometheus")
           .description("The Prometheus that scrapes the kvscope agents.")]
    if cfg.show_multi_cluster:
        out.append(query_var(
            "cluster", "Cluster", f"label_values(kvscope_build_info{sel(cfg)}, {cfg.cluster_label})",
            "Clusters (the cluster label); every panel filters by it.", ".*"))
    # engine and model: All is ".*", which is right for them, since they only filter the
    # info metric that the instance list comes from.
    return out + [
        query_var("engine", "Engine", f"label_values({info}{sel(cfg, cluster)}, engine)",
                  "Serving engines (kvscope_engine_info); narrows the instance list.", ".*"),
        query_var("model", "Model", f"label_values({info}{sel(cfg, cluster, ENGINE)}, model)",
                  "Models served (kvscope_engine_info); narrows the instance list.", ".*"),
        # No allValue: All expands to the listed instances, those of the selected engines and
        # models, so the engine and model choice holds at All too (an allValue of ".*" would
        # show every agent). Filtering each panel by an info-metric join instead would make
        # every query heavier and count an agent that observes several engines once per engine.
        query_var("instance", "Instance",
                  f"label_values({info}{sel(cfg, cluster, ENGINE, MODEL)}, instance)",
                  "kvscope agents running the selected engines and models; every panel filters "
                  "by it.", None),
    ]


def board(cfg: MixinConfig, key: str, title: str, description: str, rows: list[Row]) -> dict:
    """Build one dashboard and return its JSON model, with panel ids numbered from 1."""
    d = (db.Dashboard(f"kvscope / {title}").uid(f"{cfg.dashboard_uid_prefix}-{key}")
         .description(description).tags(list(cfg.dashboard_tags)).editable()
         .refresh(cfg.dashboard_refresh).time(cfg.dashboard_time_from, "now").timezone("browser")
         .tooltip(dm.DashboardCursorSync.CROSSHAIR)
         .link(db.DashboardLink("kvscope").type(dm.DashboardLinkType.DASHBOARDS)
               .tags(list(cfg.dashboard_tags)).as_dropdown(True).include_vars(True)
               .keep_time(True)))
    for v in variables(cfg):
        d = d.with_variable(v)
    if any(p.kind == "traces" for row in rows for p in row.panels):
        d = d.with_variable(db.DatasourceVariable("traces").label("Traces").type("tempo")
                            .description("The Tempo that receives the agents' OTLP spans."))
    for row in rows:
        d = d.with_row(db.Row(row.title))
        for p in row.panels:
            d = d.with_panel(_panel(p))
    model = json.loads(JSONEncoder(sort_keys=True).encode(d.build()))
    for i, panel in enumerate(model["panels"], start=1):
        panel["id"] = i
        if panel.get("options", {}) is None:
            del panel["options"]  # let Grafana fill the plugin's defaults
    for var in model["templating"]["list"]:
        var.pop("id", None)  # the SDK writes a zero UUID; Grafana assigns its own
    return model


def headroom_steps(cfg: MixinConfig) -> tuple[tuple[float | None, str], ...]:
    """Headroom is bad when low: red below the critical ratio, orange below the warning one."""
    return ((None, "red"), (cfg.headroom_min_ratio, "orange"), (cfg.headroom_warning_ratio, "green"))


def quantile(q: float) -> str:
    """The matcher of one recorded quantile: ``quantile="0.99"``."""
    return f'quantile="{q}"'
