"""``--simulate`` speed: block accesses per second of the simulator against libCacheSim's LRU on
the same id sequence, side by side in one run.

The simulator replays the Mooncake trace (requests by timestamp, blocks first to last) with a
single ``gpu`` tier of ``--blocks`` blocks and LRU, the configuration in which the two must
agree exactly (asserted). libCacheSim is fed the same ids two ways: from Python, one
``cache.get`` per id (the same per-access boundary the simulator has), and from its own C
reader over a plain-text id file (``process_trace``; the reader parses the file too). Also
reported: the full three-tier simulator. Goal: ratio >= 0.5.
Run: ``python bench/bench_simulate.py [--trace FILE]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import libcachesim as lcs

from kvscope.engine.engine import OffloadEngine
from kvscope.engine.presets import get_preset
from kvscope.engine.workload import MOONCAKE_BLOCK_TOKENS, read_mooncake

DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / \
    "mooncake_conversation_trace.jsonl"


def _simulate(requests, sizes, policy="lru") -> tuple[float, int]:
    engine = OffloadEngine(get_preset("tiny"), *sizes, block_tokens=MOONCAKE_BLOCK_TOKENS,
                           payload=False, policy=policy)
    t0 = time.perf_counter()
    for request in requests:
        engine.process(request)
    seconds = time.perf_counter() - t0
    return engine.stats.block_accesses / seconds, sum(engine.stats.block_hits.values())


def _lcs_python(ids, blocks) -> tuple[float, int]:
    cache = lcs.LRU(cache_size=blocks)
    req = lcs.Request()
    req.obj_size = 1
    hits = 0
    t0 = time.perf_counter()
    for obj_id in ids:
        req.obj_id = obj_id
        hits += cache.get(req)
    return len(ids) / (time.perf_counter() - t0), hits


def _lcs_reader(path, n, blocks) -> tuple[float, float]:
    reader = lcs.TraceReader(str(path), lcs.TraceType.PLAIN_TXT_TRACE)
    cache = lcs.LRU(cache_size=blocks)
    t0 = time.perf_counter()
    miss_ratio, _ = cache.process_trace(reader)
    return n / (time.perf_counter() - t0), 1.0 - miss_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    requests = read_mooncake(args.trace)
    ids = [h for r in requests for h in r.block_hashes]
    fd, name = tempfile.mkstemp(suffix=".txt", prefix="kvscope-ids-")
    with os.fdopen(fd, "w") as f:  # ids + 1: the plain-text reader treats 0 as no request
        f.write("\n".join(str(i + 1) for i in ids) + "\n")
    ours, py, c, full = [], [], [], []
    try:
        for _ in range(args.rounds):
            rate, hits = _simulate(requests, (args.blocks, 0, 0))
            ours.append(rate)
            rate, oracle_hits = _lcs_python(ids, args.blocks)
            py.append(rate)
            assert hits == oracle_hits, (hits, oracle_hits)
            rate, hit_ratio = _lcs_reader(name, len(ids), args.blocks)
            c.append(rate)
            assert abs(hit_ratio - hits / len(ids)) < 1e-12
            full.append(_simulate(requests, (args.blocks, 4 * args.blocks, 16 * args.blocks))[0])
    finally:
        os.unlink(name)
    a, b, d, e = (statistics.median(x) for x in (ours, py, c, full))
    print(f"simulate, gpu-only LRU {args.blocks} blocks, {len(ids)} block accesses: "
          f"kvscope {a / 1e3:.0f}k/s; libcachesim LRU fed from Python {b / 1e3:.0f}k/s "
          f"(ratio {a / b:.2f}), from its C reader {d / 1e3:.0f}k/s (ratio {a / d:.2f}); goal >= 0.5")
    print(f"simulate, three tiers (gpu {args.blocks}, cpu {4 * args.blocks}, disk "
          f"{16 * args.blocks}) LRU: kvscope {e / 1e3:.0f}k/s (ratio to libcachesim from "
          f"Python {e / b:.2f})")


if __name__ == "__main__":
    main()
