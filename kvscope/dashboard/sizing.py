"""The Sizing page's data: an analysis of one trace, computed once in the background.

:class:`SizingSource` reads and analyses the trace on a daemon thread when started (the
analysis of a few hundred thousand block accesses takes about a second) and then serves
:func:`kvscope.analysis.report.sizing_figure_data` from memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvscope.analysis.analyze import AnalyzeOptions, analyze
from kvscope.analysis.inputs import load_measured_rates, load_trace
from kvscope.analysis.report import block_bytes_text, sizing_figure_data
from kvscope.analysis.trace import AccessTrace
from kvscope.engine.presets import get_preset

log = logging.getLogger(__name__)

HOW_TO_ENABLE = ("no trace to size from: start the dashboard with `kvscope dashboard "
                 "--sizing-trace PATH` (a Mooncake JSONL trace or an agent's capture "
                 "directory)")


@dataclass(frozen=True)
class SizingState:
    """``status``: "off" (no trace given), "running", "ready" or "failed". ``data``: the
    figure data when ready; ``message``: what to show otherwise; ``trace``: the file."""

    status: str
    trace: str | None = None
    data: dict | None = None
    message: str = ""


class SizingSource:
    """Analyses ``trace`` (a path, or None for none) with model ``preset`` (bytes per block,
    prefill cost) and a GPU prefix cache of ``gpu_tokens`` tokens (what it serves, a CPU tier
    need not; None: a capture's gpu tier, else none). ``accesses``: makes the block accesses
    to analyse instead of reading ``trace``, which then only names them (a workload generated
    in memory, the demo's). ``preset_flag``: the command's option that sets ``preset``, named
    where the preset's bytes per block are assumed. ``start()`` begins the work; ``state()``
    reports it. Thread-safe."""

    def __init__(self, trace: str | None, preset: str = "llama-3-8b",
                 gpu_tokens: int | None = None, *,
                 accesses: Callable[[], AccessTrace] | None = None,
                 preset_flag: str = "--sizing-preset") -> None:
        self.trace = trace
        self.preset, self.preset_flag = preset, preset_flag
        self.gpu_tokens = gpu_tokens
        self._accesses = accesses
        self._state = SizingState("off", trace, message=HOW_TO_ENABLE) if trace is None else \
            SizingState("running", trace, message=f"analysing {trace} …")
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the analysis on a daemon thread (once; no-op without a trace)."""
        with self._lock:
            if self.trace is None or self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="kvscope-sizing", daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> SizingState:
        """Wait up to ``timeout`` seconds for the analysis; return the state."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.state()

    def state(self) -> SizingState:
        with self._lock:
            return self._state

    def _run(self) -> None:
        try:
            if self._accesses is not None:
                accesses, measured = self._accesses(), None
            else:
                accesses, measured = load_trace(self.trace), load_measured_rates(self.trace)
            analysis = analyze(accesses, AnalyzeOptions(
                get_preset(self.preset), gpu_tokens=self.gpu_tokens, measured=measured))
            state = SizingState("ready", self.trace, sizing_figure_data(analysis),
                                f"{analysis.requests:,} requests, {analysis.accesses:,} block "
                                f"accesses over {analysis.duration_seconds:,.0f} s; "
                                f"{block_bytes_text(analysis, self.preset_flag)}, "
                                f"GPU prefix cache "
                                f"{analysis.sizing.assumptions['gpu_tokens']:,} tokens; "
                                f"{analysis.method}")
        except Exception as exc:  # noqa: BLE001 — a boundary: any failure becomes a message
            state = SizingState("failed", self.trace,
                                message=f"cannot analyse {self.trace}: {exc}")
            # the terminal too: whoever started the dashboard may not open the Sizing page
            log.error("kvscope dashboard: %s", state.message)
        with self._lock:
            self._state = state
