"""`kvscope analyze`: the pure analysis, its JSON and text, the Sizing page data, and the CLI."""

import itertools
import json

import numpy as np
import pytest

from kvscope.agent.capture import CaptureWriter
from kvscope.analysis.analyze import AnalyzeOptions, analyze
from kvscope.analysis.inputs import load_trace
from kvscope.analysis.report import render_text, sizing_figure_data, to_dict
from kvscope.cli import main
from kvscope.engine.presets import get_preset
from tests.traces import trace_path

RECORDS = [  # Mooncake JSONL: 512-token blocks; the first two blocks are shared
    {"timestamp": 0, "input_length": 1536, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 4000, "input_length": 512, "output_length": 10, "hash_ids": [7]},
]


@pytest.fixture
def small_trace(tmp_path):
    return _small(tmp_path)


def _small(tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def test_cli_json_is_complete_and_exact(small_trace, capsys):
    assert main(["analyze", str(small_trace), "--json", "--preset", "tiny"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == "kvscope.analysis/v1"
    assert (out["accesses"], out["requests"], out["block_tokens"]) == (9, 4, 512)
    assert out["bytes_per_block"] == 2048 * 512  # tiny: 2 KiB per token
    assert out["reuse"]["reuse_share"] == pytest.approx(4 / 9)
    lru = out["curves"]["lru"]
    # accesses 0 1 2 0 1 3 0 1 7: reuses at distances 2, 2, 2, 2 -> all hit from 3 blocks on
    assert lru["sizes_blocks"][-1] == 3
    assert lru["miss_ratio"][-1] == pytest.approx(5 / 9)
    assert lru["sizes_bytes"][-1] == 3 * 2048 * 512
    assert out["sizing"]["offload"] is True
    assert out["sizing"]["recommended"]["blocks"] == 3


def test_cli_text_report(small_trace, capsys):
    assert main(["analyze", str(small_trace), "--preset", "tiny", "--arc-points", "2"]) == 0
    text = capsys.readouterr().out
    for heading in ("Reuse", "Miss-ratio curves (lru-exact)", "Sizing", "Verdict: Offload"):
        assert heading in text
    assert "--kv-offloading-size" in text
    # the sizes follow the model's block shape: the report names the preset it assumed
    assert "bytes/block (preset tiny; --preset for your model)" in text.splitlines()[1]
    # the body says the saving as the verdict does (once "0.0 s" beside "0.04157 s")
    saved = next(line for line in text.splitlines() if "prefill saved" in line)
    amount = saved.split("prefill saved ")[1].split(";")[0]
    assert f"saving {amount} of prefill" in text, (amount, text)


def test_the_verdict_names_what_it_assumed(small_trace, capsys):
    """A trace measures none of what the verdict's figures rest on: all four are named under
    it (a tryout's damaged capture priced its tokens at a preset's rate, 8 times its own, and
    only a line far above said so); given on the command line, the bandwidth, the prefill
    rate and the GPU cache are not assumptions, the KV block size (the preset's) still is."""
    def under_verdict(*args):
        assert main(["analyze", str(small_trace), "--preset", "tiny", *args]) == 0
        lines = capsys.readouterr().out.splitlines()
        verdict = next(i for i, line in enumerate(lines) if line.startswith("Verdict: Offload"))
        return [line for line in lines[verdict + 1:] if line.startswith("  - ")]

    assumed = under_verdict()
    assert [line.split(" assumed, not measured: ")[0] for line in assumed] == [
        "  - promotion bandwidth", "  - prefill rate", "  - KV bytes per block",
        "  - GPU prefix cache"]
    assert assumed[1].endswith(": preset tiny's cost model")
    assert under_verdict("--bandwidth-gbps", "10", "--prefill-tokens-per-second", "5000",
                         "--gpu-tokens", "512") == [
        "  - KV bytes per block assumed, not measured: preset tiny's KV shape"]


def test_one_request_is_one_request(tmp_path, capsys):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n")
    assert main(["analyze", str(path), "--preset", "tiny"]) == 0
    assert "  1 request, " in capsys.readouterr().out


def test_a_capture_directory_none_of_whose_segments_reads_is_named(tmp_path, capsys):
    """A capture directory whose only blocks segment is damaged: the error told a user who had
    passed the directory to "pass the capture directory"; it names the directory and the
    segment that does not read."""
    capture = tmp_path / "dmg"
    capture.mkdir()
    segment = capture / "blocks-000000000000001-1-000001.parquet"
    segment.write_bytes(b"garbage")
    assert main(["analyze", str(capture)]) == 2
    err = capsys.readouterr().err
    assert f"{capture}: no blocks segment of it can be read: {segment}: a blocks segment that " \
        "cannot be read, damaged or cut short (" in err and "pass" not in err


def test_a_capture_stopped_before_any_request_says_so(tmp_path, capsys):
    """An agent stopped before the engine served anything leaves only its samples' segments
    (totals, tiers): analyze said its blocks segments were missing, as if the tap recorded no
    block hashes; compare, its requests. Both now say no request reached the capture."""
    for name in ("early", "early2"):
        writer = CaptureWriter(tmp_path / name)
        writer.add_sample({"ts": 1.0, "transfer_bytes": {"gpu->cpu": 0}, "transfer_blocks": {},
                           "transfer_seconds_sum": {}, "tier_capacity_bytes": {"cpu": 1 << 30}})
        writer.close()
    capture = tmp_path / "early"
    assert sorted(p.name.split("-")[0] for p in capture.iterdir()) == ["tiers", "totals"]
    assert main(["analyze", str(capture)]) == 2
    assert (f"{capture}: no request reached this capture (it holds only tiers and totals "
            "segments: ") in capsys.readouterr().err
    assert main(["compare", str(capture), str(tmp_path / "early2")]) == 2
    assert f"{capture}: no request reached this capture" in capsys.readouterr().err


def test_cli_errors_exit_2(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "missing.jsonl")]) == 2
    (tmp_path / "capture.csv").write_text("a,b\n")  # read as Mooncake JSONL, as replay does
    assert main(["analyze", str(tmp_path / "capture.csv")]) == 2
    assert f"{tmp_path / 'capture.csv'}:1: not JSON" in (err := capsys.readouterr().err)
    assert "(read as Mooncake JSONL, as a file not ending in .parquet is; a trace may also be " \
        "a capture directory)" in err
    (tmp_path / "passwd").write_text("root:x:0:0\n")
    assert main(["analyze", str(tmp_path / "passwd")]) == 2
    assert f"{tmp_path / 'passwd'}:1: not JSON" in capsys.readouterr().err
    (tmp_path / "trace.txt").write_text(json.dumps(RECORDS[0]) + "\n")  # replay reads it too
    assert main(["analyze", str(tmp_path / "trace.txt"), "--preset", "tiny"]) == 0
    assert "  1 request, " in capsys.readouterr().out
    assert main(["analyze", str(tmp_path / "capture.parquet")]) == 2  # a capture, but missing
    assert "No such file or directory" in capsys.readouterr().err
    (tmp_path / "ok.jsonl").write_text(json.dumps(RECORDS[0]) + "\n")
    with pytest.raises(SystemExit) as exited:  # argparse refuses it
        main(["analyze", str(tmp_path / "ok.jsonl"), "--target-share", "2"])
    assert exited.value.code == 2 and "must be in (0, 1]" in capsys.readouterr().err


def test_a_sample_too_small_to_size_from_is_refused(capsys):
    """SHARDS at R = 1e-9 keeps none of the trace's 182,790 distinct blocks: a curve from it
    would claim any tier serves everything, so analyze refuses with one line instead."""
    assert main(["analyze", str(trace_path()), "--method", "shards-rate",
                 "--sample-rate", "1e-9"]) == 2
    err = capsys.readouterr().err
    assert "distinct blocks" in err and len(err.strip().splitlines()) == 1


def test_a_thin_sample_of_a_small_trace_is_refused_too(tmp_path, capsys):
    """The trace's first 30 requests hold fewer than 1,000 distinct blocks; R = 0.001 keeps
    about none of them (an expected 0.7), yet analyze printed "a 0.1 GiB CPU tier serves 100.0%
    of prompt tokens" beside a 3.49% reuse ceiling."""
    small = tmp_path / "m30.jsonl"
    with open(trace_path()) as f:
        small.write_text("".join(itertools.islice(f, 30)))
    assert main(["analyze", str(small), "--preset", "tiny", "--method", "shards-rate",
                 "--sample-rate", "0.001"]) == 2
    err = capsys.readouterr().err
    assert "distinct blocks" in err and len(err.strip().splitlines()) == 1
    assert main(["analyze", str(small), "--preset", "tiny"]) == 0  # unsampled: sized as before
    assert "Verdict" in capsys.readouterr().out


def test_options_validate():
    preset = get_preset("tiny")
    for bad in (dict(method="nope"), dict(sample_rate=2.0), dict(bandwidth=0),
                dict(gpu_tokens=-1), dict(budget_bytes=0), dict(target_share=0)):
        with pytest.raises(ValueError):
            AnalyzeOptions(preset, **bad).validate()


def test_sizing_page_data_is_plain_and_consistent():
    trace = load_trace(trace_path())
    analysis = analyze(trace, AnalyzeOptions(get_preset("llama-3-8b"), arc_points=4))
    data = sizing_figure_data(analysis)
    json.dumps(data)  # plain data only
    assert len(data["lru"]["gib"]) == len(data["lru"]["hit_ratio"])
    assert len(data["cpu"]["gib"]) == len(data["cpu"]["transfer_seconds"])
    assert data["recommended"]["gib"] == pytest.approx(
        data["recommended"]["blocks"] * analysis.bytes_per_block / 2**30)
    assert data["offload"] and data["kv_offloading_size_gib"] >= data["recommended"]["gib"]
    assert max(data["lru"]["hit_ratio"]) == pytest.approx(0.3664, abs=5e-5)
    assert data["notes"] == analysis.notes and any("No GPU prefix cache" in n
                                                   for n in data["notes"])
    json.loads(json.dumps(to_dict(analysis)))
    text = render_text(analysis)
    assert "Verdict" in text
    # the Mooncake trace's most shared prefix is one block (id 0, the system prompt)
    assert "   1 block       512 tokens x 12,030 reuses" in text and "1 blocks" not in text
    # a recommendation below the knee, as here, says what it is (a new user took the knee for it)
    assert analysis.sizing.recommended.blocks < analysis.sizing.knee.blocks
    assert "the smallest size that buys 90% of the largest affordable size's gain" in text


def test_a_budget_does_not_move_the_knee_and_the_report_says_when_it_lies_beyond():
    """The Mooncake trace for llama-3-8b (64 MiB blocks) without a budget and with 1 GiB (16
    blocks, far below the knee): the same knee, the curve past the budget, the recommendation
    within it, and the report naming the budget the knee lies beyond."""
    trace = load_trace(trace_path())
    preset = get_preset("llama-3-8b")
    free = analyze(trace, AnalyzeOptions(preset, arc_points=0)).sizing
    tight = analyze(trace, AnalyzeOptions(preset, arc_points=0, budget_bytes=2**30))
    s = tight.sizing
    assert s.knee == free.knee and s.knee.bytes > 2**30
    assert s.curve[-1] == free.curve[-1] and s.recommended.bytes <= 2**30
    assert f"knee: {s.knee.blocks:,} blocks" in render_text(tight)
    assert "up to the trace's working set; beyond the budget of 1.00 GiB)" in render_text(tight)


@pytest.mark.parametrize("method", ["shards-rate", "shards-size"])
def test_sampled_methods_track_the_exact_curve(method):
    trace = load_trace(trace_path())
    preset = get_preset("llama-3-8b")
    exact = analyze(trace, AnalyzeOptions(preset, arc_points=0))
    sampled = analyze(trace, AnalyzeOptions(preset, method=method, sample_rate=0.1,
                                            sample_blocks=8192, arc_points=0))
    assert sampled.method.startswith("lru-shards-fixed-" + method.split("-")[1])
    assert np.mean(np.abs(sampled.lru.miss_ratio - exact.lru.miss_ratio)) <= 0.01
    assert sampled.reuse.reuse_share == exact.reuse.reuse_share  # counted exactly either way


@pytest.mark.parametrize("arc", [False, True], ids=["lru", "arc"])
def test_the_curve_table_has_no_row_of_0_blocks(tmp_path, capsys, arc):
    """One block asked three times: a working set of 1 block, 2 of the 3 accesses hits from 1
    block on. The table's rows are 1 block at least (a row of 0 blocks read 0.6667, the 1-block
    hit ratio, where a cache of nothing hits nothing; ARC off, the rows are the LRU's, on, the
    ARC curve's sizes, which had a 0 of their own for a working set under 6 blocks)."""
    path = tmp_path / "repeat.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 512,
                                        "output_length": 1, "hash_ids": [5]}) + "\n"
                            for t in (0, 1000, 2000)))
    assert main(["analyze", str(path), "--preset", "tiny",
                 *(() if arc else ("--arc-points", "0"))]) == 0
    table = capsys.readouterr().out.split("Miss-ratio curves")[1].split("\n\n")[0]
    rows = [line.split() for line in table.splitlines()[2:]]
    # preset tiny's 2 KiB a token: a 512-token block is 1 MiB (it read "0.00 GiB")
    assert rows == [["1", "1.0", "MiB", "0.6667", "0.6667", "0.6667" if arc else "-"]]


def test_a_sample_rate_the_method_does_not_use_is_named(small_trace):
    """--sample-rate without --method shards-rate, on a trace auto analyses exactly: the
    output was identical to the same run without it, and said nothing."""
    options = AnalyzeOptions(get_preset("tiny"), sample_rate=0.01, arc_points=0)
    analysis = analyze(load_trace(small_trace), options)
    assert analysis.method == "lru-exact"
    assert any(n.startswith("--sample-rate 0.01 was not used: the curve is lru-exact")
               for n in analysis.notes)
    plain = analyze(load_trace(small_trace), AnalyzeOptions(get_preset("tiny"), arc_points=0))
    assert not any("--sample-rate" in n or "--sample-blocks" in n for n in plain.notes)
    # --sample-blocks likewise, used by shards-size alone
    blocks = analyze(load_trace(small_trace), AnalyzeOptions(get_preset("tiny"), arc_points=0,
                                                             sample_blocks=10))
    assert "--sample-blocks 10 was not used: the curve is lru-exact (the sample size is for " \
        "--method shards-size)." in blocks.notes


def test_a_curve_of_very_little_traffic_says_so(small_trace):
    """The 4 requests above, 5 distinct blocks in 9 accesses: the curve is exact for them, and
    a verdict stands, but the report says how little it rests on (a tryout's 2 requests read
    "Offload" without a word). The Mooncake conversation trace (182,790 distinct blocks in
    288,500 accesses) gets no such note."""
    options = AnalyzeOptions(get_preset("tiny"), arc_points=0)
    notes = analyze(load_trace(str(small_trace)), options).notes
    assert "The input holds only 5 distinct blocks in 9 accesses: its curve is exact for it, " \
        "but a larger workload's may differ; size from a longer trace or capture." in notes
    notes = analyze(load_trace(trace_path()), options).notes
    assert not any("distinct block" in n for n in notes)


@pytest.mark.parametrize("gpu_tokens,said", [(511, True), (512, False), (0, False)])
def test_a_gpu_cache_smaller_than_a_block_is_named(small_trace, gpu_tokens, said):
    """--gpu-tokens 511 beside 512-token blocks holds no block: it silently meant no GPU cache
    (and the note that none is assumed was gone, as the cache was given); now a note says so.
    512 holds one; 0 is none as asked, without a note."""
    options = AnalyzeOptions(get_preset("tiny"), gpu_tokens=gpu_tokens, arc_points=0)
    notes = analyze(load_trace(str(small_trace)), options).notes
    assert any("holds no whole block of 512: none is assumed" in n for n in notes) is said


def test_a_segment_of_another_kind_or_unfinished_says_what_it_is(tmp_path, capsys):
    """A tryout passed analyze a capture's requests segment (Arrow's "No match for
    FieldRef.Name(ts)" came back) and a .parquet.tmp one (read as JSONL: "not UTF-8 text");
    each error now says what the file is."""
    from kvscope.agent.capture import CaptureWriter
    from kvscope.agent.requests import RequestRecord

    writer = CaptureWriter(tmp_path / "cap")
    writer.add_request(RequestRecord("r", "1" * 32, "engine", 1.0, prompt_tokens=8, ttft=0.1,
                                     finished=1.2))
    writer.close()
    requests = next((tmp_path / "cap").glob("requests-*.parquet"))
    unfinished = tmp_path / "cap" / "blocks-0000000000001-1-000009.parquet.tmp"
    unfinished.write_bytes(b"PAR1")
    # a blocks segment cut short: damaged, not "one of its blocks-*.parquet files" to pass
    cut = tmp_path / "cap" / "blocks-0000000000001-1-000001.parquet"
    cut.write_bytes(requests.read_bytes()[:40])
    for path, said in ((requests, "not a kvscope blocks segment (it is a requests segment); "
                                  "pass the capture directory, or one of its blocks-"),
                       (unfinished, "a capture segment still being written"),
                       (cut, "a blocks segment that cannot be read, damaged or cut short (")):
        assert main(["analyze", str(path)]) == 2
        err = capsys.readouterr().err
        assert said in err
        assert path != cut or err.rstrip().endswith(
            "; pass its capture directory to read the other segments")


def test_analyze_names_a_capture_with_segments_gone(tmp_path, capsys):
    """A capture of 4 segments of block accesses, the second removed (a tryout's rm; a size
    cap deletes the oldest): compare noted it, analyze read the rest without a word. It now
    says so on stderr, as compare does; with every segment there, nothing."""
    from kvscope import events as ev
    from kvscope.agent.capture import CaptureWriter

    writer = CaptureWriter(tmp_path / "cap", segment_rows=2)
    for i in range(4):
        writer.add_lookup("engine", ev.Lookup(ts=1.0 + i, request_id=f"r{i}",
                                              tokens={"recompute": 32}, blocks=2,
                                              block_hashes=(1, 2 + i), block_tokens=16))
        writer.flush()
    writer.close()
    segments = sorted((tmp_path / "cap").glob("blocks-*.parquet"))
    assert len(segments) == 4
    assert main(["analyze", str(tmp_path / "cap"), "--preset", "tiny"]) == 0
    assert "note:" not in capsys.readouterr().err
    segments[1].unlink()
    assert main(["analyze", str(tmp_path / "cap"), "--preset", "tiny"]) == 0
    assert (f"kvscope analyze: note: {tmp_path / 'cap'}: 1 of its segments is gone (deleted by "
            "its size cap, capture_max_bytes, oldest first, or lost to a failed write): block "
            "accesses it recorded may be missing") in capsys.readouterr().err


def test_an_own_cpu_tier_no_larger_than_the_gpus_is_noted(tmp_path):
    """A demo with a cpu tier of 64 blocks under a gpu tier of 256 (a tryout's): the curve's
    inclusive tier of 64 serves nothing, where the engine's served 2.2% of the tokens; a note
    says why, and none is made for a tier larger than the GPU's."""
    from kvscope.analysis.rates import measured_rates

    trace = load_trace(str(_small(tmp_path)))
    for cpu, said in ((2, True), (3, False)):
        measured = measured_rates(0, 0.0, {}, {}, {}, capacities={"gpu": (0, 2),
                                                                  "cpu": (0, cpu)})
        analysis = analyze(trace, AnalyzeOptions(get_preset("tiny"), measured=measured,
                                                 arc_points=0))
        assert analysis.sizing.current.blocks == cpu
        assert any(n.startswith(f"The input's own CPU tier ({cpu} blocks) is no larger than "
                                "its GPU prefix cache (2)") for n in analysis.notes) is said
