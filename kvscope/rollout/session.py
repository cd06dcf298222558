"""One rollout session, unattended: start the arms that have a command, warm each up, run the
plan (:mod:`kvscope.rollout.plan`) through the load generator with the host sampled and each
arm's metrics read around every run, then judge and write the report.

Every finished run is written to ``rollout.json`` at once, so that a session that stops early
(an arm that dies or stops answering, a load generator that fails) keeps what it measured: the
report is then written from the runs that finished, with the error in it, and
:class:`RolloutError` carries the one line to print. An interruption (Ctrl-C, SIGTERM, SIGHUP)
stops the arms and writes that report too (error ``"interrupted"``), then goes on as
KeyboardInterrupt.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from kvscope import __version__
from kvscope.analysis.bootstrap import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES
from kvscope.analysis.compare import Budget, RequestSample
from kvscope.engine.workload import TraceError
from kvscope.rollout import loadgen, report, workload
from kvscope.rollout.arms import Arm, ArmError, cost
from kvscope.rollout.host import HostSampler
from kvscope.rollout.judge import judge
from kvscope.rollout.plan import Step, plan, streams
from kvscope.signals import ignore_signals_while_exiting, stop_on_signals

SEED_STRIDE = 1_000_003  # runs of one session get seeds seed * stride + index: never shared


class RolloutError(RuntimeError):
    """The session stopped early; the partial report is written (``report`` its directory)."""


@dataclass
class Options:
    """What a session runs: concurrency ``levels``, ``repetitions``, ``requests`` per run,
    ``warmup_requests`` per arm before the first run (0: none), ``aa`` (the A/A pair),
    ``workload`` (``"mixed"`` or a Mooncake trace), ``block_tokens``, ``max_prompt_tokens``,
    ``max_output_tokens``, ``seed``; the load generator's ``loadgen`` executable and
    ``tokenizer`` (a directory or model name, or None); ``start_timeout`` (None: each arm's
    default, :meth:`~kvscope.rollout.arms.Arm.start`), ``run_timeout`` and
    ``request_timeout`` (seconds); ``judge``: :func:`kvscope.rollout.judge.judge`'s options (budgets, resamples,
    confidence, min_requests)."""

    levels: list[int]
    repetitions: int
    requests: int
    warmup_requests: int
    aa: bool
    workload: str
    block_tokens: int
    max_prompt_tokens: int
    max_output_tokens: int
    seed: int
    loadgen: str
    tokenizer: str | None
    start_timeout: float | None
    run_timeout: float
    request_timeout: float
    judge: dict


def _loadgen_version(executable: str) -> str:
    try:
        out = subprocess.run([executable, "--version"], capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.strip().rsplit(" ", 1)[-1] or "unknown"


def _sample(run: dict) -> RequestSample:
    c = run["cost"]
    return RequestSample(run["slot"], run["ttft"], run["itl"], tokens=c["tokens"],
                         transfer_bytes=c["transfer_bytes"], transfer_blocks=c["transfer_blocks"],
                         transfer_seconds=c["transfer_seconds"],
                         transfer_failures=c["transfer_failures"],
                         failures_unmeasured=tuple(c.get("failures_unmeasured", ())),
                         prefill_seconds=c["prefill_seconds"],
                         promotion_waits=c.get("promotion_wait"),
                         # the agent counts every source; vLLM's own metrics gpu and
                         # recompute only, the rest not measured (it read cpu 0%)
                         token_sources=None if c["source"] == "agent" else tuple(c["tokens"]),
                         # neither an agent nor the server's metrics: nothing counted them
                         transfers_measured=c["source"] != "none",
                         # failed or cut off (not the unsent); a report from before: None
                         failed_requests=run.get("errors"))


class Session:
    """A rollout of ``arms`` (the first is the baseline) with ``options``, writing into
    ``directory``; ``progress`` gets one line per step (default: stderr)."""

    def __init__(self, arms: list[Arm], options: Options, directory: str | Path,
                 progress: Callable[[str], None] | None = None) -> None:
        self.arms = {a.name: a for a in arms}
        self.baseline = arms[0].name
        self.options = options
        self.directory = Path(directory)
        self.steps = plan([a.name for a in arms], options.levels, options.repetitions,
                          options.aa)
        self.progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
        self.doc: dict = {}

    def _say(self, text: str) -> None:
        self.progress(f"[rollout] {text}")

    def _load(self, arm: Arm, level: int, requests: int, seed: int, name: str
              ) -> tuple[loadgen.LoadResult, list[str]]:
        o = self.options
        rows = workload.prompts(o.workload, requests, seed, block_tokens=o.block_tokens,
                                max_prompt_tokens=o.max_prompt_tokens,
                                max_output_tokens=o.max_output_tokens)
        data = self.directory / "data" / f"{name}.jsonl"
        workload.write_jsonl(data, rows)
        out = self.directory / "loadgen" / f"{name}.json"
        argv = loadgen.command(o.loadgen, target=arm.url, tokenizer=o.tokenizer, level=level,
                               requests=requests, data=data, report=out, seed=seed,
                               request_timeout=o.request_timeout)
        return loadgen.run(argv, report=out, log=self.directory / "logs" / f"{name}.log",
                           timeout=o.run_timeout), argv

    def _run(self, step: Step) -> dict:
        arm = self.arms[step.arm]
        arm.check()
        seed = self.options.seed * SEED_STRIDE + step.index
        before = arm.snapshot()
        started = time.time()
        with HostSampler() as host:
            try:
                result, argv = self._load(arm, step.level, self.options.requests, seed,
                                          f"run-{step.index + 1:03d}")
            except loadgen.LoadgenError as exc:
                arm.check()  # a server that died is the cause to name
                raise loadgen.LoadgenError(f"run {step.index + 1} ({step.slot} at "
                                           f"{streams(step.level)}): {exc}") from None
        elapsed = time.time() - started
        arm.check()
        spent = cost(before, arm.snapshot())
        run = {"index": step.index, "slot": step.slot, "arm": step.arm, "level": step.level,
               "rep": step.rep, "seed": seed, "started": started, "elapsed_s": elapsed,
               "ttft": result.ttft, "itl": result.itl, "e2e": result.e2e,
               "prompt_tokens": result.prompt_tokens, "output_tokens": result.output_tokens,
               "started_at": result.started, "ended_at": result.ended,
               "errors": result.errors, "unsent": result.unsent,
               "loadgen_percentiles": result.percentiles,
               "cost": vars(spent), "host": host.summary(), "command": argv}
        if spent.source == "agent" and result.ttft and not spent.tokens:  # a wrong --agent?
            run["warning"] = (f"{arm.name}'s agent ({arm.agent}) counted no prompt tokens in a "
                              f"run of {len(result.ttft)} requests: is it the agent beside "
                              f"{arm.url}? Its hit quality reads not measured")
            self._say(f"warning: {run['warning']}")
        return run

    def run(self) -> dict:
        """Run the session; return the report's document. Raises RolloutError (after writing
        the partial report) when it stops early, KeyboardInterrupt (after the same) when
        interrupted."""
        o = self.options
        for sub in ("data", "loadgen", "logs"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        self.doc = {
            "meta": {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "kvscope": __version__, "python": platform.python_version(),
                     "platform": platform.platform(), "argv": sys.argv,
                     "loadgen": {"executable": o.loadgen,
                                 "guidellm": _loadgen_version(o.loadgen)},
                     "options": {k: v for k, v in vars(o).items() if k != "judge"},
                     "budgets": {k: _budget_json(v) for k, v in o.judge.items()
                                 if "budget" in k}},
            "arms": [{"name": a.name, "url": a.url, "agent": a.agent, "command": a.command,
                      "health": a.health_url} for a in self.arms.values()],
            "baseline": self.baseline, "levels": sorted(o.levels),
            "repetitions": o.repetitions, "planned_runs": len(self.steps), "runs": [],
            "judgements": [], "tails": {}}
        error, interrupted = None, False
        try:
            for i, arm in enumerate(self.arms.values()):
                self._say(f"starting {arm.name}: waiting for {arm.health_url}" if arm.command
                          else f"waiting for {arm.name} at {arm.health_url}")  # no --start
                arm.start(self.directory / "logs" / f"server-{i + 1}.log", o.start_timeout)
                arm.snapshot()  # an --agent that cannot be read fails now, not after a run
            for i, arm in enumerate(self.arms.values()):
                if o.warmup_requests:
                    self._say(f"warming up {arm.name} ({o.warmup_requests} requests)")
                    self._load(arm, 1, o.warmup_requests,
                               o.seed * SEED_STRIDE + len(self.steps) + i, f"warmup-{i + 1}")
            first = time.time()  # the runs' mean time so far estimates the rest
            for n, step in enumerate(self.steps):
                done = time.time() - t0
                left = (f", about {(time.time() - first) / n * (len(self.steps) - n):.0f} s "
                        "left" if n else "")
                self._say(f"run {n + 1}/{len(self.steps)}: {step.slot} at {streams(step.level)}, "
                          f"repetition {step.rep + 1}/{o.repetitions} ({done:.0f} s{left})")
                self.doc["runs"].append(self._run(step))
                report.write_json(self.directory, self.doc)
        except (ArmError, loadgen.LoadgenError, TraceError, ValueError, OSError) as exc:
            error = str(exc)
            self.doc["error"] = error
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP (signals.interrupt_on_signals)
            interrupted = True
            self.doc["error"] = "interrupted"
            self._say("interrupted: stopping the arms, writing the report of the finished runs")
        finally:
            # From here a signal is noted, not obeyed: one that cut the servers' stop short left
            # a server running and the report unwritten. The finished runs are judged.
            signalled = threading.Event()
            stop_on_signals(signalled)
            if any(arm.command for arm in self.arms.values()):
                self._say("stopping the servers it started")
            for arm in self.arms.values():
                arm.stop()
        self._finish(time.time() - t0)
        ignore_signals_while_exiting()
        if interrupted or signalled.is_set():
            raise KeyboardInterrupt
        if error:
            raise RolloutError(f"{error} (partial results in {self.directory})")
        return self.doc

    def _finish(self, elapsed: float) -> None:
        o = self.options
        runs = self.doc["runs"]
        self.doc["meta"]["elapsed_s"] = elapsed
        self.doc["tails"] = report.tails(
            runs, resamples=o.judge.get("resamples", DEFAULT_RESAMPLES),
            confidence=o.judge.get("confidence", DEFAULT_CONFIDENCE), seed=o.judge.get("seed", 0))
        steps = {s.index: s for s in self.steps}
        results = [(steps[r["index"]], _sample(r)) for r in runs]
        for name in list(self.arms)[1:]:
            try:
                j = judge(results, self.baseline, name, aa=o.aa, **o.judge)
            except ValueError as exc:  # an arm without a finished run: say so, judge the rest
                self.doc.setdefault("not_judged", {})[name] = str(exc)
                continue
            self.doc["judgements"].append(report.judgement_dict(j))
        report.write(self.directory, self.doc)


def _budget_json(budget: Budget | None) -> dict | None:
    """A budget in rollout.json: null (none given), ``{"seconds": S}`` or ``{"relative": R}``
    (0.1: the baseline's p99 plus 10%)."""
    return None if budget is None else {k: v for k, v in asdict(budget).items()
                                        if v is not None}
