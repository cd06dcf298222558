"""Command-line value types shared by every ``kvscope`` subcommand (argparse ``type=``).

Each raises ``argparse.ArgumentTypeError`` with the reason, so argparse reports the flag.
"""

from __future__ import annotations

import argparse


def positive(kind=float):
    """A parser of ``kind`` values > 0."""
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def non_negative(kind=int):
    """A parser of ``kind`` values >= 0 (e.g. a tier size where 0 disables the tier)."""
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value
    return parse


def host(text: str) -> str:
    """A listen address; empty is refused (it would mean every interface)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be an address, e.g. 127.0.0.1 (0.0.0.0 for all)")
    return text


def port(text: str) -> int:
    """A TCP port, 1-65535."""
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return value
