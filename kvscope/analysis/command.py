"""``kvscope analyze INPUT [--json]``: arguments and the handler. ``kvscope/cli.py`` only wires
:func:`add_arguments` and :func:`run` into its subcommands."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from kvscope.analysis.analyze import METHODS, AnalyzeOptions, analyze
from kvscope.analysis.inputs import load_measured_rates, load_trace
from kvscope.analysis.report import render_text, to_json
from kvscope.analysis.sizing import DEFAULT_BANDWIDTH, GIB
from kvscope.engine.presets import PRESETS, get_preset
from kvscope.argtypes import at_least, at_most, path, positive, share, token_count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``analyze`` options to ``parser``."""
    parser.add_argument("input", metavar="INPUT", type=path(),
                        help="trace to analyze: Mooncake JSONL (a file not ending in .parquet), "
                        "or an agent capture directory (kvscope agent --capture-dir) or .parquet "
                        "segment")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    parser.add_argument("--preset", default="llama-3-8b", choices=sorted(PRESETS),
                        help="model preset for bytes per block and prefill cost (default %(default)s)")
    parser.add_argument("--bandwidth-gbps", type=at_least(0.001, "GB/s"), metavar="GB/S",
                        help="host-to-device promotion bandwidth, GB/s (default: a capture's "
                        "own, measured over its timed cpu->gpu copies; without any, "
                        f"{DEFAULT_BANDWIDTH / 1e9:g}, assumed)")
    parser.add_argument("--prefill-tokens-per-second", type=at_least(1, "token/s"),
                        metavar="TOKENS",
                        help="prefill rate (default: a capture's own, its recomputed tokens "
                        "over its prefill seconds; without them, the preset's, assumed)")
    parser.add_argument("--gpu-tokens", type=token_count, metavar="TOKENS",
                        help="GPU prefix-cache capacity in tokens (vLLM logs it as 'GPU KV cache "
                        "size', its CPU build as 'CPU KV cache size'; default: a capture's gpu "
                        "tier as its engine reported it, else 0: none)")
    parser.add_argument("--budget-gib", type=positive(float, at_most=2**30), metavar="GIB",
                        help="most host RAM the CPU tier may take (default: no limit)")
    parser.add_argument("--target-share", type=share, default=0.9, metavar="SHARE",
                        help="recommend the smallest size buying this share of the affordable "
                        "gain (default %(default)s)")
    parser.add_argument("--method", choices=METHODS, default="auto",
                        help="LRU curve: exact stack distances, SHARDS fixed-rate or fixed-size, "
                        "or auto (exact up to 20M accesses; default %(default)s)")
    parser.add_argument("--sample-rate", type=share, metavar="R",
                        help="SHARDS fixed-rate sampling rate (default: about 2M sampled accesses)")
    parser.add_argument("--sample-blocks", type=positive(int), default=65_536, metavar="N",
                        help="SHARDS fixed-size sample size in blocks (default %(default)s)")
    parser.add_argument("--arc-points", type=at_most(64, "each size is one ARC simulation"),
                        default=12, metavar="N",
                        help="sizes on the ARC curve, 0 to skip ARC (default %(default)s)")


def options_from(args: argparse.Namespace) -> AnalyzeOptions:
    """Build :class:`AnalyzeOptions` from parsed arguments (raises UnknownPreset, ValueError)."""
    return AnalyzeOptions(
        preset=get_preset(args.preset),
        bandwidth=args.bandwidth_gbps * 1e9 if args.bandwidth_gbps else None,
        prefill_tokens_per_second=args.prefill_tokens_per_second,
        gpu_tokens=args.gpu_tokens,
        budget_bytes=args.budget_gib * GIB if args.budget_gib else None,
        target_share=args.target_share, method=args.method, sample_rate=args.sample_rate,
        sample_blocks=args.sample_blocks, arc_points=args.arc_points)


def run(args: argparse.Namespace) -> int:
    """Analyze ``args.input`` and print the report or JSON; return 0.

    Bad options, an unreadable input or a sample too small to size from print one line to
    stderr and return 2.
    """
    try:
        options = options_from(args)
        options.validate()
        trace = load_trace(args.input)
        if Path(args.input).is_dir():  # as compare says it (a gap in the accesses read)
            from kvscope.analysis.capture_reader import segments_gone  # pyarrow only here

            for note in segments_gone(args.input, "block accesses"):
                print(f"kvscope analyze: note: {note}", file=sys.stderr)
        options = replace(options, measured=load_measured_rates(args.input))
        analysis = analyze(trace, options)
    except ValueError as exc:  # TraceError included  # the command-line boundary: one line, exit code 2
        print(f"kvscope analyze: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(to_json(analysis) + "\n" if args.json else render_text(analysis))
    return 0
