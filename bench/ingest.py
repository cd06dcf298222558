"""Ingest throughput: events/s from emitters through ZMQ into the pipeline, against a bare
msgspec decode of the same batches (the floor any ingest path pays). Goal: ratio >= 0.5.

The emitter runs in its own process, as a tap does inside an engine; the clock runs from its
first emit until the agent's pipeline has aggregated every event.

A last line says where the time goes: the decode, and the pipeline's fold alone, measured in this
process on batches decoded beforehand.

Run: python bench/ingest.py [--events N] [--repeat R]
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time

from kvscope import events as ev
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources.ingest import IngestSource
from kvscope.agent.taps.emitter import Emitter

BATCH = 1024


def workload(n: int) -> list:
    """A request's worth of events repeated: the mix an engine tap sends."""
    out = []
    for i in range(n // 5):
        rid = f"r{i}"
        out += [
            ev.RequestStarted(ts=1.0, request_id=rid, prompt_tokens=2048),
            ev.Lookup(ts=1.0, request_id=rid, tokens={"gpu": 1024, "cpu": 512, "recompute": 512},
                      blocks=128, block_hits={"gpu": 64, "cpu": 32}),
            ev.Transfer(ts=1.0, src="cpu", dst="gpu", blocks=32, bytes=1 << 21, duration=1e-4,
                        request_id=rid),
            ev.Eviction(ts=1.0, tier="gpu", blocks=1, bytes=1 << 16, age=3.0, hits=1),
            ev.RequestFinished(ts=1.1, request_id=rid, ttft=0.1, prompt_tokens=2048),
        ]
    return out


def payloads(events: list) -> list[bytes]:
    """The batches an emitter would send for ``events``, encoded."""
    return [ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="engine", seq=i,
                                     events=events[i * BATCH:(i + 1) * BATCH]))
            for i in range((len(events) + BATCH - 1) // BATCH)]


def bare_decode(encoded: list[bytes]) -> float:
    """Seconds to msgspec-decode ``encoded`` batches."""
    t0 = time.perf_counter()
    for payload in encoded:
        ev.decode_batch(payload)
    return time.perf_counter() - t0


def fold_only(encoded: list[bytes]) -> float:
    """Seconds the pipeline takes to fold ``encoded`` batches, decoded beforehand."""
    batches = [ev.decode_batch(payload).events for payload in encoded]
    pipeline = Pipeline()
    t0 = time.perf_counter()
    for events in batches:
        pipeline.ingest("engine", events)
    return time.perf_counter() - t0


def _emit_all(endpoint: str, n: int, started) -> None:
    events = workload(n)
    emitter = Emitter(endpoint, source="engine", batch_size=BATCH, flush_interval=0.001,
                      max_buffer=len(events) + 1)
    time.sleep(0.3)  # let the connection come up before the clock starts
    started.value = time.monotonic()
    for event in events:
        emitter.emit(event)
    emitter.close(timeout=30.0)


def through_agent(n: int, expected: int) -> float:
    """Seconds from the emitter process's first emit until the pipeline has every event."""
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/ingest.sock"
        pipeline = Pipeline()
        source = IngestSource(pipeline, endpoint)
        source.start()
        spawn = multiprocessing.get_context("spawn")  # a forked child must not inherit ZMQ state
        started = spawn.Value("d", 0.0)
        child = spawn.Process(target=_emit_all, args=(endpoint, n, started))
        child.start()
        while pipeline.events_received().get("engine", 0) < expected:
            if child.exitcode not in (None, 0):
                raise SystemExit(f"the emitter process failed (exit code {child.exitcode})")
            if child.exitcode == 0 and time.monotonic() - started.value > 60:
                raise SystemExit(f"the emitter finished but only {pipeline.events_received()} "
                                 f"of {expected} events arrived; dropped: "
                                 f"{pipeline.snapshot().events_dropped}")
            time.sleep(0.005)
        elapsed = time.monotonic() - started.value
        child.join()
        source.shutdown()
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=500_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    events = workload(args.events)
    n = len(events)
    encoded = payloads(events)
    agent = min(through_agent(args.events, n) for _ in range(args.repeat))
    decode = min(bare_decode(encoded) for _ in range(args.repeat))
    fold = min(fold_only(encoded) for _ in range(args.repeat))
    print(f"events: {n:,}")
    print(f"emitter -> ZMQ -> pipeline: {n / agent:,.0f} events/s")
    print(f"bare msgspec decode:        {n / decode:,.0f} events/s")
    print(f"ratio (ingest / decode): {decode / agent:.2f}  (goal >= 0.5)")
    print(f"where the time goes, ns/event: decode {decode / n * 1e9:.0f}, "
          f"pipeline fold {fold / n * 1e9:.0f}")


if __name__ == "__main__":
    main()
