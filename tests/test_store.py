"""The request store: frames survive crashes, torn tails are ignored, segments are bounded."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from conftest import free_port
from kvscope import events as ev
from kvscope.agent.requests import RequestRecord, TransferRecord
from kvscope.agent.store import RequestStore, read_segment
from kvscope.agent.taps.emitter import Emitter


def _record(i):
    return RequestRecord(f"r{i}", f"{i:032x}", "engine", 1000.0 + i, prompt_tokens=64,
                         tokens={"gpu": 48, "recompute": 16}, ttft=0.05,
                         transfers=(TransferRecord("cpu", "gpu", 2, 65536, 1000.0 + i, 1e-4),))


def test_records_round_trip_and_a_torn_tail_is_ignored(tmp_path):
    store = RequestStore(tmp_path)
    store.start()
    for i in range(10):
        store.add(_record(i))
    store.shutdown()
    (segment,) = store.segments()
    assert read_segment(segment) == [_record(i) for i in range(10)]
    data = segment.read_bytes()
    segment.write_bytes(data[:-7])  # a crash in the middle of the last frame
    assert [r.request_id for r in read_segment(segment)] == [f"r{i}" for i in range(9)]


def test_a_corrupt_frame_stops_reading_but_keeps_what_came_before(tmp_path):
    store = RequestStore(tmp_path)
    for i in range(3):
        store.add(_record(i))
        store.flush()
    (segment,) = store.segments()
    data = bytearray(segment.read_bytes())
    frame = len(data) // 3
    data[frame + 20] ^= 0xFF  # flip a payload byte of the second frame: its CRC no longer holds
    segment.write_bytes(bytes(data))
    assert [r.request_id for r in read_segment(segment)] == ["r0"]


def test_segments_rotate_and_are_pruned_by_size_and_age(tmp_path):
    now = [1_000_000.0]
    store = RequestStore(tmp_path, segment_bytes=1, max_bytes=10_000, max_age=3600.0,
                         clock=lambda: now[0])
    for i in range(40):  # every flush rotates (segment_bytes=1): one record per segment
        now[0] += 1.0
        store.add(_record(i))
        store.flush()
    sizes = [p.stat().st_size for p in store.segments()]
    assert sum(sizes[:-1]) <= 10_000 and len(sizes) < 40
    assert [r.request_id for r in store.load(5)] == [f"r{i}" for i in range(35, 40)]
    os.utime(store.segments()[0], (0, 0))  # make the oldest segment ancient
    oldest = store.segments()[0]
    now[0] += 1.0
    store.add(_record(99))
    store.flush()
    assert oldest not in store.segments()


def _start_agent(port, ingest, store_dir, log):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "agent", "--port", str(port), "--ingest", ingest,
         "--store-dir", str(store_dir)], stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL)
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


def test_kill_9_mid_write_loses_at_most_the_last_second(tmp_path):
    """Requests stream in continuously; we read how many the agent holds, wait 1.5 s (more than
    the 1 s flush interval), kill -9 it while writes go on, and restart it on the same store:
    it must restore at least the count read before the wait, from intact frames only."""
    port, ingest, store_dir = free_port(), f"ipc://{tmp_path}/in.sock", tmp_path / "store"
    log = open(tmp_path / "agent.log", "w")
    proc = _start_agent(port, ingest, store_dir, log)
    stop = threading.Event()

    def feed():
        emitter = Emitter(ingest, source="engine", flush_interval=0.01)
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
        assert len(on_disk) == restored  # every intact frame restored, nothing invented
        assert all(r.ttft == 0.01 and r.tokens == {"gpu": 32} for r in on_disk)
        assert not list(store_dir.glob("*.tmp"))
    finally:
        restarted.send_signal(signal.SIGINT)
        assert restarted.wait(30) == 0


def test_a_request_waiting_for_late_transfers_is_stored_when_the_agent_stops(tmp_path):
    """A finished request whose transfers may still come from another source (vLLM's worker
    tap) waits before it reaches the sinks; stopping the agent hands it over before the store
    closes, so a restarted agent has it. (A sample interval of an hour: only the stop can
    hand it over.)"""
    from kvscope.agent.agent import Agent
    from kvscope.agent.config import AgentSettings

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
