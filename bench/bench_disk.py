"""``disk`` tier read bandwidth against plain ``os.read`` of the same files, side by side.

The disk tier reads ``--blocks`` chunk files (header + payload) into host pool rows on its
thread pool and verifies each checksum (:meth:`DiskStore.read_many`); the baseline opens each
file and ``os.read``s it whole, one after another, with no checks. Two settings, each run
side by side round by round:

- cold: before every read pass each file's cached pages are dropped
  (``posix_fadvise(POSIX_FADV_DONTNEED)``, which touches only these files), so both read
  from the storage device, as a disk tier does when it is larger than free RAM;
- warm: files the page cache holds, so the figure is the tier's own CPU cost (CRC-32 of
  every byte) against a bare memory copy.

Goal: ratio >= 0.8. Run: ``python bench/bench_disk.py [--dir DIR]`` (DIR on the disk to test).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from kvscope.engine.disk import DiskStore


def _plain(paths, size: int) -> float:
    t0 = time.perf_counter_ns()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.read(fd, size)
        finally:
            os.close(fd)
        assert len(data) == size
    return (time.perf_counter_ns() - t0) / 1e9


def _drop_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _measure(store, items, paths, file_bytes, rounds, cold) -> tuple[float, float]:
    total = len(paths) * file_bytes
    ours, plain = [], []
    for _ in range(rounds):
        if cold:
            _drop_cache(paths)
        t0 = time.perf_counter_ns()
        reasons = store.read_many(items)
        ours.append(total / ((time.perf_counter_ns() - t0) / 1e9))
        assert reasons == [None] * len(items)
        if cold:
            _drop_cache(paths)
        plain.append(total / _plain(paths, file_bytes))
    return statistics.median(ours), statistics.median(plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-bytes", type=int, default=1 << 20, help="default: tiny@512 tokens")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", help="directory for the chunk files (default: a temporary one)")
    args = parser.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="kvscope-bench-disk-")
    store = DiskStore(directory, args.block_bytes, threads=args.threads)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 255, size=(args.blocks, args.block_bytes), dtype=np.uint8)
    store.write_many([(i, 1000 + i, rows[i]) for i in range(args.blocks)])
    out = np.empty_like(rows)
    paths = [store.path(i) for i in range(args.blocks)]
    file_bytes = os.path.getsize(paths[0])
    items = [(i, 1000 + i, out[i]) for i in range(args.blocks)]
    os.sync()  # written pages must be clean before they can be dropped
    results = {}
    for cold in (True, False):
        _plain(paths, file_bytes)  # warm the page cache (the cold runs drop it again)
        results["cold" if cold else "warm"] = _measure(store, items, paths, file_bytes,
                                                       args.rounds, cold)
    assert (out == rows).all()
    store.close()
    if not args.dir:
        for path in paths:
            os.unlink(path)
        os.rmdir(directory)
    for name, (a, b) in results.items():
        print(f"disk tier read, {name}, {args.blocks} chunks of {file_bytes} B, {args.threads} "
              f"threads, {os.cpu_count()} cpus: disk tier {a / 1e9:.2f} GB/s (CRC-checked), plain "
              f"os.read {b / 1e9:.2f} GB/s, ratio {a / b:.2f} (goal >= 0.8)")

if __name__ == "__main__":
    main()
