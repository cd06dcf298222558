"""Every PromQL expression the mixin ships, and which catalog metrics each one reads.

Used by the tests (catalog agreement, and evaluating every query against a real Prometheus)
and by ``docs/grafana.md``'s list of GPU-only panels. Pure functions over the generated objects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvscope.catalog import BY_NAME
from kvscope.mixin.alerts import alerts
from kvscope.mixin.config import MixinConfig
from kvscope.mixin.dashboards import dashboards
from kvscope.mixin.rules import recording_rules

_METRIC = re.compile(r"(?<![A-Za-z0-9_:])kvscope_[a-z0-9_]+")
_RECORD = re.compile(r"(?<![A-Za-z0-9_:])kvscope:[a-z0-9_:]+")
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*[a-z_]+\)$", re.S)
_HIST_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Query:
    """``kind``: panel, variable, record or signal. ``where``: board/panel title, record name
    or alert name. ``exemplar``: the panel asks Grafana for exemplars."""

    kind: str
    where: str
    expr: str
    exemplar: bool = False


def metric_names(expr: str) -> set[str]:
    """kvscope metric names an expression names, histogram series folded to their family."""
    out = set()
    for name in _METRIC.findall(expr):
        if name not in BY_NAME:
            for suffix in _HIST_SUFFIXES:
                base = name.removesuffix(suffix)
                if base != name and BY_NAME.get(base) and BY_NAME[base].type == "histogram":
                    name = base
                    break
        out.add(name)
    return out


def record_metrics(cfg: MixinConfig) -> dict[str, set[str]]:
    """Recorded series name -> catalog metrics it is computed from (through earlier records)."""
    out: dict[str, set[str]] = {}
    for rule in recording_rules(cfg):
        used = metric_names(rule["expr"])
        for record in _RECORD.findall(rule["expr"]):
            used |= out.get(record, set())
        out.setdefault(rule["record"], set()).update(used)
    return out


def reads(expr: str, cfg: MixinConfig) -> set[str]:
    """Catalog metrics an expression reads, directly or through recording rules."""
    records = record_metrics(cfg)
    used = metric_names(expr)
    for record in _RECORD.findall(expr):
        used |= records.get(record, set())
    return used


def gpu_only(expr: str, cfg: MixinConfig) -> bool:
    """True when the expression reads a metric that only exists where an NVIDIA GPU is."""
    return any(BY_NAME[m].gpu_only for m in reads(expr, cfg) if m in BY_NAME)


def all_queries(cfg: MixinConfig) -> list[Query]:
    out: list[Query] = []
    for name, board in dashboards(cfg).items():
        title = board["title"]
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                m = _LABEL_VALUES.match(var["query"])
                expr = m.group(1) if m else var["query"]
                out.append(Query("variable", f"{title} / ${var['name']}", expr))
        for panel in board["panels"]:
            if panel.get("datasource", {}).get("type") == "tempo":
                continue  # TraceQL, not PromQL
            for target in panel.get("targets", []):
                out.append(Query("panel", f"{title} / {panel['title']}", target["expr"],
                                 bool(target.get("exemplar"))))
    for rule in recording_rules(cfg):
        out.append(Query("record", rule["record"], rule["expr"]))
    for alert in alerts(cfg):
        out += [Query("signal", alert.name, s) for s in alert.signals]
    return out


def gpu_only_panels(cfg: MixinConfig) -> list[str]:
    """Board / panel titles whose every query needs a GPU."""
    by_panel: dict[str, list[bool]] = {}
    for q in all_queries(cfg):
        if q.kind == "panel":
            by_panel.setdefault(q.where, []).append(gpu_only(q.expr, cfg))
    return sorted(p for p, flags in by_panel.items() if all(flags))


def substitute(expr: str, instance: str = ".+", rate_interval: str = "1m") -> str:
    """Replace Grafana's variables so the expression runs on Prometheus's HTTP API."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$instance", instance)
            .replace("$engine", ".*").replace("$model", ".*"))
