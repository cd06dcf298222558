"""Sizing from a sampled capture: the vLLM tap's block-hash predicate (kvscope/sampling.pyx),
the capture's sampled rows, and the analysis that scales them (SHARDS: Waldspurger et al.,
FAST '15).

The truths: the predicate is MurmurHash3's fmix64 (Appleby) plus SplitMix64's increment,
written out plainly here from the published constants; the miss-ratio curve a sample must match
is the exact LRU curve of the full stream from Mattson's stack distances
(kvscope/analysis/stackdist.py, itself held to a naive LRU stack and libcachesim in
tests/analysis/test_mrc.py); the totals of a capture are counted by hand in each docstring.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kvscope import events as ev
from kvscope import sampling
from kvscope.agent.capture import CaptureWriter
from kvscope.analysis import shards
from kvscope.analysis.analyze import AnalyzeOptions, analyze
from kvscope.analysis.capture_reader import read_block_trace
from kvscope.analysis.mrc import lru_curve, mean_absolute_error
from kvscope.analysis.synthetic import prefix_stream
from kvscope.engine.presets import get_preset
from traces import trace_path

MASK = (1 << 64) - 1
T0 = 1_700_000_000.0


def reference_hash(key: int, seed: int = 0) -> int:
    """fmix64 (Appleby, MurmurHash3) of ``(key ^ seed) + 0x9E3779B97F4A7C15`` (SplitMix64's
    increment), top 32 bits: the spatial hash kvscope.sampling documents, in plain Python."""
    x = (((key ^ seed) & MASK) + 0x9E3779B97F4A7C15) & MASK
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK
    x ^= x >> 33
    return x >> 32


def reference_key(block_hash: bytes) -> int:
    """A bytes block hash's key: its first 8 bytes, little-endian (zero-padded)."""
    return int.from_bytes(block_hash[:8].ljust(8, b"\0"), "little")


def test_the_predicate_is_fmix64_in_the_tap_and_in_the_analysis():
    rng = random.Random(1)
    keys = [rng.getrandbits(64) for _ in range(5000)] + [0, 1, MASK]
    for seed in (0, 5):
        expected = [reference_hash(k, seed) for k in keys]
        assert [sampling.spatial_hash(k, seed) for k in keys] == expected
        assert shards.spatial_hash(np.array(keys, dtype=np.uint64), seed).tolist() == expected
    digest = bytes(range(32))
    assert sampling.key_of(digest) == reference_key(digest) == 0x0706050403020100
    assert sampling.key_of(b"\x01\x02") == 0x0201
    assert sampling.key_of(-1) == MASK and sampling.key_of(1 << 70 | 9) == 9
    assert sampling.threshold(1 / 16) == 1 << 28 and sampling.rate_of(1 << 28) == 1 / 16
    with pytest.raises(ValueError):
        sampling.threshold(0.0)


def test_the_tap_keeps_exactly_the_blocks_under_the_threshold_in_order_and_caps_a_lookup():
    """200 random 32-byte hashes at R = 1/4: kept are those whose reference hash is under
    2**30, with their positions; with a cap of 5 the first 5 are kept and the rest counted."""
    rng = random.Random(2)
    hashes = [rng.randbytes(32) for _ in range(200)]
    t = sampling.threshold(0.25)
    want = [(reference_key(h), i) for i, h in enumerate(hashes)
            if reference_hash(reference_key(h)) < t]
    assert 30 < len(want) < 70  # about 50
    keys, depths, dropped = sampling.sample(hashes, 200, t)
    assert list(zip(keys, depths)) == want and dropped == 0
    keys, depths, dropped = sampling.sample(hashes, 200, t, cap=5)
    assert list(zip(keys, depths)) == want[:5] and dropped == len(want) - 5
    # only the first ``blocks`` count (vLLM's list grows with the output's blocks)
    assert sampling.sample(hashes, 10, t)[1] == [d for _, d in want if d < 10]
    with pytest.raises(TypeError):
        sampling.sample(["not bytes"], 1, t)


def test_rates_nest_so_a_sample_can_be_sampled_again():
    ids = np.arange(100_000, dtype=np.uint64)
    h = shards.spatial_hash(ids)
    low, high = h < sampling.threshold(1 / 64), h < sampling.threshold(1 / 16)
    assert low.sum() > 0 and not (low & ~high).any()


def _lookup(ts, rid, prompt, keys, depths, rate, sources=()):
    return ev.Lookup(ts=ts, request_id=rid, tokens={"recompute": prompt}, blocks=prompt // 16,
                     block_hashes=tuple(keys), block_depths=tuple(depths),
                     block_sources=tuple(sources), block_tokens=16, block_sample_rate=rate)


def test_a_sampled_capture_counts_every_lookup_and_block(tmp_path):
    """At R = 1/4 (16-token blocks): L1 at t=1, prompt 70 tokens (4 full blocks), kept depths
    1 and 3 (keys 11, 13); L2 at t=2, 32 tokens (2 blocks), none kept: one row of depth -1;
    L3 at t=3, 48 tokens (3 blocks), kept depth 0 (key 20). The trace: accesses 11, 13, 20 of
    requests 0, 0, 2 at times 0, 0, 2; 3 requests; the full stream 4 + 2 + 3 = 9 accesses of
    64 + 32 + 48 = 144 tokens; prompt tokens 70 + 32 + 48 = 150."""
    writer = CaptureWriter(tmp_path, clock=lambda: T0)
    writer.add_lookup("vllm", _lookup(T0 + 1, "a", 70, [11, 13], [1, 3], 0.25, ["gpu", "cpu"]))
    writer.add_lookup("vllm", _lookup(T0 + 2, "b", 32, [], [], 0.25))
    writer.add_lookup("vllm", _lookup(T0 + 3, "c", 48, [20], [0], 0.25))
    writer.add_lookup("vllm", ev.Lookup(ts=T0 + 4, request_id="d", tokens={"recompute": 16}))
    writer.close()
    trace = read_block_trace(tmp_path)
    assert trace.block_ids.tolist() == [11, 13, 20]
    assert trace.depths.tolist() == [1, 3, 0] and trace.requests.tolist() == [0, 0, 2]
    assert trace.times.tolist() == [0.0, 0.0, 2.0] and trace.tokens.tolist() == [16, 16, 16]
    assert trace.request_count == 3 and trace.prompt_tokens == 150
    assert (trace.sample_rate, trace.full_accesses, trace.full_tokens) == (0.25, 9, 144)
    assert "1 block in 4" in trace.source


def test_lookups_sampled_at_a_higher_rate_are_sampled_again_at_the_lowest(tmp_path):
    """A lookup at R = 1 (every block, as the reference engine records them) beside one at
    R = 1/4: its blocks are kept only where the reference hash is under 2**30, and all 6 of its
    blocks count in the full stream's accesses (4 + 6 = 10)."""
    keys = list(range(1000, 1006))
    kept = [k for k in keys if reference_hash(k) < 1 << 30]
    writer = CaptureWriter(tmp_path, clock=lambda: T0)
    writer.add_lookup("vllm", _lookup(T0 + 1, "a", 64, [7], [2], 0.25))
    writer.add_lookup("engine", _lookup(T0 + 2, "b", 96, keys, range(6), 1.0))
    writer.close()
    trace = read_block_trace(tmp_path)
    assert trace.block_ids.tolist() == [7, *kept]
    assert trace.sample_rate == 0.25 and trace.full_accesses == 10


def _tap_capture(ids: np.ndarray, directory, prompt_blocks: int = 32) -> None:
    """``ids`` cut into prompts of ``prompt_blocks`` blocks, each block's hash a 32-byte digest
    whose first 8 bytes are its id (little-endian), sampled as the vLLM tap samples them, at
    the default rate, into a capture."""
    writer = CaptureWriter(directory, clock=lambda: T0)
    t = sampling.threshold(sampling.DEFAULT_RATE)
    rate = sampling.rate_of(t)
    tail = bytes(24)
    for n, start in enumerate(range(0, len(ids), prompt_blocks)):
        chunk = ids[start:start + prompt_blocks].tolist()
        hashes = [i.to_bytes(8, "little") + tail for i in chunk]
        keys, depths, dropped = sampling.sample(hashes, len(hashes), t)
        assert dropped == 0
        writer.add_lookup("vllm", _lookup(T0 + n * 0.01, f"r{n}", 16 * len(chunk), keys,
                                          depths, rate))
        if n % 2000 == 1999:
            writer.flush()
    writer.close()


def test_the_sampled_curve_is_within_0_01_of_the_exact_one_at_the_default_rate(tmp_path):
    """The issue's proof: 2M synthetic accesses (kvscope.analysis.synthetic, seed 11) through
    the tap's predicate at the default rate (1/16) into a capture, read and analysed: the mean
    absolute error of the LRU miss-ratio curve, by accesses and by tokens, against the exact
    curve of the full stream (Mattson stack distances) is <= 0.01. The scaled totals are the
    stream's: 2,000,000 accesses of 16 tokens."""
    ids = prefix_stream(2_000_000, seed=11)
    _tap_capture(ids, tmp_path)
    trace = read_block_trace(tmp_path)
    assert trace.sample_rate == sampling.DEFAULT_RATE
    assert 0.055 * len(ids) < len(trace) < 0.07 * len(ids)
    analysis = analyze(trace, AnalyzeOptions(get_preset("tiny"), arc_points=0))
    assert analysis.accesses == 2_000_000 and analysis.sampled_accesses == len(trace)
    assert "sampled by the tap" in analysis.method
    exact = lru_curve(ids, analysis.lru.sizes)
    assert 0.2 < 1 - exact.miss_ratio[-1] < 0.8  # a curve with room to err
    mae = mean_absolute_error(analysis.lru, exact)
    assert mae <= 0.01, mae
    tokens = lru_curve(ids, analysis.lru.sizes, np.full(len(ids), 16))
    assert mean_absolute_error(analysis.lru_tokens, tokens) <= 0.01
    # sizing counts the full stream's tokens (the curve's hits times 2M x 16 tokens), at the
    # preset's prefill rate: nothing in this capture measured one
    top = analysis.sizing.curve[-1]
    assert top.prefill_seconds_saved == pytest.approx(
        top.cpu_token_hit_share * 2_000_000 * 16 / get_preset("tiny").prefill_tokens_per_second)
    assert analysis.sizing.assumptions["prefill_source"].startswith("assumed")
    assert analysis.sizing.assumptions["preset"] == "tiny"
    print(f"MAE at R=1/16: {mae:.4f} (accesses)")


def test_a_sampled_capture_s_reuse_share_is_the_full_stream_s(tmp_path):
    """The Mooncake conversation trace's blocks (288,500 accesses of 182,790 distinct blocks:
    its README's reuse share 1 - 182,790 / 288,500 = 0.3664) through the tap's predicate at
    1/16: the reuse shares printed beside the curves estimate that share, and equal the curves'
    ceiling (SHARDS: distinct sampled blocks / R over the full stream's accesses). Its hottest
    block, id 0 (12,030 reuses), falls outside the sample, and the sample's own share, which
    weights each sampled block by its accesses, read 0.335: below the curve it is the
    ceiling of."""
    with open(trace_path()) as f:
        ids = np.array([h for line in f for h in json.loads(line)["hash_ids"]], dtype=np.int64)
    assert (len(ids), len(np.unique(ids))) == (288_500, 182_790)
    assert reference_hash(0) >= sampling.threshold(sampling.DEFAULT_RATE)  # id 0 not sampled
    _tap_capture(ids, tmp_path)
    analysis = analyze(read_block_trace(tmp_path), AnalyzeOptions(get_preset("tiny"),
                                                                   arc_points=0))
    reuse = analysis.reuse
    assert reuse.reuse_share == pytest.approx(1 - 182_790 / 288_500, abs=0.005)
    assert reuse.token_reuse_share == pytest.approx(reuse.reuse_share)  # 16 tokens a block
    assert reuse.reuse_share == pytest.approx(analysis.lru.hit_ratio[-1])
    assert reuse.token_reuse_share == pytest.approx(analysis.lru_tokens.hit_ratio[-1])


def test_a_sampled_capture_says_what_it_cannot_give(tmp_path):
    """A tap capture (1/16): asked for --sample-rate 0.5 it cannot sample more than the tap
    kept, and says so (it was silent, and the curve was the tap's rate's); 1/32 is below the
    tap's and needs no note. Its shared prefixes are not measured (None), not "none" ([]):
    most of a prompt's blocks are not in it."""
    _tap_capture(prefix_stream(40_000, seed=3), tmp_path)
    trace = read_block_trace(tmp_path)
    high = analyze(trace, AnalyzeOptions(get_preset("tiny"), method="shards-rate",
                                         sample_rate=0.5, arc_points=0))
    assert any("--sample-rate 0.5 is above the tap's 0.0625" in n for n in high.notes)
    assert high.reuse.top_prefixes is None and high.reuse.to_dict()["top_prefixes"] is None
    low = analyze(trace, AnalyzeOptions(get_preset("tiny"), method="shards-rate",
                                        sample_rate=1 / 32, arc_points=0))
    assert not any("--sample-rate" in n for n in low.notes)
    # exact (and auto, on a capture this small) keep the tap's rate: the rate given is not used,
    # and says so as for a full trace (a tap's curve is fixed-rate, which hid the note)
    for method in ("exact", "auto"):
        kept = analyze(trace, AnalyzeOptions(get_preset("tiny"), method=method,
                                             sample_rate=1 / 32, arc_points=0))
        assert "R=0.0625, sampled by the tap" in kept.method
        assert any(n.startswith("--sample-rate 0.03125 was not used") for n in kept.notes)


def test_a_tap_sample_too_thin_for_a_curve_gives_no_verdict(tmp_path):
    """A tryout's vLLM capture of 40 requests sharing a prefix: at 1/16 the sample kept 11
    distinct blocks, read 0% reuse and said "Do not offload" beside a third of the prompt
    tokens served from cache. Here 40 prompts of one 16-block prefix and 16 blocks of their
    own (656 distinct blocks, about 41 sampled): below shards.MIN_SAMPLED_BLOCKS (1,000)
    distinct sampled blocks there is no verdict, nor a size, and the report says why; a
    capture of 40,000 accesses (over 1,000 sampled) has its verdict."""
    shared = list(range(16))
    ids = np.array([b for n in range(40) for b in shared + list(range(1000 + 16 * n,
                                                                      1016 + 16 * n))],
                   dtype=np.uint64)
    _tap_capture(ids, tmp_path / "thin")
    trace = read_block_trace(tmp_path / "thin")
    assert len(np.unique(trace.block_ids)) < shards.MIN_SAMPLED_BLOCKS
    sizing = analyze(trace, AnalyzeOptions(get_preset("tiny"), arc_points=0)).sizing
    assert sizing.offload is None and sizing.recommended is None and not sizing.reasons
    assert sizing.kv_offloading_size_gib is None
    assert sizing.verdict.startswith("Not enough data to size a tier: the tap's sample holds ")
    assert "of the 1,000 a curve needs" in sizing.verdict
    _tap_capture(prefix_stream(40_000, seed=3), tmp_path / "thick")
    trace = read_block_trace(tmp_path / "thick")
    assert len(np.unique(trace.block_ids)) >= shards.MIN_SAMPLED_BLOCKS
    sizing = analyze(trace, AnalyzeOptions(get_preset("tiny"), arc_points=0)).sizing
    assert sizing.offload is not None and not sizing.verdict.startswith("Not enough data")


def test_a_tap_capture_sampled_again_too_thin_is_refused_as_a_trace_would_be(tmp_path):
    """A tap capture of 2,000 accesses (1/16: about 125 sampled) analysed at its own rate is a
    sample already, and goes; sampled again at 1/100 it keeps a handful of blocks, and is
    refused as a trace's thin sample is (it printed a curve of 0 and 1 blocks serving 38%)."""
    _tap_capture(prefix_stream(2_000, seed=5), tmp_path)
    trace = read_block_trace(tmp_path)
    assert analyze(trace, AnalyzeOptions(get_preset("tiny"), arc_points=0)).accesses == 2_000
    with pytest.raises(ValueError, match="too few for a curve to size a tier from"):
        analyze(trace, AnalyzeOptions(get_preset("tiny"), method="shards-rate",
                                      sample_rate=0.01, arc_points=0))


def test_a_capture_prefill_rate_beside_a_preset_kv_size_is_noted():
    """A demo capture of a tiny model without an offload tier: its prefill rate came from the
    capture, its KV bytes per block from analyze's default preset (llama-3-8b, 64 times
    tiny's block), and the verdict flipped to "do not offload" unremarked. The report notes
    the mix; not where the capture measured the KV size too (its transfers), nor where it
    measured no prefill (both the preset's)."""
    from kvscope.analysis.inputs import from_block_ids
    from kvscope.analysis.rates import measured_rates

    trace = from_block_ids(np.array([1, 2, 3, 1, 2, 3, 4, 1, 2], dtype=np.uint64), 16)
    preset = get_preset("llama-3-8b")

    def noted(measured):
        notes = analyze(trace, AnalyzeOptions(preset, measured=measured, arc_points=0)).notes
        return [n for n in notes if "two models" in n]

    prefill_only = measured_rates(1000, 0.25, {}, {})
    assert noted(prefill_only) == [
        "The prefill rate is the capture's, but the KV bytes per block are preset llama-3-8b's, "
        "assumed (the capture moved no blocks to measure them by): a verdict from two models "
        "if the engine's is another; give --preset for it."]
    assert noted(measured_rates(1000, 0.25, {"cpu->gpu": 32768}, {"cpu->gpu": 0.001},
                                {"cpu->gpu": 1})) == []
    assert noted(measured_rates(0, 0.0, {}, {})) == []


def test_kv_bytes_and_the_gpu_tier_come_from_the_capacities_the_engine_reported():
    """By hand: with no transfer, the cpu tier's 8 GiB over its 65,536 blocks is 131,072 KV
    bytes a block, and the gpu tier's 2,048 blocks of 16 tokens are a GPU prefix cache of
    32,768 tokens (vLLM's 'GPU KV cache size'), each said to be the capture's; transfers that
    counted blocks still set the KV bytes, and --gpu-tokens, 0 included, wins over the
    capture's. A capture whose engine reported no tier assumes none, and says so."""
    from kvscope.analysis.analyze import _rates
    from kvscope.analysis.rates import measured_rates

    capacities = {"gpu": (0, 2048), "cpu": (8 << 30, 65536)}
    m = measured_rates(0, 0.0, {}, {}, {}, capacities=capacities)
    preset = get_preset("tiny")
    _, _, block_bytes, gpu_tokens, sources = _rates(AnalyzeOptions(preset, measured=m), 16)
    assert (block_bytes, gpu_tokens) == (131072, 32768)
    assert sources["kv_bytes"] == ("measured: the capture's cpu tier, 8,589,934,592 bytes in "
                                   "65,536 blocks as its engine reported it")
    assert sources["gpu"] == ("measured: the capture's gpu tier, 2,048 blocks as its engine "
                              "reported it")
    moved = measured_rates(0, 0.0, {"gpu->cpu": 3000}, {}, {"gpu->cpu": 2}, capacities=capacities)
    assert moved.bytes_per_block == 1500
    for given in (0, 4096):
        _, _, _, gpu_tokens, sources = _rates(AnalyzeOptions(preset, gpu_tokens=given,
                                                             measured=m), 16)
        assert (gpu_tokens, sources["gpu"]) == (given, "given (--gpu-tokens)")
    _, _, block_bytes, gpu_tokens, sources = _rates(AnalyzeOptions(
        preset, measured=measured_rates(0, 0.0, {}, {}, {}, capacities={"cpu": (0, 100)})), 16)
    assert (block_bytes, gpu_tokens) == (None, 0)
    assert sources["gpu"].startswith("assumed: none")


def test_sizing_rates_are_measured_given_or_assumed_and_say_which():
    """By hand: 1e9 bytes of cpu->gpu copies in 0.5 s is 2e9 bytes/s (gpu->cpu copies do not
    count: promotions are host to device); 1,000 recomputed tokens in 0.25 s of prefill is
    4,000 tokens/s. A given value wins; with neither, 25 GB/s and the preset's rate, assumed;
    no prefill seconds is not measured (None), never 0 tokens/s. KV bytes per block: the
    1e9 + 32,768 bytes over the 1,000 + 1 blocks of the directions that counted blocks
    (gpu->cpu's 5 bytes came without a block count: left out), 999,033.7."""
    from kvscope.analysis.analyze import _rates
    from kvscope.analysis.rates import measured_rates

    m = measured_rates(1000, 0.25, {"cpu->gpu": 10**9, "gpu->cpu": 5, "cpu->disk": 32768},
                       {"cpu->gpu": 0.5, "gpu->cpu": 1.0}, {"cpu->gpu": 1000, "cpu->disk": 1})
    assert (m.bandwidth, m.prefill_tokens_per_second) == (2e9, 4000.0)
    assert m.bytes_per_block == pytest.approx((10**9 + 32768) / 1001)
    preset = get_preset("tiny")
    bandwidth, prefill, block_bytes, _, sources = _rates(AnalyzeOptions(preset, measured=m), 16)
    assert (bandwidth, prefill, block_bytes) == (2e9, 4000.0, m.bytes_per_block)
    assert sources["bandwidth"].startswith("measured: 1,000,000,000 bytes")
    assert sources["prefill"].startswith("measured: 1,000 recomputed")
    assert sources["kv_bytes"] == "measured: 1,000,032,768 bytes in 1,001 blocks (the " \
        "capture's transfers)"
    bandwidth, _, _, _, sources = _rates(AnalyzeOptions(preset, bandwidth=5e9, measured=m), 16)
    assert bandwidth == 5e9 and sources["bandwidth"] == "given (--bandwidth-gbps)"
    none = measured_rates(1000, 0.0, {"gpu->cpu": 5}, {"gpu->cpu": 1.0})
    assert none.bandwidth is None and none.prefill_tokens_per_second is None
    assert none.bytes_per_block is None
    bandwidth, prefill, block_bytes, _, sources = _rates(AnalyzeOptions(preset, measured=none),
                                                             16)
    assert bandwidth == 25e9 and prefill is None and sources["bandwidth"].startswith("assumed")
    assert block_bytes is None
    assert "prefill" not in sources and "kv_bytes" not in sources  # sizing says: the preset's
