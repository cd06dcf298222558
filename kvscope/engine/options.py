"""The reference engine's command-line options, one definition for every subcommand that runs
it (``kvscope demo``, ``kvscope replay``): model preset, tier capacities, the disk tier's
directory and the policy, and the engine they describe."""

from __future__ import annotations

import argparse
import errno
import os

from kvscope.argtypes import directory, non_negative, positive
from kvscope.engine.policy import POLICIES
from kvscope.engine.presets import PRESETS, ModelPreset


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--preset``, ``--gpu-blocks``, ``--cpu-blocks``, ``--disk-blocks``, ``--disk-dir``
    and ``--policy`` to ``p``."""
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="model preset giving the KV block shape (default %(default)s)")
    p.add_argument("--gpu-blocks", type=positive(int), default=256, metavar="N",
                   help="gpu tier capacity in blocks (default %(default)s)")
    p.add_argument("--cpu-blocks", type=non_negative(int), default=1024, metavar="N",
                   help="cpu tier capacity in blocks; 0 disables offload (default %(default)s)")
    p.add_argument("--disk-blocks", type=non_negative(int), default=0, metavar="N",
                   help="disk tier capacity in blocks, chunk files in --disk-dir; 0 disables it "
                        "(default %(default)s)")
    p.add_argument("--disk-dir", metavar="DIR",
                   type=directory("for a temporary directory, removed at exit"),
                   help="directory for disk chunk files, created if absent; the chunks "
                   "are removed at exit (default: a temporary directory, removed at exit)")
    p.add_argument("--policy", choices=POLICIES, default="lru",
                   help="eviction policy of every tier (default %(default)s)")


def open_engine(preset: ModelPreset, gpu_blocks: int, cpu_blocks: int, disk_blocks: int,
                disk_dir: str | None, **options):
    """The :class:`~kvscope.engine.engine.OffloadEngine` those options describe (``options``:
    its other keyword arguments). Raises
    :class:`~kvscope.engine.engine.EngineConfigError`, naming the flag, for a ``disk_dir``
    without a disk tier or one the disk tier cannot use (in use, not writable), and for what
    the engine refuses."""
    from kvscope.engine.engine import EngineConfigError, OffloadEngine  # torch: only to run it

    if disk_dir and not disk_blocks:
        raise EngineConfigError("--disk-dir is for the disk tier, which is off: give "
                                "--disk-blocks too")
    try:
        return OffloadEngine(preset, gpu_blocks, cpu_blocks, disk_blocks, disk_dir=disk_dir,
                             **options)
    except OSError as exc:  # only the disk tier's directory touches the file system here
        why = exc.strerror or str(exc)
        if disk_dir is None:
            raise EngineConfigError(f"the disk tier's temporary directory: {why}; give "
                                    "--disk-dir") from None
        doing = ("" if exc.errno == errno.EBUSY else "cannot write chunk files there: "
                 if os.path.isdir(disk_dir) else "cannot create it: ")
        raise EngineConfigError(f"--disk-dir {disk_dir}: {doing}{why}") from None
