"""``kvscope rollout``: arguments and the handler. ``kvscope/cli.py`` only wires
:func:`add_arguments` and :func:`run` into its subcommands."""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

from kvscope.analysis.compare import check_resamples
from kvscope.analysis.compare_cmd import add_verdict_arguments
from kvscope.argtypes import http_url, non_negative, path, positive
from kvscope.rollout import loadgen, workload
from kvscope.rollout.arms import RUNNING_TIMEOUT_S, START_TIMEOUT_S, Arm
from kvscope.rollout.plan import AA_SUFFIX, DEFAULT_LEVELS, DEFAULT_REPETITIONS
from kvscope.rollout.session import Options, RolloutError, Session
from kvscope.rollout.workload import MIXED
from kvscope.signals import interrupt_on_signals

DESCRIPTION = (
    "Run the guide's rollout method unattended: drive a load generator (guidellm) against a "
    "baseline and one or more candidates, warm-up first, then a concurrency ramp of a mixed "
    "workload (shared system prompts, multi-turn sessions, one-off prompts, long and short), "
    "interleaved and repeated so that drift hits every arm alike, with the baseline run twice "
    "per repetition (the A/A pair) so that the noise floor is measured. Writes rollout.json and "
    "a self-contained rollout.html into --out: per-level TTFT/ITL/end-to-end tails with "
    "bootstrap intervals over repetitions, hit quality and transfer cost per arm, host "
    "context, the exact commands, and a verdict per candidate: keep, roll back (disable the "
    "newest tier) or inconclusive. The first --arm is the baseline.")
EPILOG = """example, two vLLM servers already running, the candidate with the kvscope tap and agent:
  kvscope rollout --arm base=http://127.0.0.1:8000 --arm cpu=http://127.0.0.1:8001 \\
      --agent cpu=http://127.0.0.1:9400 --ttft-budget +10% --itl-budget +10% --out runs/cpu-tier

or started by the rollout (and stopped when it ends), each with its health URL:
  kvscope rollout --arm base=http://127.0.0.1:8000 --start 'base=vllm serve MODEL --port 8000' \\
      --arm cpu=http://127.0.0.1:8001 --start 'cpu=vllm serve MODEL --port 8001 \\
      --kv-transfer-config ...' --levels 1,2,4,8 --repetitions 3

Exit codes: 0 done (whatever the verdict); 2 bad input, or the session stopped early (an arm
unreachable or dead, the load generator missing or failing): one line says why, and the runs
that finished are in the report."""


def _pairs(flag: str, value_type=str):
    """An argparse type for NAME=VALUE."""
    def parse(text: str):
        name, sep, value = text.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. {flag} "
                                             "base=http://127.0.0.1:8000)")
        return name.strip(), value_type(value.strip())
    parse.__name__ = "NAME=VALUE"
    return parse


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]  # "1,,2": an item left out, refused
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct stream counts >= 1, "
                                         "comma-separated (e.g. 1,2,4,8,16)")
    return levels


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``rollout`` options to ``p``."""
    p.description, p.epilog = textwrap.fill(DESCRIPTION, 79), EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    url = _pairs("--arm", http_url)
    p.add_argument("--arm", type=url, action="append", required=True, metavar="NAME=URL",
                   help="an arm: its name and its OpenAI-compatible server's base URL (its "
                   "/v1/completions, /metrics and /health are used; a trailing /v1 is "
                   "dropped); repeat, the baseline first")
    p.add_argument("--agent", type=_pairs("--agent", http_url), action="append", default=[],
                   metavar="NAME=URL", help="the kvscope agent beside an arm: hit quality and "
                   "transfer cost from its /metrics (default: from the server's /metrics)")
    p.add_argument("--start", type=_pairs("--start"), action="append", default=[],
                   metavar="NAME=COMMAND", help="a shell command that starts an arm's server; "
                   "started before the first run, stopped at the end (default: running)")
    p.add_argument("--health", type=_pairs("--health", http_url), action="append", default=[],
                   metavar="NAME=URL", help="the URL that answers 200 once an arm serves "
                   "(default: its URL + /health)")
    p.add_argument("--levels", type=_levels, default=list(DEFAULT_LEVELS), metavar="N,N,...",
                   help="concurrency levels, streams (default 1,2,4,8,16)")
    p.add_argument("--repetitions", type=positive(int), default=DEFAULT_REPETITIONS, metavar="N",
                   help="repetitions of the ramp per arm; 2 or more measure run-to-run "
                   "variance (default %(default)s)")
    p.add_argument("--requests", type=positive(int), default=200, metavar="N",
                   help="requests per run, i.e. per arm, level and repetition "
                   "(default %(default)s)")
    p.add_argument("--warmup-requests", type=non_negative(int), default=16, metavar="N",
                   help="requests per arm before the first run, not measured (default "
                   "%(default)s; 0: none)")
    p.add_argument("--no-aa", dest="aa", action="store_false",
                   help="leave out the A/A pair (the baseline's second run per repetition): "
                   "faster, but the noise floor is then not measured")
    p.add_argument("--workload", default=MIXED, metavar="mixed|TRACE",
                   help="'mixed' (default), or a Mooncake JSONL trace (hash_ids of 512-token "
                   "blocks) replayed in order")
    p.add_argument("--block-tokens", type=positive(int), default=64, metavar="N",
                   help="tokens per workload block: the mixed workload's unit, and what a "
                   "trace's 512-token block becomes (default %(default)s)")
    p.add_argument("--max-prompt-tokens", type=positive(int), default=4096, metavar="N",
                   help="longest prompt; longer ones are cut, keeping their prefix "
                   "(default %(default)s)")
    p.add_argument("--max-output-tokens", type=positive(int), default=256, metavar="N",
                   help="longest completion asked for (default %(default)s)")
    p.add_argument("--seed", type=non_negative(int), default=0,
                   help="seed of the workload and the bootstrap (default %(default)s)")
    add_verdict_arguments(p)
    p.add_argument("--loadgen", metavar="PATH", type=path("to find guidellm"),
                   help="guidellm executable (default: the "
                   "cached environment of scripts/vllm_env.sh --guidellm, then PATH)")
    p.add_argument("--tokenizer", metavar="DIR|NAME", help="tokenizer guidellm counts tokens "
                   "with (default: the served model's)")
    p.add_argument("--start-timeout", type=positive(float), metavar="SECONDS",
                   help="wait this long for an arm's health URL (default "
                        f"{START_TIMEOUT_S:g} for an arm --start starts, "
                        f"{RUNNING_TIMEOUT_S:g} for a server already running)")
    p.add_argument("--run-timeout", type=positive(float), default=1800, metavar="SECONDS",
                   help="stop a run that takes longer (default %(default)s)")
    p.add_argument("--request-timeout", type=positive(float), default=300, metavar="SECONDS",
                   help="give up on a request whose server sends nothing for this long "
                   "(default %(default)s)")
    p.add_argument("--out", metavar="DIR", type=path("for a new rollout-YYYYmmdd-HHMMSS"),
                   help="report directory (default "
                   "rollout-YYYYmmdd-HHMMSS); must be new or empty")


def _arms(args: argparse.Namespace) -> list[Arm]:
    # the server's root: an OpenAI client's base URL ends in /v1, where no /health answers
    arms = {name: Arm(name, url.rstrip("/").removesuffix("/v1")) for name, url in args.arm}
    if len(arms) != len(args.arm):
        raise ValueError("arm names repeat: give each --arm its own NAME")
    for name in arms:  # the baseline's second run is "<baseline> (A/A)": one name, two arms
        if name.endswith(AA_SUFFIX):
            raise ValueError(f"--arm {name}=...: a name ending in {AA_SUFFIX.strip()!r} is the "
                             "A/A run's; name the arm otherwise")
    for flag, dest, attr in (("--agent", "agent", "agent"), ("--start", "start", "command"),
                             ("--health", "health", "health")):
        given = set()
        for name, value in getattr(args, dest):
            if name not in arms:
                raise ValueError(f"{flag} {name}=...: no --arm named {name}")
            if name in given:
                raise ValueError(f"{flag} {name}=... given twice: one per arm")
            given.add(name)
            setattr(arms[name], attr, value)
    return list(arms.values())


def _check_tokenizer(tokenizer: str | None) -> None:
    """Raise ValueError for a ``--tokenizer`` written as a path (``/``, ``.`` or ``~`` first:
    never a Hugging Face model name) that is no directory, which guidellm would otherwise
    report only at the first run, after every server started."""
    if tokenizer and tokenizer.startswith(("/", ".", "~")) and \
            not Path(tokenizer).expanduser().is_dir():
        raise ValueError(f"--tokenizer {tokenizer}: no such directory (give the served "
                         "model's directory, or a Hugging Face model name)")


def run(args: argparse.Namespace) -> int:
    """Run the rollout; print where the report is and each verdict. Returns 0, or 2 for bad
    input or a session that stopped early (one line on stderr; partial results kept)."""
    try:
        arms = _arms(args)
        check_resamples(args.resamples, args.confidence)  # now, not after the runs
        executable = loadgen.find(args.loadgen)
        if args.workload != MIXED:
            if not Path(args.workload).is_file():
                raise ValueError(f"--workload {args.workload}: no such trace file (or 'mixed')")
            # read now what the runs will read (their first requests), not after servers start
            workload.prompts(args.workload, max(args.requests, args.warmup_requests), args.seed,
                             block_tokens=args.block_tokens,
                             max_prompt_tokens=args.max_prompt_tokens,
                             max_output_tokens=args.max_output_tokens)
        _check_tokenizer(args.tokenizer)
        out = Path(args.out or time.strftime("rollout-%Y%m%d-%H%M%S"))
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            what = "a directory that holds files" if out.is_dir() else "a file"
            raise ValueError(f"--out {out}: {what} already; a rollout writes its report into "
                             "a new or empty directory: give another --out")
        options = Options(
            levels=args.levels, repetitions=args.repetitions, requests=args.requests,
            warmup_requests=args.warmup_requests, aa=args.aa, workload=args.workload,
            block_tokens=args.block_tokens, max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens, seed=args.seed, loadgen=executable,
            tokenizer=args.tokenizer, start_timeout=args.start_timeout,
            run_timeout=args.run_timeout, request_timeout=args.request_timeout,
            judge={"ttft_budget": args.ttft_budget, "itl_budget": args.itl_budget,
                   "confidence": args.confidence, "resamples": args.resamples,
                   "seed": args.seed, "min_requests": args.min_requests})
        session = Session(arms, options, out)  # checks the plan: no --out made for a bad one
        try:  # now, not after the servers started
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--out {out}: cannot create it ({exc.strerror})") from None
    except (ValueError, loadgen.LoadgenError) as exc:  # TraceError is a ValueError
        print(f"kvscope rollout: error: {exc}", file=sys.stderr)
        return 2
    interrupt_on_signals()  # SIGTERM and SIGHUP stop the arms and keep the runs, as Ctrl-C
    try:
        doc = session.run()
    except RolloutError as exc:
        print(f"kvscope rollout: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        written = [name for name in ("rollout.html", "rollout.json") if (out / name).exists()]
        partial = "partial " if "error" in session.doc else ""  # else: its runs were all in
        where = (f"{partial}results in {out}: {', '.join(written)}" if written
                 else "before it began: nothing to report")
        print(f"kvscope rollout: interrupted after {len(session.doc.get('runs', ()))} of "
              f"{len(session.steps)} runs ({where}); a rollout does not resume: run it again "
              "with another --out", file=sys.stderr)
        return 130
    for j in doc["judgements"]:
        print(f"{j['candidate']}: {j['verdict']['text']}")
    for name, why in doc.get("not_judged", {}).items():
        print(f"{name}: not judged: {why}")
    print(f"report: {out / 'rollout.html'} (data: {out / 'rollout.json'})")
    return 0
