"""The agent's Parquet capture: engine -> pipeline -> capture -> reader, torn files ignored,
segments bounded, and analyze on a capture equal to analyze on the same in-memory sequence."""

import errno
import fcntl
import itertools
import json
import os
import re
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import tmpfs

from kvscope import events as ev
from kvscope.agent.capture import TMP_SUFFIX, CaptureWriter, missing_segments
from kvscope.agent.config import AgentSettings, ConfigError
from kvscope.agent.record_data import RecordData
from kvscope.agent.requests import RequestRecord
from kvscope.analysis.analyze import AnalyzeOptions, analyze
from kvscope.analysis.capture_reader import read_block_trace, read_request_sample
from kvscope.analysis.inputs import from_requests, load_trace
from kvscope.analysis.report import to_dict
from kvscope.cli import main
from kvscope.engine.engine import OffloadEngine
from kvscope.engine.presets import get_preset
from kvscope.engine.workload import SyntheticConfig, TraceError, synthetic
from kvscope.service.agent import Agent

T0 = 1_700_000_000.0  # Unix seconds at workload time 0
PRESET = get_preset("tiny")
NO_COLLECTORS = {"host": {"enabled": False}, "gpu": {"enabled": False}}


def _requests(n=300, seed=3):
    return list(itertools.islice(synthetic(SyntheticConfig(seed=seed, block_tokens=16)), n))


def _run_through_agent(capture_dir, requests, cpu_blocks=256):
    """Replay ``requests`` through the simulator into a real Agent with a capture; the engine's
    clock reads T0 + each request's arrival. Returns the engine (closed)."""
    agent = Agent(AgentSettings(capture_dir=capture_dir, collectors=NO_COLLECTORS),
                  with_ingest=False)
    now = [T0]
    engine = OffloadEngine(PRESET, 64, cpu_blocks, payload=False, record_blocks=True,
                           clock=lambda: now[0],
                           emit=lambda event: agent.pipeline.ingest("engine", (event,)))
    agent.start()
    try:
        for request in requests:
            now[0] = T0 + request.arrival
            engine.process(request)
        engine.close()
    finally:
        agent.shutdown()
    return engine


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """(capture directory, requests, engine) of one 300-request run, with a torn ``.tmp``
    segment (half of a real one) and a garbage ``.tmp`` left in the directory afterwards."""
    directory = tmp_path_factory.mktemp("capture")
    requests = _requests()
    engine = _run_through_agent(directory, requests)
    segment = sorted(directory.glob("blocks-*.parquet"))[0]
    data = segment.read_bytes()
    (directory / ("blocks-9999999999999-4000000-000001" + TMP_SUFFIX)).write_bytes(
        data[: len(data) // 2])
    (directory / ("requests-9999999999999-4000000-000002" + TMP_SUFFIX)).write_bytes(b"PAR1 torn")
    return directory, requests, engine


def test_block_accesses_round_trip_and_torn_segments_are_ignored(captured):
    directory, requests, engine = captured
    trace = read_block_trace(directory)
    expected = from_requests(requests, 16)
    np.testing.assert_array_equal(trace.block_ids, expected.block_ids)
    np.testing.assert_array_equal(trace.tokens, expected.tokens)
    np.testing.assert_array_equal(trace.requests, expected.requests)
    np.testing.assert_array_equal(trace.depths, expected.depths)
    np.testing.assert_allclose(trace.times, expected.times - requests[0].arrival, atol=1e-6)
    assert (trace.request_count, trace.prompt_tokens, trace.block_tokens) == (
        expected.request_count, expected.prompt_tokens, 16)
    # the per-block outcomes add up to the engine's own token accounting
    table = pq.read_table(sorted(directory.glob("blocks-*.parquet")))
    outcome = table.column("outcome").to_numpy(zero_copy_only=False)
    tokens = table.column("tokens").to_numpy()
    by_outcome = {s: int(tokens[outcome == s].sum()) for s in ev.TOKEN_SOURCES}
    assert by_outcome == {s: engine.stats.tokens[s] for s in ev.TOKEN_SOURCES}
    assert by_outcome["cpu"] > 0 and by_outcome["gpu"] > 0  # the run exercised both tiers


def test_requests_round_trip(captured):
    directory, requests, engine = captured
    sample = read_request_sample(directory, name="run")
    assert sample.requests == len(requests)
    np.testing.assert_allclose(np.sort(sample.ttft), np.sort(engine.stats.ttfts))
    assert sample.tokens == {s: engine.stats.tokens[s] for s in ev.TOKEN_SOURCES}
    assert len(sample.itl) == sum(r.output_tokens > 1 for r in requests)
    np.testing.assert_allclose(sample.itl, PRESET.decode_seconds(1))
    # the simulator's transfers: real sizes, durations from the preset's cost model
    promoted = sample.transfer_blocks["cpu->gpu"]
    assert promoted > 0
    assert sample.transfer_bytes["cpu->gpu"] == promoted * engine.block_bytes
    assert sample.transfer_seconds["cpu->gpu"] == pytest.approx(
        promoted * engine.block_bytes / PRESET.h2d_bytes_per_second)
    assert sample.promotion_wait.sum() == pytest.approx(sample.transfer_seconds["cpu->gpu"])


def test_a_request_without_tokens_by_source_prices_none_of_them(tmp_path):
    """Two requests of 1,000 prompt tokens, each 1 s of prefill: the tap's, all recomputed,
    and one seen through vLLM's span alone (no tokens by source, written as 0). The span's
    second of prefill was priced against the tap's tokens: 500 tokens/s. By hand: 1,000
    tokens recomputed in the 1 s of the request that measured them."""
    writer = CaptureWriter(tmp_path)
    for rid, tokens in (("tap", {"recompute": 1000}), ("span", {})):
        writer.add_request(RequestRecord.from_data(RecordData(
            request_id=rid, trace_id="", source="vllm", arrival=T0, prompt_tokens=1000,
            tokens=tokens, ttft=1.0, prefill=1.0, finished=T0 + 2)))
    writer.close()
    sample = read_request_sample(tmp_path)
    assert sample.tokens["recompute"] == 1000 and sample.prefill_seconds == 1.0


def test_analyze_on_a_capture_equals_analyze_on_the_same_sequence(captured):
    directory, requests, _engine = captured
    options = AnalyzeOptions(preset=PRESET, arc_points=4, curve_points=24)
    # the same sequence with the times the agent saw: Unix stamps, counted from the first
    rebased = [replace(r, arrival=(T0 + r.arrival) - (T0 + requests[0].arrival)) for r in requests]
    in_memory = to_dict(analyze(from_requests(rebased, 16), options))
    for path in (directory, sorted(directory.glob("blocks-*.parquet"))[0]):
        if path != directory and len(list(directory.glob("blocks-*.parquet"))) > 1:
            continue  # a single segment equals the whole only when there is one
        on_capture = to_dict(analyze(load_trace(path), options))
        on_capture.pop("source"), in_memory.pop("source", None)
        assert on_capture == in_memory


def test_analyze_command_reads_a_capture_directory(captured, capsys):
    directory, requests, _engine = captured
    assert main(["analyze", str(directory), "--json", "--preset", "tiny", "--arc-points", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == len(requests) and out["block_tokens"] == 16


def test_a_capture_without_block_rows_or_a_missing_one_is_a_trace_error(tmp_path, captured):
    directory, _requests, _engine = captured
    only_requests = tmp_path / "only-requests"
    only_requests.mkdir()
    for p in directory.glob("requests-*.parquet"):
        shutil.copy(p, only_requests)
    # it says what writes them: lookups with block hashes (an agent with a capture directory
    # whose tap sends none writes requests only)
    with pytest.raises(TraceError, match="no blocks segments .* carry block_hashes"):
        read_block_trace(only_requests)
    with pytest.raises(TraceError, match="no such capture"):
        read_request_sample(tmp_path / "missing")
    assert main(["compare", str(tmp_path / "missing"), str(directory)]) == 2
    # a directory with no segments at all is most likely a wrong path: said in a few words
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match=r"empty: not a capture directory \(no segments in it\); "
                       "give a trace file or a directory"):
        read_block_trace(tmp_path / "empty")
    # compare reads captures only: no trace file offered
    with pytest.raises(TraceError, match=r"in it\); give a directory kvscope agent"):
        read_request_sample(tmp_path / "empty")
    # a rollout's --out (the dashboard's Compare page reads it) is named as one, with its report
    (tmp_path / "empty" / "rollout.json").write_text("{}")
    with pytest.raises(TraceError, match=r"wrote; it holds a rollout's report: open "
                       + re.escape(str(tmp_path / "empty" / "rollout.html"))):
        read_request_sample(tmp_path / "empty")


def test_segments_still_being_written_are_named_not_skipped_unremarked(tmp_path, captured,
                                                                       caplog):
    """A running capture keeps its newest rows in .parquet.tmp segments until the minute ends:
    analyze left them out unremarked, and compare said the capture had no requests segments.
    Now the reader says how many it left out, and with none finished, to run again later."""
    directory, _requests, _engine = captured
    running = tmp_path / "running"
    running.mkdir()
    for p in directory.glob("requests-*.parquet"):
        shutil.copy(p, running)
    (running / "requests-0000000000-1-1.parquet.tmp").write_bytes(b"PAR1")
    read_request_sample(running)
    assert "left out 1 requests segment still being written" in caplog.text
    (running / "blocks-0000000000-1-1.parquet.tmp").write_bytes(b"PAR1")
    with pytest.raises(TraceError, match="no finished blocks segments yet, 1 blocks segment "
                                         "still being written .* run again"):
        read_block_trace(running)


def _lookup(i, blocks=8):
    return ev.Lookup(ts=T0 + i, request_id=f"r{i}", tokens={"recompute": blocks * 16},
                     blocks=blocks, block_hashes=[(i * 1000 + b) for b in range(blocks)],
                     block_sources=["recompute"] * blocks, block_tokens=16)


def _fill(writer, now, step=1.0):
    """400 lookups (3,200 block rows) ``step`` seconds apart, flushed every 5 (40 rows)."""
    for i in range(400):
        now[0] += step
        writer.add_lookup("engine", _lookup(i))
        if i % 5 == 4:
            writer.flush()


def test_segments_with_nulls_are_an_error_naming_the_capture(tmp_path, capsys):
    """A hand-edited or foreign requests segment with null token counts crashed compare with a
    traceback (exit 1); null block hashes were read as 2**63, all one block. Both are now one
    line naming the capture and the column, exit 2."""
    import pyarrow as pa

    from kvscope.agent.capture import BLOCKS_SCHEMA, REQUESTS_SCHEMA

    for kind, schema in (("requests", REQUESTS_SCHEMA), ("blocks", BLOCKS_SCHEMA)):
        directory = tmp_path / kind
        directory.mkdir()
        nullable = "tokens_gpu" if kind == "requests" else "block_hash"
        columns = {f.name: [None] * 3 if f.name == nullable else
                   [[]] * 3 if f.name == "transfers" else
                   ["x"] * 3 if pa.types.is_string(f.type) else [0] * 3 for f in schema}
        columns.update({"ttft": [0.1] * 3} if kind == "requests" else {})
        pq.write_table(pa.table(columns, schema=schema), directory / f"{kind}-1-1-1.parquet")
    with pytest.raises(TraceError, match="requests: requests segments with empty values in "
                                         "tokens_gpu"):
        read_request_sample(tmp_path / "requests")
    with pytest.raises(TraceError, match="blocks: blocks segments with empty values in block_hash"):
        read_block_trace(tmp_path / "blocks")
    shutil.copytree(tmp_path / "requests", tmp_path / "again")
    assert main(["compare", str(tmp_path / "requests"), str(tmp_path / "again")]) == 2
    assert "requests segments with empty values in tokens_gpu" in capsys.readouterr().err
    # inside a transfer too: ok null read as a failure, src null as the direction "None->gpu"
    directory = tmp_path / "transfers"
    directory.mkdir()
    columns = {f.name: ["x"] * 3 if pa.types.is_string(f.type) else [0] * 3
               for f in REQUESTS_SCHEMA}
    columns.update(ttft=[0.1] * 3, transfers=[[{"src": "cpu", "dst": "gpu", "blocks": 1,
                                                "bytes": 1, "start": 0.0, "duration": 0.0,
                                                "ok": None}]] * 3)
    pq.write_table(pa.table(columns, schema=REQUESTS_SCHEMA), directory / "requests-1-1-1.parquet")
    with pytest.raises(TraceError, match="empty values in transfers"):
        read_request_sample(directory)


def test_lookups_captured_out_of_time_order_are_read_in_time_order(tmp_path):
    """Two taps' batches interleave: lookups at T0+3 (3 blocks), T0+1 (2), T0+2 (4) captured in
    that order read as a capture of them in time order (duration 2 s, not -1 s; times never
    run back), each lookup's blocks together and its prompt tokens with it."""
    def lookup(i, blocks):
        return ev.Lookup(ts=T0 + i, request_id=f"r{i}", tokens={"recompute": blocks * 16},
                         blocks=blocks, block_hashes=[i * 1000 + b for b in range(blocks)],
                         block_sources=["recompute"] * blocks, block_tokens=16)

    traces = {}
    for name, order in (("shuffled", (3, 1, 2)), ("sorted", (1, 2, 3))):
        writer = CaptureWriter(tmp_path / name)
        for i in order:
            writer.add_lookup("engine", lookup(i, {1: 2, 2: 4, 3: 3}[i]))
        writer.close()
        traces[name] = read_block_trace(tmp_path / name)
    shuffled, ordered = traces["shuffled"], traces["sorted"]
    for field in ("block_ids", "times", "tokens", "requests", "depths"):
        np.testing.assert_array_equal(getattr(shuffled, field), getattr(ordered, field))
    assert list(ordered.times) == [0.0] * 2 + [1.0] * 4 + [2.0] * 3
    assert shuffled.prompt_tokens == ordered.prompt_tokens and shuffled.duration == 2.0


def test_a_queueing_replay_is_captured_in_the_order_it_was_served(tmp_path):
    """Requests arriving 0.1 ms apart, each served in modelled milliseconds (the preset's
    prefill rate): the replay's single server queues them, by more each time (FCFS, so request
    i waits about i times a service less i times 0.1 ms). Their lookups were stamped at
    arrival, the engine's clock less that queueing, which runs backwards from one request to
    the next, so the capture's block rows, read in time order, came back in another order than
    served and analyze of a demo's capture differed from analyze of its trace. Stamped when the
    engine looks the request up, they come back in the order served."""
    from kvscope.engine.replay import Replayer

    requests = [replace(r, arrival=i * 1e-4) for i, r in enumerate(_requests(n=120))]
    agent = Agent(AgentSettings(capture_dir=tmp_path, collectors=NO_COLLECTORS),
                  with_ingest=False)
    engine = OffloadEngine(PRESET, 64, 256, payload=False, record_blocks=True,
                           emit=lambda event: agent.pipeline.ingest("engine", (event,)))
    agent.start()
    try:
        Replayer(engine, requests, speed=None).run()
        engine.close()
    finally:
        agent.shutdown()
    served = from_requests(requests, 16)
    trace = read_block_trace(tmp_path)
    assert len(set(served.requests)) == 120
    np.testing.assert_array_equal(trace.block_ids, served.block_ids)
    np.testing.assert_array_equal(trace.depths, served.depths)


def test_segments_rotate_are_whole_and_are_pruned_to_the_byte_bound(tmp_path):
    now = [T0]
    writer = CaptureWriter(tmp_path, max_bytes=40_000, segment_rows=200,
                           clock=lambda: now[0])
    _fill(writer, now)  # a segment every 25 lookups
    writer.close()
    segments = writer.segments("blocks")
    assert not list(tmp_path.glob(f"*{TMP_SUFFIX}"))
    sizes = [p.stat().st_size for p in segments]
    assert 1 < len(segments) < 16 and sum(sizes[:-1]) <= 40_000
    for p in segments:  # every kept segment is a complete Parquet file
        assert pq.read_metadata(p).num_rows == 200
    trace = read_block_trace(tmp_path)  # what is left: the newest lookups, whole
    assert len(trace) == 200 * len(segments) and trace.block_ids[-1] == 399 * 1000 + 7


def test_the_size_cap_keeps_the_newest_state_of_a_long_run(tmp_path):
    """The tiers' capacities (gpu 64 blocks, cpu 256) and the transfer totals are written at
    the start and never change; 400 lookups then fill the capture past its 40,000-byte cap.
    The size cap deleted the oldest segments of every kind, those first: analyze lost the GPU
    tier's size. The newest segment of each such kind stays, and reads back."""
    from kvscope.analysis.capture_reader import read_tier_capacities, read_transfer_totals

    now = [T0]
    writer = CaptureWriter(tmp_path, max_bytes=40_000, segment_rows=200, clock=lambda: now[0])
    writer.add_sample({"ts": T0, "transfer_bytes": {"gpu->cpu": 4096},
                       "transfer_blocks": {"gpu->cpu": 1}, "transfer_seconds_sum": {},
                       "tier_capacity_bytes": {"gpu": 64 * 4096, "cpu": 256 * 4096},
                       "tier_capacity_blocks": {"gpu": 64, "cpu": 256}})
    writer.flush()
    _fill(writer, now)
    writer.close()
    assert len(writer.segments("blocks")) < 16  # the cap deleted some
    assert read_tier_capacities(tmp_path) == {"gpu": (64 * 4096, 64), "cpu": (256 * 4096, 256)}
    assert read_transfer_totals(tmp_path)["gpu->cpu"][:2] == (4096, 1)


def test_missing_segments_counts_those_the_size_cap_deleted(tmp_path):
    """3,200 rows at 200 a segment: a writer numbers 16 segments, 1 to 16. Under no cap all
    16 stay: none missing. Under a 40,000-byte cap it keeps the newest k and 16 - k are gone.
    A second writer in the same directory and process (the pid of the first, as an agent
    restarted as pid 1 in a container has) numbers its own from 1 again: its 16, all kept
    under no cap, add none, and the first writer's gone ones still count."""
    def write(directory, max_bytes, start=T0):
        now = [start]
        writer = CaptureWriter(directory, max_bytes=max_bytes, segment_rows=200,
                               clock=lambda: now[0])
        _fill(writer, now)
        writer.close()
        return len(writer.segments())

    assert write(tmp_path / "all", 1 << 30) == 16 and missing_segments(tmp_path / "all") == 0
    # a running writer's open segments are there, not gone: lookups and totals each flush,
    # blocks rotating every 2 lookups while totals stays open (it read 1 gone of 4 made)
    now = [T0]
    running = CaptureWriter(tmp_path / "running", segment_rows=16, clock=lambda: now[0])
    for i in range(6):
        now[0] += 1.0
        running.add_lookup("engine", _lookup(i))
        running.add_sample({"ts": now[0], "transfer_bytes": {"cpu->gpu": i + 1},
                            "transfer_blocks": {"cpu->gpu": i + 1}, "transfer_seconds_sum": {}})
        running.flush()
    assert list((tmp_path / "running").glob(f"totals-*{TMP_SUFFIX}"))
    assert missing_segments(tmp_path / "running") == 0
    running.close()
    kept = write(tmp_path / "capped", 40_000)
    assert 1 < kept < 16 and missing_segments(tmp_path / "capped") == 16 - kept
    write(tmp_path / "capped", 1 << 30, T0 + 1000)  # a later run
    assert missing_segments(tmp_path / "capped") == 16 - kept


def test_a_small_byte_bound_makes_small_segments(tmp_path):
    """max_bytes 12,000, under the ~20 KB the 3,200 rows take as one segment, and no row or age
    limit in reach: segments rotate past a quarter of it (3,000 bytes; a Parquet file of the
    11 block columns with one row group is already ~6 KB), so the newest segment, kept at every
    prune, stays well under the bound instead of holding everything."""
    now = [T0]
    writer = CaptureWriter(tmp_path, max_bytes=12_000, clock=lambda: now[0])
    _fill(writer, now, step=0.01)
    writer.close()
    sizes = [p.stat().st_size for p in writer.segments("blocks")]
    assert max(sizes) < 7_000 and sum(sizes) <= 12_000


def test_segments_rotate_by_age_and_pending_rows_are_bounded(tmp_path):
    now = [T0]
    writer = CaptureWriter(tmp_path, segment_seconds=60.0, max_pending_rows=20,
                           clock=lambda: now[0])
    writer.add_lookup("engine", _lookup(0))
    writer.add_lookup("engine", _lookup(1))
    writer.add_lookup("engine", _lookup(2))  # 24 rows > 20: dropped and counted
    assert writer.dropped["blocks"] == 8
    writer.flush()
    assert not writer.segments() and len(list(tmp_path.glob(f"*{TMP_SUFFIX}"))) == 1
    now[0] += 61.0
    writer.flush()  # no new rows, but the open segment is a minute old: finished
    assert len(writer.segments("blocks")) == 1
    assert not list(tmp_path.glob(f"*{TMP_SUFFIX}"))


def test_lookups_without_block_hashes_write_nothing_and_orphans_are_removed(tmp_path, caplog):
    """A .tmp segment a killed writer left is removed at start, even when its name carries
    this process's pid (an agent as pid 1 in a container: each run's orphans were kept, and
    outside the byte bound), and the log says so (a tryout saw its crashed run's segments
    vanish without a word); one a running writer holds its lock on stays."""
    orphan = tmp_path / f"blocks-0000000000001-{os.getpid()}-000001{TMP_SUFFIX}"
    live = tmp_path / f"blocks-0000000000001-{os.getpid()}-000002{TMP_SUFFIX}"
    orphan.write_bytes(b"torn")
    with open(live, "wb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # what a writer still running holds
        writer = CaptureWriter(tmp_path, flush_interval=0.01)
        writer.start()
        writer.add_lookup("engine", ev.Lookup(ts=T0, request_id="r", tokens={"gpu": 16},
                                              blocks=1))
        writer.shutdown()
        writer.shutdown()  # safe twice
    assert not orphan.exists() and live.exists()
    assert "removed 1 unfinished segment(s) (4 bytes)" in caplog.text
    assert not writer.segments()
    CaptureWriter(tmp_path / "never").shutdown()  # safe without start


def test_rows_that_do_not_fit_the_schema_are_dropped_and_capture_goes_on(tmp_path, caplog):
    """A request with 2**63 prompt tokens (past int64) once stopped the capture thread for
    good; a record now refuses such a count itself (OverflowError), but a request id that is
    no UTF-8 (a lone surrogate, from an engine in the agent's process) still does not fit the
    string column: its flush drops that flush's rows (1), logs once, and the next request is
    written."""
    from kvscope.agent.requests import RequestRecord

    with pytest.raises(OverflowError):
        RequestRecord("big", "ab" * 16, "engine", T0, prompt_tokens=2**63)
    writer = CaptureWriter(tmp_path)
    writer.add_request(RequestRecord("bad\ud800", "ab" * 16, "engine", T0, prompt_tokens=8,
                                     finished=T0 + 1))
    writer.flush()
    writer.add_request(RequestRecord("fine", "ab" * 16, "engine", T0, prompt_tokens=8,
                                     finished=T0 + 1))
    writer.close()
    assert writer.dropped["requests"] == 1 and "do not fit the Parquet schema" in caplog.text
    (segment,) = writer.segments("requests")
    assert pq.read_table(segment).column("request_id").to_pylist() == ["fine"]


def test_a_lookup_whose_blocks_do_not_fit_drops_its_own_rows_only(tmp_path):
    """A valid Lookup (a count is up to 2**53) with blocks of 2**32 tokens does not fit the
    int32 columns. It once made its flush drop every queued row, 4 of another source's with
    it: now its 1 row is dropped and the other 4 are written."""
    writer = CaptureWriter(tmp_path)
    writer.add_lookup("engine-a", ev.Lookup(
        ts=T0, request_id="fine", tokens={"gpu": 64}, blocks=4, block_hashes=(1, 2, 3, 4),
        block_sources=("gpu",) * 4, block_tokens=16))
    writer.add_lookup("engine-b", ev.validate(ev.Lookup(
        ts=T0, request_id="huge", tokens={"recompute": 2**32}, blocks=1, block_hashes=(9,),
        block_sources=("recompute",), block_tokens=2**32)))
    writer.close()
    assert writer.dropped["blocks"] == 1
    (segment,) = writer.segments("blocks")
    assert pq.read_table(segment).column("request_id").to_pylist() == ["fine"] * 4


def test_a_segment_that_fails_to_write_is_deleted_and_its_rows_counted(tmp_path):
    """The disk fills while a segment is open (its .tmp is a link to /dev/full, which answers
    every write with ENOSPC): that segment is deleted rather than published without its footer
    (which made `kvscope analyze` refuse the whole directory), its 8 rows count as dropped, and
    the next rows go to a new, whole segment."""
    now = [T0]
    writer = CaptureWriter(tmp_path, clock=lambda: now[0])
    first = tmp_path / f"blocks-{int(T0 * 1000):015d}-{os.getpid()}-000001{TMP_SUFFIX}"
    first.symlink_to("/dev/full")
    writer.add_lookup("engine", _lookup(0))
    for step in (writer.flush, writer.close):
        try:
            step()
        except OSError:
            pass
    assert writer.dropped["blocks"] == 8 and not first.exists() and not writer.segments()
    now[0] += 1.0
    writer.add_lookup("engine", _lookup(1))
    writer.close()
    (segment,) = writer.segments("blocks")
    assert pq.read_table(segment).num_rows == 8


def _disk_full(fd):
    raise OSError(errno.ENOSPC, "No space left on device")


def _logged_flushes(writer, lookups, now=None):
    """For each i of ``lookups``: queue ``_lookup(i)``, run a flush as the flush thread does
    (its failures logged by the outage log), then advance ``now[0]`` a second when given."""
    for i in lookups:
        writer.add_lookup("engine", _lookup(i))
        writer._logged(writer.flush)
        if now is not None:
            now[0] += 1.0


def test_a_full_disk_is_logged_once_and_again_when_rows_are_written(tmp_path, monkeypatch,
                                                                       caplog):
    """Three flushes fail (ENOSPC from fsync, as each finishes its one-row segment): one
    warning, not one a second; the first flush that writes again says so, with the 3 rows
    lost meanwhile (8 blocks each: 24)."""
    writer = CaptureWriter(tmp_path, segment_rows=1)
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", _disk_full)
    _logged_flushes(writer, range(3))
    monkeypatch.setattr(os, "fsync", real_fsync)
    writer._logged(writer.flush)  # nothing to write: no recovery yet
    writer.add_lookup("engine", _lookup(3))
    writer._logged(writer.flush)
    assert caplog.text.count("could not write") == 1
    assert caplog.text.count("writing") == 1 and "24 rows could not be written" in caplog.text
    assert len(writer.segments("blocks")) == 1


def test_a_full_disk_is_logged_once_while_open_segments_still_take_rows(tmp_path, monkeypatch,
                                                                        caplog):
    """Segments finish every 2 s and the disk refuses their ends (ENOSPC from fsync): each
    segment takes two flushes' rows, then is given up at the third, and the next flush opens a
    new one. That flush's rows were counted written, so the log said "writing again" and
    "could not write" once more at every segment (7 pairs in 25 s); now rows count as written
    once their segment is finished: one line for 9 failing flushes, and one when a segment is
    written whole again, with the 9 lookups' 72 rows lost."""
    now = [T0]
    writer = CaptureWriter(tmp_path, segment_seconds=2.0, clock=lambda: now[0])
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", _disk_full)
    _logged_flushes(writer, range(9), now)
    assert caplog.text.count("could not write") == 1 and " again; " not in caplog.text
    assert writer.dropped["blocks"] == 72 and not writer.segments()
    monkeypatch.setattr(os, "fsync", real_fsync)
    _logged_flushes(writer, range(9, 12), now)  # the segment opened now finishes at the third
    assert caplog.text.count("could not write") == 1
    assert caplog.text.count(" again; ") == 1 and "72 rows could not be written" in caplog.text
    (segment,) = writer.segments("blocks")
    assert pq.read_table(segment).num_rows == 24


def test_a_segment_whose_rename_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The rename into place fails (an I/O error, injected into os.replace): the finished
    .tmp was once left behind, outside the byte bound and never removed while the agent ran.
    It is deleted and its 8 rows counted as dropped."""
    writer = CaptureWriter(tmp_path)
    writer.add_lookup("engine", _lookup(0))

    def failing_replace(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        writer.close()
    assert writer.dropped["blocks"] == 8 and list(tmp_path.iterdir()) == []


def test_a_failed_directory_fsync_after_the_rename_drops_nothing(tmp_path, monkeypatch, caplog):
    """The segment is renamed into place, then the directory's fsync fails (injected): its 8
    rows are readable and were once counted as dropped all the same. They count as written;
    a warning says what may not survive a power loss."""
    writer = CaptureWriter(tmp_path)
    writer.add_lookup("engine", _lookup(0))
    fsync = os.fsync

    def fsync_failing_on_directories(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_failing_on_directories)
    writer.close()
    assert writer.dropped["blocks"] == 0 and "could not fsync" in caplog.text
    (segment,) = writer.segments("blocks")
    assert pq.read_table(segment).num_rows == 8


def test_an_entry_the_capture_cannot_delete_does_not_stop_pruning(tmp_path):
    """A directory named like the oldest segment cannot be unlinked: it is no segment, and the
    segments after it are still pruned to the byte bound (before, pruning stopped there)."""
    (tmp_path / "blocks-000000000000001-1-000001.parquet").mkdir()
    now = [T0]
    writer = CaptureWriter(tmp_path, max_bytes=40_000, segment_rows=200, clock=lambda: now[0])
    for i in range(100):
        writer.add_lookup("engine", _lookup(i))
        now[0] += 1.0
        writer.flush()
    writer.close()
    assert sum(p.stat().st_size for p in writer.segments()) <= 40_000


def test_a_removed_capture_directory_is_made_again_and_both_streams_go_on(tmp_path):
    """The directory is removed while both streams have a segment open: the next flush gives
    those segments up (their rows counted as dropped) instead of failing every second from
    then on with the requests stream never written; the rows after it reach new, whole
    segments in the directory made again."""
    from kvscope.agent.requests import RequestRecord

    directory = tmp_path / "cap"
    now = [T0]
    writer = CaptureWriter(directory, clock=lambda: now[0])
    record = RequestRecord("r", "ab" * 16, "engine", T0, prompt_tokens=8, finished=T0 + 1)
    writer.add_lookup("engine", _lookup(0))
    writer.add_request(record)
    writer.flush()
    shutil.rmtree(directory)
    writer.add_lookup("engine", _lookup(1))
    with pytest.raises(OSError):
        writer.flush()
    assert writer.dropped == {"blocks": 16, "requests": 1, "totals": 0, "tokens": 0, "tiers": 0}
    now[0] += 1.0
    writer.add_lookup("engine", _lookup(2))
    writer.add_request(record)
    writer.close()
    assert [pq.read_table(p).num_rows for p in writer.segments()] in ([8, 1], [1, 8])


@pytest.mark.parametrize("samples", [2, 0], ids=["sampled", "stopped-before-a-sample"])
def test_the_agents_samples_give_the_capture_its_transfer_totals(tmp_path, samples):
    """A background store (no request) of 4 blocks, 4096 bytes, 2 ms, and one that failed (io);
    a disk->cpu promotion of 2 blocks, 2048 bytes, seen untimed by a source blind to failures
    (KV events); then ``samples`` dashboard samples, and the agent stops. The capture's totals
    hold the stores, which no request row does, in one row per direction (a sample with
    nothing new adds none): gpu->cpu 4096 bytes, 4 blocks, 0.002 s, 1 failure; disk->cpu 2048
    bytes, 2 blocks, 0 s, failures not measured (None, never 0). With no sample taken (the agent
    samples once a second) the last one, at shutdown, holds them: the totals missed up to a
    second of transfers."""
    from kvscope.analysis.capture_reader import read_transfer_totals

    agent = Agent(AgentSettings(capture_dir=tmp_path / "cap", collectors=NO_COLLECTORS),
                  with_ingest=False)
    agent.start()
    try:
        agent.pipeline.ingest("engine", [
            ev.Transfer(ts=T0, src="gpu", dst="cpu", blocks=4, bytes=4096, duration=0.002),
            ev.Transfer(ts=T0, src="gpu", dst="cpu", blocks=4, bytes=4096, duration=0.001,
                        ok=False, reason="io")])
        agent.pipeline.ingest("kv-events", [
            ev.Transfer(ts=T0, src="disk", dst="cpu", blocks=2, bytes=2048, duration=0.0,
                        timed=False, sees_failures=False)])
        for _ in range(samples):
            agent.sample()
    finally:
        agent.shutdown()
    assert read_transfer_totals(tmp_path / "cap") == {"gpu->cpu": (4096, 4, 0.002, 1),
                                                      "disk->cpu": (2048, 2, 0.0, None)}
    segments = list((tmp_path / "cap").glob("totals-*.parquet"))
    assert len(segments) == 1 and pq.read_table(segments[0]).num_rows == 2
    assert not list((tmp_path / "cap").glob("requests-*.parquet"))


def test_agents_restarted_into_one_capture_add_their_runs_up(tmp_path):
    """Two agent runs into one capture directory: run 1 moves 100 bytes (cpu->gpu) and counts
    200 gpu tokens, run 2 150 bytes and 300 tokens. Each run's counters start at 0, and run 2's
    first row was above run 1's last, so no drop told of the restart: the totals read 150
    bytes and 300 tokens, run 1's lost. By hand: 250 bytes, 500 tokens."""
    from kvscope.analysis.capture_reader import read_token_totals, read_transfer_totals

    for nbytes, tokens in ((100, 200), (150, 300)):
        agent = Agent(AgentSettings(capture_dir=tmp_path / "cap", collectors=NO_COLLECTORS),
                      with_ingest=False)
        agent.start()
        try:
            agent.pipeline.ingest("engine", [
                ev.Transfer(ts=T0, src="cpu", dst="gpu", blocks=1, bytes=nbytes, duration=0.001),
                ev.Lookup(ts=T0, request_id="", tokens={"gpu": tokens}, blocks=0)])
        finally:
            agent.shutdown()
    assert read_transfer_totals(tmp_path / "cap")["cpu->gpu"][:2] == (250, 2)
    assert read_token_totals(tmp_path / "cap")["gpu"] == 500


def test_a_failing_last_sample_still_closes_the_capture(tmp_path, monkeypatch):
    """A bug in the last sample (fault injected: recording a sample raises) made the agent's
    shutdown raise before it closed its sinks: the open segments stayed unfinished, and the
    next agent there deletes them, up to a minute of rows. They are finished now, and the
    bug is logged."""
    agent = Agent(AgentSettings(capture_dir=tmp_path / "cap", collectors=NO_COLLECTORS),
                  with_ingest=False)
    agent.start()
    agent.pipeline.ingest("engine", [ev.RequestStarted(ts=T0, request_id="r", prompt_tokens=4),
                                     ev.RequestFinished(ts=T0 + 1, request_id="r", ttft=0.5,
                                                        prompt_tokens=4)])

    def bug(*_args, **_kwargs):
        raise RuntimeError("a sample bug")

    monkeypatch.setattr(agent.pipeline, "record_sample", bug)
    agent.shutdown()
    assert not list((tmp_path / "cap").glob(f"*{TMP_SUFFIX}"))
    assert list(read_request_sample(tmp_path / "cap").ttft) == [0.5]


def test_the_agents_samples_give_the_capture_its_token_totals(tmp_path):
    """vLLM in zero-code mode tells the agent its prompt tokens by source as counters, one
    aggregate Lookup per scrape, with no request id: no request row holds them. Two scrapes,
    gpu 100 + 50, cpu 200 + 0, recompute 300 + 25, a sample after each and one after nothing
    new: the capture's token totals are gpu 150, cpu 200, recompute 325, in two rows per
    source (the third sample changed nothing). An agent that counted no token writes none."""
    from kvscope.analysis.capture_reader import read_token_totals

    agent = Agent(AgentSettings(capture_dir=tmp_path / "cap", collectors=NO_COLLECTORS),
                  with_ingest=False)
    agent.start()
    try:
        agent.sample()  # nothing counted yet: no row
        for tokens in ({"gpu": 100, "cpu": 200, "recompute": 300},
                       {"gpu": 50, "cpu": 0, "recompute": 25}):
            agent.pipeline.ingest("vllm", [ev.Lookup(ts=T0, request_id="", tokens=tokens,
                                                     blocks=0)])
            agent.sample()
        agent.sample()
    finally:
        agent.shutdown()
    assert read_token_totals(tmp_path / "cap") == {"gpu": 150, "cpu": 200, "recompute": 325}
    rows = pq.read_table(list((tmp_path / "cap").glob("tokens-*.parquet"))).to_pylist()
    assert sorted((r["source"], r["tokens"]) for r in rows) == [
        ("cpu", 200), ("cpu", 200), ("gpu", 100), ("gpu", 150), ("recompute", 300),
        ("recompute", 325)]

    agent = Agent(AgentSettings(capture_dir=tmp_path / "none", collectors=NO_COLLECTORS),
                  with_ingest=False)
    agent.start()
    try:
        agent.sample()
    finally:
        agent.shutdown()
    assert read_token_totals(tmp_path / "none") is None


def test_the_capture_holds_the_tiers_capacities_and_analyze_takes_them(tmp_path, captured):
    """The reference engine of the 300-request run had a gpu tier of 64 blocks and a cpu tier
    of 256, of preset tiny's 16-token blocks: its capture holds both, in bytes and blocks, and
    analyze takes the GPU prefix cache (64 x 16 = 1,024 tokens) from them instead of assuming
    none, and evaluates the cpu tier's own size on its curve. A tier resized later adds a row,
    and the last one counts; samples that change nothing add none."""
    from kvscope.analysis.capture_reader import read_measured_rates, read_tier_capacities

    directory, _, _ = captured
    bpb = PRESET.bytes_per_block(16)
    assert read_tier_capacities(directory) == {"gpu": (64 * bpb, 64), "cpu": (256 * bpb, 256)}
    analysis = analyze(load_trace(str(directory)), AnalyzeOptions(
        PRESET, measured=read_measured_rates(directory), arc_points=0))
    assumptions = analysis.sizing.assumptions
    assert assumptions["gpu_tokens"] == 1024
    assert assumptions["gpu_tokens_source"] == ("measured: the capture's gpu tier, 64 blocks "
                                                "as its engine reported it")
    assert not any("No GPU prefix cache" in note for note in analysis.notes)
    # The engine's own tiers by the curve against what they served in the run: its GPU tier
    # is an LRU of 64 blocks, as the curve's GPU cache (the same share to the last token); the
    # curve's CPU tier is inclusive (it holds the GPU's blocks too), the engine's holds others
    # beside them, so it served more, by a little here (the curve is the conservative one).
    served = read_request_sample(directory).tokens
    share = {source: n / sum(served.values()) for source, n in served.items()}
    current = analysis.sizing.current
    assert current.blocks == 256 and current.bytes == 256 * bpb
    assert analysis.sizing.gpu_token_hit_share == pytest.approx(share["gpu"], abs=1e-12)
    assert current.cpu_token_hit_share <= share["cpu"] <= current.cpu_token_hit_share + 0.05

    agent = Agent(AgentSettings(capture_dir=tmp_path / "cap", collectors=NO_COLLECTORS),
                  with_ingest=False)
    agent.start()
    try:
        for blocks in (100, 100, 300):
            agent.pipeline.ingest("engine", [ev.TierSnapshot(
                ts=T0, tier="cpu", capacity_bytes=blocks * 4096, resident_bytes=0,
                capacity_blocks=blocks, resident_blocks=0)])
            agent.sample()
    finally:
        agent.shutdown()
    assert read_tier_capacities(tmp_path / "cap") == {"cpu": (300 * 4096, 300)}
    rows = pq.read_table(list((tmp_path / "cap").glob("tiers-*.parquet"))).to_pylist()
    assert [(r["tier"], r["capacity_blocks"]) for r in rows] == [("cpu", 100), ("cpu", 300)]


@pytest.mark.parametrize("damaged", ["requests", "totals"])
def test_a_damaged_kind_of_segment_costs_only_what_it_measures(tmp_path, captured, caplog,
                                                                damaged):
    """A tryout cut the capture's requests segment short: analyze then assumed every rate,
    the bandwidth measured by the intact totals too; an empty totals segment did the same to
    the prefill rate the requests measure. Each kind of segment now measures what it can:
    without the requests the totals give the bandwidth and the KV bytes per block; without
    the totals the requests give the prefill rate and their own transfers the rest (the
    transfer cost compare reads falls back the same way), and a warning says which."""
    from kvscope.analysis.capture_reader import read_measured_rates, read_request_sample

    directory, _, _ = captured
    whole = read_measured_rates(directory)
    copy = tmp_path / "cap"
    shutil.copytree(directory, copy)
    for segment in copy.glob(f"{damaged}-*.parquet"):
        segment.write_bytes(segment.read_bytes()[: segment.stat().st_size // 2])
    with caplog.at_level("WARNING", logger="kvscope.analysis.capture_reader"):
        rates = read_measured_rates(copy)
    assert rates.bandwidth is not None and rates.bytes_per_block is not None
    assert rates.gpu_blocks == whole.gpu_blocks == 64
    if damaged == "requests":
        assert rates.prefill_tokens_per_second is None
        assert (rates.bandwidth, rates.bytes_per_block) == (whole.bandwidth,
                                                            whole.bytes_per_block)
        assert "no prefill rate measured" in caplog.text
    else:
        assert rates.prefill_tokens_per_second == whole.prefill_tokens_per_second
        assert "its requests' transfers are its transfer cost" in caplog.text
        assert len(read_request_sample(copy).ttft) == len(read_request_sample(directory).ttft)


@pytest.fixture
def read_only_mount(tmp_path):
    """A read-only tmpfs at tmp_path/"ro" (denies root too); skipped where mounting is not
    allowed."""
    with tmpfs(tmp_path / "ro", "ro,size=1m") as mount:
        yield mount


def _unwritable(how, tmp_path, request):
    """A directory path no file can be written under, for root too (CI runs as root, whom
    chmod does not stop), but for "mode 555" (skipped as root)."""
    if how == "parent is a file":
        (tmp_path / "file").write_text("")
        return tmp_path / "file" / "sink"
    if how == "a file in its place":
        (tmp_path / "sink").write_text("")
        return tmp_path / "sink"
    if how == "takes no files":
        return Path("/proc/self")  # a directory: procfs creates no file there
    if how == "read-only mount":
        return request.getfixturevalue("read_only_mount")
    if os.geteuid() == 0:
        pytest.skip("root writes into a mode 555 directory")
    directory = tmp_path / "sink"
    directory.mkdir(mode=0o555)
    return directory


@pytest.mark.parametrize("key", ["store_dir", "capture_dir"])
@pytest.mark.parametrize("how", ["parent is a file", "a file in its place", "takes no files",
                                 "read-only mount", "mode 555"])
def test_every_sink_refuses_to_start_in_a_directory_it_cannot_write(tmp_path, request, key,
                                                                     how):
    """One start-up rule for every sink that writes files: a store_dir or capture_dir where no
    file can be written stops the agent at start, naming the key, the directory and what to
    fix (a read-only capture_dir used to start and drop every row), with nothing running."""
    directory = _unwritable(how, tmp_path, request)
    agent = Agent(AgentSettings(**{key: directory}, collectors=NO_COLLECTORS),
                  with_ingest=False)
    with pytest.raises(ConfigError) as refused:
        agent.start()
    message = str(refused.value)
    assert message.startswith(f"cannot use {key} {directory}: ")
    flag = "--" + key.replace("_", "-")  # the demo has no config file: the flag is named too
    assert f"make it a directory this user can create files in, or set {key} ({flag}) to " \
        "one" in message
    assert not agent.ready and not [t for t in threading.enumerate()
                                    if t.name in ("kvscope-store", "kvscope-capture")]
