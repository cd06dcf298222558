"""Should I offload here? The guide's five "skip offload when" conditions, judged from samples.

The guide (shared/guide/kv-offload-guide.txt, "When KV cache offload is the wrong
optimization") says to skip KV cache offload for now when:

1. GPU memory is not the limiter.
2. Prompts are nearly all unique, so retained prefixes do not return.
3. The primary SLO is very low tail latency and the transfer path cannot be shown to fit inside it.
4. Host DRAM or storage is already a contested production resource.
5. Prefix caching, batching, context limits, model selection, or cache quantization have not yet
   been evaluated.

The guide gives no numbers for any of them, so every threshold here is a documented default in
:class:`Settings` (docs/dashboard.md, "Should I offload here?"). Each condition gets one
:class:`Check` whose verdict is one of :data:`VERDICTS`, with its evidence (numbers and the
window they come from); :func:`assess` adds the overall verdict and the headline figures.
A signal no source reports is "not measured", never 0 and never a pass.

Pure: samples (the shape of :mod:`kvscope.samples`) and request records (the API's dicts) in,
plain dataclasses out; no I/O and no clock (house rule 9).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvscope.dashboard.series import (Sample, bytes_text, is_number, last_window,
                                      mapping, ordered, scalar_increase, swap_in_increase,
                                      window_increase)
from kvscope.analysis.transfer_cost import seconds_by_tier
from kvscope.mixin.config import MixinConfig
from kvscope.samples import KEY_SEPARATOR
from kvscope.vocabulary import NOT_MEASURED, TIERS

PAYS = "offload pays"
SKIP = "skip offload"
TOO_LITTLE = "too little traffic"
# overall only: no condition rules offload out, but the tiers' timed transfers took longer than
# the prefill they saved (a tryout read a green "offload pays" beside 0.1x as "keep the tier")
NOT_PAYING = "not paying as sized"
VERDICTS = (PAYS, SKIP, NOT_MEASURED, TOO_LITTLE)  # a condition's
OVERALL_VERDICTS = (*VERDICTS, NOT_PAYING)

# the guide's wording of each condition, keyed by the check's stable id
CONDITIONS = {
    "gpu-limiter": "GPU memory is not the limiter",
    "unique-prompts": "Prompts are nearly all unique, so retained prefixes do not return",
    "tail-slo": "The tail SLO is tight and the transfer path cannot be shown to fit inside it",
    "host-dram": "Host DRAM is already a contested resource",
    "cheaper-steps": "Prefix caching, batching, context limits, model selection or cache "
                     "quantization not yet evaluated",
}
CACHE_SOURCES = TIERS  # prompt-token sources that are cache hits: every tier, not recompute
GIB = 1024 ** 3
_MIXIN = MixinConfig()


@dataclass(frozen=True)
class Settings:
    """Thresholds (the guide gives none; these are kvscope's defaults, each overridable).

    ``window_seconds``: the samples judged, counted back from the newest (default 300 s, the
    mixin's rate window). ``min_requests``: fewer finished requests in the window give "too
    little traffic" for checks 1-3 (default 20: a p99 over fewer is one request).
    Check 1: GPU memory is the limiter when the window saw at least ``min_preemptions``
    preemptions (default 1), or GPU KV usage at or above ``gpu_kv_usage_high`` (0-1, default
    0.9) in at least ``pressure_share`` of its samples (0-1, default 0.1), or at least
    ``waiting_min`` requests waiting (default 1) in that share of its samples.
    Check 2: prompts are nearly all unique when under ``min_reuse_share`` (0-1, default 0.1)
    of prompt blocks repeat a prefix seen before (:func:`unique_prompts`).
    Check 3: ``ttft_budget_seconds`` (default the mixin's ``ttft_budget_seconds``, 2.5 s, its
    KvscopeTTFTBudgetBreach rollback rule) for the p99 TTFT; over it, the transfer path is
    blamed when promotion wait is at least ``promotion_share_max`` of TTFT (0-1, default 0.1).
    Check 4: host DRAM is contested when headroom (available minus the reserve) fell below
    ``min_headroom_bytes`` (default 0: the reserve is being eaten into).
    """

    window_seconds: float = 300.0
    min_requests: int = 20
    min_preemptions: int = 1
    gpu_kv_usage_high: float = 0.9
    waiting_min: float = 1.0
    pressure_share: float = 0.1
    min_reuse_share: float = 0.1
    ttft_budget_seconds: float = _MIXIN.ttft_budget_seconds
    promotion_share_max: float = 0.1
    min_headroom_bytes: float = 0.0


@dataclass(frozen=True)
class Check:
    """One condition: ``key`` (a :data:`CONDITIONS` key), the guide's ``condition``, the
    ``verdict`` (one of :data:`VERDICTS`) and ``evidence``, one line per signal."""

    key: str
    condition: str
    verdict: str
    evidence: tuple[str, ...]


@dataclass(frozen=True)
class Headline:
    """The figures read first, over the window. ``token_share``: dict[source, 0-1] of prompt
    tokens (empty without any); ``saved_vs_spent``: dict[tier, (prefill seconds saved, transfer
    seconds spent)] for each offload tier (an offload counted to the tier it stores into, a
    promotion to the tier its blocks came from, a staged leg too:
    :func:`~kvscope.analysis.transfer_cost.seconds_by_tier`; None when none of its
    transfers was timed: vLLM's /metrics and KV events time none);
    ``ttft_p99``: seconds (the worst per-sample p99) or None; ``ttft_budget``: seconds;
    ``headroom_bytes``, ``reserve_bytes``: the newest values, None when not measured;
    ``prefix_reuse_share``: the share (0-1) of prompt blocks whose prefix was seen before
    (check 2's reuse share), None when no lookup carried block hashes."""

    token_share: dict[str, float]
    saved_vs_spent: dict[str, tuple[float, float | None]]
    ttft_p99: float | None
    ttft_budget: float
    headroom_bytes: float | None
    reserve_bytes: float | None
    prefix_reuse_share: float | None = None


@dataclass(frozen=True)
class Assessment:
    """The overall ``verdict`` (one of :data:`OVERALL_VERDICTS`), the five ``checks`` in the
    guide's order, the ``headline``, and the window: ``span_seconds`` between its first and
    last sample, ``n_samples``, ``requests`` finished in it (None when no source counts
    requests while blocks moved: KV events alone)."""

    verdict: str
    checks: tuple[Check, ...]
    headline: Headline
    span_seconds: float
    n_samples: int
    requests: float | None
    reasons: tuple[str, ...] = ()


def assess(samples: Sequence[Sample], records: Sequence[Mapping] = (),
           settings: Settings = Settings()) -> Assessment:
    """Judge the last ``settings.window_seconds`` of ``samples`` (oldest first) and the request
    ``records`` finished in it (for the promotion wait share of TTFT).

    The overall verdict: "skip offload" when any check says so (the guide: skip when any
    condition holds); else "too little traffic" when a traffic check (1-3) says so; else
    "offload pays" when any check does, the others not measured, unless every offload tier's
    transfers were timed and took longer than the prefill seconds they saved
    (:func:`saved_and_spent`): then "not paying as sized"; else "not measured". ``reasons``
    names the checks behind it. No request nor prompt token counted while blocks were stored,
    moved or evicted in the window (KV events alone report neither) is no traffic to call too
    little: the requests are not measured, and the checks judge what was.
    """
    window = last_window(samples, settings.window_seconds)
    span = float(window[-1]["ts"]) - float(window[0]["ts"]) if window else 0.0
    requests = scalar_increase(window, "requests") or 0.0
    tokens = window_increase(window, "prompt_tokens")
    if not requests and not any(tokens.values()) and _blocks_moved(window):
        requests = None
    prefix = window_increase(window, "prompt_prefix_blocks")
    start = float(window[0]["ts"]) if window else float("inf")
    recent = [r for r in records if is_number(r.get("finished")) and r["finished"] >= start]
    where = f"last {span:.0f} s, {len(window)} samples, {requests_text(requests)}"
    low_traffic = requests is not None and requests < settings.min_requests
    checks = (
        gpu_limiter(window, settings, low_traffic),
        unique_prompts(tokens, prefix, settings, low_traffic),
        tail_slo(window, tokens, recent, settings, low_traffic),
        host_dram(window, settings),
        cheaper_steps(window, tokens),
    )
    checks = tuple(Check(c.key, c.condition, c.verdict, (*c.evidence, where)) for c in checks)
    verdict, reasons = overall(checks)
    head = headline(window, tokens, prefix, settings)
    saved, spent = saved_and_spent(head.saved_vs_spent)
    if verdict == PAYS and spent is not None and spent > saved:
        verdict = NOT_PAYING
    return Assessment(verdict, checks, head, span, len(window), requests, reasons)


def requests_text(requests: float | None) -> str:
    """The window's requests, as the verdicts' evidence says them."""
    return ("requests not measured (no source counts them)" if requests is None
            else f"{requests:.0f} requests")


def _blocks_moved(window: Sequence[Sample]) -> bool:
    """Blocks were transferred or evicted in the window, or a tier's resident blocks changed
    (by any source)."""
    if any(v > 0 for name in ("transfer_blocks", "evicted_blocks")
           for v in window_increase(window, name).values()):
        return True
    resident = [mapping(sample, "tier_resident_blocks") for sample in window]
    return any(r != resident[0] for r in resident)


def saved_and_spent(saved_vs_spent: Mapping[str, tuple[float, float | None]]
                    ) -> tuple[float, float | None]:
    """Prefill seconds saved and transfer seconds spent over the offload tiers of
    :attr:`Headline.saved_vs_spent`; spent None when a tier's transfer time was not measured
    (or there is no tier)."""
    saved = sum(s for s, _ in saved_vs_spent.values())
    if not saved_vs_spent or any(t is None for _, t in saved_vs_spent.values()):
        return saved, None
    return saved, sum(t for _, t in saved_vs_spent.values())


def overall(checks: Sequence[Check]) -> tuple[str, tuple[str, ...]]:
    """(verdict, the keys of the checks that decided it); see :func:`assess`."""
    for verdict, keys in ((SKIP, None), (TOO_LITTLE, ("gpu-limiter", "unique-prompts",
                                                       "tail-slo")), (PAYS, None)):
        hits = tuple(c.key for c in checks
                     if c.verdict == verdict and (keys is None or c.key in keys))
        if hits:
            return verdict, hits
    return NOT_MEASURED, ()


def gpu_limiter(window: Sequence[Sample], s: Settings, low_traffic: bool) -> Check:
    """Check 1, GPU memory is not the limiter. Signals: preemptions (counter, summed over
    sources), GPU KV usage (0-1, the fullest source per sample) and requests waiting (summed
    over sources per sample). Any signal over its threshold (:class:`Settings`): "offload
    pays" (GPU memory is the limiter); all three measured and under: "skip offload"; otherwise
    "not measured" (what is unmeasured could be the limiter). The GPU prefix cache's evictions
    are evidence beside them, not a signal: a full cache evicts whether or not its blocks
    return (check 2 says whether they do)."""
    key = "gpu-limiter"
    preempted = window_increase(window, "preemptions")
    usage = _per_sample(window, "gpu_kv_cache_usage_ratio", max)
    waiting = _per_sample(window, "requests_waiting", sum)
    lines, pressure, measured = [], [], 0
    if preempted:
        n = sum(preempted.values())
        measured += 1
        pressure.append(n >= s.min_preemptions)
        lines.append(f"preemptions: {n:.0f} in the window (limiter at {s.min_preemptions})")
    else:
        lines.append("preemptions: not measured (no source reports them)")
    for name, values, at, unit in (("GPU KV usage", usage, s.gpu_kv_usage_high, "ratio"),
                                   ("requests waiting", waiting, s.waiting_min, "requests")):
        if values is None:
            lines.append(f"{name}: not measured (no source reports it)")
            continue
        over = int(np.sum(values >= at))
        share = over / len(values)
        measured += 1
        pressure.append(share >= s.pressure_share)
        shown = _ratio if unit == "ratio" else (lambda v: f"{v:.1f}")
        # the count, not a rounded share: 4 of 42 (9.5%) read "10% (limiter at 10%)", not over
        lines.append(f"{name} ≥ {shown(at)} in {over} of {len(values)} samples ({share:.1%}; "
                     f"limiter at {s.pressure_share:.0%}); mean "
                     f"{shown(float(np.mean(values)))}, max {shown(float(np.max(values)))}")
    # a tryout's zero-code run read "skip" from low usage (vLLM's gauge counts running requests
    # only) beside 237 GPU evictions in a second, unshown
    evicted = window_increase(window, "evicted_blocks").get("gpu")
    lines.append("GPU prefix cache evictions: not measured (no source reports them)"
                 if evicted is None else
                 f"GPU prefix cache evictions: {evicted:,.0f} blocks in the window (a full cache "
                 "evicts whether or not its blocks return: condition 2 says whether they do)")
    if low_traffic:
        verdict = TOO_LITTLE
    elif any(pressure):
        verdict = PAYS
    else:
        verdict = SKIP if measured == 3 else NOT_MEASURED
    return Check(key, CONDITIONS[key], verdict, tuple(lines))


def unique_prompts(tokens: Mapping[str, float], prefix: Mapping[str, float], s: Settings,
                   low_traffic: bool) -> Check:
    """Check 2, prompts nearly all unique. ``tokens``: prompt tokens by source in the window;
    ``prefix``: estimated prompt blocks by prefix ``seen`` before or ``new`` in the window
    (``kvscope_prompt_prefix_blocks_total``; empty where no lookup carries block hashes).

    Two signals, either of which shows reuse: the reuse share, of prompt blocks whose prefix
    was seen before whatever the tiers held, and the share served from cache (tokens from any
    cache / all prompt tokens), which sees only the reuse the tiers were big enough to keep.
    Either at or over ``min_reuse_share``: "offload pays". Both under it: "skip offload". The
    served share alone under it proves nothing (no lookup carries block hashes: zero-code
    mode): "not measured", never "skip offload". The served share also covers what a sampled
    reuse share can miss: a short shared prefix (a system prompt of a few blocks) goes
    unsampled at the tap's 1 in 16 most of the time."""
    key = "unique-prompts"
    total = sum(tokens.values())
    blocks = sum(prefix.values())
    share = reuse_share(prefix)
    if not total and not blocks:
        return Check(key, CONDITIONS[key], TOO_LITTLE if low_traffic else NOT_MEASURED,
                     ("prompt tokens by source: none in the window",))
    served = sum(tokens.get(src, 0.0) for src in CACHE_SOURCES) / total if total else 0.0
    lines = [f"served from cache: {served:.1%} of {total:,.0f} prompt tokens (by source: "
             f"{_shares(tokens)})" if total else "served from cache: no prompt tokens counted"]
    if share is not None:
        lines.insert(0, f"reuse share {share:.1%}: prompt blocks whose prefix was seen before, "
                        f"of {blocks:,.0f} (from the block hashes lookups carry; unique when "
                        f"this and the share served are both under {s.min_reuse_share:.0%})")
    else:
        lines.append("reuse share: not measured (no lookup in the window carried block hashes: "
                     "the vLLM tap sends a sample unless its kvscope_block_sample_rate is 0, "
                     "the reference engine every block, vLLM's metrics and KV events none); a "
                     "low share served from cache does not show unique prompts, only tiers too "
                     "small for the reuse")
    if max(served, share or 0.0) >= s.min_reuse_share:
        verdict = PAYS
    else:
        verdict = NOT_MEASURED if share is None else SKIP
    return Check(key, CONDITIONS[key], TOO_LITTLE if low_traffic else verdict, tuple(lines))


def reuse_share(prefix: Mapping[str, float]) -> float | None:
    """The share (0-1) of ``prefix``'s blocks (by ``seen``/``new``) seen before; None without
    any."""
    blocks = sum(prefix.values())
    return prefix.get("seen", 0.0) / blocks if blocks else None


def tail_slo(window: Sequence[Sample], tokens: Mapping[str, float],
             records: Sequence[Mapping], s: Settings, low_traffic: bool) -> Check:
    """Check 3, tail SLO. p99 TTFT: the worst per-sample p99 in the window (each over its last
    minute); promotion wait share: summed promotion wait / summed TTFT of the ``records``
    finished in the window that measured their wait (vLLM's spans alone do not). No TTFT:
    "not measured"; no promoted tokens (cpu, disk, remote): "not measured" (the transfer path
    was not exercised); p99 TTFT within budget: "offload pays"; over it with promotions at
    least ``promotion_share_max`` of TTFT: "skip offload"; over it with less: "offload pays"
    (the transfer path fits; the breach is elsewhere); over it with no request that measured
    its wait: "not measured" (nothing says whether promotions caused the breach)."""
    key = "tail-slo"
    p99 = _worst_p99(window, "ttft_seconds")
    wait_p99 = _worst_p99(window, "promotion_wait_seconds")
    promoted = sum(tokens.get(src, 0.0) for src in CACHE_SOURCES if src != "gpu")
    pairs = [(r["promotion_wait"], r["ttft"]) for r in records
             if is_number(r.get("promotion_wait")) and is_number(r.get("ttft"))]
    ttft_sum = sum(t for _w, t in pairs)
    share = sum(w for w, _t in pairs) / ttft_sum if ttft_sum > 0 else None
    lines = [f"p99 TTFT {seconds_text(p99)} against a budget of {seconds_text(s.ttft_budget_seconds)}"
             if p99 is not None else "p99 TTFT: not measured",
             f"p99 promotion wait {seconds_text(wait_p99)}" if wait_p99 is not None
             else "p99 promotion wait: no promotions measured",
             f"promotion wait {share:.1%} of TTFT over {len(pairs)} requests (blamed from "
             f"{s.promotion_share_max:.0%})" if share is not None
             else "promotion wait share of TTFT: not measured (no request in the window "
                  "measured its promotion wait)"]
    if low_traffic:
        verdict = TOO_LITTLE
    elif p99 is None or not promoted:
        verdict = NOT_MEASURED
        if p99 is not None:
            lines.append("no tokens were promoted: the transfer path was not exercised")
    elif p99 <= s.ttft_budget_seconds:
        verdict = PAYS
    else:
        verdict = (NOT_MEASURED if share is None
                   else SKIP if share >= s.promotion_share_max else PAYS)
    return Check(key, CONDITIONS[key], verdict, tuple(lines))


def host_dram(window: Sequence[Sample], s: Settings) -> Check:
    """Check 4, host DRAM contested. Headroom (bytes, available minus the reserve; the host
    collector's) at its lowest in the window under ``min_headroom_bytes``, or any page read
    back in from swap in the window (``host_swap_in_bytes``, host-wide; measured only where
    the host collector reports the memory limit): "skip offload"; otherwise "offload pays";
    no headroom reported: "not measured". Other processes' memory is the newest sample's
    ``host_memory_part_bytes`` "other" part where the engine's memory was read (memory in use
    that is not the engine's, docs/collectors.md), evidence only."""
    key = "host-dram"
    headroom = [float(v) for x in window if is_number(v := x.get("host_memory_headroom_bytes"))]
    reserve = _newest(window, "host_memory_reserve_bytes")
    available = _newest(window, "host_memory_available_bytes")
    swapped = (swap_in_increase(window)
               if _newest(window, "host_memory_limit_bytes") is not None else None)
    # the lowest in the window, so it may read below the headroom card's newest value
    floor = ("once available memory eats into the reserve" if s.min_headroom_bytes == 0
             else f"under {_gib(s.min_headroom_bytes)}")
    lines = [f"lowest headroom in the window {_gib(min(headroom))} (contested {floor})"
             if headroom else "headroom: not measured",
             f"available {_gib(available)}, reserve {_gib(reserve)}" if available is not None
             and reserve is not None else "available and reserve: not measured",
             "swap: not measured (no swap-in counter)" if swapped is None
             else f"swap-in: {swapped / 2**20:.1f} MiB read back from swap (contested above 0)",
             _other_memory(window)]
    if not headroom:
        verdict = NOT_MEASURED
    else:
        verdict = (SKIP if min(headroom) < s.min_headroom_bytes or (swapped or 0.0) > 0
                   else PAYS)
    return Check(key, CONDITIONS[key], verdict, tuple(lines))


def _other_memory(window: Sequence[Sample]) -> str:
    # "other" is the engine's memory out only where the engine's is read (engine_other);
    # without, it holds the engine's beyond its KV budget too (agent/memory_budget.py)
    parts = mapping(window[-1], "host_memory_part_bytes") if window else {}
    if not (is_number(parts.get("other")) and is_number(parts.get("engine_other"))):
        return "other processes' memory: not measured (the engine's own is not: engine_pid)"
    return f"other processes' memory {bytes_text(float(parts['other']))} (in use, not the engine's)"


def cheaper_steps(window: Sequence[Sample], tokens: Mapping[str, float]) -> Check:
    """Check 5, cheaper steps first. The KV cache settings each source's engine reports (the
    newest sample's ``engine_cache_config``: (source, prefix caching on/off, KV cache dtype
    width) per key): GPU prefix caching off for any: "skip offload" (turn it on first); on
    for all that say: "offload pays" for what is measured, with what a narrower KV cache
    dtype would save; no engine says: "not measured", with whether the GPU prefix cache
    served tokens (then prefix caching is on). Batching, context limits and model selection
    have no signal: each says so."""
    key = "cheaper-steps"
    settings = _cache_settings(window)
    total = sum(tokens.values())
    gpu = tokens.get("gpu", 0.0)
    if not total:
        served = "GPU prefix cache: no prompt tokens in the window"
    elif "gpu" not in tokens:  # LMCache's view, say: the engine's own GPU hits unseen
        served = "GPU prefix cache: not measured (no source reports its hits)"
    else:
        served = f"GPU prefix cache served {gpu / total:.1%} of prompt tokens"
    unmeasured = ("not measured: batching (vLLM --max-num-seqs, --max-num-batched-tokens), "
                  "context limits (--max-model-len), model selection")
    if not settings:
        if gpu > 0:
            seen = f"{served}: prefix caching is on"
        elif total and "gpu" in tokens:  # measured, and none served: a hint
            seen = ("GPU prefix cache served no tokens: check prefix caching is on (vLLM "
                    "--enable-prefix-caching)")
        else:  # no tokens, or the GPU's not measured: nothing to hint from
            seen = served
        return Check(key, CONDITIONS[key], NOT_MEASURED, (
            "KV cache settings: not measured (no engine reports them)", seen,
            "not measured: KV cache quantization (vLLM --kv-cache-dtype fp8)", unmeasured))
    # sources that say the same once: vLLM's tap and its /metrics report one engine's settings
    same: dict[tuple[str, str], list[str]] = {}
    for source, prefix, dtype in settings:
        same.setdefault((prefix, dtype), []).append(source)
    lines = [f"{', '.join(sources)}: prefix caching {prefix}; KV cache dtype "
             f"{DTYPE_ADVICE.get(dtype, dtype)}" for (prefix, dtype), sources in same.items()]
    off = [source for source, prefix, _ in settings if prefix == "off"]
    if off:
        lines.append(f"turn GPU prefix caching on first ({', '.join(off)}; vLLM "
                     "--enable-prefix-caching): it reuses prefixes without any transfer")
    return Check(key, CONDITIONS[key], SKIP if off else PAYS, (*lines, served, unmeasured))


# what each KV cache dtype width (vocabulary.KV_CACHE_DTYPES) leaves to save before offloading
DTYPE_ADVICE = {
    "auto": "auto (the model's, 16-bit as a rule): fp8 would halve the KV bytes before any "
            "offload (vLLM --kv-cache-dtype fp8)",
    "32bit": "32-bit: 16-bit would halve the KV bytes, fp8 quarter them, before any offload",
    "16bit": "16-bit: fp8 would halve the KV bytes before any offload (vLLM --kv-cache-dtype "
             "fp8)",
    "8bit": "8-bit (quantized): the KV bytes are half a 16-bit cache's already",
    "4bit": "4-bit (quantized): the KV bytes are a quarter of a 16-bit cache's already",
    "other": "other (quantized or mixed widths): check its bytes per token",
}


def _cache_settings(window: Sequence[Sample]) -> list[tuple[str, str, str]]:
    """(source, prefix caching, KV cache dtype) of each key of the newest sample that has
    any ``engine_cache_config``, sorted; [] when none has."""
    for x in reversed(window):
        keys = [k.split(KEY_SEPARATOR) for k in mapping(x, "engine_cache_config")]
        if keys:
            return sorted(tuple(k) for k in keys if len(k) == 3)
    return []


def headline(window: Sequence[Sample], tokens: Mapping[str, float],
             prefix: Mapping[str, float], s: Settings) -> Headline:
    """The :class:`Headline` of the window (``tokens``, ``prefix``: as for
    :func:`unique_prompts`)."""
    total = sum(tokens.values())
    share = {src: tokens[src] / total for src in ordered(tokens)} if total else {}
    saved = window_increase(window, "prefill_seconds_saved")
    spent = seconds_by_tier(window_increase(window, "transfer_seconds_sum"),
                            window_increase(window, "transfer_blocks"))
    tiers = [t for t in ordered(set(saved) | set(spent)) if t != "gpu"]
    return Headline(share, {t: (saved.get(t, 0.0), spent.get(t)) for t in tiers},
                    _worst_p99(window, "ttft_seconds"), s.ttft_budget_seconds,
                    _newest(window, "host_memory_headroom_bytes"),
                    _newest(window, "host_memory_reserve_bytes"),
                    reuse_share(prefix))


def _per_sample(window: Sequence[Sample], name: str, combine) -> np.ndarray | None:
    """``combine`` (sum, max) of each sample's values of the keyed gauge ``name``; samples
    without any skipped; None when none has one (not measured)."""
    values = [float(combine(v for v in mapping(x, name).values() if is_number(v)))
              for x in window if any(is_number(v) for v in mapping(x, name).values())]
    return np.asarray(values) if values else None


def _worst_p99(window: Sequence[Sample], name: str) -> float | None:
    values = [p for x in window if is_number(p := mapping(x, name).get("p99"))]
    return max(values) if values else None


def _newest(window: Sequence[Sample], name: str) -> float | None:
    for x in reversed(window):
        if is_number(value := x.get(name)):
            return float(value)
    return None


def _shares(tokens: Mapping[str, float]) -> str:
    total = sum(tokens.values())
    return ", ".join(f"{src} {tokens[src] / total:.0%}" for src in ordered(tokens))


def _ratio(value: float) -> str:
    return f"{value:.0%}"


def seconds_text(value: float | None) -> str:
    """"12.3 ms" under a second, "2.50 s" from one, "not measured" for None."""
    if value is None:
        return "not measured"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def _gib(value: float | None) -> str:
    return "not measured" if value is None else bytes_text(value)
