"""Disk-tier faults with real files: each one makes the block a miss that is recomputed,
counts an error by reason, never serves wrong bytes, leaves no temporary file behind, and the
engine keeps going.

Setting (gpu 1, cpu 1, disk 4 blocks, LRU): r0 [A], r1 [B], r2 [C] leave A's only copy on disk
(chunk file written by a spill). r3 [A] then must stage A disk -> cpu -> gpu.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from kvscope import events as ev
from kvscope.engine.engine import EngineConfigError, OffloadEngine
from kvscope.engine.presets import get_preset
from test_engine import _req, _resident_bytes_ok

TINY = get_preset("tiny")
A, B, C, D, E = 201, 202, 203, 204, 205
ROOT = REPO_ROOT


def _no_temporary_files(directory):
    return [p.name for p in Path(directory).iterdir() if p.name.endswith(".tmp")] == []


def _with_a_on_disk(directory, events):
    engine = OffloadEngine(TINY, 1, 1, 4, emit=events.append, disk_dir=directory)
    for i, h in enumerate([A, B, C]):
        engine.process(_req(f"r{i}", h))
    assert engine.disk.order() == [A]
    return engine, engine.disk.pool.path(engine.disk.get(A).slot)


def _truncate(path):
    os.truncate(path, 1000)


def _flip_payload_byte(path):
    with open(path, "r+b") as f:
        f.seek(32 + 5000)  # past the 32-byte header
        byte = f.read(1)
        f.seek(32 + 5000)
        f.write(bytes([byte[0] ^ 0xFF]))


def _overwrite_header_hash(path):
    data = bytearray(path.read_bytes())
    data[8:16] = (999).to_bytes(8, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,reason", [
    (_truncate, "truncated"),
    (_flip_payload_byte, "checksum"),
    (os.unlink, "missing"),
    (_overwrite_header_hash, "corrupt"),
])
def test_a_bad_chunk_is_a_miss_that_is_recomputed(tmp_path, damage, reason):
    events = []
    engine, path = _with_a_on_disk(tmp_path, events)
    damage(path)
    outcome = engine.process(_req("r3", A))
    assert outcome.tokens == {"gpu": 0, "cpu": 0, "disk": 0, "recompute": 16}
    assert outcome.block_hits["disk"] == 0 and outcome.failed_blocks == 1
    assert engine.stats.errors == {reason: 1}
    failed = [t for t in events if isinstance(t, ev.Transfer) and not t.ok]
    assert [(t.src, t.dst, t.blocks, t.reason) for t in failed] == [("disk", "cpu", 1, reason)]
    assert not any(isinstance(t, ev.Transfer) and t.request_id == "r3" and t.dst == "gpu"
                   for t in events)  # the garbage never went on to the gpu
    assert A not in engine.disk and A not in engine.cpu
    gone = [(e.tier, e.reason) for e in events if isinstance(e, ev.Eviction) and e.reason == "failed"]
    assert gone == [("disk", "failed"), ("cpu", "failed")]
    # the summary's evictions are the Eviction events' blocks, the failed ones included (the
    # agent's kvscope_evicted_blocks_total counts every reason)
    evicted = {tier: 0 for tier in engine.stats.evictions}
    for e in events:
        if isinstance(e, ev.Eviction):
            evicted[e.tier] += e.blocks
    assert engine.stats.evictions == evicted
    _resident_bytes_ok(engine)  # gpu holds A's recomputed bytes; nothing holds wrong bytes
    # the engine keeps going: A is a gpu hit now, B (spilled during r3) comes back from disk
    assert engine.process(_req("r4", A)).tokens["gpu"] == 16
    assert engine.process(_req("r5", B)).tokens["disk"] == 16
    _resident_bytes_ok(engine)
    assert _no_temporary_files(tmp_path)
    engine.close()


def _damage_every_chunk(directory):
    for path in Path(directory).glob("chunk-*.kv"):
        os.truncate(path, 100)


@pytest.mark.parametrize("sizes, before, damaged", [
    ((1, 2, 2), [(D, A), (C, A)], (C, D, A)),
    ((1, 2, 3), [(C, A), (C, D), (A, D)], (C, A)),
], ids=["no-promotion-pending", "promotion-planned-after"])
def test_a_read_that_fails_while_copies_are_planned_never_reaches_the_gpu(
        tmp_path, sizes, before, damaged):
    """Every chunk cut short, then a request whose disk reads fail in a flush that planning a
    later copy runs (a gpu slot written twice in one request). With no promotion pending yet
    the engine raised IndexError (an empty recompute entry, the demo's replay thread killed);
    with the promotion planned after the failure, it copied the failed read's cpu slot (A's
    bytes mixed with D's old ones) to the gpu, then served it as a gpu hit. The failed reads
    are counted, every tier holds exactly its prefill's bytes, and the engine goes on."""
    engine = OffloadEngine(TINY, *sizes[:2], sizes[2], disk_dir=tmp_path)
    for i, hashes in enumerate(before):
        engine.process(_req(f"r{i}", *hashes))
    _damage_every_chunk(tmp_path)
    outcome = engine.process(_req("damaged", *damaged))
    assert outcome.failed_blocks > 0 and engine.stats.errors.get("truncated")
    _resident_bytes_ok(engine)
    engine.process(_req("after", A))
    _resident_bytes_ok(engine)
    engine.close()


def test_a_cpu_hit_is_not_pushed_to_disk_by_its_own_request(tmp_path):
    """gpu 1, cpu 1, disk 2: A is on the cpu and the disk tiers when a request for it comes,
    with its disk chunk cut short. Making room on the gpu for A evicts D, whose offload needed
    the cpu tier's one slot: that pushed A off the cpu, A was read from its damaged chunk,
    failed and was recomputed (its cpu hit taken back). A is pinned now, as vLLM pins what a
    request loads: D is not offloaded (one cpu Admission skip) and A is served from the cpu,
    the bad chunk never read. By hand: one cpu hit, 16 cpu tokens, no error."""
    events = []
    engine = OffloadEngine(TINY, 1, 1, 2, disk_dir=tmp_path, emit=events.append)
    for i, h in enumerate([A, B, C, A, D]):
        engine.process(_req(f"r{i}", h))
    assert engine.cpu.order() == [A] and A in engine.disk
    os.truncate(engine.disk.pool.path(engine.disk.get(A).slot), 100)
    outcome = engine.process(_req("r5", A))
    assert outcome.block_hits == {"gpu": 0, "cpu": 1, "disk": 0}
    assert outcome.tokens["cpu"] == 16 and engine.stats.errors == {}
    assert engine.cpu.order() == [A] and D not in engine.cpu and D not in engine.disk
    assert [e.skipped for e in events if isinstance(e, ev.Admission) and e.tier == "cpu"][-1] == 1
    ev.validate([e for e in events if isinstance(e, ev.Lookup)][-1])  # raises if refused
    engine.close()


def test_a_repeated_block_read_from_disk_after_its_cpu_hit_is_taken_back_from_disk(tmp_path):
    """gpu 3, cpu 2, disk 4 (LRU). After [2], [1], [3,5,2], [1]: gpu [5,2,1], cpu [3,1],
    disk [2], block 2's chunk cut short. r4 [2,3,5,1,2]: 2 a gpu hit; 3, 5 and 1 cpu hits,
    each evicting a gpu block whose offload spills the cpu's unpinned LRU. At the second 2
    (its pin went at its first turn) the cpu holds it: a cpu hit; making room offloads 3,
    which pushes 2 off the cpu, so 2 is staged from its bad chunk, fails, and is recomputed.
    By hand: gpu 1, cpu 3, disk 0 hits. Its hit had been taken back from the disk, which had
    not counted it: disk -1, a Lookup the agent refuses."""
    events = []
    engine = OffloadEngine(TINY, 3, 2, 4, disk_dir=tmp_path, emit=events.append)
    for i, hashes in enumerate([(2,), (1,), (3, 5, 2), (1,)]):
        engine.process(_req(f"r{i}", *hashes))
    assert [engine.gpu.order(), engine.cpu.order(), engine.disk.order()] == [[5, 2, 1], [3, 1],
                                                                             [2]]
    engine.drain()
    os.truncate(engine.disk.pool.path(engine.disk.get(2).slot), 100)
    outcome = engine.process(_req("r4", 2, 3, 5, 1, 2))
    assert outcome.block_hits == {"gpu": 1, "cpu": 3, "disk": 0}
    assert outcome.tokens == {"gpu": 16, "cpu": 48, "disk": 0, "recompute": 16}
    assert min(engine.stats.block_hits.values()) >= 0
    ev.validate([e for e in events if isinstance(e, ev.Lookup)][-1])  # raises if refused
    engine.close()


def _mount_tmpfs(directory, size):
    """A real, tiny tmpfs (needs root with CAP_SYS_ADMIN); False when mounting is refused."""
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                            capture_output=True)
    return result.returncode == 0


@pytest.mark.parametrize("size, refused", [("320k", True), ("512k", False)])
def test_a_disk_tier_is_refused_unless_its_files_fit(tmp_path, size, refused):
    """10 tiny chunks of 32,768 bytes each took 36 KiB on a real tmpfs (a 32-byte header,
    rounded up to 4 KiB pages), and a rewrite's temporary file stands beside the chunk it
    replaces (4 I/O threads). By hand: (10 + 4) x 36,864 = 516,096 bytes. A 320 KiB disk was
    taken (its 327,680 bytes free matched 10 x 32,768) and then held 8 of the 10 blocks, the
    others disk_full; it is refused at start. 512 KiB (524,288 free) is taken."""
    directory = tmp_path / "disk"
    directory.mkdir()
    if not _mount_tmpfs(directory, size):
        pytest.skip("cannot mount a tmpfs here")
    try:
        if refused:
            with pytest.raises(EngineConfigError, match="the disk tier needs"):
                OffloadEngine(TINY, 1, 1, 10, disk_dir=directory)
        else:
            OffloadEngine(TINY, 1, 1, 10, disk_dir=directory).close()
    finally:  # lazily: an engine a failing test left open holds the directory
        subprocess.run(["umount", "-l", str(directory)], check=True)


def test_disk_full_drops_the_spill_and_the_block_is_recomputed(tmp_path):
    """Disk full, for real: a 16 KiB tmpfs cannot hold one 32 KiB chunk, so the spill fails
    with ENOSPC. Where mounting is not allowed, the kernel's file-size limit (RLIMIT_FSIZE,
    with SIGXFSZ ignored) refuses the same write with EFBIG; both count as ``disk_full``."""
    import resource

    directory = tmp_path / "disk"
    directory.mkdir()
    events = []
    # built first: the engine refuses a disk tier larger than the free space at its start;
    # here the disk fills up under a running engine
    engine = OffloadEngine(TINY, 1, 1, 4, disk_dir=directory, emit=events.append)
    mounted = _mount_tmpfs(directory, "16k")
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        if not mounted:
            resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, old_limit[1]))
        for i, h in enumerate([A, B, C]):
            engine.process(_req(f"r{i}", h))  # r2 spills A: refused
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        assert engine.stats.errors == {"disk_full": 1}
        assert A not in engine.disk and engine.stats.moved["cpu->disk"] == 0
        # the spill was admitted and its write failed: disk failed 1, stored 0
        failed = [(e.stored, e.skipped, e.failed) for e in events
                  if isinstance(e, ev.Admission) and e.tier == "disk"]
        assert failed == [(0, 0, 1)], failed
        # A left the cpu tier without a copy below: dropped, not offloaded (it read offloaded,
        # so kvscope_dropped_blocks_total missed it)
        assert [e.offloaded for e in events if isinstance(e, ev.Eviction) and e.tier == "cpu"
                and e.reason == "capacity"] == [False]
        assert engine.stats.offloaded["cpu"] == 0
        assert _no_temporary_files(directory) and list(directory.iterdir()) == []
        outcome = engine.process(_req("r3", A))  # A is nowhere: recomputed
        assert outcome.tokens["recompute"] == 16
        assert engine.process(_req("r4", A)).tokens["gpu"] == 16  # the engine keeps going
        _resident_bytes_ok(engine)
        engine.close()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
        if mounted:
            subprocess.run(["umount", str(directory)], check=True)


PERMISSION_SCENARIO = r"""
import json, os, sys
import numpy as np
from pathlib import Path
from kvscope.engine.engine import OffloadEngine, prefill_value
from kvscope.engine.presets import get_preset
from kvscope.engine.workload import Request
directory = Path(sys.argv[1])
req = lambda name, *hs: Request(name, 0.0, 16 * len(hs), 1, hs)
engine = OffloadEngine(get_preset("tiny"), 1, 1, 4, disk_dir=directory)
for i, h in enumerate([201, 202, 203]):
    engine.process(req(f"r{i}", h))
os.chmod(engine.disk.pool.path(engine.disk.get(201).slot), 0)   # unreadable chunk
os.chmod(directory, 0o555)                                       # no new files
r3 = engine.process(req("r3", 201))
r4 = engine.process(req("r4", 204))
ok = all(bool((engine.gpu.pool.data[engine.gpu.get(h).slot] == prefill_value(h)).all())
         for h in engine.gpu.order())
print(json.dumps({"errors": engine.stats.errors, "r3": r3.tokens, "ok": ok,
                  "disk": engine.disk.order(),
                  "tmp": [p for p in os.listdir(directory) if p.endswith(".tmp")]}))
"""


def test_permission_denied_on_read_and_write():
    """Permission denied, for real: the kernel refuses the read and the file creation. Root
    bypasses file modes through CAP_DAC_OVERRIDE, so as root the scenario runs in a child
    process whose bounding set lacks CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (util-linux
    ``setpriv``); the file modes then bind it like any owner."""
    directory = Path(tempfile.mkdtemp(prefix="kvscope-perm-"))
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without util-linux setpriv to drop CAP_DAC_OVERRIDE")
        caps = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--"]
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        result = subprocess.run([*prefix, sys.executable, "-c", PERMISSION_SCENARIO, str(directory)],
                                capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        os.chmod(directory, 0o755)
        shutil.rmtree(directory)
    assert out["r3"]["recompute"] == 16 and out["ok"]
    # r3: reading A's chunk is refused, and the spills of the cpu victims made on the way (B,
    # then C) cannot create files. Nothing is left on the disk tier, nothing half-written.
    assert out["errors"] == {"permission": 3}, out
    assert out["disk"] == [] and out["tmp"] == []
