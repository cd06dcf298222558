"""A real tap beside a flooder: what a sender of oversized messages costs the agent, and its
neighbour (issue 26, item 2).

The agent's ingest socket (defaults: max_batch_bytes 4 MiB, so ZMQ takes messages up to 8 MiB
and the agent refuses those over 4 MiB as ``too_large``) listens on loopback TCP, as in a node.
A tap process sends a workload's events through a real Emitter (defaults: 100,000 events of
buffer, flushed every 50 ms) at ``--rate`` events/s for ``--seconds``; beside it a flooder
process sends 8 MiB - 64 bytes messages of one-byte events as fast as ZMQ takes them. Printed:
the tap's events emitted, folded by the agent, dropped by its emitter; the flood's messages
sent and refused; the agent's CPU seconds and its peak RSS growth over the run.

The figures before and after the header of a refused batch stopped being decoded into an
object per event are in the commit that added this bench. Run: python bench/ingest_flood.py
[--seconds S] [--rate R] [--no-flood]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import socket
import time

import msgspec
import zmq

from kvscope import events as ev
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources.ingest import IngestSource

from ingest import workload  # bench/ingest.py's: the mix an engine tap sends


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _tap(endpoint: str, rate: int, seconds: float, result) -> None:
    from kvscope.agent.taps.emitter import Emitter

    emitter = Emitter(endpoint, source="engine")
    events = workload(int(rate * seconds) + 5)
    time.sleep(0.3)  # connected
    emitted, start = 0, time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        due = min(len(events), int(elapsed * rate))
        for event in events[emitted:due]:
            emitter.emit(event)
        emitted = due
        time.sleep(0.01)
    emitter.close(timeout=10.0)
    result["emitted"], result["dropped"] = emitted, emitter.dropped


def _flood(endpoint: str, stop, result) -> None:
    events = (8 << 20) - 64 - 40
    data = msgspec.msgpack.encode({"version": ev.SCHEMA_VERSION, "source": "flood", "seq": 0,
                                   "events": [1] * events})
    assert len(data) <= 8 << 20
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 100)
    sock.connect(endpoint)
    sent = 0
    while not stop.is_set():
        try:
            sock.send(data, copy=False)
            sent += 1
        except zmq.Again:
            continue
    result["sent"], result["bytes"], result["events"] = sent, len(data), events
    sock.close()
    context.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=10_000, help="the tap's events/s")
    parser.add_argument("--no-flood", action="store_true", help="the tap alone, for reference")
    args = parser.parse_args()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    pipeline = Pipeline()
    source = IngestSource(pipeline, endpoint)
    source.start()
    spawn = multiprocessing.get_context("spawn")
    manager = spawn.Manager()
    tap_result, flood_result, stop = manager.dict(), manager.dict(), spawn.Event()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu0 = time.process_time()
    tap = spawn.Process(target=_tap, args=(endpoint, args.rate, args.seconds, tap_result))
    flooder = spawn.Process(target=_flood, args=(endpoint, stop, flood_result))
    tap.start()
    if not args.no_flood:
        flooder.start()
    tap.join()
    stop.set()
    if not args.no_flood:
        flooder.join()
    time.sleep(1.0)  # the agent folds what it holds
    cpu = time.process_time() - cpu0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    source.shutdown()
    snap = pipeline.snapshot()
    folded = snap.events_received.get("engine", 0)
    emitted, dropped = tap_result["emitted"], tap_result["dropped"]
    print(f"tap: {emitted:,} events emitted at {args.rate:,}/s for {args.seconds:g} s; folded "
          f"{folded:,} ({folded / emitted:.1%}), its emitter dropped {dropped:,}")
    if not args.no_flood:
        sent, size = flood_result["sent"], flood_result["bytes"]
        refused = sum(n for (_source, reason), n in snap.events_dropped.items()
                      if reason == "too_large") // flood_result["events"]
        print(f"flood: {sent:,} messages of {size / 2**20:.1f} MiB handed to ZMQ, {refused:,} "
              f"reached the agent and were refused as too_large "
              f"({refused * size / 2**20 / args.seconds:.0f} MiB/s)")
    print(f"agent: {cpu:.1f} CPU seconds over the run, peak RSS grew {rss / 1024:.0f} MB")
    print(f"drops: {dict(sorted(snap.events_dropped.items()))}")


if __name__ == "__main__":
    main()
