"""An :class:`~kvscope.analysis.analyze.Analysis` as plain data, JSON, readable text, and the
data behind a dashboard Sizing page. Pure functions: no I/O.
"""

from __future__ import annotations

import json

import numpy as np

from kvscope.analysis.analyze import Analysis
from kvscope.analysis.sizing import GIB, SizePoint, blocks_text, seconds, size_text

SCHEMA = "kvscope.analysis/v1"


def to_dict(analysis: Analysis) -> dict:
    """Everything in ``analysis`` as JSON-ready dicts, lists and numbers (units in key names
    or in ``unit`` fields: blocks, bytes, seconds; ratios and shares are 0-1)."""
    bpb = analysis.bytes_per_block
    return {
        "schema": SCHEMA,
        "source": analysis.source,
        "accesses": analysis.accesses,
        "sample_rate": analysis.sample_rate,
        "sampled_accesses": analysis.sampled_accesses,
        "requests": analysis.requests,
        "duration_seconds": analysis.duration_seconds,
        "block_tokens": analysis.block_tokens,
        "bytes_per_block": bpb,
        "method": analysis.method,
        "reuse": analysis.reuse.to_dict(),
        "curves": {
            "lru": analysis.lru.to_dict(bpb),
            "lru_tokens": analysis.lru_tokens.to_dict(bpb),
            "arc": analysis.arc.to_dict(bpb) if analysis.arc is not None else None,
        },
        "sizing": analysis.sizing.to_dict(),
        "notes": list(analysis.notes),
    }


def to_json(analysis: Analysis) -> str:
    """:func:`to_dict` as indented JSON text."""
    return json.dumps(to_dict(analysis), indent=2)


# what the sizing's figures rest on, as the report names each, and its key in the assumptions
SOURCES = (("promotion bandwidth", "bandwidth_source"), ("prefill rate", "prefill_source"),
           ("KV bytes per block", "kv_bytes_source"), ("GPU prefix cache", "gpu_tokens_source"))


def sizing_figure_data(analysis: Analysis) -> dict:
    """The data a Sizing page plots, in plain lists: hit-ratio curves against CPU tier size in
    GiB (``lru``, ``lru_tokens``, ``arc``: dicts of ``gib`` and ``hit_ratio`` lists), the CPU
    tier's token hit share and its prefill seconds saved vs transfer seconds (``cpu``), and the
    marked points (``recommended``, ``knee``, ``current``: the input's own tier; dicts or
    None) with the verdict, ``gpu_cache_gib``: the GPU prefix cache's size (None: none given),
    and the analysis's ``notes`` (what it assumed, e.g. no GPU prefix cache)."""
    gib = analysis.bytes_per_block / GIB

    def curve(c):
        if c is None:
            return None
        return {"gib": (c.sizes * gib).tolist(), "hit_ratio": c.hit_ratio.tolist(),
                "method": c.method, "weight": c.weight}

    def point(p: SizePoint | None):
        if p is None:
            return None
        return {"gib": p.bytes / GIB, "blocks": p.blocks,
                "cpu_token_hit_share": p.cpu_token_hit_share,
                "token_hit_share": p.token_hit_share}

    s = analysis.sizing
    return {
        "lru": curve(analysis.lru), "lru_tokens": curve(analysis.lru_tokens),
        "arc": curve(analysis.arc),
        "cpu": {"gib": [p.bytes / GIB for p in s.curve],
                "cpu_token_hit_share": [p.cpu_token_hit_share for p in s.curve],
                "prefill_seconds_saved": [p.prefill_seconds_saved for p in s.curve],
                "transfer_seconds": [p.transfer_seconds for p in s.curve]},
        "gpu_token_hit_share": s.gpu_token_hit_share,
        "gpu_cache_gib": (s.assumptions["gpu_tokens"] // s.assumptions["block_tokens"] * gib
                          if s.assumptions["gpu_tokens"] else None),
        "reuse_token_share": s.reuse_token_share,
        "recommended": point(s.recommended), "knee": point(s.knee),
        "current": point(s.current),
        "offload": s.offload, "verdict": s.verdict,
        "kv_offloading_size_gib": s.kv_offloading_size_gib, "notes": list(analysis.notes),
    }


def _table(analysis: Analysis, rows: int = 8) -> list[str]:
    """A few LRU/ARC curve points: the ARC sizes, else ``rows`` evenly spaced sizes."""
    lru, lru_t, arc = analysis.lru, analysis.lru_tokens, analysis.arc
    top = int(lru.sizes[-1])
    # at least 1 block: a working set under ``rows`` blocks rounded to a row of 0 blocks that
    # read the 1-block hit ratio
    sizes = arc.sizes if arc is not None else np.unique(
        np.maximum(np.linspace(top / rows, top, rows).round(), 1).astype(np.int64))
    out = [f"  {'blocks':>10} {'size':>12} {'LRU hit':>8} {'LRU tok':>8} {'ARC hit':>8}"]
    for size in sizes.tolist():
        arc_hit = f"{1 - arc.at(size):8.4f}" if arc is not None else f"{'-':>8}"
        out.append(f"  {size:>10,} {size_text(size * analysis.bytes_per_block):>12} "
                   f"{1 - lru.at(size):8.4f} {1 - lru_t.at(size):8.4f} {arc_hit}")
    return out


def block_bytes_text(analysis: Analysis, preset_flag: str = "--preset") -> str:
    """"N bytes/block (...)": measured by the capture, or the preset's, then naming
    ``preset_flag``, the option that gives the model."""
    a = analysis.sizing.assumptions
    origin = (f"preset {a['preset']}; {preset_flag} for your model"
              if a["kv_bytes_source"].startswith("assumed") else "measured by the capture")
    return f"{analysis.bytes_per_block:,} bytes/block ({origin})"


def render_text(analysis: Analysis) -> str:
    """A readable report for a terminal."""
    r, s = analysis.reuse, analysis.sizing
    a = s.assumptions
    lines = [
        f"kvscope analyze: {analysis.source}",
        f"  {analysis.requests:,} request{'s' * (analysis.requests != 1)}, "
        f"{analysis.accesses:,} block accesses of "
        f"{analysis.block_tokens} tokens over {analysis.duration_seconds:,.0f} s; "
        + block_bytes_text(analysis),
        *([f"  sampled by the tap: 1 block in {1 / analysis.sample_rate:.4g} "
           f"(R={analysis.sample_rate:.4g}, {analysis.sampled_accesses:,} accesses kept); "
           "counts and curves scaled to the full stream"] if analysis.sample_rate < 1 else []),
        "",
        "Reuse",
        f"  unique blocks {r.unique_blocks:,}; reused blocks {r.reused_blocks:,}",
        f"  reused accesses {r.reuse_share:.2%}; reused tokens {r.token_reuse_share:.2%} "
        f"(the ceiling for any cache)",
    ]
    if r.distance.percentiles:
        d, t = r.distance.percentiles, r.time_to_reuse.percentiles
        lines += [
            f"  reuse distance (blocks) p50 {d['p50']:,.0f}  p90 {d['p90']:,.0f}  p99 {d['p99']:,.0f}",
            f"  time to reuse (s)       p50 {t['p50']:,.1f}  p90 {t['p90']:,.1f}  p99 {t['p99']:,.1f}",
        ]
    if r.top_prefixes:
        lines.append("  most shared prefixes (tokens saved if always cached):")
        for p in r.top_prefixes[:5]:
            blocks = "block" if p.blocks == 1 else "blocks"
            lines.append(f"    id {p.block_id:<20} {p.blocks:>4} {blocks:<6} {p.tokens:>8,} tokens "
                         f"x {p.uses - 1:,} reuse{'s' * (p.uses != 2)} = {p.tokens_saved:,} tokens")
    lines += ["", f"Miss-ratio curves ({analysis.method})"] + _table(analysis)
    lines += ["", "Sizing",
              f"  assumptions: promotion {a['bandwidth_bytes_per_second'] / 1e9:.3g} GB/s, prefill "
              f"{a['prefill_tokens_per_second']:,.0f} tokens/s, GPU prefix cache {a['gpu_tokens']:,} "
              f"tokens, CPU tier {a['cpu_tier']}",
              *[f"    {name} {a[key]}" for name, key in SOURCES],
              f"  GPU prefix cache alone serves {s.gpu_token_hit_share:.2%} of prompt tokens"]
    budget = a["budget_bytes"]
    if s.knee is not None:
        beyond = (f"; beyond the budget of {size_text(budget)}"
                  if budget is not None and s.knee.bytes > budget else "")
        lines.append(f"  knee: {blocks_text(s.knee.blocks)} ({size_text(s.knee.bytes)}): CPU tier "
                     f"serves {s.knee.cpu_token_hit_share:.2%} (where the gain curve bends "
                     f"most, up to the trace's working set{beyond})")
    elif s.recommended is not None:
        lines.append("  knee: none (the gain grows no slower as the tier grows, up to the "
                     "trace's working set)")
    if s.recommended is not None:
        p = s.recommended
        lines += [f"  recommended CPU tier: {blocks_text(p.blocks)} ({size_text(p.bytes)}); "
                  f"vLLM --kv-offloading-size {s.kv_offloading_size_gib:g}",
                  f"    the smallest size that buys {a['target_share']:.0%} of the largest "
                  "affordable size's gain (--target-share)",
                  f"    token hit share {p.token_hit_share:.2%} (CPU tier {p.cpu_token_hit_share:.2%})",
                  f"    prefill saved {seconds(p.prefill_seconds_saved)}; transfers "
                  f"{seconds(p.transfer_seconds)}; store traffic "
                  + (f"{s.offload_bytes_per_second / 1e9:.3g} GB/s on average"
                     if s.offload_bytes_per_second is not None
                     else "not measured (the trace spans no time)")]
    if s.current is not None:
        p = s.current
        lines.append(f"  the input's own CPU tier: {blocks_text(p.blocks)} ({size_text(p.bytes)}): "
                     f"token hit share {p.token_hit_share:.2%} (CPU tier "
                     f"{p.cpu_token_hit_share:.2%})"
                     f"; prefill saved {seconds(p.prefill_seconds_saved)}, transfers "
                     f"{seconds(p.transfer_seconds)}")
    lines += ["", f"Verdict: {s.verdict}"] + [f"  - {reason}" for reason in s.reasons[1:]]
    # the verdict's figures rest on these as much as on the curve (a tryout's damaged capture
    # priced its tokens at a preset's rate, 8 times its own, with the verdict silent about it)
    lines += [f"  - {name} assumed, not measured: {a[key].removeprefix('assumed: ')}"
              for name, key in SOURCES if a[key].startswith("assumed")]
    lines += [f"Note: {note}" for note in analysis.notes]
    return "\n".join(lines) + "\n"
