"""Command-line value types shared by every ``kvscope`` subcommand (argparse ``type=``).

Each raises ``argparse.ArgumentTypeError`` with the reason, so argparse reports the flag.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import socket
from urllib.parse import urlsplit


def _number(kind, check, reason: str):
    """A parser of finite ``kind`` values for which ``check(value)`` holds, else ``reason``.
    Named after ``kind``, so argparse says e.g. "invalid float value: 'abc'"."""
    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if not check(value):
            raise argparse.ArgumentTypeError(f"{reason}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def positive(kind=float, at_most: float | None = None):
    """A parser of ``kind`` values > 0, and at most ``at_most`` when given."""
    if at_most is None:
        return _number(kind, lambda v: v > 0, "must be > 0")
    return _number(kind, lambda v: 0 < v <= at_most, f"must be > 0 and at most {at_most:,}")


def at_least(minimum: float, unit: str):
    """A parser of floats of at least ``minimum`` ``unit`` (a rate: one too small to mean
    anything turns a few tokens into centuries of seconds)."""
    return _number(float, lambda v: v >= minimum, f"must be at least {minimum:g} {unit}")


def non_negative(kind=int, at_most: float | None = None):
    """A parser of ``kind`` values >= 0 (e.g. a tier size where 0 disables the tier), and at
    most ``at_most`` when given."""
    if at_most is None:
        return _number(kind, lambda v: v >= 0, "must be >= 0")
    return _number(kind, lambda v: 0 <= v <= at_most, f"must be 0 to {at_most:,}")


# A number of tokens (a cache's capacity), 0 or more: up to 2**53, past which a float (the
# sizing's arithmetic) cannot count one more (2**74 once failed inside numpy).
token_count = non_negative(int, at_most=2**53)
# A fraction in (0, 1] (a sampling rate, a target share).
share = _number(float, lambda v: 0 < v <= 1, "must be in (0, 1]")
# A share of a workload, 0 (none of it) to 1 (all of it).
proportion = _number(float, lambda v: 0 <= v <= 1, "must be in [0, 1]")
# A probability strictly between 0 and 1 (a confidence level: 0.95, not 95).
fraction = _number(float, lambda v: 0 < v < 1, "must be in (0, 1), e.g. 0.95")


def at_most(limit: int, why: str):
    """A parser of ints from 0 to ``limit``; ``why`` says what the limit protects."""
    return _number(int, lambda v: 0 <= v <= limit, f"must be 0 to {limit} ({why})")


def host(text: str) -> str:
    """A listen address, or a host name that resolves; empty is refused (it would mean every
    interface). Checked here, so that a mistyped name is not first asked for a token."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be an address, e.g. 127.0.0.1 (0.0.0.0 for all)")
    try:
        socket.getaddrinfo(text, None)
    except (OSError, UnicodeError) as exc:
        raise argparse.ArgumentTypeError(
            f"cannot resolve {text!r} ({getattr(exc, 'strerror', None) or exc}): give an "
            "address of this machine, e.g. 127.0.0.1 (0.0.0.0 for all)") from None
    return text


def port(text: str) -> int:
    """A TCP port, 1-65535."""
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return value


def is_http_url(text: str) -> bool:
    """Whether ``text`` is an http:// or https:// URL with a host (a port, if any, that parses;
    no whitespace)."""
    url = urlsplit(text)
    try:
        url.port  # noqa: B018  (parsing the port is the check: it raises when malformed)
    except ValueError:
        return False
    return (url.scheme in ("http", "https") and bool(url.hostname)
            and not any(c.isspace() for c in text))


def http_url(text: str) -> str:
    """A base URL to read from (an agent's, Prometheus'): checked up front, as a dashboard
    started with ``localhost:9090`` only said so on its pages."""
    if not is_http_url(text):
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL with a host, "
                                         "e.g. http://127.0.0.1:9400 (an agent) or "
                                         f"http://127.0.0.1:9090 (Prometheus), got {text}")
    return text


# One PromQL label matcher: a label name, an operator and a quoted string (the Prometheus
# docs' "Time series selectors": "...", '...' or `...`, backslash escapes in the first two).
_MATCHER = (r"""\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(?:=~|!~|!=|=)\s*"""
            r"""(?:"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)\s*""")
_BODY = rf"(?:{_MATCHER}(?:,{_MATCHER})*,?)?\s*"
_MATCHERS = re.compile(rf"\{{{_BODY}\}}|{_BODY}", re.DOTALL)


def label_matchers(text: str) -> str:
    """PromQL label matchers to add to every query, with or without their braces
    (``job="kvscope"``, ``{job="kvscope",env!~"dev.*"}``): checked up front, as a matcher
    without quotes started the dashboard and then read as "prometheus unreachable" on every
    page."""
    if not _MATCHERS.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(
            f"must be PromQL label matchers, each a label, an operator (=, !=, =~, !~) and a "
            f'quoted value, comma-separated, e.g. job="kvscope"; got {text}')
    return text


# A Prometheus duration (and Grafana's refresh): units largest first, each at most once.
PROMETHEUS_DURATION = re.compile(r"(?=\d)(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?")


def prometheus_duration(text: str) -> str:
    """``text`` if Prometheus reads it as a duration (``1m``, ``2m30s``), else an argparse
    error saying so."""
    if not PROMETHEUS_DURATION.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be a Prometheus duration such as 1m or 2m30s, "
                                         f"not {text}")
    return text


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) listens on loopback only; a host name
    may resolve to anything, so it is not."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _utf8(text: str) -> None:
    """Refuse a path holding bytes that are not UTF-8 (Python keeps them as lone surrogates):
    pyarrow, which reads and writes captures, cannot open it (a tryout's compare ended in a
    UnicodeEncodeError traceback), and one rule for every path is simpler to state than a
    list of the commands that would manage."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise argparse.ArgumentTypeError(
            f"{os.fsencode(text).decode(errors='backslashreplace')} is not UTF-8 text (character "
            f"{exc.start + 1}): kvscope names its files in UTF-8, as the Parquet library of its "
            "captures needs; rename it") from None


def path(off: str | None = None):
    """An argparse type for a file or directory path: empty is refused (read as the current
    directory, or as the flag left out), and so is one that is not UTF-8 text; ``off`` says
    what leaving the flag out does (None: an argument that must be given)."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(
                "is empty; give a path" + (f", or leave the flag out {off}" if off else ""))
        _utf8(text)
        return text
    parse.__name__ = "path"
    return parse


def directory(off: str):
    """An argparse type for a directory flag: empty is refused, since it would mean the current
    directory, and so is one that is not UTF-8 text; ``off`` says what leaving the flag out
    does (the config keys say the same)."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(
                f"is empty, which would mean the current directory; leave the flag out {off}, "
                "or use . for the current directory")
        _utf8(text)
        if os.path.exists(text) and not os.path.isdir(text):
            raise argparse.ArgumentTypeError(
                f"{text} is a file, not a directory; give a directory, or leave the flag out "
                f"{off}")
        return text
    parse.__name__ = "directory"
    return parse
