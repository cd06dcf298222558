"""The vLLM worker tap's bookkeeping and mapping (kvscope.agent.taps.worker_events), without vLLM.

TapWorker (kvscope.agent.taps.vllm) is the vLLM shell around this observer; it is tested with
vLLM in tests/agent/test_vllm_tap.py and tests/agent/test_vllm_managers.py, and bench/gpu_check.py runs the
observer on a GPU's CUDA-event-timed copies.
"""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from types import SimpleNamespace

from conftest import REPO_ROOT
from kvscope import events as ev
from kvscope.agent.taps.worker_events import WorkerObserver

ROOT = REPO_ROOT


def result(job_id: int, success: bool, transfer_size: int | None = None,
           transfer_time: float | None = None) -> SimpleNamespace:
    """vLLM's ``TransferResult`` fields, read by attribute."""
    return SimpleNamespace(job_id=job_id, success=success, transfer_size=transfer_size,
                           transfer_time=transfer_time)


def spec(*blocks: int) -> SimpleNamespace:
    return SimpleNamespace(block_ids=list(blocks))


def observer(**kwargs) -> tuple[WorkerObserver, list]:
    sent: list = []
    clock = iter(range(100, 200)).__next__  # submit times 100, 101, ...
    return WorkerObserver(sent.append, clock=lambda: float(clock()), **kwargs), sent


def test_a_store_and_a_load_become_transfers_with_the_workers_figures():
    obs, sent = observer()
    obs.submitted(1, "gpu", "cpu", spec(0, 1, 2))
    obs.submitted(2, "cpu", "gpu", spec(5, 6), "req-1")
    obs.finished([result(2, True, 4096, 0.25), result(1, True, 6144, 0.5)])
    assert sent == [
        ev.Transfer(ts=101.0, src="cpu", dst="gpu", blocks=2, bytes=4096, duration=0.25,
                    request_id="req-1"),
        ev.Transfer(ts=100.0, src="gpu", dst="cpu", blocks=3, bytes=6144, duration=0.5),
    ]
    assert obs.errors == 0
    obs.finished([result(1, True, 6144, 0.5)])  # a job is reported once
    assert len(sent) == 2


def test_untimed_and_failed_results():
    obs, sent = observer()
    for job_id in (1, 2, 3):
        obs.submitted(job_id, "gpu", "cpu", spec(0))
    obs.finished([result(1, True), result(2, True, 512, None), result(3, False, 512, 0.1)])
    untimed, no_time, failed = sent
    assert (untimed.timed, untimed.bytes, untimed.duration, untimed.ok) == (False, 0, 0.0, True)
    assert (no_time.timed, no_time.bytes, no_time.duration) == (False, 512, 0.0)
    assert (failed.ok, failed.reason, failed.timed, failed.bytes) == (False, "unknown", True, 512)
    assert obs.errors == 0


def test_results_of_jobs_not_seen_are_skipped():
    obs, sent = observer()
    obs.finished([result(7, True, 1, 0.1)])
    assert sent == [] and obs.errors == 0


def test_jobs_never_heard_back_about_are_bounded_and_counted():
    obs, sent = observer(max_jobs=2)
    for job_id in (1, 2, 3, 4):
        obs.submitted(job_id, "gpu", "cpu", spec(job_id))
    assert obs.errors == 2  # jobs 1 and 2 forgotten, oldest first
    obs.finished([result(job_id, True, 8, 0.1) for job_id in (1, 2, 3, 4)])
    assert [t.blocks for t in sent] == [1, 1] and [t.ts for t in sent] == [102.0, 103.0]


def test_never_raises_counts_and_logs_the_first_failure_under_vllms_logger(caplog):
    obs, sent = observer()
    caplog.set_level(logging.WARNING, logger="vllm")
    obs.submitted(1, "gpu", "cpu", SimpleNamespace(block_ids=iter([1, 2])))  # no len()
    obs.submitted(2, "gpu", "cpu", spec(0))
    obs.finished([SimpleNamespace(job_id=2)])  # no success, size, time
    obs.finished(None)  # not iterable
    assert obs.errors == 3 and sent == []
    assert [(r.name, r.levelno) for r in caplog.records] == [
        ("vllm.kvscope.agent.taps.worker_events", logging.WARNING)]
    assert "worker submit failed" in caplog.records[0].getMessage()


def test_emit_failures_are_counted_not_raised():
    def emit(event):
        raise RuntimeError("full")

    obs = WorkerObserver(emit)
    obs.submitted(1, "cpu", "gpu", spec(0))
    obs.finished([result(1, True, 8, 0.1)])
    assert obs.errors == 1


def test_imports_without_vllm():
    """Imports with vLLM made unimportable, and brings nothing outside the standard library and
    kvscope.events' own (msgspec; typing_extensions where msgspec wants it): bench/gpu_check.py
    imports it where vLLM cannot be installed."""
    code = ("import sys; sys.modules['vllm'] = None; before = set(sys.modules); "
            "import kvscope.agent.taps.worker_events; "
            "print(sorted({n.split('.')[0] for n in set(sys.modules) - before} "
            "- set(sys.stdlib_module_names)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    brought = set(ast.literal_eval(proc.stdout))
    assert brought <= {"kvscope", "msgspec", "typing_extensions"}, proc.stdout


def test_jobs_in_flight_are_reported_per_direction_when_they_change():
    """Stores of 3 and 2 blocks and a load of 4: gpu->cpu 2 jobs, 5 blocks; cpu->gpu 1, 4.
    Store 1 (3 blocks) finishes: gpu->cpu 1 job, 2 blocks, and only that direction is sent
    again; a report with nothing changed sends nothing. Past ``max_jobs`` the forgotten job
    leaves the count too (else a lost job would stay in flight for good)."""
    obs, sent = observer(max_jobs=3)
    assert not obs.in_flight_changed
    obs.submitted(1, "gpu", "cpu", spec(0, 1, 2))
    obs.submitted(2, "gpu", "cpu", spec(3, 4))
    obs.submitted(3, "cpu", "gpu", spec(5, 6, 7, 8), "req-1")
    assert obs.in_flight_changed
    obs.report_in_flight()
    assert sent == [ev.TransfersInFlight(ts=103.0, src="gpu", dst="cpu", transfers=2, blocks=5),
                    ev.TransfersInFlight(ts=103.0, src="cpu", dst="gpu", transfers=1, blocks=4)]
    assert not obs.in_flight_changed
    obs.finished([result(1, True, 6144, 0.5)])
    obs.report_in_flight()
    assert sent[3:] == [ev.TransfersInFlight(ts=104.0, src="gpu", dst="cpu", transfers=1,
                                             blocks=2)]
    obs.report_in_flight()
    assert len(sent) == 4
    obs.submitted(4, "gpu", "cpu", spec(9))
    obs.submitted(5, "gpu", "cpu", spec(10))  # 4 jobs > max_jobs 3: job 2 (2 blocks) forgotten
    obs.report_in_flight()
    assert sent[4:] == [ev.TransfersInFlight(ts=107.0, src="gpu", dst="cpu", transfers=2,
                                             blocks=2)]
    assert obs.errors == 1
