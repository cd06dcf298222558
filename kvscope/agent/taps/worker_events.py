"""The worker side of the vLLM tap without vLLM: job bookkeeping, and each finished job's result
turned into a ``Transfer`` event.

:class:`~kvscope.agent.taps.vllm.TapWorker` (vLLM's ``OffloadingWorker`` subclass) is a thin
shell around a :class:`WorkerObserver`: it calls vLLM's worker, then tells the observer what it
submitted and what finished. Kept apart from vLLM so that it runs where vLLM cannot be installed
(bench/gpu_check.py's worker path on a CUDA machine) and is tested directly.

Imports only the standard library and :mod:`kvscope.events`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from kvscope import events as ev
from kvscope.errors import describe

# under vLLM's "vllm" logger, so the tap's lines come out in vLLM's log format and level
log = logging.getLogger("vllm." + __name__)


class WorkerObserver:
    """Remembers each submitted job (direction, GPU blocks, submit time, request) and turns each
    finished job's result into a ``Transfer`` event given to ``emit``: ``bytes`` =
    ``transfer_size``, ``duration`` = ``transfer_time`` (seconds; CUDA-event timed in vLLM's GPU
    worker), ``ok`` = ``success`` (``reason`` "unknown" when it failed: vLLM says no more).
    Results without a size or time are sent untimed (``timed`` False, 0 bytes and seconds).
    ``clock``: Unix seconds for ``ts`` (the submit time). Jobs it never hears back about are
    bounded by ``max_jobs`` (oldest forgotten, counted in ``errors``); results for jobs it did
    not see submitted are skipped. The jobs and blocks submitted and not finished, per
    direction, go to ``emit`` as a ``TransfersInFlight`` when :meth:`report_in_flight` finds
    them changed since it last sent them.

    Never raises: a failure is counted in :attr:`errors`, the first one logged (under vLLM's
    logger) and the rest counted silently."""

    def __init__(self, emit: Callable[[ev.Event], object], *,
                 clock: Callable[[], float] = time.time, max_jobs: int = 65_536) -> None:
        self.errors = 0
        self._emit = emit
        self._clock = clock
        self._max_jobs = max_jobs
        self._jobs: dict[int, tuple[str, str, int, float, str]] = {}
        # (src, dst) -> [jobs, blocks] submitted and not finished; and as last reported
        self._in_flight: dict[tuple[str, str], list[int]] = {}
        self._reported: dict[tuple[str, str], tuple[int, int]] = {}
        self.in_flight_changed = False

    def failed(self, where: str, exc: BaseException) -> None:
        """Count a failure of the tap's worker side at ``where``; the first one is logged."""
        self.errors += 1
        if self.errors == 1:
            log.warning("kvscope vLLM tap: worker %s failed (%s); counting further "
                        "failures silently", where, describe(exc))

    def submitted(self, job_id: int, src: str, dst: str, spec: object,
                  request_id: str = "", started: float | None = None) -> None:
        """Job ``job_id`` copies from tier ``src`` to ``dst``; ``spec`` is its GPU side (its
        ``block_ids`` are counted); ``request_id``: the request a load is for ("" for a store);
        ``started``: when it was submitted (Unix seconds; None: now)."""
        try:
            blocks = len(getattr(spec, "block_ids", ()))
            self._jobs[job_id] = (src, dst, blocks,
                                  self._clock() if started is None else started, request_id)
            self._count(src, dst, 1, blocks)
            if len(self._jobs) > self._max_jobs:
                forgotten = self._jobs.pop(next(iter(self._jobs)))
                self._count(forgotten[0], forgotten[1], -1, -forgotten[2])
                self.errors += 1
        except Exception as exc:
            self.failed("submit", exc)

    def finished(self, results: Iterable[object]) -> None:
        """A ``Transfer`` event for each result (read by attribute: ``job_id``, ``success``,
        ``transfer_size``, ``transfer_time``, as vLLM's ``TransferResult`` has them) of a job
        submitted here."""
        try:
            for result in results:
                job = self._jobs.pop(result.job_id, None)
                if job is None:
                    continue
                src, dst, blocks, started, rid = job
                self._count(src, dst, -1, -blocks)
                timed = result.transfer_time is not None and result.transfer_size is not None
                self._emit(ev.Transfer(
                    ts=started, src=src, dst=dst, blocks=blocks,
                    bytes=int(result.transfer_size or 0),
                    duration=float(result.transfer_time or 0.0),
                    ok=bool(result.success), reason="" if result.success else "unknown",
                    request_id=rid, timed=timed))
        except Exception as exc:
            self.failed("get_finished", exc)

    def _count(self, src: str, dst: str, jobs: int, blocks: int) -> None:
        counts = self._in_flight.setdefault((src, dst), [0, 0])
        counts[0] += jobs
        counts[1] += blocks
        self.in_flight_changed = True

    def report_in_flight(self) -> None:
        """A ``TransfersInFlight`` to ``emit`` for each direction whose jobs or blocks in flight
        changed since this last sent it (the caller checks :attr:`in_flight_changed` first, a
        flag, so that a step that moved nothing costs no call)."""
        try:
            self.in_flight_changed = False
            now = None
            for (src, dst), (jobs, blocks) in self._in_flight.items():
                if self._reported.get((src, dst)) != (jobs, blocks):
                    self._reported[(src, dst)] = (jobs, blocks)
                    now = self._clock() if now is None else now
                    self._emit(ev.TransfersInFlight(ts=now, src=src, dst=dst, transfers=jobs,
                                                    blocks=blocks))
        except Exception as exc:
            self.failed("report_in_flight", exc)
