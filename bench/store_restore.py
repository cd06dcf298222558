"""Restoring a damaged store segment: the scan that tries every offset in Python (the store
until issue 26, item 6) against :func:`kvscope.agent.store.read_segment`, side by side.

One segment is written: ``--frames`` good frames, a damaged region, ``--frames`` more. Two
kinds of damage, each read by both scans in turn (best of ``--rounds``), both checked to
give the same records:

- zeros: ``--zeros`` MiB of zero bytes, as a power loss leaves a file's unwritten tail;
- random: ``--random`` MiB of random bytes (a fixed seed), the worst case for the new scan,
  which still tries every offset whose next-but-eight byte could begin a msgpack map.

Prints MB/s of damage passed for each and the ratio. Run: ``python bench/store_restore.py
[--zeros 64] [--random 4]`` (the old scan passes about 1.2 MB/s: 64 MiB take about a minute).
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time
from pathlib import Path

import msgspec

from kvscope.agent import store as store_module
from kvscope.agent.record_data import RecordData
from kvscope.agent.requests import RequestRecord, TransferRecord
from kvscope.agent.store import RequestStore, read_segment


def _old_read_segment(path: Path) -> list[RequestRecord]:
    """read_segment as it was: every offset of a damaged region tried in Python."""
    data = memoryview(path.read_bytes())
    decoder = msgspec.msgpack.Decoder(RecordData)
    records, offset = [], 0
    while offset < len(data):
        frame = store_module._frame_at(data, offset, decoder)
        if frame is None:
            offset += 1
            continue
        record, offset = frame
        if record is not None:
            records.append(record)
    return records


def _frames(directory: Path, first: int, n: int) -> bytes:
    store = RequestStore(directory)
    for i in range(first, first + n):
        store.add(RequestRecord(f"r{i}", f"{i:032x}", "engine", 1000.0 + i, prompt_tokens=64,
                                tokens={"gpu": 48}, ttft=0.05, finished=1001.0 + i,
                                transfers=(TransferRecord("cpu", "gpu", 2, 65536, 1000.0, 1e-4),)))
    store.flush()
    (segment,) = store.segments()
    data = segment.read_bytes()
    segment.unlink()
    return data


def _best(read, path: Path, rounds: int) -> tuple[float, list]:
    best, records = float("inf"), None
    for _ in range(rounds):
        t0 = time.perf_counter()
        records = read(path)
        best = min(best, time.perf_counter() - t0)
    return best, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zeros", type=float, default=64.0, help="MiB of zeros")
    parser.add_argument("--random", type=float, default=4.0, help="MiB of random bytes")
    parser.add_argument("--frames", type=int, default=1000, help="good frames on each side")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # each read warns of the damaged region
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        before, after = _frames(directory, 1000, args.frames), _frames(directory, 5000,
                                                                       args.frames)
        rng = random.Random(26)
        damages = {"zeros": bytes(int(args.zeros * (1 << 20))),
                   "random": rng.randbytes(int(args.random * (1 << 20)))}
        print(f"{'damage':8} {'MiB':>6} {'old s':>8} {'new s':>8} {'old MB/s':>9} "
              f"{'new MB/s':>9} {'ratio':>7}")
        for name, damage in damages.items():
            path = directory / "requests-000000000000001-1-000001.kvseg"
            path.write_bytes(before + damage + after)
            old, old_records = _best(_old_read_segment, path, args.rounds)
            new, new_records = _best(read_segment, path, args.rounds)
            assert old_records == new_records and len(new_records) == 2 * args.frames
            mb = len(damage) / 1e6
            print(f"{name:8} {len(damage) / (1 << 20):6.1f} {old:8.3f} {new:8.3f} "
                  f"{mb / old:9.1f} {mb / new:9.1f} {old / new:6.0f}x")


if __name__ == "__main__":
    main()
