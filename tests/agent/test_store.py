"""The request store: frames survive crashes, torn tails are ignored, segments are bounded."""

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import free_port, sigint_default, wait_until
from kvscope import events as ev
from kvscope.agent.requests import RequestRecord, TransferRecord
from kvscope.agent.store import RequestStore, read_segment
from kvscope.agent.taps.emitter import Emitter


def _record(i, finished=None):
    return RequestRecord(f"r{i}", f"{i:032x}", "engine", 1000.0 + i, prompt_tokens=64,
                         tokens={"gpu": 48, "recompute": 16}, ttft=0.05, lookup=0.0,
                         promotion_wait=0.0, transfers=(TransferRecord("cpu", "gpu", 2, 65536, 1000.0 + i, 1e-4),),
                         finished=finished)


# A frame of _record(i) for a 4-digit i: 8 header bytes + 363 of msgpack (a 16-key map: 3
# bytes of map header, keys 155 bytes, values 205, the transfer's 7-key map among them;
# finished is nil, 1 byte).
_FRAME = 371


def _ids(records):
    return [r.request_id for r in records]


def test_records_round_trip_and_a_torn_tail_is_ignored_quietly(tmp_path, caplog):
    """10 frames of 371 bytes, one segment of 3710 bytes. Cutting 7 bytes (inside the last
    payload) or 368 (leaving 3 bytes of the last header) tears the last frame: 9 records come
    back, with no warning."""
    store = RequestStore(tmp_path)
    store.start()
    for i in range(1000, 1010):
        store.add(_record(i))
    store.shutdown()
    (segment,) = store.segments()
    assert read_segment(segment) == [_record(i) for i in range(1000, 1010)]
    data = segment.read_bytes()
    assert len(data) == 10 * _FRAME
    for cut in (7, _FRAME - 3):  # a crash in the middle of the last frame
        segment.write_bytes(data[:-cut])
        assert _ids(read_segment(segment)) == [f"r{i}" for i in range(1000, 1009)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("frame, byte", [(250, 0), (250, 3), (250, 5), (250, 28), (499, 28)])
def test_a_damaged_frame_costs_only_its_record_and_is_reported(tmp_path, caplog, frame, byte):
    """500 frames of 371 bytes in one segment. Flipping one byte of frame 250 (the high or low
    byte of its length, its CRC, its payload) or of the last frame's payload: that frame's CRC
    (or length) no longer holds, reading skips its 371 bytes from offset 371 * frame (92750,
    or 185129 for the last) and resumes at the next frame: 499 records, all but that one."""
    store = RequestStore(tmp_path)
    for i in range(1000, 1500):
        store.add(_record(i))
    store.flush()
    (segment,) = store.segments()
    data = bytearray(segment.read_bytes())
    assert len(data) == 500 * _FRAME
    data[frame * _FRAME + byte] ^= 0xFF
    segment.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvscope.agent.store"):
        records = read_segment(segment)
    assert _ids(records) == [f"r{i}" for i in range(1000, 1500) if i != 1000 + frame]
    (warning,) = caplog.records
    assert warning.levelno == logging.WARNING
    assert (f"{segment}: skipped {_FRAME} damaged bytes at offset {frame * _FRAME}"
            in warning.getMessage())


@pytest.mark.parametrize("fill", ["zeros", "random"])
def test_a_long_damaged_region_costs_no_record_and_is_passed_quickly(tmp_path, caplog, fill):
    """Two good frames around 64 MiB of zeros (what a power loss leaves of a file's tail) or
    4 MiB of random bytes: both records come back, one warning names the segment, the offset
    and the bytes skipped. Trying every offset in Python took about a minute for the zeros
    (bench/store_restore.py measures both scans side by side)."""
    store = RequestStore(tmp_path)
    for i in (1000, 1001):
        store.add(_record(i))
    store.flush()
    (segment,) = store.segments()
    data = segment.read_bytes()
    damage = bytes(64 << 20) if fill == "zeros" else random.Random(26).randbytes(4 << 20)
    segment.write_bytes(data[:_FRAME] + damage + data[_FRAME:])
    with caplog.at_level(logging.WARNING, logger="kvscope.agent.store"):
        assert _ids(read_segment(segment)) == ["r1000", "r1001"]
    (warning,) = caplog.records
    assert (f"{segment}: skipped {len(damage)} damaged bytes at offset {_FRAME}"
            in warning.getMessage())


def test_the_store_stays_within_max_bytes_and_keeps_the_newest(tmp_path):
    """max_bytes 12000: segments of 12000 // 4 = 3000 bytes hold 3000 // 371 = 8 frames (2968
    bytes). 1000 records, flushed 7 at a time, fill 125 segments; after every flush at most
    12000 bytes remain, and at the end the newest 4 segments (11872 bytes; 5 would be 14840):
    the newest 32 records, r1968..r1999. (A constant clock: no segment ages.)"""
    store = RequestStore(tmp_path, max_bytes=12_000, clock=lambda: 3000.0)
    for i in range(1000, 2000):
        store.add(_record(i))
        if i % 7 == 6 or i == 1999:
            store.flush()
            assert sum(p.stat().st_size for p in store.segments()) <= 12_000
    assert [p.stat().st_size for p in store.segments()] == [8 * _FRAME] * 4
    assert _ids(store.load(1000)) == [f"r{i}" for i in range(1968, 2000)]


def test_a_segment_that_cannot_be_deleted_is_no_failed_write(tmp_path, monkeypatch):
    """Deleting the oldest segment fails (PermissionError, injected): the flush once raised
    after its records were written, so they were counted lost and the segment abandoned.
    The records count as written, and the other segments are still pruned to max_bytes (the
    stuck one included in the total)."""
    from pathlib import Path

    store = RequestStore(tmp_path, max_bytes=12_000, clock=lambda: 3000.0)
    for i in range(1000, 1016):  # 2 full segments of 8
        store.add(_record(i))
    store.flush()
    stuck = store.segments()[0]
    unlink = Path.unlink

    def refuse(path, missing_ok=False):
        if path == stuck:
            raise PermissionError(13, "Permission denied", str(path))
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    for i in range(1016, 1100):
        store.add(_record(i))
        assert store.flush() == 1
    assert store.lost == 0 and stuck.exists()
    assert sum(p.stat().st_size for p in store.segments()) <= 12_000


def test_records_older_than_max_age_are_not_loaded_and_age_out_on_a_quiet_node(tmp_path):
    """max_age 100 s, so a segment takes writes for 25 s. The clock is injected, and each
    segment's mtime is set to the clock when it is written (what the wall clock would do).
    t=0: r0..r4 go to segment A; t=30: A is 30 s old, so r5..r9 go to a new segment B.
    t=101: r0..r4 finished 101 s ago and are not loaded, r5..r9 (71 s) are; a flush with
    nothing new deletes A (last written 101 s ago) and keeps B (71 s). t=131: B goes too."""
    now = [1_000_000.0]
    store = RequestStore(tmp_path, max_age=100.0, clock=lambda: now[0])

    def write(ids):
        for i in ids:
            store.add(_record(i, finished=now[0]))
        store.flush()
        os.utime(store.segments()[-1], (now[0], now[0]))

    write(range(5))
    assert len(store.segments()) == 1
    now[0] += 30
    write(range(5, 10))
    (_, b) = store.segments()
    now[0] += 71
    restarted = RequestStore(tmp_path, max_age=100.0, clock=lambda: now[0])
    assert _ids(restarted.load(100)) == [f"r{i}" for i in range(5, 10)]
    store.flush()
    assert store.segments() == [b]
    now[0] += 30
    store.flush()
    assert store.segments() == [] and restarted.load(100) == []


def test_segments_written_after_the_clock_stepped_back_still_sort_last(tmp_path):
    """A restarted agent, the clock stepped back 5 s since (NTP), stores the request's new
    version (vLLM's late span amended it): a later load serves that version. Named by the
    clock alone, its segment sorted before the first run's, whose stale version won."""
    _store_twice(tmp_path, 3000.0, 2995.0)
    assert [r.ttft for r in RequestStore(tmp_path, clock=lambda: 2995.0).load(10)] == [0.25]


def _store_twice(directory, first_clock, second_clock):
    """A record stored by one store, then its amended version (TTFT 0.25) by a second, each
    at its own clock (Unix seconds); returns the second store."""
    first = RequestStore(directory, clock=lambda: first_clock)
    first.add(_record(1, finished=2999.0))
    first.flush()
    second = RequestStore(directory, clock=lambda: second_clock)
    amended = _record(1, finished=2999.0)
    amended.ttft = 0.25
    second.add(amended)
    second.flush()
    return second


def test_segments_sort_by_their_stamps_as_numbers(tmp_path):
    """A segment named at the 15-digit stamp 999999999999999 (corrupt, or from a clock far
    ahead): the next is named 1000000000000000, which sorted before it as text, so the stale
    version won and pruning would take the new segment first."""
    later = _store_twice(tmp_path, 999_999_999_999.999, 3000.0)
    names = [p.name.split("-")[1] for p in later.segments()]
    assert names == ["999999999999999", "1000000000000000"]
    assert [r.ttft for r in RequestStore(tmp_path, clock=lambda: 3000.0).load(10)] == [0.25]


def _start_agent(port, ingest, store_dir, log):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "agent", "--port", str(port), "--ingest", ingest,
         "--store-dir", str(store_dir)], stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, preexec_fn=sigint_default)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert proc.poll() is None, "agent exited early"
        time.sleep(0.1)
    raise AssertionError("agent did not become ready")


def _total(port):
    return httpx.get(f"http://127.0.0.1:{port}/api/v1/requests?limit=1").json()["total"]


@pytest.mark.parametrize("source", ["engine", "vllm"])
def test_kill_9_mid_write_loses_at_most_the_last_second(tmp_path, source):
    """Requests stream in continuously; we read how many the agent holds, wait 1.5 s (more than
    the 1 s flush interval), kill -9 it while writes go on, and restart it on the same store:
    it must restore at least the count read before the wait, from intact frames only.
    Source "vllm" is the one the OTLP receiver (on by default) joins with vLLM's spans: its
    records wait 6 s for them, and once reached the store only then (6 s lost); they are
    stored at once now, and again once joined (a request restored once, as last written)."""
    port, ingest, store_dir = free_port(), f"ipc://{tmp_path}/in.sock", tmp_path / "store"
    log = open(tmp_path / "agent.log", "w")
    proc = _start_agent(port, ingest, store_dir, log)
    stop = threading.Event()

    def feed():
        emitter = Emitter(ingest, source=source, flush_interval=0.01)
        i = 0
        while not stop.is_set():
            t = time.time()
            emitter.emit(ev.RequestStarted(ts=t, request_id=f"q{i}", prompt_tokens=32))
            emitter.emit(ev.Lookup(ts=t, request_id=f"q{i}", tokens={"gpu": 32}, blocks=2,
                                   block_hits={"gpu": 2}))
            emitter.emit(ev.RequestFinished(ts=t + 0.01, request_id=f"q{i}", ttft=0.01,
                                            prompt_tokens=32))
            i += 1
            time.sleep(0.001)
        emitter.close()

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        deadline = time.monotonic() + 60
        while _total(port) < 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        before = _total(port)
        assert before >= 200
        time.sleep(1.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        stop.set()
        feeder.join()
    restarted = _start_agent(port, ingest, store_dir, log)
    try:
        restored = _total(port)
        assert restored >= before
        on_disk = [r for path in sorted(store_dir.glob("*.kvseg")) for r in read_segment(path)]
        # every intact frame's request restored, nothing invented
        assert len({r.request_id for r in on_disk}) == restored
        assert all(r.ttft == 0.01 and r.tokens == {"gpu": 32} for r in on_disk)
        assert not list(store_dir.glob("*.tmp"))
    finally:
        restarted.send_signal(signal.SIGINT)
        assert restarted.wait(30) == 0


def test_the_agent_is_live_while_it_restores_its_store(tmp_path, monkeypatch):
    """While the store is restored (held here at its load: a damaged 256 MiB store takes
    minutes), /healthz answers 200 and /readyz 503; once restored, /readyz 200. The agent once
    served nothing until restored, and a liveness probe could kill it in a loop. vLLM's spans
    are refused meanwhile (503, which OTLP exporters retry): one for a stored request would
    have made a second request."""
    from kvscope.agent.config import AgentSettings
    from kvscope.service.run import run_agent

    restoring, restored = threading.Event(), threading.Event()
    real_load = RequestStore.load

    def held_load(self, limit):
        restoring.set()
        restored.wait(60)
        return real_load(self, limit)

    monkeypatch.setattr(RequestStore, "load", held_load)
    port, stop = free_port(), threading.Event()
    settings = AgentSettings(port=port, ingest={"enabled": False},
                             collectors={"gpu": {"enabled": False}},
                             store_dir=str(tmp_path / "store"))
    agent = threading.Thread(target=run_agent, args=(settings,),
                             kwargs={"out": open(os.devnull, "w"), "stop": stop})
    agent.start()
    try:
        assert restoring.wait(60)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert httpx.get(f"{base}/readyz").status_code == 503
        span = httpx.post(f"{base}/v1/traces", content=b'{"resourceSpans": []}',
                          headers={"content-type": "application/json"})
        assert span.status_code == 503 and span.headers["retry-after"] == "1"
        restored.set()
        assert wait_until(lambda: httpx.get(f"{base}/readyz").status_code == 200)
    finally:
        restored.set()
        stop.set()
        agent.join(60)


def test_a_request_waiting_for_late_transfers_is_stored_when_the_agent_stops(tmp_path):
    """A finished request whose transfers may still come from another source (vLLM's worker
    tap) waits before it reaches the sinks; stopping the agent hands it over before the store
    closes, so a restarted agent has it. (A sample interval of an hour: only the stop can
    hand it over.)"""
    from kvscope.agent.config import AgentSettings
    from kvscope.service.agent import Agent

    settings = AgentSettings(ingest={"enabled": False}, collectors={"gpu": {"enabled": False}},
                             store_dir=str(tmp_path), sample_interval=3600)
    agent = Agent(settings)
    agent.start()
    agent.pipeline.ingest("vllm-worker", [], scope="vllm")
    agent.pipeline.ingest("vllm", [ev.RequestFinished(ts=time.time(), request_id="late",
                                                      ttft=0.2, prompt_tokens=64)])
    agent.shutdown()
    restarted = Agent(settings)
    restarted.start()
    try:
        assert restarted.pipeline.requests.get("late").ttft == 0.2
    finally:
        restarted.shutdown()


def test_an_agent_restarted_on_its_store_counts_the_batches_lost_while_it_was_away(tmp_path):
    """With a store_dir, the agent keeps its emitters' sequence numbers there: batches 0-2 of
    a tap reach the first agent, 3-4 are lost while it restarts, 5 reaches the second one,
    which counts gap 2 (by hand). Without the store it would count none."""
    import zmq

    from kvscope.agent.config import AgentSettings
    from kvscope.service.agent import Agent

    endpoint = f"ipc://{tmp_path}/in.sock"
    settings = AgentSettings(ingest={"endpoint": endpoint}, collectors={"gpu": {"enabled": False}},
                             store_dir=str(tmp_path / "store"), sample_interval=3600)

    def send(agent, *seqs):
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(endpoint)
        lookup = ev.Lookup(ts=time.time(), request_id="r", tokens={"gpu": 16})
        for seq in seqs:
            sock.send(ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="vllm", seq=seq,
                                               session="s", events=[lookup])))
        sock.close(linger=5000)
        assert wait_until(lambda: agent.pipeline.events_received().get("vllm") == len(seqs))

    first = Agent(settings)
    first.start()
    send(first, 0, 1, 2)
    first.shutdown()
    restarted = Agent(settings)
    restarted.start()
    try:
        send(restarted, 5)
        assert restarted.pipeline.snapshot().events_dropped.get(("vllm", "gap")) == 2
    finally:
        restarted.shutdown()


def test_a_request_stored_twice_is_loaded_once_as_last_written(tmp_path):
    """r1 written at its finish (TTFT 0.05), r2, then r1 again once joined (TTFT 0.25): load
    gives r2 then r1 (its last place) with TTFT 0.25; with a limit of 1, r1 alone."""
    store = RequestStore(tmp_path)
    first, second = _record(1, finished=1001.0), _record(2, finished=1002.0)
    for record in (first, second):
        store.add(record)
    store.flush()
    first.ttft = 0.25
    store.add(first)
    store.flush()
    store.shutdown()
    loaded = RequestStore(tmp_path, max_age=1e10).load(10)
    assert _ids(loaded) == ["r2", "r1"] and loaded[1].ttft == 0.25
    assert _ids(RequestStore(tmp_path, max_age=1e10).load(1)) == ["r1"]


def test_records_beyond_the_queue_bound_are_counted_lost_and_logged_once(tmp_path, caplog):
    """A stalled disk held every record in memory, with nothing counted: with 3 queued at
    most, 5 added before a flush lose 2 (one warning), the flush writes 3, and the queue
    takes records again."""
    store = RequestStore(tmp_path, max_queued=3)
    for i in range(5):
        store.add(_record(i))
    assert store.lost == 2
    assert caplog.text.count("3 requests wait to be written") == 1
    assert store.flush() == 3
    store.add(_record(5))
    assert store.flush() == 1 and store.lost == 2


def test_a_second_store_cannot_take_a_directory_in_use(tmp_path):
    """Two agents on one store_dir would prune each other's segments and restore each other's
    records: the second is refused while the first runs, and may take it once it stopped."""
    first, second = RequestStore(tmp_path), RequestStore(tmp_path)
    first.start()
    try:
        with pytest.raises(OSError, match="another kvscope agent"):
            second.take()
    finally:
        first.shutdown()
    second.start()
    second.shutdown()


def test_a_record_msgpack_cannot_hold_is_skipped_and_the_store_keeps_writing(tmp_path, caplog):
    """A token count of 2**64 (what a span once carried past every check) does not encode as
    msgpack. A record's own counts refuse it now (64 bits), but the tokens of a source outside
    the four a record counts are kept as given: that record is skipped and logged once; the
    records around it are written."""
    store = RequestStore(tmp_path, clock=lambda: 3000.0)
    bad = _record(1001)
    with pytest.raises(OverflowError):
        bad.prompt_tokens = 2**64
    bad.tokens = {"gpu": 32, "elsewhere": 2**64}
    for record in (_record(1000), bad, _record(1002)):
        store.add(record)
    store.flush()
    assert _ids(store.load(10)) == ["r1000", "r1002"] and store.unwritable == 1
    assert "cannot write request 'r1001'" in caplog.text


def test_a_store_from_before_the_bounds_is_loaded_within_them(tmp_path):
    """Segments written before records were bounded: one that finished 1e300 s (far in the
    future: it would sort first and never age out) is skipped; one with 300 transfers keeps 64
    and counts 236 omitted; those with a TTFT of NaN or inf, or a negative prefill, are
    skipped too (a NaN restored made the summary's TTFT percentiles null for good). The clock
    is 3000 s, within max_age of r1000's finish."""
    store = RequestStore(tmp_path, clock=lambda: 3000.0)
    many = _record(1000, finished=2000.0)
    many.transfers = many.transfers * 300
    nan, inf, negative = (_record(i, finished=2000.0) for i in (1003, 1004, 1005))
    nan.ttft, inf.ttft, negative.prefill = float("nan"), float("inf"), -1.0
    for record in (many, _record(1001, finished=1e300), _record(1002, finished=2001.0), nan,
                   inf, negative):
        store.add(record)
    store.flush()
    loaded = store.load(10)
    assert _ids(loaded) == ["r1000", "r1002"]
    assert len(loaded[0].transfers) == 64 and loaded[0].transfers_omitted == 236


def test_a_stored_count_past_64_bits_skips_its_record_only(tmp_path, caplog):
    """A segment of an agent from before records held 64-bit counts: r1001's prompt tokens are
    2**63. That intact frame is skipped, named as such (not as damaged bytes, nor read byte by
    byte for the next frame), and the records around it load."""
    import zlib

    import msgspec

    from kvscope.agent.record_data import RecordData
    from kvscope.agent.store import _HEADER, _SUFFIX

    frames = b""
    for i, prompt in ((1000, 1), (1001, 2**63), (1002, 1)):
        payload = msgspec.msgpack.encode(RecordData(f"r{i}", "ab" * 16, "engine", 2000.0,
                                                    prompt_tokens=prompt, finished=2000.0))
        frames += _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
    (tmp_path / f"seg-2000000-1-0{_SUFFIX}").write_bytes(frames)
    store = RequestStore(tmp_path, clock=lambda: 3000.0)
    assert _ids(store.load(10)) == ["r1000", "r1002"]
    assert "count past 64 bits" in caplog.text and "damaged" not in caplog.text


def test_a_removed_directory_is_made_again_and_the_store_writes_on(tmp_path):
    """The directory is removed while the store runs: it kept appending to the deleted segment,
    so every later record was lost without a word. Now the next flush starts a new segment in
    the directory made again, and nothing is lost."""
    directory = tmp_path / "store"
    store = RequestStore(directory, clock=lambda: 3000.0)
    store.take()
    store.add(_record(1000))
    store.flush()
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()
    store.add(_record(1001))
    store.flush()
    assert _ids(store.load(10)) == ["r1001"] and store.lost == 0
    with pytest.raises(OSError, match="another kvscope agent"):  # the lock was taken again
        RequestStore(directory).take()


def test_records_a_full_disk_refuses_are_counted_and_the_store_recovers(tmp_path, monkeypatch,
                                                                         caplog):
    """The disk is full for three flushes (the ENOSPC from fsync stands in for a full disk: no
    test machine can be filled safely): their 3 records are counted lost, the failure is
    logged once (an empty flush meanwhile is no recovery) and so is the recovery, with this
    outage's count; the next flush writes to a new segment, both good flushes' records load
    (the damaged segment's tail is skipped on read), and no empty segment is left behind."""
    store = RequestStore(tmp_path, clock=lambda: 3000.0)
    store.take()
    real_fsync = os.fsync

    def full(fd):
        raise OSError(28, "No space left on device")

    store.add(_record(1000))
    store._flush_logged()
    monkeypatch.setattr(os, "fsync", full)
    for i in (1001, 1002):
        store.add(_record(i))
    store._flush_logged()
    store._flush_logged()  # still failing, nothing to write: neither logged nor "again"
    store.add(_record(1004))
    store._flush_logged()  # 3 lost in this outage
    monkeypatch.setattr(os, "fsync", real_fsync)
    store.add(_record(1003))
    store._flush_logged()
    assert store.lost == 3
    assert caplog.text.count("could not write") == 1
    assert caplog.text.count(" again; ") == 1 and "3 requests could not be stored" in caplog.text
    assert "r1003" in _ids(store.load(10)) and "r1000" in _ids(store.load(10))
    assert all(path.stat().st_size for path in store.segments())  # no empty segment left


# Flushes 100 records at a time into a store at argv[1], under a file-size limit of argv[2]
# bytes (0: none) that makes writes past it fail with EFBIG, as a full disk's fail with ENOSPC,
# in segments of at most argv[3] bytes; prints how many records the store counted lost.
_FILL = """
import resource, signal, sys
from kvscope.agent.requests import RequestRecord
from kvscope.agent.store import RequestStore
store = RequestStore(sys.argv[1], clock=lambda: 3000.0, segment_bytes=int(sys.argv[3]))
store.take()
if int(sys.argv[2]):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a signal that kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]),) * 2)
for flush in range(8):
    for i in range(1000 + 100 * flush, 1100 + 100 * flush):
        store.add(RequestRecord(f"r{i}", f"{i:032x}", "engine", 2990.0, prompt_tokens=64,
                                ttft=0.05, finished=2991.0))
    store._flush_logged()
print(store.lost)
"""


@pytest.mark.parametrize("limit, segment_bytes", [("file size limit", 8 << 20),
                                                  ("full tmpfs", 8 << 20), ("full tmpfs", 10_000)])
def test_records_counted_lost_on_a_full_disk_are_exactly_those_missing_after_a_restart(
        tmp_path, limit, segment_bytes):
    """8 flushes of 100 records (29 KB each) into a disk that takes 64 KiB per segment (a
    file size limit; writes past it fail with EFBIG, on the path ENOSPC takes) or 128 KiB in
    all (a tmpfs; skipped where mounting is not allowed): flushes fail with frames of theirs
    written before the failure. Those frames came back at a restart though counted lost
    (10,533 counted, 10,308 missing on a real full disk); now the segment is cut back to its
    last fsync, and a restarted store reads back all but exactly the records counted lost.
    With 10 KB segments a failing flush has first filled (and fsynced) others: their records
    count as written."""
    directory = tmp_path / "store"
    directory.mkdir()
    if limit == "full tmpfs":
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs",
                                  str(directory)], capture_output=True, check=False)
        if mounted.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        done = subprocess.run([sys.executable, "-c", _FILL, str(directory),
                               str(64 << 10 if limit == "file size limit" else 0),
                               str(segment_bytes)],
                              capture_output=True, text=True, check=True, timeout=60)
        lost = int(done.stdout)
        back = RequestStore(directory, clock=lambda: 3000.0).load(10_000)
    finally:
        if limit == "full tmpfs":
            subprocess.run(["umount", str(directory)], check=False)
    assert "could not write" in done.stderr  # the disk did refuse writes
    assert 0 < lost < 800 and len(back) == 800 - lost
    assert len({r.request_id for r in back}) == len(back)


def test_flushes_a_full_disk_refuses_leave_no_segment_behind(tmp_path, monkeypatch):
    """Three flushes fail (ENOSPC from fsync stands in for a full disk): each gave its
    segment up and started a new one at the next, and each such segment, holding nothing
    durable, stayed: one per second while the disk was full, each in the way of the space
    coming back. Now they are deleted; the records are counted lost."""
    store = RequestStore(tmp_path, clock=lambda: 3000.0)
    store.take()

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    for i in range(3):
        store.add(_record(1000 + i))
        store._flush_logged()
    assert store.segments() == [] and store.lost == 3


def test_a_restarted_agents_summary_percentiles_include_the_restored_requests(tmp_path):
    """Three stored requests of TTFT 0.1, 0.2 and 0.6 s: after a restart the summary gave no
    percentiles although the API served the three. Now p50 is 0.2 (the middle one, by hand) and
    the request counter starts again at 0."""
    from fastapi.testclient import TestClient

    from kvscope.agent.config import AgentSettings
    from kvscope.service.agent import Agent
    from kvscope.service.api import create_app

    now = time.time()
    store = RequestStore(tmp_path)
    for i, ttft in enumerate((0.1, 0.2, 0.6)):
        record = _record(1000 + i, finished=now - 10 + i)
        record.ttft = ttft
        store.add(record)
    store.flush()
    agent = Agent(AgentSettings(store_dir=str(tmp_path), ingest={"enabled": False},
                                collectors={"gpu": {"enabled": False}}))
    agent.prepare()
    try:
        with TestClient(create_app(agent)) as client:
            summary = client.get("/api/v1/summary").json()
    finally:
        agent.shutdown()
    assert summary["ttft_seconds"]["p50"] == pytest.approx(0.2)
    assert agent.pipeline.snapshot().requests == 0


def test_records_the_store_could_not_write_are_exported(tmp_path, monkeypatch):
    """One request finishes while the disk is full (ENOSPC from fsync stands in for it): the
    agent's /metrics counts it in kvscope_records_dropped_total{sink="store"}; the capture's
    sinks, not configured, read 0."""
    from kvscope.agent.config import AgentSettings
    from kvscope.service.agent import Agent

    agent = Agent(AgentSettings(store_dir=str(tmp_path), ingest={"enabled": False},
                                collectors={"gpu": {"enabled": False}}))
    agent.prepare()
    real_fsync = os.fsync
    try:
        agent.pipeline.ingest("engine", [ev.RequestFinished(ts=time.time(), request_id="r",
                                                            ttft=0.1, prompt_tokens=8)])
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "full")))
        agent.store._flush_logged()
    finally:
        monkeypatch.setattr(os, "fsync", real_fsync)
        agent.shutdown()
    value = agent.exposition.registry.get_sample_value
    assert value("kvscope_records_dropped_total", {"sink": "store"}) == 1
    assert value("kvscope_records_dropped_total", {"sink": "capture_blocks"}) == 0


def test_a_store_whose_lock_was_replaced_writes_nothing_into_another_agents_directory(tmp_path):
    """Agent A's .lock is removed and agent B takes the directory: A used to write on beside B
    (two writers). Now A's next flush finds the lock is no longer its own, cannot take it back,
    and counts its 2 records lost instead of writing them; once B lets go, A takes the
    directory again and writes."""
    a = RequestStore(tmp_path, clock=lambda: 3000.0)
    a.take()
    a.add(_record(1000))
    a._flush_logged()
    (tmp_path / ".lock").unlink()
    b = RequestStore(tmp_path, clock=lambda: 3000.0)
    b.take()
    for i in (1001, 1002):
        a.add(_record(i))
    a._flush_logged()
    assert a.lost == 2 and _ids(b.load(10)) == ["r1000"]
    b._owner.close()  # B stops
    a.add(_record(1003))
    a._flush_logged()
    assert _ids(a.load(10)) == ["r1000", "r1003"]
