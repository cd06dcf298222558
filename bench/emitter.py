"""Emitter cost on the caller's thread: nanoseconds per ``Emitter.emit`` against an empty
function call of the same shape, with no agent listening (the worst case: the buffer fills
and events are counted as dropped) and with one listening. Goal: under 1 microsecond per event.

Run: python bench/emitter.py [--events N]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from kvscope import events as ev
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources.ingest import IngestSource
from kvscope.agent.taps.emitter import Emitter


def _empty(event: object) -> None:
    pass


def per_call_ns(call, events: list) -> float:
    t0 = time.perf_counter_ns()
    for event in events:
        call(event)
    return (time.perf_counter_ns() - t0) / len(events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()
    event = ev.Transfer(ts=1.0, src="cpu", dst="gpu", blocks=4, bytes=1 << 20, duration=1e-4)
    events = [event] * args.events
    baseline = min(per_call_ns(_empty, events) for _ in range(3))
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/ingest.sock"
        away = Emitter(endpoint, max_buffer=100_000)
        no_agent = min(per_call_ns(away.emit, events) for _ in range(3))
        away.close(timeout=0.1)
        source = IngestSource(Pipeline(), endpoint)
        source.start()
        live = Emitter(endpoint, max_buffer=args.events * 3 + 1)
        with_agent = min(per_call_ns(live.emit, events) for _ in range(3))
        live.close()
        source.shutdown()
    print(f"empty function call:        {baseline:6.0f} ns/event")
    print(f"emit, agent listening:      {with_agent:6.0f} ns/event  (ratio to empty call {with_agent / baseline:.1f})")
    print(f"emit, agent away (drops):   {no_agent:6.0f} ns/event  (ratio to empty call {no_agent / baseline:.1f})")
    print("goal: under 1000 ns/event")


if __name__ == "__main__":
    main()
