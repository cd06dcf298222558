"""Ingest over real ZMQ sockets: emitter -> agent, bad input counted and dropped, restarts."""

import os
import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope import events as ev
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources.ingest import QUIET, IngestSource
from kvscope.agent.taps.emitter import Emitter

from conftest import REPO_ROOT, wait_until


def _endpoint(tmp_path):
    return f"ipc://{tmp_path}/ingest.sock"


def _lookup(i):
    return ev.Lookup(ts=float(i), request_id=f"r{i}", tokens={"gpu": 16, "recompute": 4})


@pytest.fixture
def source(tmp_path):
    pipeline = Pipeline()
    src = IngestSource(pipeline, _endpoint(tmp_path), max_batch_bytes=64 << 10)
    src.start()
    yield src
    src.shutdown()


def _push(endpoint, *messages):
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    for message in messages:
        sock.send(message)
    sock.close()


def test_the_emitter_imports_nothing_but_msgspec_pyzmq_and_the_standard_library():
    """A tap runs inside the engine's process: importing the emitter there must not pull in
    the agent (FastAPI, prometheus-client, pyarrow...). What msgspec and pyzmq import
    themselves is theirs; beyond them only the emitter, the event model (with its
    vocabulary) and how an error reads in a log line, standard library only, may load."""
    import subprocess
    import sys

    code = ("import sys; import msgspec, zmq; before = set(sys.modules); "
            "import kvscope.agent.taps.emitter; "
            "print(*sorted(set(sys.modules) - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    # __mp_main__: multiprocessing's alias of __main__, made when it is imported
    third_party = {name for name in out if name.split(".")[0] not in sys.stdlib_module_names
                   and name != "__mp_main__"}
    assert third_party == {"kvscope", "kvscope.agent", "kvscope.agent.taps",
                           "kvscope.agent.taps.emitter", "kvscope.errors", "kvscope.events",
                           "kvscope.vocabulary"}


def test_emitter_delivers_every_event(source, tmp_path):
    emitter = Emitter(_endpoint(tmp_path), source="engine", engine="vllm", model="tiny-llama",
                      batch_size=100)
    for i in range(2500):
        emitter.emit(_lookup(i))
    assert wait_until(lambda: source.pipeline.snapshot().events_received.get("engine") == 2500)
    emitter.close()
    snap = source.pipeline.snapshot()
    assert snap.prompt_tokens["gpu"] == 2500 * 16
    assert snap.events_dropped == {} and emitter.dropped == 0
    assert snap.source_info == {"engine": ("vllm", "tiny-llama")}
    assert snap.cache_config == {}  # the emitter said nothing of them: nothing is known


def test_an_emitters_kv_cache_settings_reach_the_engines_cache_config(source, tmp_path):
    """An emitter given its engine's KV cache settings carries them in its batches: the agent
    records them for its source, as the kvscope_engine_cache_config_info the Overview's check
    5 reads (fp8 counted by its width)."""
    emitter = Emitter(_endpoint(tmp_path), source="engine", engine="vllm", prefix_caching=False,
                      kv_cache_dtype="fp8_e4m3")
    emitter.emit(_lookup(0))
    assert wait_until(lambda: source.pipeline.snapshot().cache_config)
    emitter.close()
    assert source.pipeline.snapshot().cache_config == {"engine": ("off", "8bit")}


def _emit_in_child(emitter, first, n):
    # nothing started before the child's first event (a child that execs at once, as
    # subprocess's with a preexec_fn, aborted in libzmq), and not the parent's on_tick
    if threading.active_count() != 1 or emitter.on_tick is not None:
        os._exit(2)
    if emitter.sent_batches or emitter.buffered() or emitter.dropped:  # the parent's counts
        os._exit(3)
    for i in range(first, first + n):
        emitter.emit(_lookup(i))
    emitter.close(timeout=10.0)
    os._exit(0 if emitter.dropped == 0 else 1)


def test_an_emitter_made_before_a_fork_delivers_the_childs_events_too(source, tmp_path):
    """An engine makes its emitter, then forks a worker (multiprocessing's fork) that emits 100
    events: they arrive, as a session of their own, beside the parent's 50. The child once kept
    them in a buffer no thread sent (the fork leaves only the calling thread) and close()
    returned at once: 100 events lost, none counted. The child starts its sender only at its
    first event, without the parent's on_tick (which sent the parent's tier state, frozen)."""
    import multiprocessing

    emitter = Emitter(_endpoint(tmp_path), source="engine", flush_interval=0.01)
    emitter.on_tick = lambda: None
    for i in range(50):
        emitter.emit(_lookup(i))
    assert wait_until(lambda: source.pipeline.snapshot().events_received.get("engine") == 50)
    child = multiprocessing.get_context("fork").Process(target=_emit_in_child,
                                                        args=(emitter, 1000, 100))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert wait_until(lambda: source.pipeline.snapshot().events_received.get("engine") == 150)
    emitter.close()
    snap = source.pipeline.snapshot()
    assert snap.prompt_tokens["gpu"] == 150 * 16 and snap.events_dropped == {}


def test_a_tap_closing_while_the_agent_is_busy_loses_no_batch(tmp_path, monkeypatch):
    """The agent folds slowly (5 ms a batch, stood in for by a sleep) while a tap sends 60
    batches and closes. ZMQ held the last batch for the agent's full receive queue and dropped
    it when the tap disconnected: 5,900 of 6,000 events arrived, none counted lost. A thread
    of its own now receives while another folds, so ZMQ's queue stays short (the batches wait,
    under 1 MB of them here, 16 KB each, in the agent's queue of 32 MiB)."""
    pipeline = Pipeline()
    fold = pipeline.ingest

    def busy(*args, **kwargs):
        time.sleep(0.005)
        fold(*args, **kwargs)

    monkeypatch.setattr(pipeline, "ingest", busy)
    source = IngestSource(pipeline, _endpoint(tmp_path))  # ZMQ's queue: 4 messages of 8 MiB
    source.start()
    try:
        emitter = Emitter(_endpoint(tmp_path), source="engine", batch_size=100,
                          flush_interval=0.001, max_buffer=10_000)
        time.sleep(0.3)  # connected: the tap's first batches are not the point here
        for i in range(6000):
            emitter.emit(_lookup(i))
        emitter.close(timeout=30.0)
        assert emitter.dropped == 0
        assert wait_until(lambda: pipeline.events_received().get("engine") == 6000)
    finally:
        source.shutdown()


def test_empty_messages_cannot_grow_the_receive_queue_past_its_bound(tmp_path, monkeypatch):
    """The fold is held (a slow batch) while a sender pushes 100,000 empty messages: the
    messages waiting stay within queue_bytes (1 MiB here), each counted with the bytes it
    costs beyond its own (64), so at most 16,385 wait. Counted by their length alone, empty
    ones cost nothing against the bound and all 100,000 waited."""
    from kvscope.agent.sources.ingest import MESSAGE_OVERHEAD

    pipeline, gate = Pipeline(), threading.Event()
    fold = pipeline.ingest

    def held(*args, **kwargs):
        gate.wait(30)
        fold(*args, **kwargs)

    monkeypatch.setattr(pipeline, "ingest", held)
    source = IngestSource(pipeline, _endpoint(tmp_path), queue_bytes=1 << 20)
    source.start()
    sender = zmq.Context.instance().socket(zmq.PUSH)
    sender.setsockopt(zmq.LINGER, 0)
    sender.setsockopt(zmq.SNDHWM, 0)
    sender.connect(_endpoint(tmp_path))
    try:
        sender.send(ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="engine", seq=0,
                                             events=[_lookup(0)])))
        for _ in range(100_000):
            sender.send(b"")
        bound = (1 << 20) // MESSAGE_OVERHEAD + 1
        assert wait_until(lambda: len(source._received) >= bound - 1)
        time.sleep(0.5)  # what more the receiver would take, it takes now
        assert len(source._received) <= bound
    finally:
        gate.set()
        source.shutdown()
        sender.close()


def test_close_waits_for_a_slow_agent_to_take_a_burst(tmp_path):
    """A burst larger than ZMQ's queues (send_hwm=2 batches of 1,000 events, about 60 KB each)
    emitted just before close(): close keeps sending as the agent drains, so every one of the
    50,000 events arrives and none is counted as dropped."""
    pipeline = Pipeline()
    src = IngestSource(pipeline, _endpoint(tmp_path),
                       queue_bytes=16 << 20)  # 2 messages of at most 8 MiB (twice the limit)
    src.start()
    try:
        emitter = Emitter(_endpoint(tmp_path), source="engine", batch_size=1000, send_hwm=2,
                          max_buffer=60_000)
        emitter.emit(_lookup(50_000))  # connected once this one has arrived
        assert wait_until(lambda: pipeline.events_received().get("engine") == 1)
        for i in range(50_000):
            emitter.emit(_lookup(i))
        emitter.close(timeout=60.0)
        assert emitter.dropped == 0
        assert wait_until(lambda: pipeline.events_received()["engine"] == 50_001)
    finally:
        src.shutdown()


def test_close_counts_what_it_could_not_send(tmp_path):
    """No agent ever binds: close() gives up after its timeout and counts every buffered
    event as dropped, so the loss is visible, not silent."""
    emitter = Emitter(_endpoint(tmp_path), source="engine", batch_size=10)
    for i in range(25):
        emitter.emit(_lookup(i))
    emitter.close(timeout=0.2)
    assert emitter.dropped == 25 and emitter.buffered() == 0


@pytest.mark.parametrize("timeout", [None, float("inf"), 3e6, 1e10])
def test_close_without_a_deadline_waits_until_the_agent_has_everything(source, tmp_path,
                                                                      timeout, monkeypatch):
    """close(None) raised a TypeError, and close(inf), close(3e6) (35 days) and close(1e10) an
    OverflowError (in the caller, or in the sender thread, which then left its socket open:
    ZMQ's linger is an int of milliseconds): all now wait until sent."""
    errors = []  # what the sender thread raises
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    emitter = Emitter(_endpoint(tmp_path), source="engine", batch_size=10)
    for i in range(25):
        emitter.emit(_lookup(i))
    emitter.close(timeout)
    assert emitter.dropped == 0 and errors == []
    assert wait_until(lambda: source.pipeline.events_received().get("engine") == 25)


@pytest.mark.parametrize("timeout", [-1.0, float("nan")])
def test_close_with_a_negative_or_nan_timeout_gives_up_at_once(tmp_path, timeout):
    emitter = Emitter(_endpoint(tmp_path), source="engine")  # no agent
    emitter.emit(_lookup(0))
    emitter.close(timeout)
    assert emitter.dropped == 1


def test_a_closed_emitters_tiers_leave_the_gauges(source, tmp_path):
    """Engines dp0 and dp1 report 1000 and 3000 bytes of cpu tier: 4000. dp1 stops (its
    emitter's close sends a final batch): 1000, where dp1's share once stayed until the agent
    restarted. dp0 stops too: no cpu tier is left to export."""
    emitters = {}
    for name, capacity in (("dp0", 1000), ("dp1", 3000)):
        emitters[name] = Emitter(_endpoint(tmp_path), source=name, flush_interval=0.01)
        emitters[name].emit(ev.TierSnapshot(ts=1.0, tier="cpu", capacity_bytes=capacity,
                                            resident_bytes=0, capacity_blocks=1,
                                            resident_blocks=0))

    def cpu_capacity():
        tier = source.pipeline.snapshot().tiers.get("cpu")
        return tier.capacity_bytes if tier else None

    assert wait_until(lambda: cpu_capacity() == 4000)
    emitters["dp1"].close()
    assert wait_until(lambda: cpu_capacity() == 1000)
    emitters["dp0"].close()
    assert wait_until(lambda: cpu_capacity() is None)


def test_close_loses_at_most_what_zmq_holds_and_counts_the_rest(tmp_path):
    """A slow agent (a PULL socket taking one 100-event batch per 20 ms) and close(0.5) on
    5,000 buffered events: what the emitter still buffers at the deadline is counted in
    ``dropped``; only what ZMQ itself holds can be lost uncounted: send_hwm (4 batches by
    default) plus what its I/O threads hold on both sides (3 batches, measured), so at most
    10 batches. (With the old send_hwm of 64, 23 batches went uncounted here.)"""
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.bind(_endpoint(tmp_path))
    received = []
    done = threading.Event()

    def slow_agent():
        while not done.is_set():
            if sock.poll(100):
                received.append(len(ev.decode_batch(sock.recv()).events))
                time.sleep(0.02)

    agent = threading.Thread(target=slow_agent)
    agent.start()
    try:
        emitter = Emitter(_endpoint(tmp_path), source="engine", batch_size=100)
        for i in range(5000):
            emitter.emit(_lookup(i))
        emitter.close(timeout=0.5)
        assert emitter.dropped > 0  # the agent was too slow for all of it
        settled = -1
        while settled != sum(received):  # what was handed over still arrives
            settled = sum(received)
            time.sleep(0.3)
        assert sum(received) + emitter.dropped >= 5000 - 10 * 100
        assert sum(received) + emitter.dropped <= 5000
    finally:
        done.set()
        agent.join()
        sock.close(0)


def test_a_closed_emitter_counts_what_it_is_given_and_close_is_safe_from_threads(tmp_path):
    emitter = Emitter(_endpoint(tmp_path), source="engine")
    closers = [threading.Thread(target=emitter.close, kwargs={"timeout": 0.2}) for _ in range(3)]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join()
    emitter.emit(_lookup(1))
    emitter.emit(_lookup(2))
    assert emitter.dropped == 2 and emitter.buffered() == 0


def test_an_event_that_breaks_the_encoder_is_dropped_and_the_emitter_keeps_sending(source, tmp_path):
    """A self-referencing dict makes msgspec raise RecursionError (not a TypeError): the batch
    is counted as dropped, and later events still arrive."""
    loop: dict = {}
    loop["x"] = loop
    emitter = Emitter(_endpoint(tmp_path), source="engine", flush_interval=0.01)
    emitter.emit(ev.Lookup(ts=1.0, request_id="bad", tokens={"gpu": 1}, block_hits=loop))
    assert wait_until(lambda: emitter.dropped == 1)
    emitter.emit(_lookup(2))
    assert wait_until(lambda: source.pipeline.events_received().get("engine") == 1)
    emitter.close()


def test_an_event_that_does_not_encode_costs_only_itself(source, tmp_path):
    """A tap's numpy scalar in one event of 21 (msgspec encodes no numpy types): the other 20
    arrive, 1 is counted dropped, where the whole batch of 21 once went."""
    import numpy as np

    emitter = Emitter(_endpoint(tmp_path), source="engine", flush_interval=0.05)
    events = [_lookup(i) for i in range(10)]
    events.append(ev.Transfer(ts=1.0, src="cpu", dst="gpu", blocks=np.int64(3), bytes=64,
                              duration=0.001))
    events += [_lookup(i) for i in range(10, 20)]
    for event in events:
        emitter.emit(event)
    assert wait_until(lambda: source.pipeline.events_received().get("engine") == 20)
    emitter.close()
    assert emitter.dropped == 1
    assert source.pipeline.snapshot().events_dropped[("engine", "emitter_buffer")] == 1


def test_bad_input_is_counted_by_reason_and_the_source_keeps_serving(source, tmp_path):
    """Drops count the events lost where the batch's header can be read, under the source it
    names (it sent a valid batch first): 2 in the future version's batch, 1 with an unknown
    tier, 600 over the size limit; 1 from a bad source name (under "ingest": the name is no
    label); the random bytes and the truncated batch cannot be read, 1 each under "ingest".
    Total 606."""
    endpoint = _endpoint(tmp_path)
    good = ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="engine", seq=0,
                                    events=[_lookup(0)]))
    wrong_version = ev.encode_batch(ev.Batch(version=99, source="engine", seq=0,
                                             events=[_lookup(0), _lookup(1)]))
    unknown_tier = msgspec.msgpack.encode({
        "version": ev.SCHEMA_VERSION, "source": "engine", "seq": 1, "events": [
            {"kind": "eviction", "ts": 0.0, "tier": "nvme", "blocks": 1, "bytes": 1, "age": 0.0,
             "hits": 0}]})
    too_large = ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="engine", seq=2,
                                         events=[_lookup(i) for i in range(600)]))
    assert 64 << 10 < len(too_large) < 2 * 64 << 10  # over the limit, under ZMQ's hard cut
    bad_name = ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="Engine 1!", seq=0,
                                        events=[_lookup(0)]))
    # 0xc1 is the one byte msgpack never uses, so these random bytes are surely malformed
    _push(endpoint, good, b"\xc1" + os.urandom(299), good[:-5], wrong_version, unknown_tier,
          too_large, bad_name)
    expected = {("ingest", "malformed"): 2, ("engine", "version"): 2, ("engine", "invalid"): 1,
                ("engine", "too_large"): 600, ("ingest", "bad_source"): 1}
    assert wait_until(lambda: source.pipeline.snapshot().events_received.get("engine") == 1
                 and sum(source.pipeline.snapshot().events_dropped.values()) == 606)
    assert source.pipeline.snapshot().events_dropped == expected
    assert source.pipeline.snapshot().source_up == {"ingest": True}


def _nested(depth):
    """A batch whose events nest an array ``depth`` deep: msgpack allows it, msgspec stops at
    Python's recursion limit (1,000 frames by default) with a RecursionError."""
    head = msgspec.msgpack.encode({"version": ev.SCHEMA_VERSION, "source": "evil", "seq": 0})
    return (bytes([head[0] + 1]) + head[1:] + msgspec.msgpack.encode("events")
            + b"\x91" * (depth + 1) + b"\xc0")


def test_a_message_nested_past_the_decoders_depth_is_dropped_and_ingest_goes_on(source, tmp_path):
    """10 KB nesting 10,000 arrays deep once raised RecursionError out of the header read and
    ended the ingest thread, silently (source_up stayed 1). It is dropped, as 1 under "ingest"
    (its header cannot be read), and the next batch is counted."""
    good = ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="engine", seq=0,
                                    events=[_lookup(0)]))
    _push(_endpoint(tmp_path), _nested(10_000), good)
    assert wait_until(lambda: source.pipeline.snapshot().events_received.get("engine") == 1)
    assert source.pipeline.snapshot().events_dropped == {("ingest", "invalid"): 1}


def test_a_bug_handling_one_message_is_logged_and_counted_and_ingest_goes_on(source, tmp_path,
                                                                            monkeypatch, caplog):
    """A bug is simulated: the pipeline raises on its first two batches. Each counts as 1
    malformed under "ingest", the traceback is logged once (a sender may repeat what raised),
    and the third batch is folded."""
    fold = source.pipeline.ingest
    calls = []

    def ingest_raising_twice(*args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:
            raise KeyError("a bug")
        fold(*args, **kwargs)

    monkeypatch.setattr(source.pipeline, "ingest", ingest_raising_twice)
    batches = [ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="engine", seq=i,
                                        events=[_lookup(i)])) for i in range(3)]
    _push(_endpoint(tmp_path), *batches)
    assert wait_until(lambda: source.pipeline.snapshot().events_received.get("engine") == 1)
    assert source.pipeline.snapshot().events_dropped == {("ingest", "malformed"): 2}
    assert caplog.text.count("KeyError: 'a bug'") == 1


def test_at_log_level_debug_every_dropped_batch_is_logged_not_only_the_first(caplog):
    """Three batches over max_batch_bytes from one source: one warning at the default level
    (a sender may repeat a bad batch forever); with log_level debug the other two as well,
    so an operator chasing drops sees each one."""
    pipeline = Pipeline()
    ingest = IngestSource(pipeline, max_batch_bytes=100)
    big = [_batch(i, "s", events=20) for i in range(3)]
    with caplog.at_level("WARNING", logger="kvscope.agent.sources.ingest"):
        ingest.handle(big[0])
    with caplog.at_level("DEBUG", logger="kvscope.agent.sources.ingest"):
        ingest.handle(big[1])
        ingest.handle(big[2])
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["WARNING", "DEBUG", "DEBUG"], lines
    assert all("from source 'engine' (too_large)" in text for _, text in lines)
    assert pipeline.snapshot().events_dropped == {("ingest", "too_large"): 60}


def test_a_string_that_is_not_utf8_makes_its_batch_malformed_under_its_source():
    """A request id of bytes 0xff 0xff (a msgpack str, not UTF-8) raised UnicodeDecodeError,
    which is no DecodeError: the batch reached the catch-all (under "ingest", logged as a bug)
    and the sender's next batch counted a gap. Its 1 event is malformed, under "engine",
    which had sent seq 0; seq 2 then follows seq 1 (which moved the sequence on): no gap."""
    pipeline = Pipeline()
    ingest = IngestSource(pipeline)
    ingest.handle(_batch(0, "a"))
    bad = ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="engine", seq=1,
                                   session="a", events=[ev.Lookup(ts=1.0, request_id="zz",
                                                                  tokens={"gpu": 1})]))
    ingest.handle(bad.replace(b"\xa2zz", b"\xa2\xff\xff"))
    ingest.handle(_batch(2, "a"))
    assert pipeline.snapshot().events_dropped == {("engine", "malformed"): 1}


def _batch(seq, session, dropped=0, version=ev.SCHEMA_VERSION, events=1):
    return ev.encode_batch(ev.Batch(version=version, source="engine", seq=seq, session=session,
                                    dropped=dropped, events=[_lookup(i) for i in range(events)]))


def test_a_refused_batch_is_not_counted_again_as_a_gap():
    """seq 0 arrives, seq 1 is in a future schema (3 events), seq 2 arrives: 3 events dropped
    for the version, no gap."""
    pipeline = Pipeline()
    ingest = IngestSource(pipeline)
    for data in (_batch(0, "a"), _batch(1, "a", version=99, events=3), _batch(2, "a")):
        ingest.handle(data)
    assert pipeline.snapshot().events_dropped == {("engine", "version"): 3}


def test_two_emitters_sharing_a_source_name_keep_their_own_counts(caplog):
    """Emitters a and b both send as "engine", interleaved, each with its own sequence and
    cumulative drops (a: 5 then 7, b: 100 then 100): drops are 7 + 100 = 107, no gap (a's
    seq 3 after 1 is one missing batch: 1 gap), and one warning names the source."""
    pipeline = Pipeline()
    ingest = IngestSource(pipeline)
    for data in (_batch(0, "a", 5), _batch(0, "b", 100), _batch(1, "a", 7), _batch(1, "b", 100),
                 _batch(3, "a", 7), _batch(2, "b", 100)):
        ingest.handle(data)
    assert pipeline.snapshot().events_dropped == {("engine", "emitter_buffer"): 107,
                                                  ("engine", "gap"): 1}
    assert [r.getMessage() for r in caplog.records].count(
        "kvscope ingest: two emitters send as source 'engine'; give each tap its own source "
        "name (their request ids and series are merged)") == 1


def test_five_emitters_sharing_a_source_name_have_their_drops_counted_once():
    """Five emitters send as "engine" in turn, each reporting 100 drops (cumulative) in each of
    10 rounds: 500 dropped. Following 4 sessions a source once counted each one pushed out as
    new again every round (5,000)."""
    pipeline = Pipeline()
    ingest = IngestSource(pipeline)
    for seq in range(10):
        for session in "abcde":
            ingest.handle(_batch(seq, session, dropped=100))
    assert pipeline.snapshot().events_dropped == {("engine", "emitter_buffer"): 500}


def test_a_session_longer_than_64_characters_makes_its_batch_invalid():
    """The agent keeps each emitter's session (a few per source): a 4 MiB one was kept too.
    Past 64 characters the batch is invalid; its header cannot be read, so 1 under "ingest"."""
    pipeline = Pipeline()
    IngestSource(pipeline).handle(ev.encode_batch(ev.Batch(
        version=ev.SCHEMA_VERSION, source="engine", seq=0, session="s" * 65,
        events=[_lookup(0)])))
    assert pipeline.snapshot().events_dropped == {("ingest", "invalid"): 1}


def test_an_emitter_refuses_a_source_name_the_agent_would_drop(tmp_path):
    with pytest.raises(ValueError, match="lowercase word"):
        Emitter(_endpoint(tmp_path), source="engA")
    with pytest.raises(ValueError, match="'ingest' is the agent's own"):
        Emitter(_endpoint(tmp_path), source="ingest")
    with pytest.raises(ValueError, match="scope"):
        Emitter(_endpoint(tmp_path), source="worker", scope="Sched")


@pytest.mark.parametrize("bad", [{"batch_size": 0}, {"max_buffer": -5}, {"max_batch_bytes": 0},
                                 {"send_hwm": 0}, {"batch_size": 2.5}, {"flush_interval": 0},
                                 {"flush_interval": float("nan")}, {"warn_after": -1}])
def test_an_emitter_refuses_bounds_that_would_break_it(tmp_path, bad):
    """batch_size 0 sent nothing and blamed the agent at close; flush_interval 0 spun the
    sender thread at a full core inside the engine; max_buffer -5 and max_batch_bytes 0
    dropped every event; send_hwm 0 is ZMQ's 'no limit'."""
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        Emitter(_endpoint(tmp_path), source="engine", **bad)


def test_an_emitter_refuses_an_endpoint_zmq_cannot_connect_with_a_value_error():
    """``foo://x`` raised ZMQError, which the documented contract does not name: now a
    ValueError that says what to use."""
    for endpoint in ("foo://x", "tcp://no-port", "inproc://agent"):
        with pytest.raises(ValueError, match="use tcp://HOST:PORT or ipc://PATH"):
            Emitter(endpoint, source="engine")


_FUZZ = Pipeline()
_FUZZ_SOURCE = IngestSource(_FUZZ, max_batch_bytes=1024)


@settings(max_examples=300, deadline=None)
@given(payload=st.one_of(
    st.binary(max_size=2048),
    # structurally close to a batch: a map with a version and random events
    st.builds(lambda v, src, evs: msgspec.msgpack.encode(
        {"version": v, "source": src, "seq": 0, "events": evs}),
        st.integers(-2, 3), st.text(max_size=40),
        st.lists(st.dictionaries(st.sampled_from(["kind", "ts", "tier", "blocks", "tokens"]),
                                 st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=8),
                                           st.floats()),
                                 max_size=5), max_size=5))))
def test_random_payloads_never_break_the_source_and_state_stays_bounded(payload):
    """Random and near-valid payloads straight into the handler (one pipeline across all
    examples): nothing raises, and the state can only grow along bounded label sets — drop
    reasons from a fixed list, sources at most max_sources."""
    _FUZZ_SOURCE.handle(payload)
    snap = _FUZZ.snapshot()
    reasons = {reason for _source, reason in snap.events_dropped}
    assert reasons <= {"malformed", "invalid", "version", "too_large", "bad_source", "gap",
                       "emitter_buffer"}
    assert len(snap.events_received) <= 16 and len(snap.events_dropped) <= 7 * 17
    assert len(snap.tiers) <= 4


def test_bad_input_leaves_no_memory_behind():
    """Memory stays bounded under bad input, measured: five kinds of bad message (random bytes,
    truncated msgpack, a wrong schema version, a batch over max_batch_bytes, an unknown tier),
    10,000 to warm up, then 50,000 more. Each is dropped and counted, so the second round may
    not keep anything: Python's traced memory grows by under 64 KiB (a kept 40-byte object
    per message would be 2 MB)."""
    import random
    import tracemalloc

    rng = random.Random(7)
    pipeline = Pipeline()
    source = IngestSource(pipeline, max_batch_bytes=4096)
    good = ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="t", seq=0,
                                    events=[_lookup(0)]))
    wrong_version = ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION + 1, source="t", seq=0,
                                             events=[_lookup(0)]))
    unknown_tier = good.replace(b"gpu", b"tpu")

    def bad(i: int) -> bytes:
        return (rng.randbytes(rng.randrange(1, 512)), good[:rng.randrange(1, len(good))],
                wrong_version, b"\x90" * 5000, unknown_tier)[i % 5]

    def flood(n: int) -> None:
        for i in range(n):
            source.handle(bad(i))

    flood(10_000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        flood(50_000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    dropped = pipeline.snapshot().events_dropped
    assert {reason for _, reason in dropped} >= {"malformed", "version", "too_large", "invalid"}
    assert sum(pipeline.snapshot().events_received.values()) == 0
    assert grown < 64 << 10, f"{grown} bytes kept by 50,000 bad messages"


def test_a_tap_may_not_take_the_name_of_one_of_the_agents_own_sources(caplog):
    """A batch from "otlp" (the receiver's name) would merge with the receiver's series: it is
    dropped as bad_source under "ingest", and the log says why."""
    pipeline = Pipeline()
    IngestSource(pipeline).handle(ev.encode_batch(ev.Batch(
        version=ev.SCHEMA_VERSION, source="otlp", seq=0, events=[_lookup(0)])))
    assert pipeline.snapshot().events_dropped == {("ingest", "bad_source"): 1}
    assert "source 'otlp': it is the agent's own" in caplog.text


def test_sources_are_bounded():
    pipeline = Pipeline()
    src = IngestSource(pipeline, max_sources=2)
    for i, name in enumerate(["a", "b", "c", "a"]):
        src.handle(ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source=name, seq=0,
                                            events=[_lookup(i)])))
    snap = pipeline.snapshot()
    assert snap.events_received == {"a": 2, "b": 1}
    assert snap.events_dropped == {("ingest", "bad_source"): 1}


def test_a_restarted_agent_gives_places_only_to_the_sources_that_send_to_it(tmp_path, caplog):
    """max_sources 2 and a store: agent A hears "old0" and "old1" (seq 0) and stops. Agent B,
    on A's state file, hears "new" (admitted: the remembered names hold no place until they
    send; they held both, for good, so every new tap was refused across restarts), then "old0"
    at seq 3 (admitted, its state restored: gap 2), then "old1" and "other" (refused: 2 places
    taken, each named in the log)."""
    state = tmp_path / "ingest-streams.json"

    def agent():
        pipeline = Pipeline()
        source = IngestSource(pipeline, _endpoint(tmp_path), max_sources=2)
        source.state_path = state
        source.start()
        return pipeline, source

    def batch(name, seq):
        return ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source=name, seq=seq,
                                        session="s", events=[_lookup(seq)]))

    pipeline, a = agent()
    _push(_endpoint(tmp_path), batch("old0", 0), batch("old1", 0))
    assert wait_until(lambda: len(pipeline.events_received()) == 2)
    a.shutdown()
    pipeline, b = agent()
    try:
        with caplog.at_level("WARNING", logger="kvscope.agent.sources.ingest"):
            _push(_endpoint(tmp_path), batch("new", 0), batch("old0", 3), batch("old1", 1),
                  batch("other", 0))
            assert wait_until(lambda: pipeline.snapshot().events_dropped.get(
                ("ingest", "bad_source")) == 2)
        snap = pipeline.snapshot()
    finally:
        b.shutdown()
    assert snap.events_received == {"new": 1, "old0": 1}
    assert {k: n for k, n in snap.events_dropped.items() if n} == {
        ("old0", "gap"): 2, ("ingest", "bad_source"): 2}
    refused = [r.getMessage() for r in caplog.records if "other sources sent" in r.getMessage()]
    assert [m.split("'")[1] for m in refused] == ["old1", "other"], refused


def test_scopes_count_as_sources():
    """max_sources 3: "w" sends with scope "s1" (2 places taken: w, s1), then with "s2" (3), then
    "s3": refused, its 1 event dropped as bad_source under "w". Each scope holds its own
    request state in the pipeline, so scopes are bounded like sources."""
    pipeline = Pipeline()
    src = IngestSource(pipeline, max_sources=3)
    for seq, scope in enumerate(("s1", "s2", "s3", "s1")):
        src.handle(ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="w", seq=seq,
                                            scope=scope, events=[_lookup(seq)])))
    snap = pipeline.snapshot()
    assert snap.events_received == {"w": 3}
    assert snap.events_dropped == {("w", "bad_source"): 1}


def test_an_emitter_drop_count_past_2_to_the_53_is_refused():
    """``dropped`` = 2**63 would add 9.2e18 to emitter_buffer: the batch cannot be decoded,
    nor its header, so it counts 1 as invalid under "ingest"."""
    pipeline = Pipeline()
    src = IngestSource(pipeline)
    src.handle(ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="engine", seq=0,
                                        dropped=2**63, events=[_lookup(0)])))
    assert pipeline.snapshot().events_dropped == {("ingest", "invalid"): 1}


def test_refused_batches_from_new_sources_take_no_place_of_a_real_tap(caplog):
    """max_sources 2: three never-seen sources send only batches of a future schema (2 events
    each); they count under "ingest" and the log names each. A real tap still gets in."""
    pipeline = Pipeline()
    src = IngestSource(pipeline, max_sources=2)
    for name in ("junk0", "junk1", "junk2"):
        src.handle(ev.encode_batch(ev.Batch(version=99, source=name, seq=0,
                                            events=[_lookup(0), _lookup(1)])))
    src.handle(ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="realtap", seq=0,
                                        events=[_lookup(0)])))
    snap = pipeline.snapshot()
    assert snap.events_received == {"realtap": 1}
    assert snap.events_dropped == {("ingest", "version"): 6}
    assert all(f"from source 'junk{i}' (version)" in caplog.text for i in range(3))


def test_a_sequence_jump_past_max_gap_is_followed_not_counted(caplog):
    """seq 0, then 2**62 (a confused sender, not 4.6e18 lost batches): no gap, one warning;
    then 2**62 + 2: one batch missing from there, a gap of 1."""
    pipeline = Pipeline()
    src = IngestSource(pipeline)
    for seq in (0, 2**62, 2**62 + 2):
        src.handle(_batch(seq, "a"))
    assert pipeline.snapshot().events_dropped == {("engine", "gap"): 1}
    assert caplog.text.count("jumped") == 1 and caplog.text.count("went missing") == 1


def test_gaps_and_emitter_drops_are_counted_and_restarts_are_not_gaps():
    """Restarts of either side are no gaps: a new emitter starts at 0, and an agent that
    restarted joins running emitters at the batch it receives first."""
    pipeline = Pipeline()
    src = IngestSource(pipeline)

    def send(session, seq, dropped=0):
        src.handle(ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="engine", seq=seq,
                                            events=[_lookup(seq)], session=session,
                                            dropped=dropped)))

    send("s1", 0)
    send("s1", 1)
    send("s1", 4, dropped=7)   # batches 2 and 3 lost; the emitter dropped 7 events so far
    send("s1", 5, dropped=7)   # no new drops
    send("s2", 0)              # a restarted emitter: its sequence starts again, no gap
    send("s3", 40)             # one this agent joins mid-stream (the agent restarted): no gap
    send("s3", 42)             # ... but from there on: batch 41 lost
    snap = pipeline.snapshot()
    assert snap.events_dropped == {("engine", "gap"): 2 + 1, ("engine", "emitter_buffer"): 7}
    assert snap.events_received == {"engine": 7}


def test_emitter_with_the_agent_away_keeps_bounded_memory_then_delivers(tmp_path, caplog):
    """No agent: the emitter holds at most max_buffer events (plus one batch ZMQ would not
    take) and counts the rest as dropped, and says once that nothing reaches the agent, naming
    the endpoint; once the agent binds, buffered events arrive, the emitter says it sends
    again, and the drop count reaches the agent as emitter_buffer drops."""
    endpoint = _endpoint(tmp_path)
    emitter = Emitter(endpoint, source="engine", max_buffer=500, batch_size=100,
                      flush_interval=0.01, warn_after=0.1)
    for i in range(5000):
        emitter.emit(_lookup(i))

    def said(text):
        return [r for r in caplog.records if text in r.getMessage()]

    assert wait_until(lambda: said("nothing reached the agent"))
    time.sleep(0.1)
    assert emitter.buffered() <= 500
    assert emitter.dropped >= 4500 - 100
    warnings = said("nothing reached the agent")
    assert len(warnings) == 1 and endpoint in warnings[0].getMessage()
    pipeline = Pipeline()
    src = IngestSource(pipeline, endpoint)
    src.start()
    try:
        assert wait_until(lambda: emitter.buffered() == 0)
        emitter.emit(_lookup(9999))  # one more batch after the reconnect carries the drop count
        expected = 5001 - emitter.dropped
        assert wait_until(lambda: pipeline.snapshot().events_received.get("engine") == expected)
        assert pipeline.snapshot().events_dropped == {("engine", "emitter_buffer"): emitter.dropped}
        assert wait_until(lambda: said("again"))
    finally:
        emitter.close()
        src.shutdown()


def test_an_emitter_logs_under_the_logger_it_is_given(tmp_path, caplog):
    """The vLLM tap hands its own ("vllm.…") logger in, so the emitter's lines come out in
    vLLM's log format: "nothing reached the agent" is logged under that name."""
    import logging

    engine_log = logging.getLogger("vllm.kvscope_test")
    emitter = Emitter(_endpoint(tmp_path), source="engine", flush_interval=0.01, warn_after=0.1,
                      logger=engine_log)
    emitter.emit(_lookup(0))
    assert wait_until(lambda: any(r.name == "vllm.kvscope_test" and "nothing reached" in
                                  r.getMessage() for r in caplog.records))
    emitter.close(timeout=0.1)


def test_emit_never_raises_on_bad_events(source, tmp_path):
    emitter = Emitter(_endpoint(tmp_path), source="engine")
    emitter.emit(object())       # not an event: fails to encode in the sender thread
    emitter.emit(_lookup(1))
    assert wait_until(lambda: emitter.dropped >= 1)
    emitter.emit(_lookup(2))
    assert wait_until(lambda: source.pipeline.snapshot().events_received.get("engine", 0) >= 1)
    emitter.close()
    emitter.close()  # safe twice


def test_emitter_calls_its_tick_hook_on_its_thread_and_survives_one_that_raises(tmp_path):
    """``on_tick`` runs on the sender thread each interval (the vLLM tap reports an idle tier
    from it); a hook that raises is dropped, and the emitter goes on sending."""
    pipeline = Pipeline()
    endpoint = f"ipc://{tmp_path}/tick.sock"
    source = IngestSource(pipeline, endpoint)
    source.start()
    emitter = Emitter(endpoint, source="engine", flush_interval=0.01)
    try:
        threads: list[str] = []
        emitter.on_tick = lambda: threads.append(threading.current_thread().name)
        assert wait_until(lambda: len(threads) >= 3)
        assert set(threads) == {"kvscope-emitter"}

        def broken():
            raise RuntimeError("hook exploded")

        emitter.on_tick = broken
        assert wait_until(lambda: emitter.on_tick is None)
        emitter.emit(_lookup(1))
        assert wait_until(lambda: pipeline.events_received().get("engine") == 1)
    finally:
        emitter.close()
        source.shutdown()


def test_an_idle_emitter_backs_off_and_the_next_event_wakes_it(source, tmp_path):
    """An emitter sending nothing woke every flush_interval (0.01 s here: 100 times a second,
    each about 0.1 ms of CPU on a virtual machine). Now each idle wake-up sleeps twice as long,
    up to IDLE_INTERVAL (1 s): over 2 s idle its sender wakes (on_tick) at most 0.01 * 2^k
    apart, so at most 7 times in the first 1.27 s and then once a second, 9 in all (it only
    wakes less on a loaded machine); 100 * 2 = 200 before. The first event after it wakes the
    sender at once (emit clears the idle mark) and is delivered."""
    emitter = Emitter(_endpoint(tmp_path), source="engine", flush_interval=0.01)
    try:
        ticks: list[float] = []
        emitter.on_tick = lambda: ticks.append(time.monotonic())
        time.sleep(2.0)
        assert 1 <= len(ticks) <= 9, ticks
        assert emitter._idle
        emitter.emit(_lookup(1))
        assert not emitter._idle
        assert wait_until(lambda: source.pipeline.events_received().get("engine") == 1)
    finally:
        emitter.close()


def test_a_tick_sends_what_was_buffered_not_what_the_engine_emits_during_its_sends(
        source, tmp_path):
    """A send releases the GIL, and the engine's thread emits meanwhile: each send used to take
    what had come since the last, so one tick sent several small batches (3.6 a tick under
    bench/tap_overhead.py's load), each waking ZMQ's I/O thread. Now a tick sends what was
    buffered when it began. The engine here emits for 1 s, a few thousand events a second, so
    a tick (0.01 s, or up to the GIL's 5 ms switch interval later) holds about a hundred, well
    under one batch (1024 events, 64 KiB): the batches sent are at most the ticks (on_tick
    runs first in each), and every event arrives. Before: 89 batches in 58 ticks."""
    emitter = Emitter(_endpoint(tmp_path), source="engine", flush_interval=0.01,
                      max_batch_bytes=64 << 10)  # the agent's here
    try:
        ticks: list[float] = []
        emitter.on_tick = lambda: ticks.append(time.monotonic())
        sent, end = 0, time.monotonic() + 1.0
        while time.monotonic() < end:
            emitter.emit(_lookup(sent))
            sent += 1
            sum(range(20_000))  # the engine's own work between two events
        assert wait_until(lambda: source.pipeline.events_received().get("engine") == sent), \
            (source.pipeline.events_received(), sent, emitter.dropped)
        assert sent > 1000 and emitter.dropped == 0
        assert 0 < emitter.sent_batches <= len(ticks), (emitter.sent_batches, len(ticks))
    finally:
        emitter.close()


def test_a_batch_scope_joins_another_sources_requests_and_a_bad_one_is_dropped():
    pipeline = Pipeline(join_window=0.0)
    src = IngestSource(pipeline)

    def send(source, events, scope=""):
        src.handle(ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source=source, seq=0,
                                            events=events, scope=scope)))

    send("vllm-worker", [ev.Transfer(ts=1.0, src="cpu", dst="gpu", blocks=1, bytes=10,
                                     duration=0.001, request_id="q")], scope="vllm")
    send("vllm", [ev.RequestFinished(ts=2.0, request_id="q", ttft=0.5, prompt_tokens=8)])
    send("vllm-worker", [_lookup(1)], scope="Not A Name")
    record = pipeline.requests.get("q")
    assert record is not None and [t.bytes for t in record.transfers] == [10]
    assert pipeline.snapshot().events_dropped == {("vllm-worker", "bad_source"): 1}


def test_a_second_agent_cannot_take_over_a_live_ipc_endpoint(source, tmp_path):
    """ZMQ's ipc bind replaces the socket file, which would leave the first agent deaf; the
    second is refused, and the first keeps receiving. A stale file (no listener) is reused."""
    second = IngestSource(Pipeline(), _endpoint(tmp_path))
    with pytest.raises(zmq.ZMQError, match="Address already in use"):
        second.start()
    _push(_endpoint(tmp_path), ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION,
                                                        source="engine", seq=0,
                                                        events=[_lookup(0)])))
    assert wait_until(lambda: source.pipeline.events_received().get("engine") == 1)
    source.shutdown()
    third = IngestSource(Pipeline(), _endpoint(tmp_path))
    third.start()
    third.shutdown()


@pytest.mark.parametrize("event", [
    {"kind": "transfer", "ts": 1.0, "src": "cpu", "dst": "gpu", "blocks": -5, "bytes": 10,
     "duration": 0.1},
    {"kind": "transfer", "ts": 1.0, "src": "cpu", "dst": "gpu", "blocks": 5, "bytes": 10,
     "duration": -1.0},
    {"kind": "lookup", "ts": 1.0, "request_id": "r", "tokens": {"gpu": -1_000_000}},
    {"kind": "request_finished", "ts": 1.0, "request_id": "r", "ttft": float("nan"),
     "prompt_tokens": 1},
    {"kind": "request_finished", "ts": float("inf"), "request_id": "r", "ttft": 0.1,
     "prompt_tokens": 1},
    # a time in milliseconds, not seconds (2023-11-14 as 1.7e12): past 2100 as seconds
    {"kind": "request_finished", "ts": 1.7e12, "request_id": "r", "ttft": 0.1,
     "prompt_tokens": 1},
    {"kind": "tier_snapshot", "ts": 1.0, "tier": "cpu", "capacity_bytes": -1,
     "resident_bytes": 0, "capacity_blocks": 0, "resident_blocks": 0},
    # a histogram whose counts do not match its bounds, or whose bounds do not ascend
    {"kind": "latency_histogram", "ts": 1.0, "metric": "ttft", "bounds": [0.1, 0.2],
     "counts": [1, 1]},
    {"kind": "latency_histogram", "ts": 1.0, "metric": "ttft", "bounds": [0.3, 0.3],
     "counts": [1, 1, 1]},
    # a count past 2**53 (float64 holds no exact integer there; 2**64 stopped the store), and
    # a duration past 1e9 s (an OTLP time in int64 nanoseconds would overflow)
    {"kind": "request_started", "ts": 1.0, "request_id": "r", "prompt_tokens": 2**53 + 1},
    {"kind": "request_finished", "ts": 1.0, "request_id": "r", "ttft": 1e15,
     "prompt_tokens": 1},
    # a request id the agent would have to keep, 100,000 times over
    {"kind": "request_started", "ts": 1.0, "request_id": "x" * 257, "prompt_tokens": 1},
])
def test_a_negative_count_or_a_nan_or_infinite_time_makes_its_event_invalid(event):
    """Such a value would turn a counter down (rate() reads a reset) or a histogram sum into
    NaN; likewise a malformed histogram or an unbounded request id: the bad event is dropped
    as invalid, and moves no counter; the good lookup in its batch counts (16 gpu tokens; the
    whole batch was once dropped for one bad event)."""
    pipeline = Pipeline()
    IngestSource(pipeline).handle(msgspec.msgpack.encode({
        "version": ev.SCHEMA_VERSION, "source": "engine", "seq": 0,
        "events": [msgspec.to_builtins(_lookup(1)), event]}))
    snap = pipeline.snapshot()
    assert snap.events_dropped == {("engine", "invalid"): 1}
    assert snap.events_received == {"engine": 1} and snap.prompt_tokens["gpu"] == 16


@pytest.mark.parametrize("event", [
    {"kind": "transfer", "ts": 1.0, "src": "gpu", "dst": "gpu", "blocks": 2, "bytes": 10,
     "duration": 0.1},
    {"kind": "tier_snapshot", "ts": 1.0, "tier": "cpu", "capacity_bytes": 100,
     "resident_bytes": 101, "capacity_blocks": 0, "resident_blocks": 0},
    {"kind": "tier_snapshot", "ts": 1.0, "tier": "cpu", "capacity_bytes": 0,
     "resident_bytes": 0, "capacity_blocks": 4, "resident_blocks": 5},
])
def test_a_transfer_to_its_own_tier_or_a_snapshot_over_its_capacity_is_invalid(event):
    """A copy from gpu to gpu moves nothing between tiers, and a tier cannot hold more than
    its capacity (101 bytes of 100; 5 blocks of 4, its bytes unknown): each is dropped as
    invalid (1) and moves nothing: no transfer bytes, no cpu tier. Beside it the good lookup
    counts (16 gpu tokens), and so does a disk snapshot of unknown capacity (0) holding 3
    blocks (the vLLM tap sends one before vLLM says the capacity): 2 received, its capacity
    left off /metrics. A scrape source checks its events with ev.validate, which refuses the
    same."""
    pipeline = Pipeline()
    unknown = ev.TierSnapshot(ts=1.0, tier="disk", capacity_bytes=0, resident_bytes=300,
                              capacity_blocks=0, resident_blocks=3)
    IngestSource(pipeline).handle(msgspec.msgpack.encode({
        "version": ev.SCHEMA_VERSION, "source": "engine", "seq": 0,
        "events": [msgspec.to_builtins(_lookup(1)), msgspec.to_builtins(unknown), event]}))
    snap = pipeline.snapshot()
    assert snap.events_dropped == {("engine", "invalid"): 1}
    assert snap.events_received == {"engine": 2} and snap.prompt_tokens["gpu"] == 16
    assert not snap.transfer_bytes and set(snap.tiers) == {"disk"}
    assert snap.tiers["disk"].resident_blocks == 3
    # what it holds is exported, its unknown capacity is not (0 would read as "holds nothing")
    from kvscope import catalog
    from kvscope.agent.metrics import snapshot_samples

    samples = snapshot_samples(snap)
    assert samples[catalog.TIER_RESIDENT_BLOCKS] == [(["disk"], 3)]
    assert samples[catalog.TIER_CAPACITY_BYTES] == samples[catalog.TIER_CAPACITY_BLOCKS] == []
    sample = pipeline.record_sample(2.0, None)  # the dashboard's history: absent there too
    assert sample["tier_resident_blocks"] == {"disk": 3}
    assert sample["tier_capacity_bytes"] == sample["tier_capacity_blocks"] == {}
    with pytest.raises(ev.SchemaError) as info:
        ev.validate(msgspec.convert(event, ev.Event))
    assert info.value.reason == "invalid"
    assert ev.validate(unknown) == unknown


def test_a_batch_of_more_events_than_an_emitter_sends_is_dropped_whole_when_one_is_invalid():
    """4,097 events, one invalid: each would be decoded on its own again (a sender's 4 MiB of
    one-byte events cost 4.6 times a whole drop, and twice its memory); beyond
    MAX_SALVAGED (an emitter sends at most 1,024) the batch goes whole, as before."""
    pipeline = Pipeline()
    good = msgspec.to_builtins(_lookup(1))
    IngestSource(pipeline, max_batch_bytes=1 << 20).handle(msgspec.msgpack.encode({
        "version": ev.SCHEMA_VERSION, "source": "engine", "seq": 0,
        "events": [good] * ev.MAX_SALVAGED + [None]}))
    snap = pipeline.snapshot()
    assert snap.events_dropped == {("ingest", "invalid"): ev.MAX_SALVAGED + 1}
    assert snap.events_received == {}


def test_a_batch_whose_own_fields_are_invalid_is_dropped_whole():
    """An engine name that is no string: nothing in the batch can be trusted (its 2 events
    are dropped as invalid, under "ingest": the source has sent no valid batch)."""
    pipeline = Pipeline()
    IngestSource(pipeline).handle(msgspec.msgpack.encode({
        "version": ev.SCHEMA_VERSION, "source": "engine", "seq": 0, "engine": 5,
        "events": [msgspec.to_builtins(_lookup(1)), msgspec.to_builtins(_lookup(2))]}))
    snap = pipeline.snapshot()
    assert snap.events_dropped == {("ingest", "invalid"): 2} and snap.events_received == {}


def test_an_event_is_sent_as_it_was_when_emitted(source, tmp_path):
    """The emitter encodes an event when it is emitted, not a tick later on its own thread: a
    tap that goes on changing a dict it put in an event (its own running count) sends the
    values it emitted. Before, r1 arrived with r2's cpu count, 99."""
    emitter = Emitter(_endpoint(tmp_path), source="engine", flush_interval=0.5)
    tokens = {"gpu": 16, "cpu": 8}
    emitter.emit(ev.Lookup(ts=1.0, request_id="r1", tokens=tokens))
    tokens["cpu"] = 99
    emitter.emit(ev.Lookup(ts=2.0, request_id="r2", tokens=tokens))
    for rid in ("r1", "r2"):
        emitter.emit(ev.RequestFinished(ts=3.0, request_id=rid, ttft=0.1, prompt_tokens=16))
    assert wait_until(lambda: source.pipeline.events_received().get("engine") == 4)
    emitter.close()
    source.pipeline.publish_settled(everything=True)
    assert source.pipeline.requests.get("r1").tokens == {"gpu": 16, "cpu": 8}
    assert source.pipeline.requests.get("r2").tokens == {"gpu": 16, "cpu": 99}


def test_the_emitter_splits_a_batch_over_the_agents_size_limit(source, tmp_path):
    """Lookups with 300 block hashes encode to about 3.3 KB each: 200 of them in one batch of
    1,024 would be ~660 KB, over the agent's 64 KiB, and refused whole. The emitter halves the
    batch until each part fits, so all 200 arrive; one lookup of 8,000 hashes (~90 KB) is over
    the limit alone: dropped, counted by the emitter and reported to the agent."""
    def lookup(i, n):
        return ev.Lookup(ts=1.0, request_id=f"r{i}", tokens={"gpu": 16}, blocks=n,
                         block_hashes=tuple(range(2**62, 2**62 + n)),
                         block_sources=("gpu",) * n, block_tokens=16)
    emitter = Emitter(_endpoint(tmp_path), source="engine", max_batch_bytes=64 << 10)
    for i in range(200):
        emitter.emit(lookup(i, 300))
    emitter.emit(lookup(200, 8000))
    emitter.emit(_lookup(201))
    assert wait_until(lambda: source.pipeline.events_received().get("engine") == 201)
    emitter.close()
    assert emitter.dropped == 1
    assert source.pipeline.snapshot().events_dropped == {("engine", "emitter_buffer"): 1}


def test_a_crash_looping_tap_does_not_make_another_count_its_drops_twice():
    """Tap "live" reports 5 drops; then 70 sessions of tap "crashy" send a batch each; "live"
    sends again, still at 5: its drops stay 5 (each source keeps its own recent sessions)."""
    pipeline = Pipeline()
    ingest = IngestSource(pipeline)

    def batch(source, seq, session, dropped=0, scope=""):
        return ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source=source, seq=seq,
                                        session=session, dropped=dropped, scope=scope,
                                        events=[_lookup(seq)]))
    ingest.handle(batch("live", 0, "L", 5))
    for i in range(70):
        ingest.handle(batch("crashy", 0, f"c{i}"))
    ingest.handle(batch("live", 1, "L", 5))
    assert pipeline.snapshot().events_dropped == {("live", "emitter_buffer"): 5}


def test_a_batch_refused_for_its_scope_is_not_counted_again_as_a_gap(caplog):
    """seq 0, 1, 2 from "worker"; seq 1 names the scope "Sched!": 1 event dropped as
    bad_source under "worker", no gap, and the log names the scope."""
    pipeline = Pipeline()
    ingest = IngestSource(pipeline)
    for seq, scope in ((0, ""), (1, "Sched!"), (2, "")):
        ingest.handle(ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="worker",
                                               seq=seq, scope=scope, events=[_lookup(seq)])))
    assert pipeline.snapshot().events_dropped == {("worker", "bad_source"): 1}
    assert "scope 'Sched!' is not a lowercase word" in caplog.text


def test_a_taps_drop_series_exist_at_0_from_its_first_batch(source):
    """Prometheus cannot see the first burst of drops in increase() when the series appears
    with it; so from a tap's first valid batch each drop reason is exported at 0, and the
    agent's own "ingest" reasons from the start. A refused name gets no series of its own."""
    from kvscope import catalog
    from kvscope.agent.metrics import snapshot_samples

    source.handle(_batch(0, "a"))
    source.handle(ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="Bad Name", seq=0,
                                           events=[_lookup(0)])))
    dropped = {tuple(labels): value for labels, value in
               snapshot_samples(source.pipeline.snapshot())[catalog.EVENTS_DROPPED]}
    assert {reason for (name, reason) in dropped if name == "engine"} == {
        "emitter_buffer", "gap", "too_large", "malformed", "invalid", "version", "bad_source",
        "abandoned"}
    assert all(n == 0 for (name, _), n in dropped.items() if name == "engine")
    assert dropped[("ingest", "bad_source")] == 1 and dropped[("ingest", "version")] == 0
    assert {name for name, _ in dropped} == {"engine", "ingest"}


def test_the_tap_example_in_the_docs_runs_and_reaches_the_agent(source, tmp_path):
    """docs/agent.md's tap example, run as written against a real ingest source (only its
    endpoint changed): its 4 events arrive and make one request with its promotion."""
    import re

    text = (REPO_ROOT / "docs" / "agent.md").read_text()
    code = re.search(r"A tap of your own.*?```python\n(.*?)```", text, re.S).group(1)
    exec(code.replace("tcp://127.0.0.1:5560", _endpoint(tmp_path)), {})
    assert wait_until(lambda: source.pipeline.events_received().get("myengine") == 4)
    source.pipeline.publish_settled(everything=True)
    record = source.pipeline.requests.get("r1")
    assert record.tokens == {"gpu": 1024, "cpu": 512, "recompute": 512}
    # 32 blocks of 16 tokens of Llama 3 8B: 32 layers x 8 KV heads x 128 x 2 x 2 bytes x 16
    assert [(t.src, t.dst, t.blocks, t.bytes) for t in record.transfers] == [
        ("cpu", "gpu", 32, 32 * 32 * 8 * 128 * 2 * 2 * 16)]


def _errors_batch(seq, session, errors):
    return ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="vllm", seq=seq,
                                    session=session, events=[_lookup(seq)], errors=errors))


def test_a_taps_error_totals_become_counted_increases(caplog):
    """Tap error totals are cumulative per emitter, as drops are. Session s1 sends internal
    0, 3, 3 and unattributed 0, 1, 2; a restarted tap (s2) sends internal 2; a batch naming a
    reason outside the vocabulary is counted for nothing and logged once. By hand: internal
    3 + 2 = 5, unattributed 2; both series exist from s1's first batch, at 0."""
    from kvscope import catalog
    from kvscope.agent.metrics import snapshot_samples

    pipeline = Pipeline()
    ingest = IngestSource(pipeline)
    ingest.handle(_errors_batch(0, "s1", {"internal": 0, "unattributed": 0}))
    assert pipeline.snapshot().tap_errors == {("vllm", "internal"): 0,
                                              ("vllm", "unattributed"): 0}
    for seq, errors in ((1, {"internal": 3, "unattributed": 1}),
                        (2, {"internal": 3, "unattributed": 2})):
        ingest.handle(_errors_batch(seq, "s1", errors))
    ingest.handle(_errors_batch(0, "s2", {"internal": 2}))
    for seq in (1, 2):
        ingest.handle(_errors_batch(seq, "s2", {"internal": 2, "request_id_abc": 9}))
    snap = pipeline.snapshot()
    assert snap.tap_errors == {("vllm", "internal"): 5, ("vllm", "unattributed"): 2}
    assert snapshot_samples(snap)[catalog.TAP_ERRORS] == [(["vllm", "internal"], 5),
                                                         (["vllm", "unattributed"], 2)]
    assert snap.events_dropped == {}  # the batches themselves were fine
    assert [r.getMessage() for r in caplog.records].count(
        "kvscope ingest: source 'vllm' reports tap errors for reason 'request_id_abc', not one "
        "of internal, unattributed; not counted") == 1


def test_an_emitter_sends_its_taps_error_totals_and_survives_a_hook_that_raises(source,
                                                                                tmp_path):
    """The hook the tap sets is read for each batch; one that raises is dropped, and the
    emitter goes on sending."""
    emitter = Emitter(_endpoint(tmp_path), source="vllm", flush_interval=0.01)
    try:
        totals = {"internal": 4, "unattributed": 1}
        emitter.tap_errors = lambda: totals
        emitter.emit(_lookup(0))
        assert wait_until(lambda: source.pipeline.snapshot().tap_errors == {
            ("vllm", "internal"): 4, ("vllm", "unattributed"): 1})

        def broken():
            raise RuntimeError("hook exploded")

        emitter.tap_errors = broken
        emitter.emit(_lookup(1))
        assert wait_until(lambda: source.pipeline.events_received().get("vllm") == 2)
        assert emitter.tap_errors is None
        assert source.pipeline.snapshot().tap_errors[("vllm", "internal")] == 4
    finally:
        emitter.close()


@pytest.mark.parametrize("case", ["too_large", "invalid", "version"])
def test_refusing_a_message_costs_a_small_constant_not_an_object_per_event(case):
    """8 MiB of one-byte events (4 MiB under max_batch_bytes for the invalid and version cases)
    refused: its header was decoded into an object per event, up to three times (peak traced
    memory about 60 times the message: 480 MB of RSS for 8 MiB). Now the header is read with
    its events undecoded and counted off the msgpack array's own header: the peak is a few KB,
    far under twice the message, and the drop still counts every event, exactly."""
    import tracemalloc

    limit = 4 << 20
    n = 2 * limit - 64 if case == "too_large" else limit - 64
    version = ev.SCHEMA_VERSION + (case == "version")
    data = msgspec.msgpack.encode({"version": version, "source": "engine", "seq": 0,
                                   "events": [1] * n})
    assert len(data) <= (2 if case == "too_large" else 1) * limit
    pipeline = Pipeline()
    source = IngestSource(pipeline, max_batch_bytes=limit)
    source.handle(memoryview(data))  # a first one: logs its reason once
    message = memoryview(data)  # as ZMQ hands it over: a view of the frame
    tracemalloc.start()
    try:
        source.handle(message)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert pipeline.snapshot().events_dropped == {("ingest", case): 2 * n}
    assert peak < 2 * len(data), f"{peak / len(data):.1f} times the message's {len(data)} bytes"
    assert peak < 64 << 10, f"{peak} bytes to refuse one message"


def test_a_graceful_stop_folds_or_counts_every_event_that_reached_the_socket(tmp_path):
    """A tap sends 100,000 events/s; a third of a second in, the agent stops (the tap goes on
    to the end of its second and closes, as taps do when a node shuts down). The agent closed
    its socket at once with ZMQ's queue unread (linger 0), and the tap's later batches went
    nowhere: lost, counted by nobody. Now the stopping agent folds what arrives until ZMQ has
    been quiet a moment (up to drain_seconds), then stops accepting and counts what is left
    (``shutdown``): emitted == folded + counted as dropped, the emitter's own count
    included, exactly."""
    pipeline = Pipeline()
    source = IngestSource(pipeline, _endpoint(tmp_path), drain_seconds=30.0)
    source.start()
    emitter = Emitter(_endpoint(tmp_path), source="engine", batch_size=100,
                      flush_interval=0.001, max_buffer=1_000_000)
    time.sleep(0.3)  # connected
    stopper = threading.Thread(target=source.shutdown)
    emitted, start = 0, time.monotonic()
    while (elapsed := time.monotonic() - start) < 1.0:
        for _ in range(int(elapsed * 100_000) - emitted):
            emitter.emit(ev.Transfer(ts=1.0, src="cpu", dst="gpu", blocks=1, bytes=4096,
                                     duration=1e-4))
            emitted += 1
        if elapsed > 0.3 and not stopper.is_alive() and not source.stopping.is_set():
            stopper.start()
        time.sleep(0.001)
    assert source.stopping.is_set()  # the agent began to stop while the tap sent
    emitter.close(timeout=2.0)
    stopper.join(timeout=60)
    assert not stopper.is_alive()
    dropped = {key: n for key, n in pipeline.snapshot().events_dropped.items()
               if key[1] != "emitter_buffer"}  # the emitter's own count, reported in-band
    folded = pipeline.events_received().get("engine", 0)
    assert folded > 0 and emitted > 90_000
    assert emitted == folded + sum(dropped.values()) + emitter.dropped, (
        f"{emitted} emitted, {folded} folded, dropped {dropped} and {emitter.dropped} by the "
        "emitter")


def test_a_stopping_agent_waits_for_a_tap_held_up_longer_than_quiet(tmp_path):
    """A tap sends, the agent begins to stop, and the tap's sender is held up for three times
    :data:`QUIET` (a loaded machine) before its last batches and its close. Quiet alone ended
    the drain there: the agent stopped accepting, and the tap's last 50 events were lost (140
    on the wire, uncounted, in one CI run). Now a tap heard from in the last :data:`HEARD`
    seconds and not closed keeps the agent folding: all 100 events are folded, none dropped."""
    pipeline = Pipeline()
    source = IngestSource(pipeline, _endpoint(tmp_path), drain_seconds=30.0)
    source.start()
    emitter = Emitter(_endpoint(tmp_path), source="engine", flush_interval=0.001)
    try:
        for _ in range(50):
            emitter.emit(_lookup(0))
        assert wait_until(lambda: pipeline.events_received().get("engine") == 50)
        stopper = threading.Thread(target=source.shutdown)
        stopper.start()
        assert wait_until(source.stopping.is_set)
        time.sleep(3 * QUIET)
        for _ in range(50):
            emitter.emit(_lookup(0))
    finally:
        emitter.close(timeout=5.0)
    stopper.join(timeout=60)
    assert not stopper.is_alive()
    assert pipeline.events_received().get("engine") == 100
    assert not {key: n for key, n in pipeline.snapshot().events_dropped.items() if n}
    assert emitter.dropped == 0


def test_what_a_stopping_agent_has_no_time_to_fold_is_counted_as_shutdown(tmp_path,
                                                                          monkeypatch):
    """50 batches of 10 events wait (the fold is held on the first) when the agent stops with
    no time to fold (drain_seconds 0): the 49 that reached its socket and were not folded, in
    its own queue, ZMQ's or the OS's, count as dropped (shutdown) under their source, each
    event once. That count dies with the agent, so an agent restarted on its state file
    counts the 49 batches as a gap at the tap's next batch (it counted none: the stopping
    agent had saved their sequence numbers as if folded)."""
    pipeline = Pipeline()
    release, fold = threading.Event(), pipeline.ingest
    state = tmp_path / "ingest-streams.json"

    def held(*args, **kwargs):
        release.wait()
        fold(*args, **kwargs)

    monkeypatch.setattr(pipeline, "ingest", held)
    source = IngestSource(pipeline, _endpoint(tmp_path), drain_seconds=0.0)
    source.state_path = state
    source.start()
    transfer = ev.Transfer(ts=1.0, src="cpu", dst="gpu", blocks=1, bytes=4096, duration=1e-4)
    sender = zmq.Context.instance().socket(zmq.PUSH)  # open until the agent stopped
    sender.connect(_endpoint(tmp_path))
    for i in range(50):
        sender.send(ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="engine", seq=i,
                                             session="s", events=[transfer] * 10)))
    time.sleep(0.3)  # every batch reached the agent's socket
    stopper = threading.Thread(target=source.shutdown)
    stopper.start()
    time.sleep(0.1)
    release.set()
    stopper.join(timeout=30)
    sender.close(linger=0)
    snap = pipeline.snapshot()
    assert snap.events_received == {"engine": 10}
    assert {key: n for key, n in snap.events_dropped.items() if n} == {("engine", "shutdown"): 490}
    restarted = Pipeline()
    again = IngestSource(restarted, _endpoint(tmp_path))
    again.state_path = state
    again.start()
    try:
        _push(_endpoint(tmp_path), ev.encode_batch(ev.Batch(
            version=ev.SCHEMA_VERSION, source="engine", seq=50, session="s",
            events=[transfer])))
        assert wait_until(lambda: restarted.events_received().get("engine") == 1)
        assert {k: n for k, n in restarted.snapshot().events_dropped.items() if n} == {
            ("engine", "gap"): 49}
    finally:
        again.shutdown()


def _tap_batch(seq, dropped=0, errors=None, events=10):
    return ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source="vllm", seq=seq,
                                    session="s", dropped=dropped, errors=errors or {},
                                    events=[_lookup(i) for i in range(events)]))


def test_a_restarted_agent_counts_the_batches_lost_while_it_was_away(tmp_path):
    """Agent A folds batches 0-4 of emitter session s (which says it dropped 3 events and
    failed once so far) and stops gracefully; batches 5-7 are lost on the way while no agent
    listens; agent B, reading A's state file, receives batch 8 (the emitter now at 5 dropped,
    2 failures). By hand: B counts gap 3 (5, 6, 7), emitter_buffer 5 - 3 = 2, internal errors
    2 - 1 = 1. Before, B took batch 8 as its first (no gap) and the cumulative 5 and 2 as new:
    the lost batches counted nowhere, the drops A had counted counted again."""
    state = tmp_path / "ingest-streams.json"

    def agent():
        pipeline = Pipeline()
        source = IngestSource(pipeline, _endpoint(tmp_path))
        source.state_path = state
        source.start()
        return pipeline, source

    pipeline, a = agent()
    _push(_endpoint(tmp_path), *(_tap_batch(seq, dropped=3, errors={"internal": 1})
                                 for seq in range(5)))
    assert wait_until(lambda: pipeline.events_received().get("vllm") == 50)
    a.shutdown()
    assert pipeline.snapshot().events_dropped[("vllm", "emitter_buffer")] == 3
    pipeline, b = agent()
    try:
        _push(_endpoint(tmp_path), _tap_batch(8, dropped=5, errors={"internal": 2}))
        assert wait_until(lambda: pipeline.events_received().get("vllm") == 10)
        snap = pipeline.snapshot()
        assert {k: n for k, n in snap.events_dropped.items() if n} == {
            ("vllm", "gap"): 3, ("vllm", "emitter_buffer"): 2}
        assert snap.tap_errors == {("vllm", "internal"): 1}
    finally:
        b.shutdown()


def test_a_state_file_that_could_not_be_saved_is_saved_once_it_can_without_traffic(tmp_path):
    """The store directory vanishes (an operator's rm -rf) before a batch: its save fails and
    is logged. The directory comes back and no tap sends: the state is saved within about a
    second (SAVE_INTERVAL), as the log promises; it waited for the next batch, and a kill -9
    meanwhile lost it."""
    store = tmp_path / "store"
    store.mkdir()
    pipeline = Pipeline()
    source = IngestSource(pipeline, _endpoint(tmp_path))
    source.state_path = store / "ingest-streams.json"
    source.start()
    try:
        store.rmdir()
        _push(_endpoint(tmp_path), _tap_batch(0))
        assert wait_until(lambda: pipeline.events_received().get("vllm") == 10)
        time.sleep(0.2)  # its save failed (no directory)
        assert not store.exists()
        store.mkdir()
        assert wait_until(source.state_path.is_file, timeout=10)
    finally:
        source.shutdown()


def test_a_state_file_that_cannot_be_read_is_logged_and_the_agent_runs_on(tmp_path, caplog):
    """A damaged state file (a half-written one cannot happen: it is replaced atomically, but
    a disk can flip bits or an operator edit it) costs only the gap count of that restart:
    the agent starts, says so, follows emitters afresh and saves a good file at stop."""
    state = tmp_path / "ingest-streams.json"
    state.write_text('{"version": 1, "streams": {"vllm": [["s", "seven", 0, {}]]}}')
    pipeline = Pipeline()
    source = IngestSource(pipeline, _endpoint(tmp_path))
    source.state_path = state
    source.start()
    try:
        _push(_endpoint(tmp_path), _tap_batch(8))
        assert wait_until(lambda: pipeline.events_received().get("vllm") == 10)
    finally:
        source.shutdown()
    assert "cannot read the emitters' sequence numbers" in caplog.text
    assert not any(n for n in pipeline.snapshot().events_dropped.values())
    assert msgspec.json.decode(state.read_bytes())["streams"] == {"vllm": [["s", 8, 0, {}]]}


_KILLED_AGENT = """
import sys, time
from pathlib import Path
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.sources.ingest import IngestSource
source = IngestSource(Pipeline(), sys.argv[1])
source.state_path = Path(sys.argv[2])
source.start()
print("up", flush=True)
time.sleep(3600)
"""


def test_after_a_kill_9_every_batch_sent_is_folded_or_counted(tmp_path):
    """A tap sends batches of 10 events, one every 2 ms, through a kill -9 of the agent and a
    new agent's start. The killed agent's last saved sequence number S is its share (what it
    folded after its last save died with it); the new agent counts the rest: every batch sent
    is at or below S, counted as gap, or folded by the new agent, and the gap is not 0 (the
    kill lost batches on the way, which nobody counted before)."""
    import subprocess
    import sys

    state, endpoint = tmp_path / "ingest-streams.json", _endpoint(tmp_path)
    killed = subprocess.Popen([sys.executable, "-c", _KILLED_AGENT, endpoint, str(state)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert killed.stdout.readline().strip() == "up"
    sender = zmq.Context.instance().socket(zmq.PUSH)
    sender.setsockopt(zmq.IMMEDIATE, 1)  # as the emitter: nothing queued without an agent
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(endpoint)
    sent, pipeline, new = 0, Pipeline(), None

    def send_for(seconds):
        nonlocal sent
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            try:
                sender.send(_tap_batch(sent), zmq.NOBLOCK)
                sent += 1
            except zmq.Again:  # no agent: the emitter keeps it and sends it later
                pass
            time.sleep(0.002)

    try:
        send_for(2.5)  # the killed agent saves at least twice meanwhile
        killed.kill()
        killed.wait()
        send_for(0.3)  # into the dead agent's connection until ZMQ sees it closed
        new = IngestSource(pipeline, endpoint)
        new.state_path = state
        saved = msgspec.json.decode(state.read_bytes())["streams"]["vllm"][0][1]
        new.start()
        send_for(1.0)
        assert wait_until(lambda: (pipeline.events_received().get("vllm", 0) // 10
                                   + pipeline.snapshot().events_dropped.get(("vllm", "gap"), 0)
                                   == sent - saved - 1))
    finally:
        sender.close()
        killed.kill()
        if new is not None:
            new.shutdown()
    gap = pipeline.snapshot().events_dropped.get(("vllm", "gap"), 0)
    assert saved > 100 and gap > 0


def test_the_agent_learns_the_processes_the_taps_run_in(source, tmp_path):
    """Each batch names its emitter's process: a real emitter's is this one. With a worker tap
    (a scope: vLLM's worker, which holds the host KV pool) among them, only the workers' count;
    a tap that closes (its final batch) leaves; an older tap's batch (pid 0) adds nothing."""
    emitter = Emitter(_endpoint(tmp_path), source="engine", flush_interval=0.01)
    emitter.emit(_lookup(0))
    assert wait_until(lambda: source.engine_pids() == (os.getpid(),))

    def batch(src, pid, scope="", final=False):
        return ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source=src, seq=0,
                                        session=f"{src}-{pid}", events=[], scope=scope,
                                        final=final, pid=pid))

    ingest = IngestSource(Pipeline())
    ingest.handle(batch("vllm", 0))
    assert ingest.engine_pids() == ()
    ingest.handle(batch("vllm", 100))
    assert ingest.engine_pids() == (100,)
    ingest.handle(batch("vllm-worker", 201, scope="vllm"))
    ingest.handle(batch("vllm-worker", 202, scope="vllm"))
    assert ingest.engine_pids() == (201, 202)
    ingest.handle(batch("vllm-worker", 201, scope="vllm", final=True))
    assert ingest.engine_pids() == (202,)
    ingest.handle(batch("vllm-worker", 202, scope="vllm", final=True))
    assert ingest.engine_pids() == (100,)
    emitter.close()
    assert wait_until(lambda: source.engine_pids() == ())


def test_requests_a_stopped_engine_left_in_flight_are_abandoned_not_joined_by_a_retry():
    """vLLM's tap sent r1's start and a load for it, then closed (its final batch) without
    finishing it: the engine stopped. Its record stayed open, and the client's retry under the
    same id (a fixed X-Request-Id) on the restarted engine joined it: the retry's record had
    the dead request's load, 60 s before the retry arrived. It is abandoned when the tap
    closes (counted), and the retry's record is its own. While another emitter of the source
    is open (two taps of one name), or a worker tap whose loads join its requests (vLLM's
    worker, scope vllm), a closing one abandons nothing."""
    def batch(session, events, final=False, seq=0, source="vllm", scope=""):
        return ev.encode_batch(ev.Batch(version=ev.SCHEMA_VERSION, source=source, seq=seq,
                                        session=session, events=events, final=final, pid=0,
                                        scope=scope))

    t0 = time.time() - 120
    started = ev.RequestStarted(ts=t0, request_id="r1", prompt_tokens=16)
    load = ev.Transfer(ts=t0 + 1, src="cpu", dst="gpu", blocks=4, bytes=4096, duration=0.1,
                       request_id="r1")
    pipeline = Pipeline()
    ingest = IngestSource(pipeline)
    ingest.handle(batch("b", [], seq=0))  # a second tap of the name, open
    ingest.handle(batch("w", [], source="vllm-worker", scope="vllm"))  # its worker's, open
    ingest.handle(batch("a", [started]))
    ingest.handle(batch("a", [], final=True, seq=1))
    ingest.handle(batch("b", [], final=True, seq=1))
    assert ("vllm", "abandoned") not in pipeline.snapshot().events_dropped
    # the worker's load comes after the scheduler's close (separate connections), then it
    # closes, the last: had the record gone at the scheduler's close, the load reopened it
    ingest.handle(batch("w", [load], source="vllm-worker", scope="vllm", seq=1))
    ingest.handle(batch("w", [], source="vllm-worker", scope="vllm", final=True, seq=2))
    assert pipeline.snapshot().events_dropped[("vllm", "abandoned")] == 1
    retry = t0 + 60
    ingest.handle(batch("c", [
        ev.RequestStarted(ts=retry, request_id="r1", prompt_tokens=16),
        ev.RequestFinished(ts=retry + 1, request_id="r1", ttft=0.5, prompt_tokens=16)]))
    pipeline.publish_settled(everything=True)
    record = pipeline.requests.get("r1")
    assert (record.arrival, tuple(record.transfers)) == (retry, ())


_KILLED_TAP = """
import sys, time
from kvscope import events as ev
from kvscope.agent.taps.emitter import Emitter
emitter = Emitter(sys.argv[1], source=sys.argv[2], flush_interval=0.01)
emitter.emit(ev.TierSnapshot(ts=time.time(), tier="cpu", capacity_bytes=64 << 20,
                             resident_bytes=64 << 20, capacity_blocks=64, resident_blocks=64))
print("sent", flush=True)
time.sleep(600)
"""


_EXITING_TAP = """
import multiprocessing, sys, time
from kvscope import events as ev
from kvscope.agent.taps.emitter import Emitter

def tap():
    emitter = Emitter(sys.argv[1], source="exits", flush_interval=30.0)
    time.sleep(0.2)  # the sender's first wait has begun: only the exit makes it send
    emitter.emit(ev.TierSnapshot(ts=time.time(), tier="cpu", capacity_bytes=64 << 20,
                                 resident_bytes=64 << 20, capacity_blocks=64, resident_blocks=64))

if sys.argv[2] == "fork":  # as vLLM's engine core: a child that ends with os._exit
    child = multiprocessing.get_context("fork").Process(target=tap)
    child.start()
    child.join()
    assert child.exitcode == 0
else:
    tap()
"""


@pytest.mark.parametrize("process", ["main", "fork"])
def test_a_tap_process_that_exits_without_closing_its_emitter_still_delivers_and_closes(
        source, tmp_path, caplog, process):
    """vLLM stopped by SIGTERM exits without its engine's shutdown reaching the tap: the
    emitter was never closed, its daemon sender thread died with the events it held (a flush
    interval of 30 s holds them all), and the agent logged the process as ended without
    closing its tap. Closed at the interpreter's exit, it delivers the event and its final
    batch: the tier shows up, then leaves with the closed tap. Also in a forked
    multiprocessing child (vLLM's engine core), which ends with os._exit: no atexit hook runs
    there."""
    import logging
    import subprocess
    import sys

    caplog.set_level(logging.INFO, logger="kvscope")
    subprocess.run([sys.executable, "-c", _EXITING_TAP, _endpoint(tmp_path), process], check=True,
                   cwd=REPO_ROOT, timeout=60, stdin=subprocess.DEVNULL)
    assert wait_until(lambda: source.pipeline.events_received().get("exits") == 1)
    assert wait_until(lambda: "cpu" not in source.pipeline.snapshot().tiers)
    assert source.engine_pids() == ()
    assert "without closing its tap" not in caplog.text  # its final batch said so, not /proc


def test_a_tap_whose_process_ends_without_closing_leaves_the_tier_gauges(source, tmp_path):
    """vLLM's server stopped by a signal never calls the tap's shutdown, so no final batch
    comes: the agent reported the dead engine's CPU tier as full for good. Two real tap
    processes report a tier; one is killed (SIGKILL): its tier goes, the other's stays. A
    source the agent cannot see in /proc (another PID namespace; pid 0: an older tap) is
    never taken for ended."""
    import subprocess
    import sys

    taps = {name: subprocess.Popen([sys.executable, "-c", _KILLED_TAP, _endpoint(tmp_path), name],
                                   stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
            for name in ("dies", "lives")}
    try:
        for tap in taps.values():
            assert tap.stdout.readline() == "sent\n"
        tiers = lambda: source.pipeline.snapshot().tiers  # noqa: E731
        assert wait_until(lambda: tiers().get("cpu") is not None
                          and tiers()["cpu"].resident_blocks == 128)
        _push(_endpoint(tmp_path), ev.encode_batch(ev.Batch(
            version=ev.SCHEMA_VERSION, source="unseen", seq=0, session="s", pid=0,
            events=[ev.TierSnapshot(ts=time.time(), tier="disk", capacity_bytes=1,
                                    resident_bytes=1, capacity_blocks=1, resident_blocks=1)])))
        assert wait_until(lambda: "disk" in tiers())
        taps["dies"].kill()
        taps["dies"].wait()
        assert wait_until(lambda: tiers()["cpu"].resident_blocks == 64)
        assert "disk" in tiers() and source.engine_pids() == (taps["lives"].pid,)
    finally:
        for tap in taps.values():
            tap.kill()
            tap.wait()
