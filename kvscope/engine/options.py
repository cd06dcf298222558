"""The reference engine's command-line options, one definition for every subcommand that runs
it (``kvscope demo``, ``kvscope replay``): model preset, tier capacities and policy."""

from __future__ import annotations

import argparse

from kvscope.argtypes import non_negative, positive
from kvscope.engine.policy import POLICIES
from kvscope.engine.presets import PRESETS


def add_engine_arguments(p: argparse.ArgumentParser, disk: str) -> None:
    """Add ``--preset``, ``--gpu-blocks``, ``--cpu-blocks``, ``--disk-blocks`` and ``--policy``
    to ``p``; ``disk`` says where the disk tier's chunk files go."""
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="model preset giving the KV block shape (default %(default)s)")
    p.add_argument("--gpu-blocks", type=positive(int), default=256, metavar="N",
                   help="gpu tier capacity in blocks (default %(default)s)")
    p.add_argument("--cpu-blocks", type=non_negative(int), default=1024, metavar="N",
                   help="cpu tier capacity in blocks; 0 disables offload (default %(default)s)")
    p.add_argument("--disk-blocks", type=non_negative(int), default=0, metavar="N",
                   help=f"disk tier capacity in blocks, chunk files {disk}; 0 disables it "
                        "(default %(default)s)")
    p.add_argument("--policy", choices=POLICIES, default="lru",
                   help="eviction policy of every tier (default %(default)s)")
