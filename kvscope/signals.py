"""Stopping the long-running commands (``demo``, ``agent``, ``dashboard``) on SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import threading

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_on_signals(stop: threading.Event) -> None:
    """Set ``stop`` on SIGINT or SIGTERM. Only the main thread can install handlers; elsewhere
    (a test running a command in a thread) this does nothing and the caller sets ``stop``."""
    if threading.current_thread() is threading.main_thread():
        for sig in _STOP_SIGNALS:
            signal.signal(sig, lambda *_: stop.set())


def ignore_signals_while_exiting() -> None:
    """Once a command has stopped cleanly: ignore further SIGINT/SIGTERM. While the interpreter
    shuts down it puts back the default action of every signal it handles, so a second Ctrl-C
    then killed the process (exit code 130) after it had already said "stopped"; a signal set
    to be ignored is left alone."""
    if threading.current_thread() is threading.main_thread():
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
