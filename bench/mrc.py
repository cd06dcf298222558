"""Benchmark: miss-ratio curves, kvscope vs libcachesim, measured side by side in one run.

On one access stream (default: 10M synthetic block accesses, seed 7), times

- kvscope's whole exact LRU curve (stack distances, O(N log N));
- kvscope's SHARDS curves, fixed-rate (R = 0.01) and fixed-size (Waldspurger et al., FAST'15);
- libcachesim (C, oracleGeneral binary reader) replaying LRU once per size, at ``--points``
  sizes of the curve,

and prints accesses per second, ratios, the largest difference between libcachesim's and the
exact miss ratios at those sizes (should be 0), and the SHARDS mean absolute error.
Goal (issue 8): the SHARDS curve is faster than libcachesim's replay of a single size.

    PYTHONPATH=. python bench/mrc.py [--accesses N] [--points K] [--trace FILE.jsonl]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from kvscope.analysis import shards
from kvscope.analysis.inputs import load_trace
from kvscope.analysis.mrc import (DistanceHistogram, curve_from_histogram, mean_absolute_error,
                                  size_grid)
from kvscope.analysis.stackdist import stack_distances
from kvscope.analysis.synthetic import prefix_stream

ORACLE_GENERAL = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])


def write_oracle_general(ids: np.ndarray, path: Path) -> None:
    """libCacheSim's oracleGeneral binary: packed (u32 time, u64 id, u32 size, i64 next)."""
    records = np.zeros(len(ids), dtype=ORACLE_GENERAL)
    records["time"] = np.arange(len(ids)) // 1000
    records["id"] = ids
    records["size"] = 1
    records["next"] = -1
    records.tofile(path)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accesses", type=int, default=10_000_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--points", type=int, default=8, help="LRU sizes libcachesim replays")
    parser.add_argument("--rate", type=float, default=0.01, help="SHARDS fixed rate")
    parser.add_argument("--blocks", type=int, default=32_768, help="SHARDS fixed-size blocks")
    parser.add_argument("--trace", help="Mooncake JSONL instead of the synthetic stream")
    args = parser.parse_args()
    import libcachesim as lcs

    if args.trace:
        ids, label = load_trace(args.trace).block_ids, args.trace
    else:
        ids, gen = timed(lambda: prefix_stream(args.accesses, seed=args.seed))
        label = f"synthetic prefix stream, seed {args.seed} (generated in {gen:.1f} s)"
    n = len(ids)
    print(f"stream: {n:,} accesses, {len(np.unique(ids)):,} distinct blocks; {label}")

    exact, t_exact = timed(lambda: DistanceHistogram.from_distances(stack_distances(ids)))
    grid = size_grid(exact.max_useful_size, 200)
    exact_curve = curve_from_histogram(exact, grid, "exact")
    rate, t_rate = timed(lambda: shards.fixed_rate(ids, args.rate))
    size, t_size = timed(lambda: shards.fixed_size(ids, args.blocks))

    points = np.unique(np.linspace(exact.max_useful_size / args.points, exact.max_useful_size,
                                   args.points).round().astype(np.int64))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stream.oracleGeneral"
        write_oracle_general(ids, path)
        reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
        lcs_miss, lcs_times = [], []
        for c in points.tolist():
            (miss, _), t = timed(lambda: lcs.LRU(c).process_trace(reader))
            lcs_miss.append(miss)
            lcs_times.append(t)
    t_one = float(np.mean(lcs_times))
    t_all = float(np.sum(lcs_times))
    diff = np.max(np.abs(np.array(lcs_miss) - (1 - exact.hit_ratio(points))))

    def row(name, seconds, note=""):
        print(f"  {name:<44} {seconds:8.2f} s  {n / seconds / 1e6:8.2f} M accesses/s  {note}")

    print("timings (same stream, measured in this run):")
    row("kvscope exact LRU curve (every size)", t_exact)
    row(f"kvscope SHARDS fixed-rate R={rate.rate:.3g} curve", t_rate,
        f"MAE {mean_absolute_error(exact_curve, curve_from_histogram(rate.histogram, grid, 'r')):.4f}")
    row(f"kvscope SHARDS fixed-size {args.blocks} blocks curve", t_size,
        f"MAE {mean_absolute_error(exact_curve, curve_from_histogram(size.histogram, grid, 's')):.4f}"
        f" (final R={size.rate:.3g})")
    row("libcachesim LRU, one size (mean)", t_one)
    row(f"libcachesim LRU, {len(points)} sizes", t_all,
        f"max |miss - exact| = {diff:.2e}")
    print("ratios:")
    print(f"  libcachesim {len(points)} sizes / kvscope exact curve   {t_all / t_exact:8.2f}x")
    print(f"  libcachesim one size / kvscope exact curve      {t_one / t_exact:8.2f}x")
    print(f"  libcachesim one size / SHARDS fixed-rate curve  {t_one / t_rate:8.2f}x"
          f"  (goal: > 1)")
    print(f"  libcachesim one size / SHARDS fixed-size curve  {t_one / t_size:8.2f}x")
    print(f"  exact curve sizes where libcachesim would need one replay each: {len(grid)}")


if __name__ == "__main__":
    main()
