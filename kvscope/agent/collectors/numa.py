"""NUMA collector: the host's NUMA nodes and, for a configured engine process, where its memory
lives: bytes per NUMA node from ``/proc/<pid>/numa_maps``.

Reading and parsing are split (node_exporter's ``getLoad``/``parseLoad``): ``parse_node_list``,
``parse_numa_maps`` and ``numa_node_bytes`` are pure; ``NumaCollector`` reads files under
injectable roots (``/sys/devices/system/node``, ``/proc``), so tests run it on real temporary
trees. A GPU's own NUMA node is the GPU collector's (``gpu.py``), read through its PCI device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvscope.agent.collectors.base import (CollectorError, EngineNotRunning, NoDataError,
                                           register)

log = logging.getLogger(__name__)

DEFAULT_NODE_ROOT = Path("/sys/devices/system/node")
DEFAULT_PROC = Path("/proc")
MAPPING_KINDS = ("anon", "file", "heap", "stack", "huge")


class NumaParseError(CollectorError):
    """A NUMA file held something other than what the kernel writes there."""


def parse_node_list(text: str) -> tuple[int, ...]:
    """Node numbers of a sysfs node list (the kernel's list format, as in
    ``/sys/devices/system/node/online``: ``0``, ``0-3``, ``0,2-3``; empty means none), sorted.
    Raises NumaParseError on anything else."""
    nodes: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise NumaParseError(f"node list: expected numbers and ranges, got {text.strip()!r}") from None
        if lo < 0 or hi < lo:
            raise NumaParseError(f"node list: bad range {part!r}")
        nodes.update(range(lo, hi + 1))
    return tuple(sorted(nodes))


@dataclass(frozen=True)
class NumaMapping:
    """One line of ``/proc/<pid>/numa_maps``: one memory range of the process.

    ``address``: its start (``/proc/<pid>/maps`` has its end). ``policy``: the effective memory
    policy as the kernel prints it (``default``, ``bind:0-1``, ``interleave=static:0-1``,
    ``prefer (many):0-1``, ...). ``kind``: one of :data:`MAPPING_KINDS`: ``file`` (a
    ``file=`` backs it; copy-on-write pages of a private file mapping are counted in it too),
    ``heap``, ``stack``, ``huge`` (hugetlb: its page counts are huge pages), else ``anon``.
    ``path``: the backing file (octal escapes as the kernel writes them), or None.
    ``pages``: dict[node, pages mapped on that node] (``N<node>=<pages>``; nodes without pages
    are not listed). ``page_size``: bytes of one counted page (``kernelpagesize_kB``), or None
    when the line does not say (older kernels, or a range with no pages)."""

    address: int
    policy: str
    kind: str
    path: str | None = None
    pages: Mapping[int, int] = field(default_factory=dict)
    page_size: int | None = None


def parse_numa_maps(text: str) -> tuple[NumaMapping, ...]:
    """Every memory range of ``/proc/<pid>/numa_maps`` text, in file order.

    The format (proc(5) and numa(7), "/proc/[pid]/numa_maps"; the kernel's
    Documentation/admin-guide/mm/numa_memory_policy.rst for the policies; written by
    ``show_numa_map`` in fs/proc/task_mmu.c): one line per range, ``<start address in hex>
    <policy> [file=<path>] [heap] [stack] [huge] [anon=<pages>] [dirty=<pages>]
    [mapped=<pages>] [mapmax=<n>] [swapcache=<n>] [active=<pages>] [writeback=<pages>]
    [N<node>=<pages> ...] [kernelpagesize_kB=<KiB>]``. A range with no pages mapped ends after
    its file, heap, stack or huge word. Fields this parser does not know are skipped. Raises
    NumaParseError on a line whose first field is no hex address or whose ``N<node>=`` or
    ``kernelpagesize_kB=`` value is no number.

    Example: ``"7f2c40000000 bind:1 anon=262144 dirty=262144 N1=262144 kernelpagesize_kB=4"`` ->
    ``NumaMapping(0x7f2c40000000, "bind:1", "anon", None, {1: 262144}, 4096)``."""
    out = []
    for line in text.splitlines():
        tokens = line.split()
        if not tokens:
            continue
        try:
            address = int(tokens[0], 16)
        except ValueError:
            raise NumaParseError(f"numa_maps: no start address in {line!r}") from None
        rest = tokens[1:]
        policy = rest.pop(0) if rest else ""
        if policy == "prefer" and rest and rest[0].startswith("(many)"):
            policy += " " + rest.pop(0)  # MPOL_PREFERRED_MANY prints as "prefer (many)"
        kind, path, pages, page_size = "anon", None, {}, None
        for token in rest:
            key, sep, value = token.partition("=")
            if key == "file" and sep:
                kind, path = "file", value
            elif not sep and (key in ("heap", "huge") or key.startswith("stack")):
                kind = "stack" if key.startswith("stack") else key  # "stack:<tid>" before 3.x
            elif sep and key[:1] == "N" and key[1:].isdigit():
                pages[int(key[1:])] = _number(value, token, line)
            elif key == "kernelpagesize_kB" and sep:
                page_size = _number(value, token, line) * 1024
        out.append(NumaMapping(address, policy, kind, path, pages, page_size))
    return tuple(out)


def _number(value: str, token: str, line: str) -> int:
    if not (value.isascii() and value.isdigit()):
        raise NumaParseError(f"numa_maps: {token!r} is no count in {line!r}")
    return int(value)


def numa_node_bytes(mappings: Iterable[NumaMapping], base_page_size: int,
                    kinds: Collection[str] | None = None) -> dict[int, int]:
    """Bytes mapped on each NUMA node, summed over ``mappings`` (only those of ``kinds``, e.g.
    ``{"anon", "huge"}``, when given): ``N<node>`` pages x the range's own page size
    (``kernelpagesize_kB``), else ``base_page_size`` (the kernel's, ``os.sysconf
    ("SC_PAGE_SIZE")``). A hugetlb range that does not say its page size cannot be sized and is
    left out. Nodes with no pages in any counted range are not keys. Raises ValueError on an
    unknown kind."""
    if kinds is not None and set(kinds) - set(MAPPING_KINDS):
        raise ValueError(f"unknown mapping kind(s) {sorted(set(kinds) - set(MAPPING_KINDS))}; "
                         f"known: {', '.join(MAPPING_KINDS)}")
    out: dict[int, int] = {}
    for mapping in mappings:
        if kinds is not None and mapping.kind not in kinds:
            continue
        size = mapping.page_size
        if size is None:
            if mapping.kind == "huge":
                continue
            size = base_page_size
        for node, pages in mapping.pages.items():
            out[node] = out.get(node, 0) + pages * size
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class NumaReading:
    """``nodes``: the host's online NUMA nodes (``/sys/devices/system/node/online``), or None
    when the kernel shows none (no NUMA support). ``engine_pid``: the process read, or None.
    ``engine_bytes``: dict[node, bytes] of that process's mapped memory per node (of the
    followed processes together, without one), a node of ``nodes`` without its pages at 0;
    None when no process is configured or followed, or the kernel has no ``numa_maps``.
    ``followed``: the taps' processes read, without ``engine_pid`` (:meth:`NumaCollector.follow`),
    sorted; () when none."""

    nodes: tuple[int, ...] | None = None
    engine_pid: int | None = None
    engine_bytes: Mapping[int, int] | None = None
    followed: tuple[int, ...] = ()


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


@register("numa", default_enabled=True)
class NumaCollector:
    """Reads the host's NUMA nodes and, with ``engine_pid``, that process's memory per node,
    once per ``collect()``.

    ``engine_pid``: the serving engine's process (vLLM's, whose pinned host KV pool is the one
    to place), or None: then the processes :meth:`follow` names, if any. ``node_root``: ``/sys/devices/system/node``. ``proc``: ``/proc``.
    ``page_size``: the kernel's base page size in bytes (default ``os.sysconf``), for ranges
    whose line does not give one.
    ``collect()`` raises NoDataError when the kernel shows no NUMA nodes and no process is
    configured, EngineNotRunning when the configured process is gone (its numa_maps cannot be
    found although the kernel has them, or are empty: exited, not yet reaped), CollectorError
    when it cannot be read (another user's process: ``numa_maps`` needs ptrace read access),
    NumaParseError on malformed files. Raises
    ValueError on a non-positive ``engine_pid``."""

    name = "numa"

    def __init__(self, engine_pid: int | None = None, *,
                 node_root: Path | str = DEFAULT_NODE_ROOT, proc: Path | str = DEFAULT_PROC,
                 page_size: Callable[[], int] = lambda: os.sysconf("SC_PAGE_SIZE")) -> None:
        if engine_pid is not None and engine_pid <= 0:
            raise ValueError(f"engine_pid must be a process id > 0, not {engine_pid}")
        self._pid = engine_pid
        self._node_root = Path(node_root)
        self._proc = Path(proc)
        self._page_size = page_size
        self._follow: Callable[[], Iterable[int]] = tuple
        self._told_unreadable: set[int] = set()  # followed processes said unreadable

    def follow(self, pids: Callable[[], Iterable[int]]) -> None:
        """Without ``engine_pid``, read the processes ``pids()`` names at each collect: the
        engine processes the taps run in (``IngestSource.engine_pids``, from each batch's
        ``pid``), their memory per node added up. One that has ended meanwhile (or exited and
        awaits its parent's reaping), or that may not be read (logged once), is skipped."""
        self._follow = pids

    def collect(self) -> NumaReading:
        online = _read(self._node_root / "online")
        nodes = parse_node_list(online) if online is not None else None
        if self._pid is not None:
            return NumaReading(nodes, self._pid, self._engine_bytes(self._pid, nodes))
        followed = tuple(sorted(set(self._follow())))
        if followed:
            found = [b for pid in followed
                     if (b := self._engine_bytes(pid, nodes, followed=True)) is not None]
            total = ({node: sum(b.get(node, 0) for b in found) for node in sorted(
                {node for b in found for node in b})} if found else None)
            return NumaReading(nodes, None, total, followed)
        if nodes is None:
            raise NoDataError(f"no NUMA nodes shown in {self._node_root}")
        return NumaReading(nodes=nodes)

    def _engine_bytes(self, pid: int, nodes: tuple[int, ...] | None,
                      followed: bool = False) -> dict[int, int] | None:
        """Process ``pid``'s bytes per node; None when the kernel has no numa_maps, or a
        ``followed`` process has ended. Raises CollectorError for a configured process that has
        ended and for one that may not be read."""
        process = self._proc / str(pid)
        try:
            text = (process / "numa_maps").read_text()
        except (FileNotFoundError, ProcessLookupError):
            if process.is_dir() or followed:
                return None  # a kernel without NUMA support has no numa_maps; a tap's engine ended
            raise EngineNotRunning(pid) from None
        except PermissionError:
            why = f"cannot read {process / 'numa_maps'}: it needs the engine's user (or ptrace " \
                  "read access)"
            if not followed:
                raise CollectorError(why) from None
            if pid not in self._told_unreadable:  # one tap's process: the others still count
                self._told_unreadable.add(pid)
                log.warning("numa collector: %s; its memory is left out (logged once)", why)
            return None
        if not text.strip():  # no address space: exited, not yet reaped (a zombie); not 0 bytes
            if followed:
                return None
            raise EngineNotRunning(pid, "it has exited; its parent has not reaped it")
        found = numa_node_bytes(parse_numa_maps(text), self._page_size())
        return dict(sorted({**{node: 0 for node in nodes or ()}, **found}.items()))

    def shutdown(self) -> None:
        """Nothing to release."""
