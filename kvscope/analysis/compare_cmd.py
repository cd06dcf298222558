"""``kvscope compare BASELINE CANDIDATE [--json]``: arguments and the handler.
``kvscope/cli.py`` only wires :func:`add_arguments` and :func:`run` into its subcommands."""

from __future__ import annotations

import argparse
import sys

from kvscope.analysis.bootstrap import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, MAX_RESAMPLES
from kvscope.analysis.compare import (DEFAULT_MIN_REQUESTS, compare, parse_budget, render_text,
                                      to_json)
from kvscope.argtypes import fraction, non_negative, path, positive

DESCRIPTION = (
    "Compare agent captures (kvscope agent --capture-dir), e.g. runs without the newest "
    "tier (BASELINE) and with it (CANDIDATE): TTFT and ITL p50/p95/p99 with percentile-"
    "bootstrap confidence intervals, hit quality by source, transfer cost, and a verdict "
    "against the rollback rule: p99 TTFT or ITL above its budget and significantly worse than "
    "the baseline -> roll back (disable the newest tier). Give each arm as several captures of "
    "repeated runs, comma-separated, so that run-to-run variance is measured (the intervals "
    "resample runs, then requests within runs); with one capture per arm it is not, and a "
    "candidate that looks worse is 'inconclusive', never 'roll back'; with several, a roll "
    "back also needs the runs themselves significantly slower (a t-test on their log p99s). "
    "Interleave the arms' runs in time (A B A B ...). The verdict is 'keep', "
    "'roll back (disable the newest tier)' or 'inconclusive'. Example: kvscope compare "
    "runs/base1,runs/base2,runs/base3 runs/cpu1,runs/cpu2,runs/cpu3 --ttft-budget 0.5")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``compare`` options to ``parser``."""
    parser.add_argument("baseline", metavar="BASELINE", type=path(),
                        help="capture directory (or requests .parquet segment) of the baseline, "
                        "or several of repeated runs, comma-separated")
    parser.add_argument("candidate", metavar="CANDIDATE", type=path(),
                        help="the same for the candidate")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    add_verdict_arguments(parser)
    parser.add_argument("--seed", type=non_negative(int), default=0,
                        help="bootstrap seed (default %(default)s)")


def add_verdict_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the rollback rule's options (budgets, resamples, confidence, minimum requests) to
    ``parser``: ``compare``'s and ``rollout``'s."""
    parser.add_argument("--ttft-budget", type=budget, metavar="SECONDS|+N%",
                        help="p99 TTFT budget: seconds, or a percentage of the baseline's p99 "
                        "(+10%%: 10%% above it; a required improvement with '=': "
                        "--ttft-budget=-5%%); a candidate above it and significantly worse "
                        "than the baseline is rolled back (default: none, judge against the "
                        "baseline only)")
    parser.add_argument("--itl-budget", type=budget, metavar="SECONDS|+N%",
                        help="p99 inter-token latency budget, as --ttft-budget (default: none, "
                        "judge against the baseline only)")
    parser.add_argument("--resamples", type=positive(int, at_most=MAX_RESAMPLES),
                        default=DEFAULT_RESAMPLES, metavar="N",
                        help="bootstrap resamples (default %(default)s)")
    parser.add_argument("--confidence", type=fraction, default=DEFAULT_CONFIDENCE,
                        metavar="LEVEL", help="confidence level, 0-1 (default %(default)s)")
    parser.add_argument("--min-requests", type=positive(int), default=DEFAULT_MIN_REQUESTS,
                        metavar="N",
                        help="fewer finished requests on a side give 'inconclusive' "
                        "(default %(default)s)")


def budget(text: str):
    """argparse type of a budget (:func:`kvscope.analysis.compare.parse_budget`)."""
    try:
        return parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace, out=None) -> int:
    """Compare and print the report or JSON; return 0 whatever the verdict.

    An unreadable capture raises TraceError (which the CLI turns into exit code 2); options
    the analysis refuses print one line to stderr and return 2.
    """
    from kvscope.analysis.capture_reader import read_arms, segments_gone  # pyarrow only here

    baseline, candidate = read_arms(args.baseline, args.candidate)
    for note in segments_gone(args.baseline) + segments_gone(args.candidate):
        print(f"kvscope compare: note: {note}", file=sys.stderr)
    try:
        result = compare(baseline, candidate, ttft_budget=args.ttft_budget,
                         itl_budget=args.itl_budget,
                         resamples=args.resamples, confidence=args.confidence, seed=args.seed,
                         min_requests=args.min_requests)
    except ValueError as exc:  # the command-line boundary: one line, exit code 2
        print(f"kvscope compare: error: {exc}", file=sys.stderr)
        return 2
    out = out or sys.stdout
    out.write(to_json(result) + "\n" if args.json else render_text(result))
    return 0
