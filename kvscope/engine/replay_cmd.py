"""``kvscope replay``: run a workload through the engine (or the simulator) and summarise it.

Without ``--trace`` the built-in synthetic workload runs for ``--requests`` requests; a
Mooncake trace (its first ``--requests``, or all) uses 512-token blocks. ``--simulate`` makes
the same decisions with no payload bytes, as fast as possible (pacing is ignored). ``--json``
prints the summary of :meth:`kvscope.engine.stats.EngineStats.summary` as one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable

from kvscope.engine.options import add_engine_arguments, open_engine
from kvscope.engine.presets import get_preset
from kvscope.engine.workload import MOONCAKE_BLOCK_TOKENS, SyntheticConfig, read_mooncake, synthetic
from kvscope.argtypes import path, positive
from kvscope.signals import stopping_on_signals


# the engine keeps every request's TTFT for the percentiles: 1M requests, tens of MB
MAX_REQUESTS = 1_000_000
SYNTHETIC_REQUESTS = 2000  # the synthetic workload's requests without --requests
PROGRESS_EVERY = 10.0  # seconds between a replay's progress lines


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``replay`` subcommand to an argparse subparsers object."""
    p = sub.add_parser(
        "replay", help="replay a trace through the offload engine and print hit ratios",
        description="Replay a Mooncake JSONL trace (or the built-in synthetic workload) through "
                    "the three-tier offload engine, or with --simulate through its decisions "
                    "only, and print hit ratios, transfers, evictions and TTFT percentiles.")
    p.add_argument("--trace", metavar="FILE", type=path("for the built-in workload"),
                   help="Mooncake JSONL trace (512-token blocks)")
    p.add_argument("--requests", type=positive(int, at_most=MAX_REQUESTS), default=None,
                   metavar="N",
                   help="requests to replay, at most "
                   f"{MAX_REQUESTS:,}: the first of --trace (default: all), or the synthetic "
                   f"workload's (default {SYNTHETIC_REQUESTS:,})")
    p.add_argument("--seed", type=int, help="seed of the synthetic workload (default 0)")
    add_engine_arguments(p)
    p.add_argument("--store-threshold", type=positive(int), default=1, metavar="N",
                   help="offload a block only once seen this many times (default 1)")
    p.add_argument("--min-priority", type=int, default=0, metavar="N",
                   help="drop instead of offloading blocks below this priority (default 0)")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--speed", type=positive(float), default=None,
                      help="workload seconds per wall second (default: as fast as possible)")
    pace.add_argument("--fast", action="store_true", help="as fast as possible (the default)")
    p.add_argument("--simulate", action="store_true",
                   help="decisions only, no payload bytes; transfer times from the cost model")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def replay(args, stop: threading.Event | None = None) -> dict:
    """Run the replay described by parsed ``args`` until its workload ends or ``stop`` is set;
    return the summary dict of the requests replayed (``interrupted``: stopped before the last).

    Raises :class:`~kvscope.engine.workload.TraceError`,
    :class:`~kvscope.engine.engine.EngineConfigError` or
    :class:`~kvscope.engine.presets.UnknownPreset`.
    """
    from kvscope.engine.engine import EngineConfigError
    from kvscope.engine.replay import Replayer

    preset = get_preset(args.preset)
    if args.trace:
        requests, block_tokens = read_mooncake(args.trace), MOONCAKE_BLOCK_TOKENS
        requests = requests[:args.requests]
        total = len(requests)
    else:
        total = args.requests or SYNTHETIC_REQUESTS
        block_tokens = preset.block_tokens
        # made as they are replayed: a list of them all held the whole workload at once
        requests = itertools.islice(
            synthetic(SyntheticConfig(seed=args.seed or 0, block_tokens=block_tokens)), total)
    if args.simulate and args.speed is not None:  # it was ignored, silently
        raise EngineConfigError("--speed paces a replay that copies KV; --simulate copies none "
                                "and replays as fast as possible: leave --speed out")
    engine = open_engine(preset, args.gpu_blocks, args.cpu_blocks, args.disk_blocks,
                         args.disk_dir, block_tokens=block_tokens, payload=not args.simulate,
                         policy=args.policy, store_threshold=args.store_threshold,
                         min_priority=args.min_priority)
    speed = None if args.fast else args.speed
    t0 = time.perf_counter()
    replayer = Replayer(engine, requests, speed=speed, stop=stop, progress=_progress(total))
    try:
        replayer.run()
    finally:
        engine.close()
    summary = engine.stats.summary(engine.block_bytes, time.perf_counter() - t0,
                                   [tier.name for tier in engine.tiers if tier.capacity_blocks])
    summary["config"] = {"trace": args.trace, "preset": preset.name, "block_tokens": block_tokens,
                         "block_bytes": engine.block_bytes, "policy": args.policy,
                         "gpu_blocks": args.gpu_blocks, "cpu_blocks": args.cpu_blocks,
                         "disk_blocks": args.disk_blocks, "simulate": args.simulate}
    summary["interrupted"] = replayer.served < total
    # what the TTFTs were priced at, not measured: prefill always, transfers when simulated
    model = summary["config"]["cost_model"] = {
        "prefill_tokens_per_second": preset.prefill_tokens_per_second}
    if args.simulate:
        model.update(h2d_bytes_per_second=preset.h2d_bytes_per_second,
                     disk_bytes_per_second=preset.disk_bytes_per_second)
    return summary


def _progress(total: int) -> Callable[[int], None]:
    """A line on stderr every :data:`PROGRESS_EVERY` seconds of a replay: the requests
    replayed of ``total``, and the seconds so far (a replay of the real trace ran minutes
    without a word)."""
    start = last = time.monotonic()

    def report(served: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY:
            last = now
            print(f"kvscope replay: {served:,} of {total:,} requests ({served / total:.0%}), "
                  f"{now - start:.0f} s", file=sys.stderr, flush=True)
    return report


def render(summary: dict) -> str:
    """A short human-readable report of a summary (which holds the tiers configured only)."""
    t = summary["ttft_seconds"]
    moved = [f"{d} {v['blocks']} blocks {v['seconds']:.3f} s"
             for d, v in summary["transfers"].items() if v["blocks"]]
    lines = [f"requests {summary['requests']}, block accesses {summary['block_accesses']}, "
             f"wall {summary['wall_seconds']:.2f} s",
             f"block hit ratio {summary['block_hit_ratio']:.4f} (" + ", ".join(
                 f"{k} {v:.4f}" for k, v in summary["block_hit_ratio_by_tier"].items()) + ")",
             f"prefix hit ratio {summary['prefix_hit_ratio']:.4f}; tokens " + ", ".join(
                 f"{k} {v}" for k, v in summary["tokens_by_source"].items()),
             "transfers " + (", ".join(moved) or "none"),
             "evictions " + ", ".join(f"{k} {v}" for k, v in summary["evictions"].items()),
             "ttft " + ", ".join(f"{p} " + ("not measured" if t[p] is None else
                                           f"{t[p] * 1e3:.2f} ms") for p in ("p50", "p95", "p99"))]
    model = summary["config"]["cost_model"]
    tiers = summary["block_hit_ratio_by_tier"]  # the rates of the tiers configured only
    rates = [f"{model[key] / 1e9:g} GB/s {link}" for tier, key, link in (
        ("cpu", "h2d_bytes_per_second", "cpu<->gpu"),
        ("disk", "disk_bytes_per_second", "disk<->cpu")) if tier in tiers and key in model]
    priced = f"prefill at {model['prefill_tokens_per_second']:,.0f} tokens/s"
    if rates:
        priced += ", transfers at " + " and ".join(rates)
    lines.append(f"modelled, not measured: {priced} (preset {summary['config']['preset']}'s cost "
                 "model)")
    if summary["errors"]:
        lines.append("errors " + ", ".join(f"{k} {v}" for k, v in summary["errors"].items()))
    return "\n".join(lines)


def run(args, out=None) -> int:
    """The subcommand's handler: replay and print to ``out`` (default: stdout); exit code 0.
    Bad input raises (see :func:`replay`); the command line reports it. Ctrl-C, SIGTERM and
    SIGHUP end the replay after the request in progress: the summary of those replayed is
    printed (a paced replay of an hour's trace lost it all), a line on stderr says it was
    interrupted, and the exit code is 130; the disk tier's chunks are removed either way."""
    stop = threading.Event()
    with stopping_on_signals(stop):
        summary = replay(args, stop)
    print(json.dumps(summary) if args.json else render(summary), file=out or sys.stdout)
    if summary["interrupted"]:
        print(f"kvscope replay: interrupted: the summary covers the {summary['requests']:,} "
              "requests replayed", file=sys.stderr)
        return 130
    return 0
