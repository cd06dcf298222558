"""A rollout's arms: the servers it drives, started by a command when it owns them, and what
each run cost them, read from their metrics before and after it.

An arm is an OpenAI-compatible server (``url``, vLLM's or another's) and, optionally, the
kvscope agent beside it (``agent``) and the command that starts it (``command``, run in its
own process group, stopped with it). Hit quality and transfer cost per run come from the
agent's ``/metrics`` when the arm has one (prompt tokens by source, transfer bytes, blocks and
seconds both ways); otherwise from the server's own ``/metrics`` through the vLLM metrics
source's mapping (:class:`kvscope.agent.sources.vllm_metrics.MetricsMapper`: tokens by source,
untimed offload and promotion bytes). The prefill seconds come from vLLM's
``vllm:request_prefill_time_seconds`` either way. What neither reports stays empty: "not
measured", never 0.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvscope import events as ev
from kvscope.agent.sources.scrape import MAX_BODY, Samples, parse
from kvscope.agent.sources.vllm_metrics import MetricsMapper

HEALTH_POLL_S = 1.0
STOP_GRACE_S = 15.0
SCRAPE_TIMEOUT_S = 10.0
START_TIMEOUT_S = 600.0  # a server this rollout starts: loading a model takes minutes
RUNNING_TIMEOUT_S = 15.0  # a server that should be up already: no long wait


class ArmError(RuntimeError):
    """An arm's server could not be started, answered no longer, or died; the message says
    which arm and what to check."""


@dataclass
class Arm:
    """One arm: ``name``, ``url`` (the server's base URL, e.g. ``http://127.0.0.1:8000``; its
    ``/metrics`` and ``/health`` are read), ``agent`` (the kvscope agent's base URL, or None),
    ``command`` (shell command that starts the server, or None: already running) and
    ``health`` (the URL that answers 200 once it serves; default ``url + "/health"``)."""

    name: str
    url: str
    agent: str | None = None
    command: str | None = None
    health: str | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)
    log: Path | None = field(default=None, repr=False)  # the started server's output
    # whether the server has /metrics (found at start; a server without: not measured)
    metrics: bool = field(default=True, repr=False)

    @property
    def health_url(self) -> str:
        return self.health or self.url.rstrip("/") + "/health"

    def start(self, log: Path, timeout: float | None = None) -> None:
        """Start the command (if any), its output to ``log``, and wait until the health URL
        answers 200. Raises ArmError when the command exits or ``timeout`` seconds pass (None:
        :data:`START_TIMEOUT_S` for a command, :data:`RUNNING_TIMEOUT_S` for a server said to
        be running already), and before starting a command when the health URL answers
        already."""
        if timeout is None:
            timeout = START_TIMEOUT_S if self.command else RUNNING_TIMEOUT_S
        if self.command:
            if _ok(self.health_url):  # else that server would be measured, and ours fail
                raise ArmError(f"arm {self.name}: {self.health_url} answers before its --start "
                               "command ran: another server holds the port (one a stopped "
                               "rollout left?); stop it, or give the arm another port")
            self.log = log
            with open(log, "ab") as out:
                self.process = subprocess.Popen(
                    self.command, shell=True, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            if _ok(self.health_url):
                self.metrics = _ok(self.url.rstrip("/") + "/metrics")
                return
            if time.monotonic() > deadline:
                raise ArmError(f"arm {self.name}: {self.health_url} did not answer 200 within "
                               f"{timeout:.0f} s" + (f" (its log: {log})" if self.command else
                                                      "; is the server running?"))
            time.sleep(HEALTH_POLL_S)

    def check(self) -> None:
        """Raise ArmError if the arm's command has exited."""
        if self.process is not None and self.process.poll() is not None:
            last = _last_line(self.log)
            raise ArmError(f"arm {self.name}: its server command exited with code "
                           f"{self.process.returncode}" + (f", its last words: {last!r}"
                                                           if last else "") +
                           f" (its log: {self.log}): {shlex.quote(self.command or '')}")

    def stop(self) -> None:
        """Stop every process of the command's process group: SIGTERM, then SIGKILL to what
        is left after a grace period. It waits for the group, not only for the shell that
        leads it: ``sh -c`` exits at SIGTERM at once, while a vLLM server still starting up
        may hang on it (a rollout interrupted then left the server running)."""
        proc, self.process = self.process, None
        if proc is None:
            return
        for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            if _group_gone(proc, grace):
                return

    def snapshot(self) -> tuple[Samples, Samples | None]:
        """The server's metrics now (empty when it has no ``/metrics``) and the agent's (None
        when the arm has none). Raises ArmError when one cannot be read."""
        return (_scrape(self.url, self.name) if self.metrics else {},
                _scrape(self.agent, f"{self.name}'s agent") if self.agent else None)


def _group_gone(leader: subprocess.Popen, timeout: float) -> bool:
    """Whether the process group ``leader`` leads has no process left within ``timeout``
    seconds (polled every 0.1 s). The leader is reaped meanwhile: unreaped, it stays in its
    group as a zombie."""
    deadline = time.monotonic() + timeout
    while True:
        leader.poll()
        try:
            os.killpg(leader.pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _last_line(path: Path | None) -> str:
    """The last non-empty line of the file at ``path`` (at most 300 characters), or ""."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
    except (OSError, TypeError):
        return ""
    return lines[-1][-300:] if lines else ""


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def _scrape(base: str, who: str) -> Samples:
    url = base.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as r:
            body = r.read(MAX_BODY + 1)
    except (OSError, ValueError) as exc:
        raise ArmError(f"{who}: cannot read {url}: {exc}") from None
    if len(body) > MAX_BODY:
        raise ArmError(f"{who}: {url} is over {MAX_BODY >> 20} MiB")
    return parse(body.decode("utf-8", "replace"))


def _increase(before: Samples, after: Samples, name: str) -> dict[frozenset, float]:
    """Each series of ``name`` in ``after``: its increase since ``before`` (a reset: its
    value)."""
    out = {}
    for (n, labels), value in after.items():
        if n == name:
            last = before.get((n, labels), 0.0)
            out[labels] = value if value < last else value - last
    return out


@dataclass(frozen=True)
class Cost:
    """What one run cost an arm: ``tokens`` (dict[source, prompt tokens]; empty: not
    measured), ``transfer_bytes`` / ``transfer_blocks`` (dict["src->dst", int]),
    ``transfer_seconds`` (dict["src->dst", float]; empty when only untimed bytes were seen),
    ``transfer_failures`` (None: not measured: the server's metrics count none, or the
    agent's sources cannot see a copy fail), ``failures_unmeasured`` (the directions the
    agent counted bytes of but no failures: its sources there cannot see a copy fail) and
    ``prefill_seconds`` (0: not reported). ``source``: where it was read (``agent``,
    ``server`` or ``none``). ``promotion_wait``: the agent's histogram of the requests' waits
    for promotions over the run, ``{"bounds": upper bounds in seconds, "counts": per bucket,
    the last +Inf, "sum": seconds}``; None without an agent or a finished request."""

    tokens: dict[str, int]
    transfer_bytes: dict[str, int]
    transfer_blocks: dict[str, int]
    transfer_seconds: dict[str, float]
    transfer_failures: int | None
    prefill_seconds: float
    source: str
    promotion_wait: dict | None = None
    failures_unmeasured: tuple[str, ...] = ()


def _waits(before: Samples, after: Samples) -> dict | None:
    """The increase of the agent's ``kvscope_promotion_wait_seconds`` (see :class:`Cost`)."""
    name = "kvscope_promotion_wait_seconds"
    cumulative = sorted((float(dict(labels)["le"]), v) for labels, v in
                        _increase(before, after, name + "_bucket").items() if "le" in dict(labels))
    if not cumulative or not cumulative[-1][1]:
        return None
    counts = [c - (cumulative[i - 1][1] if i else 0.0) for i, (_, c) in enumerate(cumulative)]
    return {"bounds": [b for b, _ in cumulative[:-1]], "counts": counts,
            "sum": sum(_increase(before, after, name + "_sum").values())}


def _failures(before: Samples, after: Samples) -> tuple[int | None, set[str]]:
    """Transfers the agent saw fail over the run, None where it exports no failure series
    (its sources cannot see a copy fail: KV events, scraped byte counters); and the
    directions ("src->dst") it has failure series of."""
    failed = _increase(before, after, "kvscope_transfer_failures_total")
    seen = {f"{d.get('src')}->{d.get('dst')}" for d in map(dict, failed)}
    return (int(sum(failed.values())) if failed else None), seen


def cost(before: tuple[Samples, Samples | None], after: tuple[Samples, Samples | None]
         ) -> Cost:
    """The :class:`Cost` of a run from :meth:`Arm.snapshot` before and after it."""
    (server0, agent0), (server1, agent1) = before, after
    prefill = sum(_increase(server0, server1, "vllm:request_prefill_time_seconds_sum").values())
    if agent0 is not None and agent1 is not None:
        def by(name: str, key: str = "src") -> dict[str, float]:
            out: dict[str, float] = {}
            for labels, v in _increase(agent0, agent1, name).items():
                d = dict(labels)
                k = d.get("source", "") if key == "source" else f"{d.get('src')}->{d.get('dst')}"
                if v:
                    out[k] = out.get(k, 0.0) + v
            return out

        moved = {k: int(v) for k, v in by("kvscope_transfer_bytes_total").items()}
        failed, seen = _failures(agent0, agent1)
        return Cost({k: int(v) for k, v in by("kvscope_prompt_tokens_total", "source").items()},
                    moved, {k: int(v) for k, v in by("kvscope_transfer_blocks_total").items()},
                    by("kvscope_transfer_seconds_sum"), failed, prefill, "agent",
                    _waits(agent0, agent1),
                    tuple(sorted(set(moved) - seen)) if failed is not None else ())
    mapper = MetricsMapper(stores=True, gpu_snapshot=False)
    mapper.map(server0, 0.0)  # the baselines
    tokens: dict[str, int] = {}
    moved: dict[str, int] = {}
    blocks: dict[str, int] = {}
    for e in mapper.map(server1, 1.0):
        if isinstance(e, ev.Lookup):
            for k, v in e.tokens.items():
                tokens[k] = tokens.get(k, 0) + v
        elif isinstance(e, ev.Transfer) and e.ok and e.bytes:
            d = f"{e.src}->{e.dst}"
            moved[d] = moved.get(d, 0) + e.bytes
            if e.blocks:  # 0: bytes without a block size, not measured
                blocks[d] = blocks.get(d, 0) + e.blocks
    return Cost(tokens, moved, blocks, {}, None, prefill, "server" if tokens else "none")
