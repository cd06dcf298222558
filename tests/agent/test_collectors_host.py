"""Host collector: cgroup v2 and v1 limits read from real files, headroom arithmetic, the
registry.

The cgroup trees are real directories and files under tmp_path laid out as the kernel lays out
``/sys/fs/cgroup`` (v2: cgroup.controllers at the root, memory.max / memory.current per level;
v1: the memory controller at ``memory/``, memory.limit_in_bytes / memory.usage_in_bytes).
psutil is injected only so that totals and availability are fixed numbers. One test reads this
machine's real psutil and real cgroup; another creates a real cgroup with a memory limit
(where this machine lets root do so) and reads it from a process inside it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvscope.agent.collectors import CollectorSet, UnknownCollectorError, resolve_enabled
from kvscope.agent.collectors.base import CollectorError
from kvscope.agent.collectors.host import (CgroupParseError, HostCollector, HostReading,
                                           parse_inactive_file, parse_limit_in_bytes,
                                           parse_memory_max, parse_proc_cgroup,
                                           read_cgroup_memory)
from kvscope.agent.collectors.metrics import collector_samples
from tests.cgroups import limited_cgroup, move

GiB = 2**30
MiB = 2**20


def _vm(total: int, available: int):
    return lambda: SimpleNamespace(total=total, available=available)


def _swap(used: int = 0, **more):
    return lambda: SimpleNamespace(used=used, **more)


def _tree(root: Path, own: str, levels: dict[str, tuple]) -> Path:
    """A cgroup v2 mount at ``root``: ``levels`` maps a relative directory to (memory.max text,
    memory.current bytes[, memory.stat text]). Returns the /proc/self/cgroup file naming
    ``own``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for rel, (max_text, current, *stat) in levels.items():
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(max_text + "\n")
        (d / "memory.current").write_text(f"{current}\n")
        if stat:
            (d / "memory.stat").write_text(stat[0])
    proc = root.parent / "proc_self_cgroup"
    proc.write_text(f"0::{own}\n")
    return proc


def _host(tmp_path, levels, own="/kubepods/pod1/ctr", total=64 * GiB, available=40 * GiB,
          reserve=GiB, budgets=None, swap_used=0) -> HostReading:
    proc = _tree(tmp_path / "cgroup", own, levels)
    collector = HostCollector(_vm(total, available), swap_memory=_swap(swap_used),
                              reserve_bytes=reserve, budgets=budgets or {},
                              cgroup_root=tmp_path / "cgroup", proc_cgroup=proc)
    return collector.collect()


def test_parse_proc_cgroup():
    assert parse_proc_cgroup("0::/system.slice/kvscope.service\n") == "/system.slice/kvscope.service"
    hybrid = "4:memory:/process_api/5bc8\n1:cpu:/\n0::/\n"  # v1 controllers plus an empty v2
    assert parse_proc_cgroup(hybrid) == "/"
    assert parse_proc_cgroup("4:memory:/docker/abc\n1:cpu,cpuacct:/docker/abc\n") is None
    # v1: the hierarchy the controller is in, alone or mounted with others
    assert parse_proc_cgroup("4:memory:/docker/abc\n0::/\n", "memory") == "/docker/abc"
    assert parse_proc_cgroup("3:cpu,memory:/x\n", "memory") == "/x"
    assert parse_proc_cgroup("0::/x\n1:cpu:/y\n", "memory") is None


def test_parse_memory_max():
    assert parse_memory_max("max\n") is None
    assert parse_memory_max("8589934592\n") == 8 * GiB
    with pytest.raises(CgroupParseError):
        parse_memory_max("lots\n")


def test_container_limit_is_tighter_than_host(tmp_path):
    """psutil: total 64 GiB, available 40 GiB. The pod (kubepods/pod1) has memory.max 8 GiB and
    memory.current 6 GiB; the container below it has memory.max "max".
    available = min(40, 8 - 6) = 2 GiB; limit = min(64, 8) = 8 GiB;
    headroom = available - reserve = 2 - 1 = 1 GiB."""
    r = _host(tmp_path, {"kubepods/pod1": (str(8 * GiB), 6 * GiB),
                         "kubepods/pod1/ctr": ("max", 5 * GiB)},
              budgets={"cpu": 4 * GiB}, swap_used=3 * MiB)
    assert (r.total, r.available, r.limit, r.headroom) == (64 * GiB, 2 * GiB, 8 * GiB, 1 * GiB)
    assert (r.reserve, r.budgets, r.swap_used) == (GiB, {"cpu": 4 * GiB}, 3 * MiB)
    assert [level.path for level in r.cgroup.levels] == [str(tmp_path / "cgroup/kubepods/pod1")]


def test_unlimited_cgroup_leaves_psutil_values(tmp_path):
    """memory.max "max" at every level: available = psutil's 40 GiB, limit = total 64 GiB,
    headroom = 40 - 1 = 39 GiB."""
    r = _host(tmp_path, {"kubepods/pod1": ("max", 6 * GiB), "kubepods/pod1/ctr": ("max", GiB)})
    assert (r.available, r.limit, r.headroom, r.cgroup) == (40 * GiB, 64 * GiB, 39 * GiB, None)


def test_psutil_tighter_than_cgroup(tmp_path):
    """Container memory.max 32 GiB, current 2 GiB (30 GiB left) but the host has only 10 GiB
    available: available = min(10, 30) = 10 GiB; limit = min(64, 32) = 32 GiB;
    headroom = 10 - 1 = 9 GiB."""
    r = _host(tmp_path, {"kubepods/pod1/ctr": (str(32 * GiB), 2 * GiB)}, available=10 * GiB)
    assert (r.available, r.limit, r.headroom) == (10 * GiB, 32 * GiB, 9 * GiB)


def test_headroom_goes_negative(tmp_path):
    """memory.max 4 GiB, current 3.5 GiB: available = 0.5 GiB = 512 MiB; reserve 1 GiB:
    headroom = 512 MiB - 1024 MiB = -512 MiB."""
    r = _host(tmp_path, {"kubepods/pod1/ctr": (str(4 * GiB), 3 * GiB + 512 * MiB)})
    assert r.available == 512 * MiB
    assert r.headroom == -512 * MiB


def test_a_reserve_at_or_over_the_limit_is_logged_once(tmp_path, caplog):
    """A tryout set reserve_bytes to 30 GiB on a 23.5 GiB host: accepted without a word, and
    every headroom check failed from the start. memory.max 4 GiB: a reserve of 4 GiB is
    logged (once over two reads, naming the cgroup), one of 4 GiB - 1 byte is not."""
    proc = _tree(tmp_path / "cgroup", "/ctr", {"ctr": (str(4 * GiB), GiB)})
    for reserve, told in ((4 * GiB - 1, 0), (4 * GiB, 1)):
        caplog.clear()
        collector = HostCollector(_vm(64 * GiB, 40 * GiB), swap_memory=_swap(),
                                  reserve_bytes=reserve, cgroup_root=tmp_path / "cgroup",
                                  proc_cgroup=proc)
        with caplog.at_level(logging.WARNING, logger="kvscope.agent.collectors.host"):
            collector.collect()
            collector.collect()
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == told, lines
        assert all("reserve_bytes" in line and "cgroup's memory limit" in line
                   for line in lines), lines


def test_reclaimable_page_cache_is_headroom(tmp_path):
    """memory.max 1 GiB, memory.current 1014 MiB of which 800 MiB inactive_file (memory.stat,
    as the kernel writes it: anon, file, active_file before it): the working set is 214 MiB,
    available = 1024 - 214 = 810 MiB, headroom 810 - 1024 = -214 MiB with the 1 GiB reserve.
    Counting the cache as used gave 10 MiB available."""
    stat = (f"anon {200 * MiB}\nfile {810 * MiB}\nkernel 4096\nactive_file {10 * MiB}\n"
            f"inactive_file {800 * MiB}\nslab 0\n")
    r = _host(tmp_path, {"ctr": (str(GiB), 1014 * MiB, stat)}, own="/ctr")
    assert (r.available, r.headroom) == (810 * MiB, 810 * MiB - GiB)
    assert r.cgroup.levels[0].working_set == 214 * MiB


def test_a_malformed_memory_stat_is_a_parse_error():
    assert parse_inactive_file("anon 1\ninactive_file 4096\n") == 4096
    assert parse_inactive_file("anon 1\n") == 0
    with pytest.raises(CgroupParseError, match="inactive_file"):
        parse_inactive_file("inactive_file lots\n")


def test_limit_and_remaining_come_from_different_levels(tmp_path):
    """Container: max 2 GiB, current 1.5 GiB (0.5 GiB left). Pod: max 10 GiB, current 9.8 GiB
    (0.2 GiB left). limit = min(2, 10) = 2 GiB; available = min(40, 0.5, 0.2) = 0.2 GiB; both
    count, each from its own level. Over-committed current (current > max) counts as 0 left."""
    r = _host(tmp_path, {"kubepods/pod1": (str(10 * GiB), 10 * GiB - 200 * MiB),
                         "kubepods/pod1/ctr": (str(2 * GiB), 1536 * MiB)})
    assert (r.limit, r.available, r.headroom) == (2 * GiB, 200 * MiB, 200 * MiB - GiB)
    r = _host(tmp_path / "over", {"ctr": (str(GiB), GiB + MiB)}, own="/ctr")
    assert (r.available, r.headroom) == (0, -GiB)


def test_cgroup_namespace_root_is_the_own_cgroup(tmp_path):
    """Inside a container with its own cgroup namespace /proc/self/cgroup says "0::/" and the
    mount root holds the container's own memory.max (2 GiB, current 1 GiB -> 1 GiB left).
    A path that is not visible under the mount falls back to the root as well."""
    r = _host(tmp_path / "a", {".": (str(2 * GiB), GiB)}, own="/")
    assert (r.available, r.limit) == (GiB, 2 * GiB)
    r = _host(tmp_path / "b", {".": (str(2 * GiB), GiB)}, own="/not/visible/here")
    assert (r.available, r.limit) == (GiB, 2 * GiB)


def test_a_v1_memory_hierarchy_is_read(tmp_path):
    """A hybrid host (this project's machine): v1 controllers, the memory one at
    /sys/fs/cgroup/memory, an empty v2 tree at unified/. The process is in /docker/abc
    (limit 2 GiB, usage 1.5 GiB of which 512 MiB total_inactive_file: working set 1 GiB, 1 GiB
    left); /docker has 8 GiB, usage 7.5 GiB (0.5 GiB left); the root's limit is v1's "none"
    (LONG_MAX rounded down to a 4 KiB page). limit = min(64, 2, 8) = 2 GiB; available =
    min(40, 1, 0.5) = 0.5 GiB. Without a memory controller mounted nothing is read, even where
    a memory.max file exists."""
    root = tmp_path / "cgroup"
    (root / "unified").mkdir(parents=True)
    levels = {".": (9223372036854771712, 3 * GiB, ""),
              "docker": (8 * GiB, 7 * GiB + 512 * MiB, ""),
              "docker/abc": (2 * GiB, 1536 * MiB,
                             f"inactive_file 0\ntotal_inactive_file {512 * MiB}\n")}
    for rel, (limit, usage, stat) in levels.items():
        d = root / "memory" / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (d / "memory.stat").write_text(stat)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("4:memory:/docker/abc\n1:name=systemd:/\n0::/\n")
    r = HostCollector(_vm(64 * GiB, 40 * GiB), swap_memory=_swap(), reserve_bytes=GiB,
                      cgroup_root=root, proc_cgroup=proc).collect()
    assert (r.limit, r.available, r.headroom) == (2 * GiB, 512 * MiB, 512 * MiB - GiB)
    assert [lv.working_set for lv in r.cgroup.levels] == [GiB, 7 * GiB + 512 * MiB]
    bare = tmp_path / "bare"
    _tree(bare, "/", {".": (str(GiB), 0)})
    (bare / "cgroup.controllers").unlink()
    assert read_cgroup_memory(bare, tmp_path / "proc_self_cgroup") is None


def test_v1_reads_no_limit_at_the_page_counters_maximum():
    """v1 says "no limit" as LONG_MAX rounded down to a page: 9223372036854771712 with 4 KiB
    pages, 9223372036854710272 with 64 KiB; a byte below the latter is a limit."""
    assert parse_limit_in_bytes("9223372036854771712\n") is None
    assert parse_limit_in_bytes("9223372036854710272\n") is None
    assert parse_limit_in_bytes("9223372036854710271\n") == 9223372036854710271
    assert parse_limit_in_bytes("268435456\n") == 256 * MiB
    with pytest.raises(CgroupParseError, match="limit_in_bytes"):
        parse_limit_in_bytes("-1x\n")


_READ_INSIDE = """
import json, sys
from kvscope.agent.collectors.host import HostCollector
sys.stdin.readline()  # moved into the cgroup meanwhile
r = HostCollector(reserve_bytes=0).collect()
print(json.dumps({"limit": r.limit, "available": r.available,
                  "levels": [[lv.path, lv.max] for lv in r.cgroup.levels] if r.cgroup else []}))
"""


def test_a_real_cgroup_with_a_memory_limit_is_read_from_inside_it():
    """A cgroup made here, below this process's own, limited to 1 GiB (v1 or v2, as the
    machine mounts them), and a process moved into it before it reads: its limit is 1 GiB
    (the machine has more), named as the cgroup made, and what is available is at most
    1 GiB."""
    with limited_cgroup(GiB, "host") as made:
        child = subprocess.Popen([sys.executable, "-c", _READ_INSIDE], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            move(made, child.pid)
        finally:
            out, _ = child.communicate("go\n", timeout=120)
    assert child.returncode == 0
    reading = json.loads(out)
    assert reading["limit"] == GiB
    assert [str(made), GiB] in reading["levels"]
    assert 0 < reading["available"] <= GiB


def test_the_engines_cgroup_limit_is_read_not_the_agents():
    """A real cgroup limited to 1 GiB holding the engine (a process moved into it), and the
    agent reading from outside it with engine_pid: the limit is the engine's 1 GiB. It was the
    agent's own cgroup's (docs/collectors.md lets the agent run beside the engine, in a
    container of its own): a sidecar's 512 MiB read as the engine's limit, so the budget
    and headroom alerts fired on a 64 GiB engine."""
    with limited_cgroup(GiB, "engine") as made:
        engine = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                  stdin=subprocess.PIPE)
        try:
            move(made, engine.pid)
            reading = HostCollector(engine_pid=engine.pid).collect()
            own = HostCollector().collect()
        finally:
            engine.communicate("", timeout=60)
    assert reading.limit == GiB and str(made) in [lv.path for lv in reading.cgroup.levels]
    assert own.limit > GiB  # the agent's own cgroup has no such limit


def _sidecar(tmp_path: Path, engine_visible: bool) -> tuple[Path, Path]:
    """A pod's cgroup v2 mount as the agent (a sidecar limited to 512 MiB) sees it: the engine
    container's cgroup (64 GiB, 40 GiB in use) under it when ``engine_visible``, else only under
    the engine's own mount, /proc/<pid>/root/<mount>, whose root is its cgroup (a cgroup
    namespace of its own). Returns (the agent's mount, a /proc with process 42, the engine)."""
    mount = tmp_path / "sys/fs/cgroup"
    proc = tmp_path / "proc"
    levels = {"kubepods/pod1/kvscope": (str(512 * MiB), 200 * MiB)}
    if engine_visible:
        levels["kubepods/pod1/engine"] = (str(64 * GiB), 40 * GiB)
    else:
        _tree(proc / "42/root" / mount.relative_to("/"), "/", {".": (str(64 * GiB), 40 * GiB)})
    _tree(mount, "/kubepods/pod1/kvscope", levels)
    (proc / "42").mkdir(parents=True, exist_ok=True)
    (proc / "42/cgroup").write_text("0::/kubepods/pod1/engine\n" if engine_visible
                                    else "0::/../../kubepods/pod1/engine\n")
    return mount, proc


@pytest.mark.parametrize("engine_visible", [True, False], ids=["shared mount", "own namespace"])
def test_a_sidecar_agent_reads_the_engines_limit(tmp_path, engine_visible):
    """The engine's 64 GiB (24 GiB left), not the sidecar's 512 MiB, whether the engine's
    cgroup is under the agent's mount or only under the engine's own (its /proc/<pid>/cgroup
    then names it past the agent's namespace root, with "/..")."""
    mount, proc = _sidecar(tmp_path, engine_visible)
    r = HostCollector(_vm(256 * GiB, 200 * GiB), swap_memory=_swap(), engine_pid=42,
                      cgroup_root=mount, proc_root=proc).collect()
    assert (r.limit, r.available) == (64 * GiB, 24 * GiB)
    r = HostCollector(_vm(256 * GiB, 200 * GiB), swap_memory=_swap(), cgroup_root=mount,
                      proc_cgroup=mount.parent / "proc_self_cgroup").collect()
    assert r.limit == 512 * MiB  # the agent's own, without engine_pid


def test_an_engines_cgroup_the_agent_cannot_see_is_no_limit_and_said_once(tmp_path, caplog):
    """Neither under the agent's mount nor under the engine's (not there, as without access
    to it): no limit is read, physical RAM is taken, and the warning says what to change,
    once."""
    mount = tmp_path / "sys/fs/cgroup"
    _tree(mount, "/kvscope", {"kvscope": (str(512 * MiB), 200 * MiB)})
    (tmp_path / "proc/42").mkdir(parents=True)
    (tmp_path / "proc/42/cgroup").write_text("0::/../engine\n")
    collector = HostCollector(_vm(256 * GiB, 200 * GiB), swap_memory=_swap(), engine_pid=42,
                              cgroup_root=mount, proc_root=tmp_path / "proc")
    caplog.set_level(logging.WARNING)
    readings = [collector.collect() for _ in range(2)]
    assert [(r.limit, r.cgroup) for r in readings] == [(256 * GiB, None)] * 2
    assert caplog.text.count("the cgroup of engine process 42") == 1
    assert "--cgroupns=host" in caplog.text


def test_an_engine_that_ended_is_said_not_running_not_read_as_physical_ram(tmp_path):
    """The engine's container limits it to 64 GiB (24 GiB left); the engine exits. Its
    /proc/<pid>/cgroup then reads nothing, which the collector took for a cgroup it could not
    see: the limit became physical RAM (256 GiB) and the headroom 200 GiB, an 8-fold rise no
    alert could fire on. It now says the process is not running, as the numa and engine-args
    collectors do (collector up 0), and reads the engine's limit again once it runs."""
    mount, proc = _sidecar(tmp_path, engine_visible=True)
    collector = HostCollector(_vm(256 * GiB, 200 * GiB), swap_memory=_swap(), engine_pid=42,
                              cgroup_root=mount, proc_root=proc)
    assert collector.collect().limit == 64 * GiB
    shutil.rmtree(proc / "42")
    with pytest.raises(CollectorError, match="engine process 42 .* is not running"):
        collector.collect()


def test_this_machines_cgroup_reads_without_error():
    """The real psutil and the real /sys/fs/cgroup and /proc/self/cgroup of this machine, once:
    whatever they hold (v1, hybrid, v2 with or without a limit), the reading is consistent."""
    r = HostCollector(reserve_bytes=GiB, budgets={"cpu": 2 * GiB}).collect()
    assert r.total > 0 and 0 <= r.available <= r.total
    assert 0 < r.limit <= r.total
    assert r.headroom == r.available - GiB
    if r.cgroup is not None:
        assert r.available <= r.cgroup.remaining and r.limit <= r.cgroup.limit
    # Linux: psutil's sin is /proc/vmstat's pswpin pages x the page size, there without swap
    # too; a counter, so a later reading holds at least what vmstat said before it
    vmstat = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    later = HostCollector().collect()
    assert later.swap_in is not None
    assert later.swap_in >= int(vmstat["pswpin"]) * os.sysconf("SC_PAGE_SIZE")


def test_swap_in_is_pages_read_back_times_the_kernels_page_and_absent_when_not_readable(
        tmp_path):
    """/proc/vmstat's pswpin (pages read back in from swap since boot) times the kernel's base
    page becomes kvscope_host_swap_in_bytes_total: 1,000 pages of 64 KiB (an arm64 kernel's)
    are 65,536,000 bytes; psutil's swap_memory().sin took every page for 4 KiB (4,096,000).
    A vmstat that cannot be read leaves the counter out: psutil's read 0 then. This
    machine's real vmstat reads."""
    cgroup = _tree(tmp_path / "cgroup", "/ctr", {"ctr": ("max", 0)})
    proc = tmp_path / "proc"
    proc.mkdir()

    def swap_in(**more):
        collectors = CollectorSet(["host"], {"host": {
            "virtual_memory": _vm(64 * GiB, 40 * GiB), "swap_memory": _swap(MiB, sin=0),
            "cgroup_root": tmp_path / "cgroup", "proc_cgroup": cgroup, **more}})
        samples = {spec.name: v for spec, v in collector_samples(collectors.collect()).items()}
        return samples["kvscope_host_swap_in_bytes_total"]

    (proc / "vmstat").write_text("pgpgin 5\npswpin 1000\npswpout 7\n")
    assert swap_in(proc_root=proc, page_size=lambda: 64 * 1024) == [([], 65_536_000)]
    (proc / "vmstat").unlink()
    assert swap_in(proc_root=proc) == []
    assert len(swap_in()) == 1  # /proc/vmstat


def test_bad_cgroup_file_marks_host_down_and_logs_once(tmp_path, caplog):
    """A malformed memory.max fails the host collector (up=0), logged once over three scrapes."""
    proc = _tree(tmp_path / "cgroup", "/ctr", {"ctr": ("garbage", 0)})
    collectors = CollectorSet(["host"], {"host": {
        "virtual_memory": _vm(64 * GiB, 40 * GiB), "swap_memory": _swap(),
        "cgroup_root": tmp_path / "cgroup", "proc_cgroup": proc}})
    with caplog.at_level(logging.INFO, logger="kvscope.agent.collectors"):
        results = [collectors.collect()["host"] for _ in range(3)]
    assert [r.up for r in results] == [False] * 3 and results[0].reading is None
    assert len([rec for rec in caplog.records if "host" in rec.getMessage()]) == 1
    assert caplog.records[0].levelno == logging.WARNING
    # fixing the file brings it back, with one recovery line
    (tmp_path / "cgroup/ctr/memory.max").write_text("max\n")
    with caplog.at_level(logging.INFO, logger="kvscope.agent.collectors"):
        assert collectors.collect()["host"].up
    assert "recovered" in caplog.records[-1].getMessage()


def test_host_samples_follow_the_catalog(tmp_path):
    """collector_samples on the 8 GiB pod reading: every host metric, budgets by tier, and the
    collector's up and duration (clock stepped by 0.25 s per call)."""
    proc = _tree(tmp_path / "cgroup", "/ctr", {"ctr": (str(8 * GiB), 6 * GiB)})
    ticks = iter([10.0, 10.25])
    collectors = CollectorSet(["host"], {"host": {
        "virtual_memory": _vm(64 * GiB, 40 * GiB), "swap_memory": _swap(MiB),
        "reserve_bytes": GiB, "budgets": {"cpu": 4 * GiB, "disk": 100 * GiB},
        "cgroup_root": tmp_path / "cgroup", "proc_cgroup": proc}}, clock=lambda: next(ticks))
    samples = {spec.name: v for spec, v in collector_samples(collectors.collect()).items()}
    assert samples["kvscope_host_memory_total_bytes"] == [([], 64 * GiB)]
    assert samples["kvscope_host_memory_available_bytes"] == [([], 2 * GiB)]
    assert samples["kvscope_host_memory_limit_bytes"] == [([], 8 * GiB)]
    assert samples["kvscope_host_swap_used_bytes"] == [([], MiB)]
    assert samples["kvscope_host_memory_reserve_bytes"] == [([], GiB)]
    assert samples["kvscope_host_memory_headroom_bytes"] == [([], GiB)]
    assert samples["kvscope_offload_budget_bytes"] == [(["cpu"], 4 * GiB), (["disk"], 100 * GiB)]
    assert samples["kvscope_collector_up"] == [(["host"], 1.0)]
    assert samples["kvscope_collector_duration_seconds"] == [(["host"], 0.25)]
    assert samples["kvscope_pcie_bytes_total"] == []


def test_registry_and_config_switches():
    """Both collectors are registered and on by default; switches turn them off by name."""
    assert resolve_enabled() >= {"host", "gpu"}
    assert "gpu" not in resolve_enabled({"gpu": False})
    with pytest.raises(UnknownCollectorError):
        resolve_enabled({"gpus": False})
    with pytest.raises(UnknownCollectorError):
        CollectorSet(["host", "disk_io"])
    with pytest.raises(ValueError):
        CollectorSet(["host"], {"host": {"reserve_bytes": -1}})
    collectors = CollectorSet(["host"])
    assert collectors.names == ["host"] and collectors.get("gpu") is None
    collectors.shutdown()
    collectors.shutdown()


def test_from_config_sections(tmp_path):
    """Config sections as ``settings.collectors.model_dump()`` gives them: ``enabled`` picks
    the collectors, the rest are factory options; ``overrides`` injects psutil and the cgroup
    root. 64 GiB total, 40 GiB available, no cgroup: headroom = 40 - 8 = 32 GiB."""
    config = {"host": {"enabled": True, "reserve_bytes": 8 * GiB, "budgets": {"cpu": 16 * GiB}},
              "gpu": {"enabled": False}}
    collectors = CollectorSet.from_config(config, overrides={"host": {
        "virtual_memory": _vm(64 * GiB, 40 * GiB), "swap_memory": _swap(),
        "cgroup_root": tmp_path}})
    # numa and engine_args have no section: on, their default
    assert collectors.names == ["engine_args", "host", "numa"]
    r = collectors.reading("host")
    assert (r.headroom, r.budgets) == (32 * GiB, {"cpu": 16 * GiB})
    assert collectors.reading("gpu") is None
    with pytest.raises(UnknownCollectorError):
        CollectorSet.from_config({"nvlink": {"enabled": True}})
