"""The rollout's report: one JSON document and one self-contained HTML page made from it.

The JSON (``rollout.json``) holds everything: the arms, levels, repetitions and exact commands
and versions used, every run (its requests' TTFT, ITL and end-to-end latency in seconds, the
load generator's own percentiles, hit quality and transfer cost, host context), the tails per
arm and level with confidence intervals, and each candidate's comparison and verdict. The HTML
(``rollout.html``) is drawn from the JSON alone (the baseline's concurrency over time and
prompt lengths too, as the guide asks a baseline to record), Plotly's JavaScript inlined, so it opens with
no network; the dashboard's Compare page reads the same JSON.

Tails per arm and level: p50/p95/p99 of each metric over the arm's repetitions at that level,
with the two-stage bootstrap interval (:func:`kvscope.analysis.bootstrap.quantile_cis`).
"""

from __future__ import annotations

import dataclasses
import html
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import plotly.io as pio

from kvscope.analysis.bootstrap import quantile_cis
from kvscope.analysis.compare import QUANTILES, json_ready, ms, render_text, to_dict
from kvscope.dashboard import figures_compare as fc
from kvscope.dashboard import figures_load
from kvscope.files import write_atomic
from kvscope.rollout.judge import Judgement

METRICS = ("ttft", "itl", "e2e")
JSON_NAME = "rollout.json"
HTML_NAME = "rollout.html"


def tails(runs: Sequence[dict], *, resamples: int, confidence: float, seed: int) -> dict:
    """``{slot: {level: {metric: [{"quantile", "value", "low", "high"}, ...]}}}`` (seconds)
    from the runs' per-request latencies; a metric no run of a slot and level reported: []."""
    grouped: dict[str, dict[int, list[dict]]] = {}
    for run in runs:
        grouped.setdefault(run["slot"], {}).setdefault(run["level"], []).append(run)
    out: dict = {}
    for slot, levels in grouped.items():
        for level, group in sorted(levels.items()):
            cells = {}
            for metric in METRICS:
                samples = [np.asarray(r[metric], dtype=np.float64) for r in group if r[metric]]
                cells[metric] = [] if not samples else [
                    {"quantile": q, "value": e.value, "low": e.low, "high": e.high}
                    for q, e in zip(QUANTILES, quantile_cis(
                        samples, QUANTILES, resamples=resamples, confidence=confidence,
                        seed=seed))]
            out.setdefault(slot, {})[str(level)] = cells
    return out


def judgement_dict(j: Judgement) -> dict:
    """A :class:`Judgement` as plain data (see :func:`kvscope.analysis.compare.to_dict`), with
    the overall comparison's plain-text report beside it, headed by the final verdict (after
    the A/A gate and the per-level check)."""
    return {"candidate": j.candidate, "verdict": {"decision": j.verdict.decision,
                                                  "text": j.verdict.text,
                                                  "reasons": j.verdict.reasons},
            "overall": to_dict(j.overall),
            "text": render_text(dataclasses.replace(j.overall, verdict=j.verdict)),
            "levels": {str(k): to_dict(v) for k, v in j.levels.items()},
            "aa": to_dict(j.aa) if j.aa is not None else None,
            "aa_levels": {str(k): to_dict(v) for k, v in j.aa_levels.items()}}


def write_json(directory: str | Path, doc: dict) -> Path:
    """Write ``doc`` as ``rollout.json`` in ``directory``, whole or not at all (a session
    does after every run). Returns its path."""
    path = Path(directory) / JSON_NAME
    write_atomic(path, json.dumps(json_ready(doc), indent=1))
    return path


def write(directory: str | Path, doc: dict) -> tuple[Path, Path]:
    """Write ``doc`` as ``rollout.json`` and its page as ``rollout.html`` in ``directory``, each
    whole or not at all. Returns their paths."""
    html_path = Path(directory) / HTML_NAME
    json_path = write_json(directory, doc)
    write_atomic(html_path, page(doc))
    return json_path, html_path


def read(path: str | Path) -> dict:
    """A rollout report from its directory or its ``rollout.json``. Raises ValueError naming
    the file when it is missing or not a rollout report."""
    path = Path(path)
    if path.is_dir():
        path = path / JSON_NAME
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable rollout report ({exc})") from None
    if not isinstance(doc, dict) or "runs" not in doc or "judgements" not in doc:
        raise ValueError(f"{path}: not a rollout report (no runs or judgements)")
    return doc


def _e(text) -> str:
    return html.escape(str(text))


def _floor_rows(doc: dict) -> str:
    rows = []
    for j in doc["judgements"]:
        for label, key in (("TTFT", "ttft"), ("ITL", "itl")):
            d = j["overall"][key][-1]["difference"]
            aa = (j.get("aa") or {}).get(key, [{}])[-1].get("difference") if j.get("aa") else None
            rows.append(f"<tr><td>{_e(j['candidate'])}</td><td>p99 {label}</td>"
                        f"<td>{_cell(d)}</td><td>{_cell(aa)}</td></tr>")
    return ("<table><tr><th>candidate</th><th>metric</th><th>candidate - baseline</th>"
            "<th>A/A pair: baseline - baseline</th></tr>" + "".join(rows) + "</table>")


def _cell(estimate: dict | None) -> str:
    # a NaN difference reaches here as None (json_ready)
    return "not measured" if estimate is None or estimate["value"] is None else \
        ms(estimate["value"])


def _runs_table(doc: dict) -> str:
    def host(run, key, field="mean", scale=1.0, fmt="{:.1f}"):
        cell = (run.get("host") or {}).get(key)
        return "not measured" if not cell else fmt.format(cell[field] * scale)

    rows = "".join(
        f"<tr><td>{r['index'] + 1}</td><td>{_e(r['slot'])}</td><td>{r['level']}</td>"
        f"<td>{r['rep'] + 1}</td><td>{len(r['ttft'])}</td><td>{r.get('errors', 0)}</td>"
        f"<td>{r.get('unsent', 'not measured')}</td>"  # a report from before it was read
        f"<td>{r.get('elapsed_s', 0):.1f}</td><td>{host(r, 'cpu_busy_percent')}</td>"
        f"<td>{host(r, 'cpu_steal_percent')}</td>"
        f"<td>{host(r, 'memory_available_bytes', 'min', 2 ** -30, '{:.2f}')}</td>"
        f"<td>{host(r, 'memory_pressure_some_avg10', 'max')}</td>"
        f"<td>{_e((r.get('cost') or {}).get('source', 'none'))}</td></tr>"
        for r in doc["runs"])
    return ("<table><tr><th>#</th><th>arm</th><th>streams</th><th>rep</th><th>requests</th>"
            "<th>errors</th><th>unsent</th><th>seconds</th><th>CPU busy % (mean)</th>"
            "<th>steal % (mean)</th><th>memory available GiB (min)</th>"
            "<th>memory pressure avg10 (max)</th><th>hit quality from</th></tr>" + rows
            + "</table>")


STYLE = """body{font-family:system-ui,sans-serif;margin:24px;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;
font-size:13px;text-align:right}th{background:#f4f4f4}pre{background:#f7f7f7;padding:10px;
overflow-x:auto;font-size:12px}.verdict{padding:10px 14px;color:#fff;border-radius:4px;
margin:8px 0}.partial{background:#fff3cd;padding:8px;border:1px solid #e0c36a}"""


def page(doc: dict) -> str:
    """The report as one HTML page (Plotly's JavaScript inlined: no network needed)."""
    meta = doc.get("meta", {})
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvscope rollout "
             f"{_e(meta.get('started', ''))}</title><style>{STYLE}</style></head><body>",
             "<h1>kvscope rollout</h1>"]
    if doc.get("error"):
        planned = f" of {doc['planned_runs']}" if doc.get("planned_runs") else ""
        parts.append(f"<p class='partial'>Partial results: the rollout stopped early, after "
                     f"{len(doc['runs'])}{planned} runs: {_e(doc['error'])}</p>")
    parts.append(f"<p>{_e(', '.join(a['name'] for a in doc.get('arms', [])))}; concurrency "
                 f"{_e(doc.get('levels'))}; {doc.get('repetitions')} repetitions; "
                 f"{len(doc['runs'])} runs; started {_e(meta.get('started', ''))}, "
                 f"{meta.get('elapsed_s', 0):.0f} s.</p>")
    warnings = dict.fromkeys(r["warning"] for r in doc["runs"] if r.get("warning"))
    parts += [f"<p class='partial'>warning: {_e(w)}</p>" for w in warnings]
    for name, why in doc.get("not_judged", {}).items():  # e.g. stopped before its first run
        parts.append(f"<div class='verdict partial'><b>{_e(name)}</b>: not judged: {_e(why)}"
                     "</div>")
    for j in doc["judgements"]:
        colour = fc.verdict_colour(j["verdict"]["decision"])
        parts.append(f"<div class='verdict' style='background:{colour}'><b>{_e(j['candidate'])}"
                     f"</b>: {_e(j['verdict']['text'])}</div><ul>"
                     + "".join(f"<li>{_e(r)}</li>" for r in j["verdict"]["reasons"]) + "</ul>")
    parts += ["<h2>The noise floor (A/A pair)</h2>", _floor_rows(doc)]
    if doc["runs"]:
        parts += _figures(doc)
    else:  # stopped before its first run: no empty charts, nor Plotly's 4.8 MB to draw them
        parts.append("<p>No run finished: nothing to chart.</p>")
    parts += ["<h2>Runs and host context</h2>", _runs_table(doc),
              "<h2>Commands and versions</h2>",
              f"<pre>{_e(json.dumps(meta, indent=1))}</pre>", "</body></html>"]
    return "\n".join(parts)


def _figures(doc: dict) -> list[str]:
    """The charts (the first carrying Plotly's JavaScript) and each judgement's text."""
    figures = [fc.level_tails(doc.get("tails"), m, q) for m in METRICS for q in (0.5, 0.99)]
    for j in doc["judgements"]:
        figures += [f.update_layout(title_text=f"{j['candidate']}: {f.layout.title.text}")
                    for f in fc.all_figures(j["overall"])]
    records = [{"arrival": a, "finished": f, "prompt_tokens": n} for r in doc["runs"]
               if r["slot"] == doc.get("baseline")
               for a, f, n in zip(r.get("started_at", []), r.get("ended_at", []),
                                  r.get("prompt_tokens", []))]
    figures += [f.update_layout(title_text=f"baseline: {f.layout.title.text}") for f in
                (figures_load.concurrency(records), figures_load.prompt_lengths(records))]
    parts = ["<h2>Tails per concurrency level, each candidate over the whole ramp, and the "
             "baseline's load</h2>"]
    parts += [pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0))
              for i, fig in enumerate(figures)]
    return parts + [f"<h2>{_e(j['candidate'])} against the baseline, all levels</h2>"
                    f"<pre>{_e(j['text'])}</pre>" for j in doc["judgements"]]
