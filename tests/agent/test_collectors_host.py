"""Host collector: cgroup v2 limits read from real files, headroom arithmetic, the registry.

The cgroup trees are real directories and files under tmp_path laid out as the kernel lays out
``/sys/fs/cgroup`` (cgroup.controllers at the root, memory.max / memory.current per level).
psutil is injected only so that totals and availability are fixed numbers; one test reads this
machine's real psutil and real cgroup.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvscope.agent.collectors import CollectorSet, UnknownCollectorError, resolve_enabled
from kvscope.agent.collectors.host import (CgroupParseError, HostCollector, HostReading,
                                           parse_inactive_file, parse_memory_max,
                                           parse_proc_cgroup,
                                           read_cgroup_memory)
from kvscope.agent.collectors.metrics import collector_samples

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
        assert all("reserve_bytes" in line and "memory.max" in line for line in lines), lines


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


def test_v1_or_hybrid_hierarchy_is_not_read(tmp_path):
    """Without cgroup.controllers at the root (cgroup v1 or a hybrid tmpfs) nothing is read,
    even where a memory.max file exists."""
    root = tmp_path / "cgroup"
    _tree(root, "/", {".": (str(GiB), 0)})
    (root / "cgroup.controllers").unlink()
    assert read_cgroup_memory(root, tmp_path / "proc_self_cgroup") is None


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


def test_swap_in_is_a_counter_of_bytes_read_back_and_absent_when_not_reported(tmp_path):
    """psutil's swap_memory().sin (bytes swapped in since boot) becomes
    kvscope_host_swap_in_bytes_total; a swap_memory() without it (an older psutil, a platform
    that does not say) leaves the counter out rather than reporting 0."""
    proc = _tree(tmp_path / "cgroup", "/ctr", {"ctr": ("max", 0)})
    for swap, want in ((_swap(MiB, sin=3 * MiB), [([], 3 * MiB)]), (_swap(MiB), [])):
        collectors = CollectorSet(["host"], {"host": {
            "virtual_memory": _vm(64 * GiB, 40 * GiB), "swap_memory": swap,
            "cgroup_root": tmp_path / "cgroup", "proc_cgroup": proc}})
        samples = {spec.name: v for spec, v in collector_samples(collectors.collect()).items()}
        assert samples["kvscope_host_swap_in_bytes_total"] == want


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
