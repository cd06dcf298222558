"""Replay: the simulator makes exactly the engine's decisions, and ``kvscope replay`` works."""

import io
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.demo import _replay
from kvscope.engine.engine import OffloadEngine
from kvscope.engine.presets import ModelPreset, get_preset
from kvscope.engine.workload import MOONCAKE_BLOCK_TOKENS, SyntheticConfig, read_mooncake, synthetic
from conftest import sigint_default, tmpfs, wait_until
from traces import trace_path

ROOT = Path(__file__).resolve().parents[2]

# A small KV shape so payload runs over 512-token trace blocks stay light: 32 B per token,
# 16 KiB per block. Decisions do not depend on block bytes.
SMALL = ModelPreset(name="small", layers=1, kv_heads=1, head_dim=8, dtype="float16",
                    block_tokens=16, params=1e9, peak_flops=989e12, mfu=0.4)


def _run(requests, payload, tmp_path, **kw):
    engine = OffloadEngine(kw.pop("preset", get_preset("tiny")), *kw.pop("sizes"), payload=payload,
                           disk_dir=tmp_path / ("payload" if payload else "sim"), **kw)
    per_request = [(o.tokens, o.block_hits) for o in map(engine.process, requests)]
    engine.close()
    orders = [t.order() for t in engine.tiers]
    return per_request, engine.stats.decisions(), orders


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("sizes", [(8, 16, 32), (3, 5, 7), (16, 4, 0)])
def test_simulate_makes_the_engines_decisions_on_synthetic(tmp_path, policy, sizes):
    config = SyntheticConfig(seed=11, system_blocks=6, turn_blocks=(1, 5), one_off_blocks=(1, 8))
    requests = list(itertools.islice(synthetic(config), 300))
    kw = dict(sizes=sizes, policy=policy, store_threshold=2, min_priority=30)
    with_bytes = _run(requests, True, tmp_path, **kw)
    simulated = _run(requests, False, tmp_path, **kw)
    assert with_bytes == simulated
    decisions = simulated[1]
    assert decisions["evictions"]["gpu"] > 0 and decisions["moved"]["cpu->gpu"] > 0
    if sizes[2]:
        assert decisions["moved"]["disk->cpu"] > 0


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_simulate_makes_the_engines_decisions_on_the_mooncake_trace(tmp_path, policy):
    requests = read_mooncake(trace_path())[:500]
    kw = dict(sizes=(40, 80, 2000), policy=policy, preset=SMALL, block_tokens=MOONCAKE_BLOCK_TOKENS)
    with_bytes = _run(requests, True, tmp_path, **dict(kw))
    simulated = _run(requests, False, tmp_path, **dict(kw))
    assert with_bytes == simulated
    assert simulated[1]["moved"]["disk->cpu"] > 0 and simulated[1]["block_hits"]["disk"] > 0


def _kvscope(*args):
    return subprocess.run([sys.executable, "-m", "kvscope", "replay", *args], capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


KEYS = {"requests", "block_accesses", "block_hit_ratio", "block_hit_ratio_by_tier",
        "prefix_hit_ratio", "tokens_by_source", "transfers", "evictions", "ttft_seconds",
        "wall_seconds"}


def _check_summary(summary):
    assert KEYS <= set(summary)
    assert set(summary["block_hit_ratio_by_tier"]) == {"gpu", "cpu", "disk"}
    assert set(summary["tokens_by_source"]) == {"gpu", "cpu", "disk", "recompute"}
    assert sum(summary["block_hit_ratio_by_tier"].values()) == pytest.approx(summary["block_hit_ratio"])
    assert sum(summary["tokens_by_source"].values()) == summary["prompt_tokens"]
    for direction in ("gpu->cpu", "cpu->gpu", "cpu->disk", "disk->cpu"):
        assert set(summary["transfers"][direction]) == {"blocks", "bytes", "seconds"}
    t = summary["ttft_seconds"]
    assert 0 < t["p50"] <= t["p95"] <= t["p99"]


def test_replay_trace_simulate_json():
    result = _kvscope("--trace", str(trace_path()), "--gpu-blocks", "1000", "--cpu-blocks", "4000",
                      "--disk-blocks", "8000", "--policy", "arc", "--simulate", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    _check_summary(summary)
    assert summary["requests"] == 12_031 and summary["block_accesses"] == 288_500
    assert summary["config"]["block_tokens"] == 512
    assert summary["block_hit_ratio_by_tier"]["disk"] > 0


def test_requests_takes_the_first_of_a_trace():
    """--requests 150 with --trace replays the trace's first 150 requests (it was ignored: a
    user's quick look replayed all 12,031): their block accesses are the hash_ids of the
    first 150 lines, counted here from the file itself."""
    with open(trace_path()) as f:
        first = [json.loads(line) for _, line in zip(range(150), f)]
    result = _kvscope("--trace", str(trace_path()), "--requests", "150", "--simulate", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["requests"] == 150
    assert summary["block_accesses"] == sum(len(row["hash_ids"]) for row in first)


def test_a_replay_says_what_it_priced_prefill_and_simulated_transfers_at():
    """A replay computes no prefill: its TTFTs price the recomputed tokens by the preset's
    cost model, and --simulate, which copies nothing, its transfers too; the report says so
    with the model's figures (preset tiny: 50 GB/s host<->device, 6.5 GB/s disk,
    presets.py). A replay that copies names no transfer rate: its copies are timed."""
    tiny = get_preset("tiny")
    prefill = f"prefill at {tiny.prefill_tokens_per_second:,.0f} tokens/s"
    simulated = _kvscope("--requests", "50", "--simulate")
    assert simulated.returncode == 0, simulated.stderr
    assert simulated.stdout.strip().splitlines()[-1] == (
        f"modelled, not measured: {prefill}, transfers at 50 GB/s cpu<->gpu (preset tiny's "
        "cost model)")
    with_disk = _kvscope("--requests", "50", "--simulate", "--disk-blocks", "64").stdout
    assert "transfers at 50 GB/s cpu<->gpu and 6.5 GB/s disk<->cpu (" in with_disk
    copied = _kvscope("--requests", "50")
    assert copied.returncode == 0, copied.stderr
    assert copied.stdout.strip().splitlines()[-1] == (
        f"modelled, not measured: {prefill} (preset tiny's cost model)")
    model = json.loads(_kvscope("--requests", "50", "--simulate", "--json").stdout)["config"]
    assert model["cost_model"]["h2d_bytes_per_second"] == tiny.h2d_bytes_per_second == 50e9


def test_replay_synthetic_with_payload_and_disk(tmp_path):
    result = _kvscope("--requests", "150", "--gpu-blocks", "32", "--cpu-blocks", "64",
                      "--disk-blocks", "256", "--disk-dir", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    _check_summary(summary)
    assert summary["transfers"]["disk->cpu"]["blocks"] > 0
    assert summary["transfers"]["disk->cpu"]["seconds"] > 0
    assert summary["errors"] == {}
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_a_disk_dir_in_use_is_refused_and_free_again_once_closed(tmp_path):
    """Two replays on one --disk-dir, a second apart, overwrote each other's chunks and read
    them back as corrupt (1,714 'corrupt' errors), both exiting 0. A store holds its directory
    (in this process here); a replay given it says so and exits 2, its chunks untouched; once
    the store closed, the directory serves again."""
    from kvscope.engine.disk import DiskStore

    holder = DiskStore(tmp_path, 64)
    holder.write(1, 7, bytes(64))
    refused = _kvscope("--requests", "20", "--disk-blocks", "16", "--disk-dir", str(tmp_path))
    assert refused.returncode == 2
    assert refused.stderr.strip() == (f"kvscope replay: error: --disk-dir {tmp_path}: in use by "
                                      "another kvscope engine (a replay or demo running now): "
                                      "give each its own directory")
    with pytest.raises(OSError, match="in use by another kvscope engine"):
        DiskStore(tmp_path, 64)
    back = bytearray(64)
    holder.read_into(1, 7, back)  # raises DiskError had the replay touched the chunk
    holder.close()
    again = DiskStore(tmp_path, 64)
    again.close()


def test_a_disk_dir_no_file_can_be_written_in_is_refused_at_start(tmp_path):
    """A --disk-dir on a read-only mount with room (a real tmpfs, which denies root too) ran
    the whole replay and exited 0, every spill failed (4,157 permission errors, disk hits
    reported from a tier that never held a block). It is refused at start, saying why."""
    with tmpfs(tmp_path / "ro", "ro,size=64m") as mount:
        refused = _kvscope("--requests", "20", "--disk-blocks", "16", "--disk-dir", str(mount))
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith(f"kvscope replay: error: --disk-dir {mount}: cannot "
                                      "write chunk files there: Read-only file system"), \
        refused.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_replay_prints_what_it_replayed_and_removes_its_chunks(tmp_path, sig):
    """A replay stopped by SIGTERM was killed outright: its --disk-dir kept 4,096 chunk files
    (145 MB), a temporary disk directory the same; one stopped by Ctrl-C (SIGINT) printed
    "interrupted" and nothing of what it had replayed (a paced hour's worth, lost). Now both
    end it after the request in progress: the summary of the requests replayed (more than
    none, fewer than asked; "interrupted": true in --json), a line on stderr, exit 130, its
    chunks gone and a file of the user's beside them kept."""
    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.Popen([sys.executable, "-m", "kvscope", "replay", "--requests", "100000",
                             "--gpu-blocks", "16", "--cpu-blocks", "16", "--disk-blocks", "4096",
                             "--disk-dir", str(tmp_path), "--json"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)
    try:
        assert wait_until(lambda: len(list(tmp_path.glob("chunk-*.kv"))) > 10, 120, 0.1)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    summary = json.loads(out)
    assert summary["interrupted"] is True and 0 < summary["requests"] < 100_000
    assert err.strip().endswith(f"kvscope replay: interrupted: the summary covers the "
                                f"{summary['requests']:,} requests replayed"), err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_replay_removes_its_disk_chunks_from_a_directory_it_was_given(tmp_path):
    """--disk-dir named by the user: a tryout's replay left its chunk-*.kv files there (with a
    large preset, gigabytes), and created the directory without removing it. The chunks go at
    exit (they mean nothing without the engine's index of them), a file of the user's beside
    them stays, and the directories the replay created (new/disk) go when they are empty."""
    given = tmp_path / "given"
    given.mkdir()
    (given / "notes.txt").write_text("mine")
    created = tmp_path / "new" / "disk"
    for directory in (given, created):
        result = _kvscope("--requests", "150", "--gpu-blocks", "32", "--cpu-blocks", "64",
                          "--disk-blocks", "256", "--disk-dir", str(directory), "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["transfers"]["cpu->disk"]["blocks"] > 0
    assert [p.name for p in given.iterdir()] == ["notes.txt"]
    assert not (tmp_path / "new").exists()


def test_replay_json_leaves_out_the_tiers_that_are_off():
    """No disk tier, and a cpu tier of 0 blocks: the JSON had disk (and cpu) entries of 0 in
    every map, as if those tiers existed and served nothing. Only the gpu tier and recompute
    remain, and no transfer direction (each touches an absent tier)."""
    result = _kvscope("--requests", "50", "--simulate", "--cpu-blocks", "0", "--json")
    summary = json.loads(result.stdout)
    for key in ("block_hit_ratio_by_tier", "evictions", "evictions_offloaded"):
        assert list(summary[key]) == ["gpu"], (key, summary[key])
    assert list(summary["tokens_by_source"]) == ["gpu", "recompute"]
    assert summary["transfers"] == {}
    summary = json.loads(_kvscope("--requests", "50", "--simulate", "--json").stdout)
    assert list(summary["transfers"]) == ["gpu->cpu", "cpu->gpu"]


def test_replay_text_report_and_bad_input(tmp_path):
    result = _kvscope("--requests", "50", "--simulate")
    assert result.returncode == 0 and "block hit ratio" in result.stdout
    # tiers that are off have no ratio, tokens or evictions (they read 0.0000); nothing moved
    # is said, not left a bare "transfers "
    result = _kvscope("--requests", "50", "--simulate", "--cpu-blocks", "0")
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and "transfers none" in lines
    assert not [line for line in lines if "cpu" in line or "disk" in line], lines
    result = _kvscope("--requests", "5", "--cpu-blocks", "0", "--disk-blocks", "8")
    assert result.returncode == 2 and "cpu tier" in result.stderr
    result = _kvscope("--trace", str(tmp_path / "absent.jsonl"))
    assert result.returncode == 2 and "cannot read trace" in result.stderr
    result = _kvscope("--requests", "5", "--simulate", "--speed", "0.5")  # was ignored
    assert result.returncode == 2 and "leave --speed out" in result.stderr


def test_the_replay_reports_its_queue_and_the_gpu_tiers_fill():
    """Three requests arrive at 0 s, the fourth long after (1e6 s), replayed as fast as possible
    through the simulator (its prefills take modelled time, so the second waits for the first
    and the third for both). At each arrival, by hand: waiting 0 (the first starts at once),
    1 (the second), 2 (the second and third), 0 (the fourth finds the server idle); running 1
    each time; at the end 0 and 0. GPU KV usage, the share of the gpu tier's 8 blocks the
    request taken holds: 3/8, 2/8, 1/8, all of it (the fourth's 9 blocks), and 0 at the end,
    although the tier then holds 8 cached blocks (its fill is another metric). The engine never
    preempts: preemptions absent (None) in every report."""
    from kvscope import events as ev
    from kvscope.engine.replay import Replayer
    from kvscope.engine.workload import Request

    preset = get_preset("tiny")
    bt = preset.block_tokens
    emitted = []
    engine = OffloadEngine(preset, 8, 16, payload=False, emit=emitted.append)
    blocks = [(1, 2, 3), (4, 5), (6,), tuple(range(7, 16))]
    arrivals = [0.0, 0.0, 0.0, 1e6]
    requests = [Request(f"r{i}", arrival, len(hashes) * bt, 1, hashes)
                for i, (arrival, hashes) in enumerate(zip(arrivals, blocks))]
    Replayer(engine, requests, speed=None).run()
    engine.close()
    stats = [e for e in emitted if isinstance(e, ev.SchedulerStats)]
    assert [(s.waiting, s.running, s.gpu_kv_usage) for s in stats] == [
        (0, 1, 3 / 8), (1, 1, 2 / 8), (2, 1, 1 / 8), (0, 1, 1.0), (0, 0, 0.0)]
    assert len(engine.gpu) == 8
    assert {s.preemptions for s in stats} == {None}


def test_a_replay_that_falls_behind_its_speed_says_so_once(caplog):
    """20,000 requests 1 workload second apart at a billion workload seconds per wall second
    (20 us of wall time for all): the engine cannot start them that fast, so the replay falls
    behind its schedule and logs one warning past its threshold (10 ms here; 5 s by
    default). As fast as possible (no speed) there is no schedule to fall behind."""
    from kvscope.engine.replay import Replayer
    from kvscope.engine.workload import Request

    preset = get_preset("tiny")
    requests = [Request(f"r{i}", float(i), 4 * preset.block_tokens, 1, (i, i + 1, i + 2, i + 3))
                for i in range(20_000)]
    engine = OffloadEngine(preset, 8, 16, payload=False)
    paced = Replayer(engine, requests, speed=1e9, behind_warning=0.01)
    paced.run()
    warned = [r for r in caplog.records if "behind the workload's schedule" in r.message]
    assert paced.behind >= 0.01 and len(warned) == 1, paced.behind
    assert "lower --speed" in warned[0].message
    # the demo says it again when the workload has played out: a tryout's trace took 3 min
    # instead of 1 after a single early warning
    out = io.StringIO()
    _replay(Replayer(engine, requests, speed=1e9, behind_warning=0.01), out, None)
    played = out.getvalue()
    assert played.startswith("kvscope demo: the workload has played out (20000 requests, up to ")
    assert " s behind its schedule at speed 1e+09: lower --speed to keep it); " in played
    caplog.clear()
    fast = Replayer(engine, requests, speed=None, behind_warning=0.01)
    fast.run()
    engine.close()
    assert fast.behind == 0.0 and not caplog.records


def test_a_speed_too_slow_for_any_wait_waits_until_stopped():
    """At 1e-300 workload seconds per wall second the second request (1 s in) is due in 1e300
    seconds, past the longest wait Python takes: the replay thread died of an OverflowError
    ("timestamp out of range"). It now waits, and stops when told, having served the first."""
    import threading

    from kvscope.engine.replay import Replayer
    from kvscope.engine.workload import Request

    preset = get_preset("tiny")
    requests = [Request(f"r{i}", float(i), preset.block_tokens, 1, (i,)) for i in range(2)]
    engine = OffloadEngine(preset, 8, 16, payload=False)
    stop = threading.Event()
    replayer = Replayer(engine, requests, speed=1e-300, stop=stop)
    raised = []

    def run():
        try:
            replayer.run()
        except Exception as exc:
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    threading.Timer(0.5, stop.set).start()
    thread.join(timeout=60)
    engine.close()
    assert not raised and not thread.is_alive() and replayer.served == 1


def test_replay_refuses_more_requests_than_it_can_hold():
    """--requests 1e20 ended in islice's ValueError traceback; 1e8 held the whole workload in
    memory (1.6 GB and growing) before printing anything."""
    result = _kvscope("--requests", "99999999999999999999")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--requests: must be > 0 and at most 1,000,000" in result.stderr


def test_the_tiers_are_reported_before_the_first_request_arrives():
    """A trace whose first request comes 100 s in: the demo said "no cpu tier configured"
    and exported no capacity until then. The replay reports the engine's tiers (8 gpu and 16
    cpu blocks, empty) and its host KV budget (the cpu tier's bytes) as it starts."""
    import threading

    from kvscope import events as ev
    from kvscope.engine.replay import Replayer
    from kvscope.engine.workload import Request

    preset = get_preset("tiny")
    emitted = []
    engine = OffloadEngine(preset, 8, 16, payload=False, emit=emitted.append)
    stop = threading.Event()
    stop.set()  # stopped before the first request is due
    Replayer(engine, [Request("late", 100.0, preset.block_tokens, 1, (1,))], speed=1.0,
             stop=stop).run()
    engine.close()
    snapshots = {e.tier: (e.capacity_blocks, e.resident_blocks) for e in emitted
                 if isinstance(e, ev.TierSnapshot)}
    assert snapshots == {"gpu": (8, 0), "cpu": (16, 0)}
    budgets = [e.kv_offload_budget for e in emitted if isinstance(e, ev.EngineMemory)]
    assert budgets == [16 * preset.bytes_per_block(preset.block_tokens)]
    assert not [e for e in emitted if isinstance(e, ev.RequestStarted)]


def test_a_disabled_cpu_tier_is_not_reported():
    """--cpu-blocks 0 disables the cpu tier: a snapshot of it (capacity 0, which the agent
    reads as unknown) made every record list it among the tiers, and compare showed "cpu
    0.0%" where the disk tier, also off, read "not measured". Only the GPU's is sent now,
    and no host KV budget."""
    from kvscope import events as ev

    emitted = []
    engine = OffloadEngine(get_preset("tiny"), 8, 0, payload=False, emit=emitted.append)
    engine.report_tiers()
    engine.close()
    assert [e.tier for e in emitted if isinstance(e, ev.TierSnapshot)] == ["gpu"]
    assert not [e for e in emitted if isinstance(e, ev.EngineMemory)]



def test_replay_without_torch_says_what_to_install(tmp_path):
    """The reference engine's payload tiers need torch (the engine extra, which the agent and
    the taps do without); installed without it, the command ended in a ModuleNotFoundError
    traceback. A torch that cannot be imported stands for the missing one (first on the path);
    --simulate needs none and runs."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}

    def replay(*args):
        return subprocess.run([sys.executable, "-m", "kvscope", "replay", "--requests", "3",
                               *args], capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL, env=env, cwd=tmp_path)

    result = replay()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "need torch, which is not installed: pip install 'kvscope[engine]'" in result.stderr
    assert replay("--simulate").returncode == 0


def test_a_long_replay_says_how_far_it_is(monkeypatch, capsys):
    """A replay of the real trace ran 143 s without a word. It says on stderr, every
    PROGRESS_EVERY seconds (0 here: after each request), how many requests of how many it has
    replayed; stdout keeps the report alone. Run in this process, it leaves the signal
    handlers as it found them (it once left SIGINT, SIGTERM and SIGHUP ignored, which every
    command the later tests started inherited: one ran on after its Ctrl-C)."""
    from kvscope import cli
    from kvscope.engine import replay_cmd

    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = [signal.getsignal(sig) for sig in stops]
    monkeypatch.setattr(replay_cmd, "PROGRESS_EVERY", 0.0)
    assert cli.main(["replay", "--requests", "40", "--simulate", "--json"]) == 0
    assert [signal.getsignal(sig) for sig in stops] == before
    out, err = capsys.readouterr()
    assert json.loads(out)["requests"] == 40
    lines = err.splitlines()
    assert len(lines) == 40 and lines[9].startswith("kvscope replay: 10 of 40 requests (25%), ")
    assert lines[-1].startswith("kvscope replay: 40 of 40 requests (100%), ")
