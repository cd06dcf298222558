"""Host collector: host memory (psutil) bounded by the cgroup memory limit (v2, or v1's memory
controller), the operator's reserve and offload budgets, the headroom left, and the serving
engine's own memory.

Reading and parsing are split (node_exporter's ``getLoad``/``parseLoad``): ``parse_proc_cgroup``,
``parse_memory_max`` and ``parse_limit_in_bytes`` are pure; ``read_cgroup_memory`` reads files
under an injectable root.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from kvscope.agent.collectors.base import CollectorError, EngineNotRunning, register

log = logging.getLogger(__name__)

DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_PROC_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 reads "no limit" as the page counter's maximum in bytes, LONG_MAX rounded down to a
# page (mm/page_counter.h: 9223372036854771712 with 4 KiB pages); at or above this, whatever
# the page size up to 64 KiB, is none
V1_UNLIMITED = (2**63 - 1) // 65536 * 65536


class CgroupParseError(CollectorError):
    """A cgroup file held something other than what the kernel writes there."""


class CgroupNotVisible(OSError):
    """Another process's cgroup is not under this process's cgroup mount."""


@dataclass(frozen=True)
class CgroupLevel:
    """One cgroup directory with a memory limit. ``path``: the directory. ``max``: its
    ``memory.max`` (v1: ``memory.limit_in_bytes``), bytes. ``current``: its ``memory.current``
    (v1: ``memory.usage_in_bytes``), bytes, page cache included. ``inactive_file``: the
    ``inactive_file`` (v1: ``total_inactive_file``) bytes of its ``memory.stat``, page cache
    the kernel reclaims before it runs out (0 when unknown)."""

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
    """The limited cgroup levels over this process, own cgroup first, then its ancestors."""

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
    ``available``: ``min(psutil available, cgroup memory.max - working set)`` when a cgroup
    limit applies (see :class:`CgroupLevel`), else psutil's ``available`` (memory new
    allocations get without swapping).
    ``limit``: ``min(total, cgroup memory.max)``. ``swap_used``: psutil ``swap_memory().used``.
    ``swap_in``: bytes read back in from swap since boot, a counter (host-wide:
    :func:`swap_in_bytes`), None where it cannot be read.
    ``reserve``: what must stay free for the OS and other services (config).
    ``budgets``: dict[tier, bytes] reserved per offload tier (config, e.g. vLLM cpu_bytes_to_use).
    ``headroom``: ``available - reserve``; negative when the reserve is being eaten into.
    ``cgroup``: the limited cgroup levels, or None when no cgroup memory limit applies.
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




def parse_proc_cgroup(text: str, controller: str = "") -> str | None:
    """The cgroup path from ``/proc/<pid>/cgroup`` text: cgroup v2's (the ``0::<path>`` line),
    or given a v1 ``controller``, the path of the hierarchy it is in; None when there is none.
    Examples: ``"0::/system.slice/x.service\\n"`` -> ``"/system.slice/x.service"``;
    ``"4:memory:/docker/abc\\n"`` with ``controller="memory"`` -> ``"/docker/abc"``."""
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (controller in controllers.split(",") if controller
                else hierarchy == "0" and controllers == ""):
            return path or "/"
    return None


def parse_memory_max(text: str) -> int | None:
    """``memory.max`` content -> bytes, or None for ``max`` (no limit).

    Raises CgroupParseError on anything else."""
    value = text.strip()
    if value == "max":
        return None
    return _parse_bytes(value, "memory.max")


def parse_limit_in_bytes(text: str) -> int | None:
    """cgroup v1 ``memory.limit_in_bytes`` content -> bytes, or None for no limit (at or above
    :data:`V1_UNLIMITED`). Raises CgroupParseError on anything but a number of bytes."""
    value = _parse_bytes(text, "memory.limit_in_bytes")
    return None if value >= V1_UNLIMITED else value


def parse_inactive_file(text: str, key: str = "inactive_file") -> int:
    """The ``key`` bytes of ``memory.stat`` content (``key value`` lines; v1's hierarchical
    count is ``total_inactive_file``), 0 when it has no such line. Raises CgroupParseError
    when its value is no number of bytes."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _parse_bytes(value, f"memory.stat {key}")
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


# a cgroup version's memory files: limit (and its parser), usage, memory.stat's inactive cache
_V2 = ("memory.max", parse_memory_max, "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", parse_limit_in_bytes, "memory.usage_in_bytes",
       "total_inactive_file")


def read_cgroup_memory(root: Path = DEFAULT_CGROUP_ROOT,
                       proc_cgroup: Path | None = DEFAULT_PROC_CGROUP,
                       mount_is_own: bool = True) -> CgroupMemory | None:
    """The tightest cgroup memory limit over a process's cgroup and its ancestors.

    ``root``: where the cgroups are mounted. It is cgroup v2 when it holds
    ``cgroup.controllers``; otherwise (v1, or hybrid: v1 controllers beside an empty v2 tree)
    v1's memory controller is read at ``root/memory``, if mounted there. ``proc_cgroup``:
    ``/proc/self/cgroup`` (or another process's), naming the process's cgroup (v2's, or v1
    memory's) below the mount (None: the mount is the process's cgroup); when that directory
    is not visible (a container with its own
    cgroup namespace or mount), the mount itself is the process's cgroup if
    ``mount_is_own`` (this process's own mount), else :class:`CgroupNotVisible` is raised.
    Levels whose limit is none (v2 ``max``, v1 :data:`V1_UNLIMITED`) or absent (v2's root
    cgroup has none) impose nothing; each limited level is read with its usage and
    ``memory.stat``. Raises CgroupParseError on malformed files and OSError when a file exists
    but cannot be read.
    """
    if (root / "cgroup.controllers").is_file():
        files, controller = _V2, ""
    elif (root / "memory" / "memory.limit_in_bytes").is_file():
        files, controller, root = _V1, "memory", root / "memory"
    else:
        return None
    limit_file, parse_limit, usage_file, inactive_key = files
    text = _read(proc_cgroup) if proc_cgroup is not None else None
    rel = parse_proc_cgroup(text, controller) if text is not None else None
    own = root / rel.lstrip("/") if rel else root
    if rel is None or "/.." in rel or not own.is_dir():  # "/..": another cgroup namespace's
        if not mount_is_own and proc_cgroup is not None:
            raise CgroupNotVisible(f"cgroup {rel!r} of {proc_cgroup} is not under {root}")
        own = root
    levels: list[CgroupLevel] = []
    level = own
    while True:
        max_text = _read(level / limit_file)
        limit = parse_limit(max_text) if max_text is not None else None
        current_text = _read(level / usage_file) if limit is not None else None
        if limit is not None and current_text is not None:
            stat_text = _read(level / "memory.stat")
            levels.append(CgroupLevel(str(level), limit, _parse_bytes(current_text, usage_file),
                                      parse_inactive_file(stat_text, inactive_key)
                                      if stat_text else 0))
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


def swap_in_bytes(vmstat: Path, page_size: int) -> int | None:
    """Bytes read back in from swap since boot: ``pswpin`` of ``vmstat`` (``/proc/vmstat``;
    the kernel counts one per base page read in, mm/page_io.c) times ``page_size``, the
    kernel's base page in bytes. None when the file cannot be read or has no ``pswpin``:
    psutil's ``swap_memory().sin`` read 0 then (a measurement of nothing), and counted 4 KiB
    pages whatever the kernel's (64 KiB on some arm64 kernels: 16 times too few)."""
    try:
        text = vmstat.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "pswpin":
            return int(value) * page_size if value.strip().isdigit() else None
    return None


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
    memory (its descendants' included) is read (:func:`engine_memory`), and whose cgroup's
    memory limit is the one read (the agent in a container of its own, a sidecar, has its own
    limit, not the engine's): under the agent's cgroup mount when it is there, else under the
    engine's own mount (``/proc/<pid>/root``, where a cgroup namespace of its own puts it at
    the root), else none (logged once); None: the agent's own cgroup is read.
    ``cgroup_root``/``proc_cgroup``: see ``read_cgroup_memory`` (``proc_cgroup``: by default
    ``<proc_root>/self/cgroup``, or ``<proc_root>/<engine_pid>/cgroup``).
    ``virtual_memory``/``swap_memory``: psutil's functions, injectable for deterministic tests.
    ``page_size``: the kernel's base page in bytes (``os.sysconf``), for ``<proc_root>/vmstat``'s
    swap-in pages.
    Raises ValueError on a negative reserve or budget. A reserve at or above the memory limit
    (headroom can never be positive: every alert and verdict on it fires) is logged once.
    """

    name = "host"

    def __init__(self, virtual_memory: Callable = psutil.virtual_memory, *,
                 swap_memory: Callable = psutil.swap_memory, reserve_bytes: int = 0,
                 budgets: Mapping[str, int] | None = None, engine_pid: int | None = None,
                 cgroup_root: Path | str = DEFAULT_CGROUP_ROOT,
                 proc_cgroup: Path | str | None = None, proc_root: Path | str = "/proc",
                 page_size: Callable[[], int] = lambda: os.sysconf("SC_PAGE_SIZE")) -> None:
        budgets = dict(budgets or {})
        if reserve_bytes < 0 or any(v < 0 for v in budgets.values()):
            raise ValueError("reserve_bytes and budgets must be >= 0 bytes")
        self._virtual_memory = virtual_memory
        self._swap_memory = swap_memory
        self._reserve = int(reserve_bytes)
        self._budgets = budgets
        self._engine_pid = engine_pid
        self._cgroup_root = Path(cgroup_root)
        self._proc_root = Path(proc_root)
        self._page_size = page_size
        self._proc_cgroup = Path(proc_cgroup) if proc_cgroup is not None else \
            self._proc_root / ("self" if engine_pid is None else str(engine_pid)) / "cgroup"
        self._told_reserve = self._told_cgroup = False

    def collect(self) -> HostReading:
        """Raises EngineNotRunning when ``engine_pid`` is not running: its cgroup cannot be
        read, and physical RAM taken for its limit read as a measurement (a supervisor's
        restart keeps the cgroup's limit under a new pid)."""
        pid = self._engine_pid
        if pid is not None and not (self._proc_root / str(pid)).is_dir():
            raise EngineNotRunning(pid)
        vm = self._virtual_memory()
        swap = self._swap_memory()
        cgroup = self._cgroup()
        reading = host_reading(vm.total, vm.available, swap.used, self._reserve, self._budgets,
                               cgroup, swap_in_bytes(self._proc_root / "vmstat",
                                                     self._page_size()))
        if self._reserve >= reading.limit and not self._told_reserve:
            self._told_reserve = True
            log.warning("host collector: [collectors.host] reserve_bytes (%d) is at or above "
                        "the memory limit (%d bytes, %s): the headroom can never be positive; "
                        "set a reserve below the limit (logged once)", self._reserve,
                        reading.limit, "the cgroup's memory limit"
                        if reading.limit < reading.total else "physical RAM")
        if self._engine_pid is None:
            return reading
        return replace(reading, engine=engine_memory(self._engine_pid))

    def _cgroup(self) -> CgroupMemory | None:
        """The memory limit over the engine's cgroup when ``engine_pid`` names one, else over
        the agent's (see the class)."""
        if self._engine_pid is None:
            return read_cgroup_memory(self._cgroup_root, self._proc_cgroup)
        try:
            return read_cgroup_memory(self._cgroup_root, self._proc_cgroup, mount_is_own=False)
        except CgroupNotVisible:
            pass
        mount = self._proc_root / str(self._engine_pid) / "root" / \
            self._cgroup_root.relative_to(self._cgroup_root.anchor)
        try:
            if mount.is_dir():
                return read_cgroup_memory(mount, None)
            why = "not there"
        except OSError as exc:
            why = str(exc)
        if not self._told_cgroup:
            self._told_cgroup = True
            log.warning("host collector: the cgroup of engine process %d is neither under %s "
                        "nor readable under %s (%s): its memory limit is not read, physical "
                        "RAM is taken; share its cgroup namespace (docker --cgroupns=host) or "
                        "give the agent ptrace access to it (logged once)", self._engine_pid,
                        self._cgroup_root, mount, why)
        return None

    def shutdown(self) -> None:
        """Nothing to release."""
