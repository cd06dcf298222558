"""NUMA collector: the numa_maps and node-list parsers on literal text, the collector on real
temporary sysfs/proc trees and on this machine's real /proc.

``TWO_NODE_NUMA_MAPS`` is written by hand in the format proc(5) and numa(7) document for
``/proc/<pid>/numa_maps`` (and fs/proc/task_mmu.c ``show_numa_map`` prints), as a two-node host
running an engine with a 1 GiB host KV pool bound to node 1 would show it; this machine has one
node, so a two-node file cannot be recorded here.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_until
from kvscope.agent.collectors import CollectorSet, NumaCollector, NumaReading
from kvscope.agent.collectors.base import CollectorError
from kvscope.agent.collectors.metrics import collector_samples
from kvscope.agent.collectors.numa import (NumaMapping, NumaParseError, numa_node_bytes,
                                           parse_node_list, parse_numa_maps)

KiB, MiB, GiB = 2**10, 2**20, 2**30
PAGE = 4 * KiB
LOGGER = "kvscope.agent.collectors"

TWO_NODE_NUMA_MAPS = """\
00400000 default file=/usr/bin/python3.12 mapped=200 mapmax=3 N0=120 N1=80 kernelpagesize_kB=4
00e4f000 default heap anon=5000 dirty=5000 active=4000 N0=3000 N1=2000 kernelpagesize_kB=4
7f0000000000 bind:1 anon=262144 dirty=262144 N1=262144 kernelpagesize_kB=4
7f4000000000 interleave:0-1 huge anon=8 dirty=8 N0=4 N1=4 kernelpagesize_kB=2048
7f5000000000 prefer (many):0-1 anon=10 dirty=10 N0=10 kernelpagesize_kB=4
7f6000000000 default file=/dev/shm/kv\\040pool
7f7000000000 default file=/usr/lib/x86_64-linux-gnu/libc.so.6 mapped=400 mapmax=40 N0=400 kernelpagesize_kB=4
7ffd00000000 default stack anon=33 dirty=33 N0=33 kernelpagesize_kB=4
"""


# ---- parsers on literal text -------------------------------------------------------------------

def test_parse_numa_maps_two_node_host():
    maps = parse_numa_maps(TWO_NODE_NUMA_MAPS)
    assert len(maps) == 8
    assert maps[0] == NumaMapping(0x400000, "default", "file", "/usr/bin/python3.12",
                                  {0: 120, 1: 80}, PAGE)
    assert maps[1].kind == "heap" and maps[1].pages == {0: 3000, 1: 2000}
    assert maps[2] == NumaMapping(0x7F0000000000, "bind:1", "anon", None, {1: 262144}, PAGE)
    assert (maps[3].kind, maps[3].policy, maps[3].page_size) == ("huge", "interleave:0-1", 2 * MiB)
    assert maps[4].policy == "prefer (many):0-1" and maps[4].pages == {0: 10}
    # a range with no pages mapped ends after its file word
    assert maps[5] == NumaMapping(0x7F6000000000, "default", "file", "/dev/shm/kv\\040pool", {}, None)
    assert maps[7].kind == "stack"


def test_numa_node_bytes_sums_pages_times_each_ranges_page_size():
    """All ranges: node 0 = (120 + 3000 + 10 + 400 + 33) pages x 4 KiB + 4 huge pages x 2 MiB =
    3563 x 4096 + 8 MiB = 14,594,048 + 8,388,608 = 22,982,656 bytes; node 1 = (80 + 2000 +
    262144) x 4096 + 4 x 2 MiB = 1,082,261,504 + 8,388,608 = 1,090,650,112 bytes.
    Anonymous and hugetlb ranges only (where a host KV pool lives): node 0 = 10 x 4096 + 8 MiB
    = 8,429,568; node 1 = 262144 x 4096 + 8 MiB = 1,082,130,432. The base page size is not used:
    every line gives its own."""
    maps = parse_numa_maps(TWO_NODE_NUMA_MAPS)
    assert numa_node_bytes(maps, 65536) == {0: 22_982_656, 1: 1_090_650_112}
    assert numa_node_bytes(maps, PAGE, kinds={"anon", "huge"}) == {0: 8_429_568, 1: 1_082_130_432}
    assert numa_node_bytes(maps, PAGE, kinds={"file"}) == {0: 520 * PAGE, 1: 80 * PAGE}
    assert numa_node_bytes(maps, PAGE, kinds=()) == {}
    with pytest.raises(ValueError, match="pinned"):
        numa_node_bytes(maps, PAGE, kinds={"pinned"})


def test_numa_maps_without_page_size_uses_the_base_page_and_skips_huge():
    """Lines of a kernel that printed no kernelpagesize_kB: 3 base pages of 16 KiB on node 1 =
    49,152 bytes; a hugetlb range of unknown page size cannot be sized and is left out."""
    text = "00600000 default anon=3 dirty=3 N1=3\n7f4000000000 default huge anon=2 N0=2\n\n"
    assert numa_node_bytes(parse_numa_maps(text), 16 * KiB) == {1: 49_152}


@pytest.mark.parametrize("line", ["zzz default N0=1", "00400000 default N0=x",
                                  "00400000 default N1=1 kernelpagesize_kB=four"])
def test_numa_maps_malformed(line):
    with pytest.raises(NumaParseError):
        parse_numa_maps(line + "\n")


def test_parse_node_list():
    assert parse_node_list("0\n") == (0,)
    assert parse_node_list("0-1\n") == (0, 1)
    assert parse_node_list("0,2-3\n") == (0, 2, 3)
    assert parse_node_list("\n") == ()
    for bad in ("a", "3-1", "0-"):
        with pytest.raises(NumaParseError):
            parse_node_list(bad)


# ---- the collector on temporary trees ----------------------------------------------------------

def _tree(tmp_path: Path, online: str | None = "0-1\n", pid: int = 4242,
          numa_maps: str | None = TWO_NODE_NUMA_MAPS) -> dict:
    """A sysfs node directory and a /proc with one process, as the kernel lays them out."""
    nodes, proc = tmp_path / "node", tmp_path / "proc"
    nodes.mkdir(parents=True)
    if online is not None:
        (nodes / "online").write_text(online)
    (proc / str(pid)).mkdir(parents=True)
    if numa_maps is not None:
        (proc / str(pid) / "numa_maps").write_text(numa_maps)
    return {"node_root": nodes, "proc": proc, "page_size": lambda: PAGE}


def _samples(results) -> dict:
    return {spec.name: v for spec, v in collector_samples(results).items()}


def test_collector_reads_nodes_and_the_engines_memory_per_node(tmp_path):
    """Nodes 0-2 online; the engine has pages on 0 and 1 (as above) and none on node 2, which
    is known and reads 0."""
    collectors = CollectorSet(["numa"], {"numa": {"engine_pid": 4242,
                                                  **_tree(tmp_path, online="0-2\n")}})
    results = collectors.collect()
    assert results["numa"].reading == NumaReading((0, 1, 2), 4242,
                                                  {0: 22_982_656, 1: 1_090_650_112, 2: 0})
    s = _samples(results)
    assert s["kvscope_host_numa_nodes"] == [([], 3.0)]
    assert s["kvscope_process_numa_bytes"] == [(["0"], 22_982_656.0), (["1"], 1_090_650_112.0),
                                               (["2"], 0.0)]
    assert s["kvscope_collector_up"] == [(["numa"], 1.0)]


def test_without_engine_pid_only_the_nodes(tmp_path):
    reading = NumaCollector(**_tree(tmp_path)).collect()
    assert reading == NumaReading((0, 1), None, None)
    s = _samples(CollectorSet(["numa"], {"numa": _tree(tmp_path / "b")}).collect())
    assert s["kvscope_host_numa_nodes"] == [([], 2.0)]
    assert s["kvscope_process_numa_bytes"] == []


def test_what_is_not_known_is_absent(tmp_path, caplog):
    """A kernel without NUMA support: no node list and no numa_maps. With an engine pid the
    collector is up with nothing to report; without one it has no data (up 0, one info line).
    A configured engine that is gone makes it fail (up 0, one warning over three scrapes)."""
    no_numa = _tree(tmp_path / "a", online=None, numa_maps=None)
    assert NumaCollector(4242, **no_numa).collect() == NumaReading(None, 4242, None)
    s = _samples(CollectorSet(["numa"], {"numa": {"engine_pid": 4242, **no_numa}}).collect())
    assert s["kvscope_host_numa_nodes"] == s["kvscope_process_numa_bytes"] == []
    assert s["kvscope_collector_up"] == [(["numa"], 1.0)]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        results = CollectorSet(["numa"], {"numa": no_numa}).collect()
        assert not results["numa"].up
        gone = CollectorSet(["numa"], {"numa": {"engine_pid": 999, **_tree(tmp_path / "b")}})
        assert [gone.collect()["numa"].up for _ in range(3)] == [False] * 3
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith(LOGGER)]
    assert [level for level, _ in lines] == [logging.INFO, logging.WARNING], lines
    assert "999" in lines[1][1] and "not running" in lines[1][1]
    assert _samples({"numa": gone.collect()["numa"]})["kvscope_process_numa_bytes"] == []


def test_malformed_files_fail_the_collector(tmp_path):
    collectors = CollectorSet(["numa"], {"numa": {"engine_pid": 4242, **_tree(
        tmp_path, numa_maps="00400000 default N0=many\n")}})
    assert not collectors.collect()["numa"].up


def test_engine_pid_must_be_a_process_id():
    with pytest.raises(ValueError):
        NumaCollector(0)


# ---- this machine ------------------------------------------------------------------------------

@pytest.mark.skipif(not Path("/proc/self/numa_maps").is_file(),
                    reason="this kernel has no /proc/<pid>/numa_maps (no NUMA support)")
def test_real_proc_sees_this_process_grow_by_what_it_touches():
    """This process as the engine, on the real /proc and /sys: every node it has memory on is
    an online node, and 64 MiB allocated and written raise the sum over nodes by 64 MiB (within
    8 MiB for the interpreter's own allocations in between)."""
    collector = NumaCollector(os.getpid())
    before = collector.collect()
    assert before.engine_pid == os.getpid()
    assert before.engine_bytes and sum(before.engine_bytes.values()) > 0
    if before.nodes is not None:
        assert set(before.engine_bytes) <= set(before.nodes)
    block = bytearray(64 * MiB)
    for i in range(0, len(block), PAGE):
        block[i] = 1
    after = collector.collect()
    grown = sum(after.engine_bytes.values()) - sum(before.engine_bytes.values())
    assert 56 * MiB <= grown <= 72 * MiB, grown
    del block


def test_without_engine_pid_it_follows_the_taps_processes_and_adds_them_up(tmp_path):
    """No engine_pid: the processes the taps run in (``follow``, from each batch's pid) are
    read and added up per node; one that has ended is skipped, not a failure; a configured
    engine_pid wins over them."""
    tree = _tree(tmp_path, online="0-2\n")  # process 4242 with the two-node numa_maps
    (tree["proc"] / "4343").mkdir()
    (tree["proc"] / "4343" / "numa_maps").write_text(
        "7f0000000000 bind:2 anon=256 dirty=256 N2=256 kernelpagesize_kB=4\n")
    collector = NumaCollector(**tree)
    asked = []
    collector.follow(lambda: asked.append(1) or [4343, 4242, 4242, 5555])  # 5555 has ended
    reading = collector.collect()
    assert reading == NumaReading((0, 1, 2), None, {0: 22_982_656, 1: 1_090_650_112,
                                                    2: 256 * PAGE}, (4242, 4343, 5555))
    s = _samples({"numa": CollectorSet(["numa"], {"numa": tree}).collect()["numa"]})
    assert s["kvscope_process_numa_bytes"] == []  # a collector nothing told to follow
    collector.follow(lambda: [5555])  # every tap's process ended: nothing known, still up
    assert collector.collect() == NumaReading((0, 1, 2), None, None, (5555,))
    configured = NumaCollector(4242, **tree)
    configured.follow(lambda: [4343])
    assert configured.collect().engine_bytes == {0: 22_982_656, 1: 1_090_650_112, 2: 0}
    assert len(asked) == 1


def test_following_this_process_on_the_real_proc():
    """On this machine's real /proc: the test process, followed as a tap's, has memory on
    some node."""
    collector = NumaCollector()
    collector.follow(lambda: [os.getpid()])
    reading = collector.collect()
    assert reading.followed == (os.getpid(),) and sum(reading.engine_bytes.values()) > 0


def test_an_exited_unreaped_process_is_not_measured_as_0_bytes(tmp_path):
    """A real child process that exited and was not reaped (a zombie) has an empty numa_maps.
    Configured, it was reported as 0 bytes on every node, a measurement of nothing; now it is
    not running (collector down). Followed as a tap's, it is skipped, the others counted."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        status = Path(f"/proc/{child.pid}/status")
        assert wait_until(lambda: "State:\tZ" in status.read_text())
        assert Path(f"/proc/{child.pid}/numa_maps").read_text() == ""
        with pytest.raises(CollectorError, match="is not running"):
            NumaCollector(child.pid).collect()
        collector = NumaCollector()
        collector.follow(lambda: [child.pid, os.getpid()])
        reading = collector.collect()
        assert reading.followed == tuple(sorted([child.pid, os.getpid()]))
        assert sum(reading.engine_bytes.values()) > 0
    finally:
        child.wait()


def test_a_followed_process_it_may_not_read_is_left_out_not_the_collector(caplog):
    """Process 1 (this machine's init, whose numa_maps the test may not read: ptrace rules)
    followed beside this process: the collector went down and hid this process's placement
    and the host's nodes; now 1 is left out, with one warning."""
    try:
        Path("/proc/1/numa_maps").read_text()
        pytest.skip("process 1's numa_maps is readable here")
    except PermissionError:
        pass
    collector = NumaCollector()
    collector.follow(lambda: [1, os.getpid()])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        readings = [collector.collect() for _ in range(2)]
    assert all(sum(r.engine_bytes.values()) > 0 for r in readings)
    assert caplog.text.count("/proc/1/numa_maps") == 1
