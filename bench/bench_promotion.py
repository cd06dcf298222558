"""Promotion bandwidth through the engine (``cpu -> gpu``, batched) against a bare
``torch.Tensor.copy_`` of the same bytes between the same two pools, measured side by side.

Setup: ``--blocks`` blocks of a request are offloaded to the ``cpu`` tier, then the request
comes back and all of them are promoted in one batch. The engine's figure is the timed
``cpu->gpu`` copy it reports (CUDA events with CUDA, the copying thread's CPU time,
``thread_time_ns``, without); the bare copy is timed the same way. Goal: ratio >= 0.8.
Run: ``python bench/bench_promotion.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvscope.engine.engine import OffloadEngine
from kvscope.engine.presets import get_preset
from kvscope.engine.workload import Request


def _bare_copy_seconds(dst, src) -> float:
    if dst.is_cuda:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3
    t0 = time.thread_time_ns()
    dst.copy_(src)
    return (time.thread_time_ns() - t0) / 1e9


def run(blocks: int, block_tokens: int, rounds: int, shuffle: bool) -> dict:
    preset = get_preset("tiny")
    ours, bare = [], []
    for r in range(rounds):
        # A fresh engine each round: the slot layout is then the same every round (one run in
        # the same order, single-block runs reversed), not interleaved by earlier rounds.
        engine = OffloadEngine(preset, blocks, 2 * blocks, block_tokens=block_tokens)
        size = engine.block_bytes * blocks
        first = tuple(range(blocks))
        again = tuple(reversed(first)) if shuffle else first
        for name, hashes in (("a", first), ("b", tuple(range(blocks, 2 * blocks)))):
            engine.process(Request(f"{r}{name}", 0.0, blocks * block_tokens, 1, hashes))
        outcome = engine.process(Request(f"{r}c", 0.0, blocks * block_tokens, 1, again))
        engine.drain()
        assert outcome.tokens["cpu"] == blocks * block_tokens, outcome.tokens
        (promotion,) = [x for x in outcome.results if (x.src, x.dst) == ("cpu", "gpu")]
        ours.append(promotion.bytes / promotion.duration)
        src, dst = engine.cpu.pool.data[:blocks], engine.gpu.pool.data[:blocks]
        bare.append(size / _bare_copy_seconds(dst, src))
        engine.close()
    ours_bw, bare_bw = statistics.median(ours), statistics.median(bare)
    return {"bytes": size, "engine_gb_s": ours_bw / 1e9, "bare_copy_gb_s": bare_bw / 1e9,
            "ratio": ours_bw / bare_bw}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--block-tokens", type=int, default=512, help="512: 1 MiB tiny blocks")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA)"
    for shuffle in (False, True):
        res = run(args.blocks, args.block_tokens, args.rounds, shuffle)
        layout = "reversed order (scattered slots)" if shuffle else "same order"
        print(f"promotion cpu->gpu, {device}, {res['bytes'] / 2**20:.0f} MiB, {layout}: "
              f"engine {res['engine_gb_s']:.2f} GB/s, bare copy_ {res['bare_copy_gb_s']:.2f} GB/s, "
              f"ratio {res['ratio']:.2f} (goal >= 0.8)")


if __name__ == "__main__":
    main()
