"""The load generator a rollout drives: guidellm (vLLM's own, https://github.com/vllm-project/
guidellm), run as a command, one run per arm, concurrency level and repetition.

Each run sends a JSON-lines file of prompts (:mod:`kvscope.rollout.workload`) to the server's
``/v1/completions`` at a fixed concurrency (guidellm's ``concurrent`` profile: ``level``
streams, each sending its next request when the last one finished) until ``requests`` have been
sent, and writes guidellm's JSON report, from which :func:`read_report` takes every
successful request's TTFT, mean inter-token latency and end-to-end latency (seconds), and
guidellm's own percentiles of them beside.

guidellm lives in its own environment (``scripts/vllm_env.sh --guidellm`` builds one in the
cache, with the CPU torch), never in kvscope's: it pins its own transformers and torch.
:func:`find` looks for it there, then on ``PATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

GUIDELLM_VERSION = "0.8.1"
TORCH_VERSION = "2.13.0"
CACHE = Path(os.environ.get("KVSCOPE_CACHE", "/var/cache/kvscope"))
CACHED = CACHE / f"guidellm-{GUIDELLM_VERSION}-torch-{TORCH_VERSION}" / "bin" / "guidellm"
PERCENTILES = ("p50", "p95", "p99")


class LoadgenError(RuntimeError):
    """The load generator is missing, failed or wrote no report; the message says what to
    do."""


def find(explicit: str | None = None) -> str:
    """The guidellm executable: ``explicit`` if given, else the cached environment's, else
    ``guidellm`` on PATH. Raises LoadgenError naming how to get one."""
    for candidate in ([explicit] if explicit else [str(CACHED), shutil.which("guidellm")]):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise LoadgenError(
        (f"load generator {explicit} is not an executable file" if explicit else
         f"guidellm not found (looked at {CACHED} and PATH)") +
        ": build it with `bash scripts/vllm_env.sh --guidellm`, or give --loadgen PATH")


@dataclass(frozen=True)
class LoadResult:
    """One run's successful requests: ``ttft``, ``itl`` (mean inter-token latency of requests
    with 2 output tokens or more), ``e2e`` (request latency), all seconds, in completion
    order; ``prompt_tokens`` and ``output_tokens`` per request, and when each was sent and
    ended (``started``, ``ended``: Unix seconds); ``errors``: requests that failed or were cut
    off; ``percentiles``: guidellm's own, ``{metric: {"p50", "p95", "p99"}}``
    in seconds, for ``ttft``, ``itl`` and ``e2e``; ``unsent``: requests of the run's limit
    (``max_requests``) its report lists nowhere: made and cancelled before sending them when
    the limit stopped the run (counted in ``scheduler_metrics.requests_made.incomplete``;
    guidellm 0.8.1's ``benchmark/schemas/accumulator.py``: "cancelled before starting"), or
    created and never processed (seen once: 24 created, 23 listed, ``dataset_incomplete``)."""

    ttft: list[float]
    itl: list[float]
    e2e: list[float]
    prompt_tokens: list[int]
    output_tokens: list[int]
    started: list[float]
    ended: list[float]
    errors: int
    percentiles: dict[str, dict[str, float]] = field(default_factory=dict)
    unsent: int = 0


# guidellm's report: metric -> (per-request field, summary metric, seconds per unit)
_FIELDS = {"ttft": ("time_to_first_token_ms", "time_to_first_token_ms", 1e-3),
           "itl": ("inter_token_latency_ms", "inter_token_latency_ms", 1e-3),
           "e2e": ("request_latency", "request_latency", 1.0)}


def read_report(path: str | Path) -> LoadResult:
    """The one benchmark of guidellm's JSON report at ``path`` as a :class:`LoadResult`.
    Raises LoadgenError when it is missing, malformed or holds other than one benchmark."""
    try:
        doc = json.loads(Path(path).read_text())
        (bench,) = doc["benchmarks"]
        requests = bench["requests"]
        ok = sorted(requests["successful"], key=lambda r: r.get("request_end_time") or 0)
        out: dict[str, list[float]] = {k: [] for k in _FIELDS}
        for r in ok:
            for metric, (name, _, unit) in _FIELDS.items():
                value = r.get(name)
                if value is not None and (metric != "itl" or (r.get("output_tokens") or 0) > 1):
                    out[metric].append(float(value) * unit)
        percentiles = {}
        for metric, (_, summary, unit) in _FIELDS.items():
            cells = bench["metrics"][summary]["successful"]
            if cells.get("count"):
                percentiles[metric] = {p: cells["percentiles"][p] * unit for p in PERCENTILES}
        cut_off = len(requests.get("incomplete") or [])
        errors = len(requests.get("errored") or []) + cut_off
        # guidellm counts every cancelled request, and lists those that had started
        made = (bench.get("scheduler_metrics") or {}).get("requests_made") or {}
        unsent = max(0, int(made.get("incomplete") or 0) - cut_off)
        limit = (((bench.get("config") or {}).get("constraints") or {})
                 .get("max_requests") or {}).get("args", {}).get("count")
        if isinstance(limit, int):  # what the run asked for, less what the report lists
            unsent = max(unsent, limit - len(ok) - errors)
        return LoadResult(out["ttft"], out["itl"], out["e2e"],
                          [int(r.get("prompt_tokens") or 0) for r in ok],
                          [int(r.get("output_tokens") or 0) for r in ok],
                          [float(r["request_start_time"]) for r in ok],
                          [float(r["request_end_time"]) for r in ok], errors, percentiles,
                          unsent)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoadgenError(f"{path}: not a guidellm report of one benchmark ({exc!r})") from None


def command(executable: str, *, target: str, tokenizer: str | None, level: int,
            requests: int, data: str | Path, report: str | Path, seed: int,
            request_timeout: float) -> list[str]:
    """The guidellm command line of one run (see the module). ``request_timeout``: seconds a
    request may wait for the server's next bytes; without it guidellm 0.8.1 can wait forever
    on the streams of a server that died."""
    argv = [executable, "run",
            "--backend", f"kind=openai_http,target={target},request_format=/v1/completions,"
                         f"timeout={request_timeout:g}",
            "--profile", f"kind=concurrent,streams={level}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--data", f"kind=json_file,path={data}",
            "--seed", f"kind=static,value={seed}",
            "--output", f"kind=json,path={report}",
            "--disable-console-interactive"]
    if tokenizer:
        argv[4:4] = ["--tokenizer", f"kind=hf_auto,model={tokenizer}"]
    return argv


def run(argv: list[str], *, report: str | Path, log: str | Path, timeout: float) -> LoadResult:
    """Run one guidellm command (stdin closed, output to ``log``) and read its report. Raises
    LoadgenError when it fails, runs past ``timeout`` seconds (then it is killed) or writes no
    report; the message holds the log's last lines."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise LoadgenError(f"guidellm ran past {timeout:.0f} s and was stopped; its log: "
                               f"{log}") from None
        except BaseException:  # the rollout interrupted: guidellm, in its own session, ran on
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if rc != 0 or not Path(report).is_file():
        lines = Path(log).read_text(errors="replace").strip().splitlines()[-3:]
        raise LoadgenError(f"guidellm exited with code {rc}" + (
            "" if Path(report).is_file() else " and wrote no report") + f" (log {log}): "
            + " | ".join(lines))
    return read_report(report)
