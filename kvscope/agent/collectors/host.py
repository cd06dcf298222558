"""Host collector: host memory (psutil) bounded by the cgroup v2 memory limit, the operator's
reserve and offload budgets, the headroom left, and the serving engine's own memory.

Reading and parsing are split (node_exporter's ``getLoad``/``parseLoad``): ``parse_proc_cgroup``
and ``parse_memory_max`` are pure; ``read_cgroup_memory`` reads files under an injectable root.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from kvscope.agent.collectors.base import CollectorError, register

log = logging.getLogger(__name__)

DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_PROC_CGROUP = Path("/proc/self/cgroup")


class CgroupParseError(CollectorError):
    """A cgroup file held something other than what the kernel writes there."""


@dataclass(frozen=True)
class CgroupLevel:
    """One cgroup v2 directory with a memory limit. ``path``: the directory. ``max``: its
    ``memory.max``, bytes. ``current``: its ``memory.current``, bytes (page cache included).
    ``inactive_file``: the ``inactive_file`` bytes of its ``memory.stat``, page cache the kernel
    reclaims before it runs out (0 when unknown)."""

    path: str
    max: int
    current: int
    inactive_file: int = 0

    @property
    def working_set(self) -> int:
        """``current - inactive_file``, bytes: what the cgroup cannot give back without
        swapping or an OOM kill. The kubelet's and cAdvisor's working set
        (``container_memory_working_set_bytes``), which Kubernetes evicts by."""
        return self.current - min(self.inactive_file, self.current)


@dataclass(frozen=True)
class CgroupMemory:
    """The limited cgroup v2 levels over this process, own cgroup first, then its ancestors."""

    levels: tuple[CgroupLevel, ...]

    @property
    def limit(self) -> int:
        """The tightest ``memory.max``, bytes."""
        return min(level.max for level in self.levels)

    @property
    def remaining(self) -> int:
        """The least ``memory.max`` less the working set (see :class:`CgroupLevel`) over the
        levels, bytes; never below 0 (current may overshoot max while the kernel reclaims)."""
        return max(min(level.max - level.working_set for level in self.levels), 0)


@dataclass(frozen=True)
class HostReading:
    """Host memory at one moment; every value in bytes.

    ``total``: physical memory (psutil ``virtual_memory().total``).
    ``available``: ``min(psutil available, cgroup memory.max - working set)`` when a cgroup v2
    limit applies (see :class:`CgroupLevel`), else psutil's ``available`` (memory new
    allocations get without swapping).
    ``limit``: ``min(total, cgroup memory.max)``. ``swap_used``: psutil ``swap_memory().used``.
    ``swap_in``: bytes read back in from swap since boot, a counter (psutil
    ``swap_memory().sin``, host-wide), None where psutil does not report it.
    ``reserve``: what must stay free for the OS and other services (config).
    ``budgets``: dict[tier, bytes] reserved per offload tier (config, e.g. vLLM cpu_bytes_to_use).
    ``headroom``: ``available - reserve``; negative when the reserve is being eaten into.
    ``cgroup``: the limited cgroup v2 levels, or None when no v2 memory limit applies.
    ``engine``: the engine process's memory with its descendants' (:func:`engine_memory`), or
    None when no engine process is configured or it cannot be read.
    """

    total: int
    available: int
    limit: int
    swap_used: int = 0
    reserve: int = 0
    budgets: Mapping[str, int] = field(default_factory=dict)
    headroom: int = 0
    cgroup: CgroupMemory | None = None
    engine: int | None = None
    swap_in: int | None = None




def parse_proc_cgroup(text: str) -> str | None:
    """The cgroup v2 path from ``/proc/<pid>/cgroup`` text (the ``0::<path>`` line), or None on
    a v1-only system. Example: ``"0::/system.slice/x.service\\n"`` -> ``"/system.slice/x.service"``."""
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            return path or "/"
    return None


def parse_memory_max(text: str) -> int | None:
    """``memory.max`` content -> bytes, or None for ``max`` (no limit).

    Raises CgroupParseError on anything else."""
    value = text.strip()
    if value == "max":
        return None
    return _parse_bytes(value, "memory.max")


def parse_inactive_file(text: str) -> int:
    """The ``inactive_file`` bytes of ``memory.stat`` content (``key value`` lines), 0 when
    it has no such line. Raises CgroupParseError when its value is no number of bytes."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "inactive_file":
            return _parse_bytes(value, "memory.stat inactive_file")
    return 0


def _parse_bytes(value: str, what: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise CgroupParseError(f"{what}: expected bytes, got {value.strip()!r}") from None


def _read(path: Path) -> str | None:
    """File content, or None when it is gone (a cgroup can vanish between listing and reading)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def read_cgroup_memory(root: Path = DEFAULT_CGROUP_ROOT,
                       proc_cgroup: Path = DEFAULT_PROC_CGROUP) -> CgroupMemory | None:
    """The tightest cgroup v2 memory limit over this process's cgroup and its ancestors.

    ``root``: where the cgroup v2 hierarchy is mounted; it counts as v2 only when it holds
    ``cgroup.controllers`` (on a v1 or hybrid host nothing is read and None is returned).
    ``proc_cgroup``: ``/proc/self/cgroup``, naming this process's cgroup below ``root``; when that
    directory is not visible (a container with its own cgroup namespace or mount), ``root``
    itself is the process's cgroup. Levels whose ``memory.max`` is ``max`` or absent (the root
    cgroup has none) impose nothing; each limited level is read with its ``memory.current``
    and ``memory.stat``. Raises CgroupParseError on malformed files and
    OSError when a file exists but cannot be read.
    """
    if not (root / "cgroup.controllers").is_file():
        return None
    text = _read(proc_cgroup)
    rel = parse_proc_cgroup(text) if text is not None else None
    own = root / rel.lstrip("/") if rel else root
    if not own.is_dir():
        own = root
    levels: list[CgroupLevel] = []
    level = own
    while True:
        max_text = _read(level / "memory.max")
        limit = parse_memory_max(max_text) if max_text is not None else None
        current_text = _read(level / "memory.current") if limit is not None else None
        if limit is not None and current_text is not None:
            stat_text = _read(level / "memory.stat")
            levels.append(CgroupLevel(str(level), limit,
                                      _parse_bytes(current_text, "memory.current"),
                                      parse_inactive_file(stat_text) if stat_text else 0))
        if level == root or root not in level.parents:
            return CgroupMemory(tuple(levels)) if levels else None
        level = level.parent


def engine_memory(pid: int,
                  process: Callable[[int], psutil.Process] = psutil.Process) -> int | None:
    """Bytes of memory process ``pid`` and its descendants hold: the sum of their proportional
    set sizes (PSS, psutil's ``memory_full_info().pss`` from ``/proc/<pid>/smaps_rollup``), so
    that memory the processes share (vLLM's workers map one host KV pool) counts once, not
    once per process. None when ``pid`` is gone or may not be read (it needs the engine's user
    or ptrace read access, in the same PID namespace). A descendant that exits meanwhile is
    left out. Reading PSS walks the processes' page tables: milliseconds per GiB mapped."""
    try:
        root = process(pid)
        tree = [root, *root.children(recursive=True)]
        total = root.memory_full_info().pss
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    for child in tree[1:]:
        try:
            total += child.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return int(total)


def host_reading(total: int, psutil_available: int, swap_used: int, reserve: int,
                 budgets: Mapping[str, int], cgroup: CgroupMemory | None,
                 swap_in: int | None = None) -> HostReading:
    """Combine the inputs (bytes) into a HostReading; pure arithmetic, see HostReading."""
    available, limit = psutil_available, total
    if cgroup is not None:
        available = min(available, cgroup.remaining)
        limit = min(limit, cgroup.limit)
    return HostReading(total=total, available=available, limit=limit, swap_used=swap_used,
                       reserve=reserve, budgets=dict(budgets), headroom=available - reserve,
                       cgroup=cgroup, swap_in=swap_in)


@register("host", default_enabled=True)
class HostCollector:
    """Reads host memory once per ``collect()``.

    ``reserve_bytes``: bytes to keep free for the OS and other services. ``budgets``: dict[tier,
    bytes] per offload tier: the operator's, which override what the engine reports
    (docs/collectors.md, "Memory budgets"). ``engine_pid``: the serving engine's process, whose
    memory (its descendants' included) is read (:func:`engine_memory`); None: not read.
    ``cgroup_root``/``proc_cgroup``: see ``read_cgroup_memory``.
    ``virtual_memory``/``swap_memory``: psutil's functions, injectable for deterministic tests.
    Raises ValueError on a negative reserve or budget. A reserve at or above the memory limit
    (headroom can never be positive: every alert and verdict on it fires) is logged once.
    """

    name = "host"

    def __init__(self, virtual_memory: Callable = psutil.virtual_memory, *,
                 swap_memory: Callable = psutil.swap_memory, reserve_bytes: int = 0,
                 budgets: Mapping[str, int] | None = None, engine_pid: int | None = None,
                 cgroup_root: Path | str = DEFAULT_CGROUP_ROOT,
                 proc_cgroup: Path | str = DEFAULT_PROC_CGROUP) -> None:
        budgets = dict(budgets or {})
        if reserve_bytes < 0 or any(v < 0 for v in budgets.values()):
            raise ValueError("reserve_bytes and budgets must be >= 0 bytes")
        self._virtual_memory = virtual_memory
        self._swap_memory = swap_memory
        self._reserve = int(reserve_bytes)
        self._budgets = budgets
        self._engine_pid = engine_pid
        self._cgroup_root = Path(cgroup_root)
        self._proc_cgroup = Path(proc_cgroup)
        self._told_reserve = False

    def collect(self) -> HostReading:
        vm = self._virtual_memory()
        swap = self._swap_memory()
        cgroup = read_cgroup_memory(self._cgroup_root, self._proc_cgroup)
        swap_in = getattr(swap, "sin", None)
        reading = host_reading(vm.total, vm.available, swap.used, self._reserve, self._budgets,
                               cgroup, None if swap_in is None else int(swap_in))
        if self._reserve >= reading.limit and not self._told_reserve:
            self._told_reserve = True
            log.warning("host collector: [collectors.host] reserve_bytes (%d) is at or above "
                        "the memory limit (%d bytes, %s): the headroom can never be positive; "
                        "set a reserve below the limit (logged once)", self._reserve,
                        reading.limit, "the cgroup's memory.max" if reading.limit < reading.total
                        else "physical RAM")
        if self._engine_pid is None:
            return reading
        return replace(reading, engine=engine_memory(self._engine_pid))

    def shutdown(self) -> None:
        """Nothing to release."""
