"""How an exception reads in a log line or an error message."""

from __future__ import annotations


def describe(exc: BaseException) -> str:
    """``exc`` as ``"Type: message"``, or ``"Type"`` alone when the message is empty
    (``KeyError()``, ``TimeoutError()``, some of httpx's timeouts), never ``"Type: "``."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
