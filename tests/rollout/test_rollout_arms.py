"""What a run cost an arm (kvscope.rollout.arms.cost), from its metrics before and after: the
agent's when it has one, else vLLM's own; what neither reports stays empty (not measured). And
stopping an arm's server."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from kvscope.agent.sources.scrape import parse
from kvscope.rollout.arms import Arm, cost

AGENT = """kvscope_prompt_tokens_total{{source="gpu"}} {gpu}
kvscope_prompt_tokens_total{{source="cpu"}} {cpu}
kvscope_prompt_tokens_total{{source="recompute"}} {re}
kvscope_transfer_bytes_total{{src="gpu",dst="cpu"}} {store}
kvscope_transfer_bytes_total{{src="cpu",dst="gpu"}} {load}
kvscope_transfer_blocks_total{{src="gpu",dst="cpu"}} {store_blocks}
kvscope_transfer_seconds_sum{{src="gpu",dst="cpu"}} {store_s}
kvscope_transfer_failures_total{{src="cpu",dst="gpu",reason="unknown"}} {failed}
"""
VLLM = """vllm:prompt_tokens_total{{engine="0"}} {prompt}
vllm:prefix_cache_hits_total{{engine="0"}} {hits}
vllm:request_prefill_time_seconds_sum{{engine="0"}} {prefill}
"""


def test_an_arm_with_an_agent_costs_its_counters_increases():
    """Before: 100 gpu, 0 cpu, 50 recompute tokens; 4096 B stored in 1 block in 0.5 s. After:
    160 / 32 / 90; 12288 B in 3 blocks in 0.75 s, 2048 B loaded, one failed load. By hand:
    tokens gpu 60, cpu 32, recompute 40; gpu->cpu 8192 B, 2 blocks, 0.25 s; cpu->gpu 2048 B;
    1 failure, and the stores' failures not measured (no failure series of gpu->cpu: a
    source blind to them stored); prefill 3.5 - 1.25 = 2.25 s from vLLM."""
    before = (parse(VLLM.format(prompt=150, hits=100, prefill=1.25)), parse(AGENT.format(
        gpu=100, cpu=0, re=50, store=4096, load=0, store_blocks=1, store_s=0.5, failed=0)))
    after = (parse(VLLM.format(prompt=282, hits=160, prefill=3.5)), parse(AGENT.format(
        gpu=160, cpu=32, re=90, store=12288, load=2048, store_blocks=3, store_s=0.75,
        failed=1)))
    c = cost(before, after)
    assert c.source == "agent"
    assert c.tokens == {"gpu": 60, "cpu": 32, "recompute": 40}
    assert c.transfer_bytes == {"gpu->cpu": 8192, "cpu->gpu": 2048}
    assert c.transfer_blocks == {"gpu->cpu": 2}
    assert c.transfer_seconds == {"gpu->cpu": 0.25}
    assert (c.transfer_failures, c.prefill_seconds) == (1, 2.25)
    assert c.failures_unmeasured == ("gpu->cpu",)


def test_an_agent_blind_to_failed_copies_does_not_count_none_failed():
    """An agent whose sources cannot see a copy fail (KV events: it exports no failure series)
    has not measured the arm's failed transfers: None, where a sum over no series read 0."""
    blind = "".join(line + "\n" for line in AGENT.splitlines() if "failures" not in line)
    counters = dict(gpu=1, cpu=1, re=1, store=1, load=1, store_blocks=1, store_s=1)
    before = (parse(VLLM.format(prompt=1, hits=1, prefill=1.0)), parse(blind.format(**counters)))
    after = (parse(VLLM.format(prompt=2, hits=1, prefill=2.0)),
             parse(blind.format(**{**counters, "cpu": 2, "load": 4096})))
    c = cost(before, after)
    assert (c.source, c.transfer_bytes) == ("agent", {"cpu->gpu": 4095})
    assert c.transfer_failures is None


def test_an_arm_without_an_agent_costs_vllms_prefix_cache_counters():
    """vLLM's prompt tokens 150 -> 282 (+132) with prefix-cache hits 100 -> 160 (+60): gpu 60,
    recompute 72; no transfer seen, so none (not 0 seconds: not measured); vLLM counts no
    failed transfers: not measured (None), not 0."""
    before = (parse(VLLM.format(prompt=150, hits=100, prefill=1.0)), None)
    after = (parse(VLLM.format(prompt=282, hits=160, prefill=2.0)), None)
    c = cost(before, after)
    assert c.source == "server"
    assert c.tokens == {"gpu": 60, "recompute": 72}
    assert (c.transfer_bytes, c.transfer_seconds, c.prefill_seconds) == ({}, {}, 1.0)
    assert c.transfer_failures is None


def test_a_server_without_prefix_cache_counters_measures_nothing():
    c = cost((parse("other_metric 1\n"), None), (parse("other_metric 2\n"), None))
    assert (c.source, c.tokens, c.prefill_seconds) == ("none", {}, 0.0)


def _waits(le_001: int, le_01: int, total: int, seconds: float) -> str:
    """The agent's promotion-wait histogram, cumulative as exposed."""
    name = "kvscope_promotion_wait_seconds"
    return (f'{name}_bucket{{le="0.001"}} {le_001}\n{name}_bucket{{le="0.01"}} {le_01}\n'
            f'{name}_bucket{{le="+Inf"}} {total}\n{name}_count {total}\n{name}_sum {seconds}\n')


def test_the_agents_promotion_waits_give_the_arms_mean_and_p99():
    """The run adds 100 waits: 90 of them <= 1 ms, 9 in (1, 10] ms, 1 above 10 ms, 0.15 s in
    all (the histogram before: 10 <= 1 ms, 0.01 s). Mean 0.15 / 100 = 1.5 ms; p99 by PromQL's
    histogram_quantile: rank 99 is the 9th of 9 in (1, 10] ms, so 10 ms. The rollout said
    "promotion wait not measured" though the agent measured it; an arm without an agent still
    says so."""
    from kvscope.analysis.compare import RequestSample, compare
    from kvscope.rollout.judge import pooled

    server = parse(VLLM.format(prompt=0, hits=0, prefill=0))
    before = (server, parse(_waits(10, 10, 10, 0.01)))
    after = (server, parse(_waits(100, 109, 110, 0.16)))
    waits = cost(before, after).promotion_wait
    assert waits == {"bounds": [0.001, 0.01], "counts": [90, 9, 1],
                     "sum": pytest.approx(0.15)}
    ttft = np.full(100, 0.05)
    # two runs of one arm pooled: the counts add up, the mean and p99 stay
    halves = [{**waits, "counts": [45, 4.5, 0.5], "sum": 0.075}] * 2
    agent = pooled([RequestSample("cpu", ttft, promotion_waits=h) for h in halves], "cpu")
    plain = RequestSample("base", ttft)
    c = compare(plain, agent, ttft_budget=None, resamples=100)
    assert c.candidate.promotion_wait_mean == pytest.approx(0.0015)
    assert c.candidate.promotion_wait_p99 == pytest.approx(0.01)
    assert c.baseline.promotion_wait_mean is None and c.baseline.promotion_wait_p99 is None
    assert cost((server, None), (server, None)).promotion_wait is None


def test_stopping_an_arm_stops_its_server_when_the_shell_that_started_it_exits_first(
        tmp_path, monkeypatch):
    """``--start`` runs through ``sh -c``, which SIGTERM ends at once; a server that outlives
    it (here one that ignores SIGTERM, as a vLLM server still starting up can hang on it) must
    not be left running: stop() waits for the whole process group and SIGKILLs what is left."""
    monkeypatch.setattr("kvscope.rollout.arms.STOP_GRACE_S", 1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pidfile = tmp_path / "server.pid"
    server = ("import http.server, os, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
              f"http.server.HTTPServer(('127.0.0.1', {port}), "
              "http.server.SimpleHTTPRequestHandler).serve_forever()")
    arm = Arm("base", f"http://127.0.0.1:{port}", health=f"http://127.0.0.1:{port}/",
              command=f"{sys.executable} -c \"{server}\" & wait")
    arm.start(tmp_path / "base.log", timeout=60)
    pid = int(pidfile.read_text())
    stat = Path(f"/proc/{pid}/stat")
    try:
        arm.stop()
        # gone, or a zombie its new parent has not reaped yet: no longer running either way
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    finally:  # a failing stop() must not leave the server behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_running_servers_arm_waits_the_start_timeout_given(tmp_path, monkeypatch):
    """A server started outside the rollout, still loading its model: the arm waited at most
    RUNNING_TIMEOUT_S (15 s; 1 here) whatever --start-timeout said. Here the server answers
    after 3 s: a timeout of 60 given, the arm waits for it; none given, the default (1 s) ends
    the wait first, naming it."""
    import http.server
    import threading

    from kvscope.rollout.arms import ArmError

    monkeypatch.setattr("kvscope.rollout.arms.RUNNING_TIMEOUT_S", 1.0)
    monkeypatch.setattr("kvscope.rollout.arms.HEALTH_POLL_S", 0.1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    arm = Arm("base", f"http://127.0.0.1:{port}", health=f"http://127.0.0.1:{port}/")
    with pytest.raises(ArmError, match=r"did not answer 200 within 1 s; is the server running"):
        arm.start(tmp_path / "base.log")
    server = http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler,
                                    bind_and_activate=False)  # the port closed until it serves
    serving = threading.Event()

    def serve():
        server.server_bind()
        server.server_activate()
        serving.set()
        server.serve_forever()

    later = threading.Timer(3.0, serve)
    later.start()
    try:
        arm.start(tmp_path / "base.log", timeout=60)
        assert serving.is_set()
    finally:
        later.cancel()
        if serving.wait(10):
            server.shutdown()
        server.server_close()
