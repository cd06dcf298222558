"""Pure transforms from samples to plottable series (no I/O, no clock; house rule 9).

A *sample* is one entry of the agent's ``GET /api/v1/timeseries`` answer (the Prometheus
backend builds the same shape), a dict with ``ts`` (Unix seconds) and the fields declared in
:mod:`kvscope.samples`: cumulative counters (dicts keyed by source, tier or ``"src->dst"``),
gauges, and percentiles ``{"p50", "p95", "p99"}``.
Any field or key may be missing: a counter key that never occurred counts as 0, a gauge key
without a value draws no point.

Times come back as float milliseconds since the Unix epoch in numpy arrays: plotly draws
them on a date axis (in UTC) and serialises numpy arrays as binary, which keeps a refresh
over an hour of samples cheap (see bench/dashboard.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvscope.samples import PERCENTILES as _PERCENTILES
from kvscope.vocabulary import TIERS

Sample = Mapping[str, object]
Series = tuple[np.ndarray, np.ndarray]  # (times in epoch ms, values)

# Canonical order of keys, so a source, tier or direction keeps its place across refreshes.
ORDER = (*TIERS, "recompute",
         "gpu->cpu", "cpu->gpu", "cpu->disk", "disk->cpu", "disk->gpu", "cpu->remote",
         "remote->cpu")
PERCENTILES = tuple(_PERCENTILES)  # ("p50", "p95", "p99")


def bytes_text(value: float) -> str:
    """A byte count for text, in binary units: "2.00 GiB" from 1 GiB, "512.0 MiB", "4.0 KiB",
    "12 B" (a tier of a few MiB read "0.00 GiB"); a negative count keeps its sign."""
    size = abs(value)
    for unit, scale, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if round(size / scale, digits) >= 1:  # as it prints: 2**30 - 1 is "1.00 GiB"
            return f"{value / scale:.{digits}f} {unit}"
    return f"{value:.0f} B"


def is_number(value) -> bool:
    """Whether ``value`` is a finite int or float and no bool (a sample's or a record's value
    that can be shown; anything else is not measured)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def last_window(samples: Sequence[Sample], seconds: float) -> list[Sample]:
    """The samples no older than ``seconds`` before the newest one (relative to the data,
    not the wall clock, so replays of old data still show)."""
    if not samples:
        return []
    newest = float(samples[-1]["ts"])
    return [s for s in samples if float(s["ts"]) >= newest - seconds]


def thin(samples: Sequence[Sample], max_points: int) -> list[Sample]:
    """Every k-th sample, k the smallest step leaving at most ``max_points``, always keeping
    the newest. Counters stay exact (rates between kept samples are averages over the gap)."""
    n = len(samples)
    if n <= max_points or max_points < 2:
        return list(samples)
    step = -(-n // max_points)
    return list(samples[(n - 1) % step::step])


def times_ms(samples: Sequence[Sample]) -> np.ndarray:
    """Sample times as epoch milliseconds (float64)."""
    return np.fromiter((float(s["ts"]) for s in samples), float, len(samples)) * 1000.0


def ordered(keys: Iterable[str]) -> list[str]:
    """Known keys in :data:`ORDER`, then any others alphabetically."""
    keys = set(keys)
    return [k for k in ORDER if k in keys] + sorted(keys - set(ORDER))


def mapping(sample: Sample, field: str) -> Mapping:
    value = sample.get(field)
    return value if isinstance(value, Mapping) else {}


def reported_tiers(sample: Sample) -> set[str]:
    """The tiers ``sample`` holds a capacity or a residency of: those its agent's sources
    report."""
    return {tier for field in ("tier_capacity_bytes", "tier_capacity_blocks",
                               "tier_resident_bytes", "tier_resident_blocks")
            for tier in mapping(sample, field)}


def tier_shown(samples: Sequence[Sample], tier: str) -> bool:
    """Whether ``tier`` shows in the samples otherwise than by its residency: a count of the
    prompt tokens it served (0 included: a source looked it up), copies into or out of it, or
    a budget."""
    return (tier in keys_of(samples, "prompt_tokens")
            or tier in keys_of(samples, "offload_budget_bytes")
            or any(tier in d.split("->") for field in ("transfer_bytes", "transfer_blocks")
                   for d in keys_of(samples, field)))


def unconfigured_tiers(samples: Sequence[Sample]) -> set[str]:
    """The offload tiers nothing in ``samples`` shows: no residency or capacity reported and
    not :func:`tier_shown` (the Tiers page's "no <tier> tier configured")."""
    reported = {tier for s in samples for tier in reported_tiers(s)}
    return {tier for tier in TIERS[1:] if tier not in reported and not tier_shown(samples, tier)}


def keys_of(samples: Sequence[Sample], field: str) -> list[str]:
    """Every key that ``sample[field]`` holds in any sample, in canonical order."""
    return ordered({k for s in samples for k in mapping(s, field)})


def _increases(values: np.ndarray) -> np.ndarray:
    """Increases between consecutive counter values (along the first axis); a decrease is a
    reset, whose increase is the new value itself (PromQL ``rate()``)."""
    diff = np.diff(values, axis=0)
    return np.where(diff >= 0, diff, values[1:])


def counter_matrix(samples: Sequence[Sample], field: str) -> tuple[list[str], np.ndarray]:
    """(keys, values): ``values[i, j]`` is counter ``keys[j]`` at sample ``i`` (missing: 0)."""
    keys = keys_of(samples, field)
    out = np.zeros((len(samples), len(keys)))
    for i, sample in enumerate(samples):
        d = mapping(sample, field)
        for j, key in enumerate(keys):
            value = d.get(key)
            if isinstance(value, (int, float)):
                out[i, j] = value
    return keys, out


# seconds: the shortest and longest window a per-second rate is taken over (see rate_window)
MIN_RATE_WINDOW = 10.0
MAX_RATE_WINDOW = 60.0


def rate_window(samples: Sequence[Sample], field: str) -> float:
    """Seconds to take the per-second rates of counter ``field`` over: twice the median gap
    between the samples where the counter (summed over its keys) went up, within
    [:data:`MIN_RATE_WINDOW`, :data:`MAX_RATE_WINDOW`]. The dashboard samples every second,
    while a source the agent scrapes (vLLM's, SGLang's, LMCache's and TensorRT-LLM's metrics:
    every 5 s by default) steps once a scrape: a rate between consecutive samples read 0 in
    four of five and five times the rate in the fifth. A window of two steps holds as many
    steps wherever it lies (steps 5 s apart: two in every 10 s)."""
    keys, values = counter_matrix(samples, field)
    return _window(times_ms(samples), values) if keys else MIN_RATE_WINDOW


def _window(ts: np.ndarray, values: np.ndarray) -> float:
    """:func:`rate_window` of the counter matrix ``values`` sampled at ``ts`` (epoch ms)."""
    if len(ts) < 3:
        return MIN_RATE_WINDOW
    stepped = ts[1:][_increases(values).sum(axis=1) > 0] / 1000.0
    if len(stepped) < 2:
        return MIN_RATE_WINDOW
    gap = float(np.median(np.diff(stepped)))
    return min(MAX_RATE_WINDOW, max(MIN_RATE_WINDOW, 2.0 * gap))


def counter_rates(samples: Sequence[Sample], field: str,
                  window: float | None = None) -> dict[str, Series]:
    """Per-second rates of the cumulative counters ``sample[field][key]``, each over the
    last ``window`` seconds (None: :func:`rate_window`), as PromQL ``rate(x[window])``.

    Returns dict[key, (times, rates)], keys in canonical order; one point per sample after the
    first whose timestamp is later than the one before, at its time: the increase since the
    newest sample at least ``window`` seconds older (the first sample, while none is) over
    the seconds between them. A missing key counts as 0; a value lower than the previous one
    is a reset (the increase is the new value, as ``rate()`` takes it). Rates are in the
    counter's unit per second.
    """
    if len(samples) < 2:
        return {}
    keys, values = counter_matrix(samples, field)
    ts = times_ms(samples)
    later = np.flatnonzero(np.diff(ts) > 0) + 1  # the samples that get a point
    if not keys or not len(later):
        return {}
    if window is None:
        window = _window(ts, values)
    # the window's first sample for each point: the newest at least `window` s before it
    start = np.maximum(np.searchsorted(ts, ts[later] - window * 1000.0, side="right") - 1, 0)
    seconds = (ts[later] - ts[start]) / 1000.0
    totals = np.vstack([np.zeros(len(keys)), np.cumsum(_increases(values), axis=0)])
    rates = (totals[later] - totals[start]) / seconds[:, None]
    return {key: (ts[later], rates[:, j]) for j, key in enumerate(keys)}


def window_increase(samples: Sequence[Sample], field: str) -> dict[str, float]:
    """Each counter's increase over the samples (resets handled as in :func:`counter_rates`)."""
    if len(samples) < 2:
        return {}
    keys, values = counter_matrix(samples, field)
    return {key: float(_increases(values[:, j]).sum()) for j, key in enumerate(keys)}


def scalar_increase(samples: Sequence[Sample], field: str) -> float | None:
    """The increase of the unkeyed cumulative counter ``sample[field]`` (e.g. ``requests``)
    over the samples that hold a number for it (resets as in :func:`counter_rates`); None when
    no sample holds one."""
    values = np.asarray([float(v) for s in samples
                         if isinstance(v := s.get(field), (int, float))], float)
    if not len(values):
        return None
    return float(_increases(values).sum()) if len(values) > 1 else 0.0


def swap_in_increase(samples: Sequence[Sample]) -> float | None:
    """Bytes read back in from swap over the samples that read the host
    (``host_memory_limit_bytes`` a number; the others hold 0 for the counter, no reading:
    counted, a sample that missed the reading read as a reset and the host's whole swap-in
    since boot as this window's); None where none did."""
    read = [s for s in samples if is_number(s.get("host_memory_limit_bytes"))]
    return scalar_increase(read, "host_swap_in_bytes") if read else None


def cumulative_increase(samples: Sequence[Sample], field: str) -> dict[str, Series]:
    """Each counter's running increase since the first sample: dict[key, (times, values)]."""
    if len(samples) < 2:
        return {}
    keys, values = counter_matrix(samples, field)
    ts = times_ms(samples)
    return {key: (ts, np.concatenate(([0.0], np.cumsum(_increases(values[:, j])))))
            for j, key in enumerate(keys)}


def bucket_increase(samples: Sequence[Sample], field: str) -> dict[str, np.ndarray]:
    """Per-bucket increases of the histograms ``sample[field][key]`` (lists of per-bucket
    counts) over the samples: each bucket a counter, its increases between consecutive
    samples that hold the key added up, resets as in :func:`counter_rates` (PromQL's
    ``increase()`` per bucket series; first and last alone read a reset followed by growth as
    a negative count). A key the first sample lacks had no observations then (zeros, as a
    missing counter is 0 in :func:`window_increase`: else a tier's first evictions fell out
    of its histograms while its counters kept them); a key whose buckets change in number
    counts from the change on. dict[key, counts]."""
    if not samples:
        return {}
    rows: dict[str, list[np.ndarray]] = {}
    for i, sample in enumerate(samples):
        for key, counts in mapping(sample, field).items():
            row = np.asarray(counts, float)
            kept = rows.setdefault(key, [] if i == 0 else [np.zeros_like(row)])
            if kept and kept[-1].shape != row.shape:
                kept[:] = [np.zeros_like(row)]
            kept.append(row)
    return {key: _increases(np.vstack(rows[key])).sum(axis=0) if len(rows[key]) > 1
            else np.zeros_like(rows[key][0]) for key in ordered(rows)}


def gauge_series(samples: Sequence[Sample], field: str) -> dict[str, Series]:
    """The gauges ``sample[field][key]`` as dict[key, (times, values)], canonical key order.
    A sample without a key contributes no point to that key's series."""
    pts: dict[str, tuple[list[float], list[float]]] = {}
    for sample in samples:
        t = float(sample["ts"]) * 1000.0
        for key, value in mapping(sample, field).items():
            if isinstance(value, (int, float)):
                xs, ys = pts.setdefault(key, ([], []))
                xs.append(t)
                ys.append(float(value))
    return {k: (np.asarray(pts[k][0]), np.asarray(pts[k][1])) for k in ordered(pts)}


def scalar_series(samples: Sequence[Sample], field: str) -> Series:
    """The numeric values of ``sample[field]`` with their times; samples without one skipped."""
    xs, ys = [], []
    for sample in samples:
        value = sample.get(field)
        if isinstance(value, (int, float)):
            xs.append(float(sample["ts"]) * 1000.0)
            ys.append(float(value))
    return np.asarray(xs), np.asarray(ys)


def quantile_series(samples: Sequence[Sample], field: str,
                    key: str | None = None) -> dict[str, Series]:
    """Percentiles ``sample[field]`` (or ``sample[field][key]``) as dict["p50"|"p95"|"p99",
    (times, seconds)]; a sample without a value gives NaN (a gap in the line). Empty when no
    sample has any value."""
    ts = times_ms(samples)
    out = {}
    for p in PERCENTILES:
        ys = np.full(len(samples), np.nan)
        for i, sample in enumerate(samples):
            d = mapping(sample, field)
            if key is not None:
                d = d.get(key) if isinstance(d.get(key), Mapping) else {}
            value = d.get(p)
            if isinstance(value, (int, float)):
                ys[i] = value
        if not np.isnan(ys).all():
            out[p] = (ts, ys)
    return out
