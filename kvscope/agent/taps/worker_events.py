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
    not see submitted are skipped.

    Never raises: a failure is counted in :attr:`errors`, the first one logged (under vLLM's
    logger) and the rest counted silently."""

    def __init__(self, emit: Callable[[ev.Event], object], *,
                 clock: Callable[[], float] = time.time, max_jobs: int = 65_536) -> None:
        self.errors = 0
        self._emit = emit
        self._clock = clock
        self._max_jobs = max_jobs
        self._jobs: dict[int, tuple[str, str, int, float, str]] = {}

    def failed(self, where: str, exc: BaseException) -> None:
        """Count a failure of the tap's worker side at ``where``; the first one is logged."""
        self.errors += 1
        if self.errors == 1:
            log.warning("kvscope vLLM tap: worker %s failed (%s: %s); counting further "
                        "failures silently", where, type(exc).__name__, exc)

    def submitted(self, job_id: int, src: str, dst: str, spec: object,
                  request_id: str = "") -> None:
        """Job ``job_id`` copies from tier ``src`` to ``dst``; ``spec`` is its GPU side (its
        ``block_ids`` are counted); ``request_id``: the request a load is for ("" for a store)."""
        try:
            blocks = len(getattr(spec, "block_ids", ()))
            self._jobs[job_id] = (src, dst, blocks, self._clock(), request_id)
            if len(self._jobs) > self._max_jobs:
                del self._jobs[next(iter(self._jobs))]
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
                timed = result.transfer_time is not None and result.transfer_size is not None
                self._emit(ev.Transfer(
                    ts=started, src=src, dst=dst, blocks=blocks,
                    bytes=int(result.transfer_size or 0),
                    duration=float(result.transfer_time or 0.0),
                    ok=bool(result.success), reason="" if result.success else "unknown",
                    request_id=rid, timed=timed))
        except Exception as exc:
            self.failed("get_finished", exc)
