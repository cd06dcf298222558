"""Runs a tiny vLLM engine (CPU build, dummy weights) for the vLLM integration tests.

Run with the vLLM environment's python (``KVSCOPE_VLLM_PYTHON``), never imported by pytest:

    python tests/vllm_driver.py MODE OUT.json [--endpoint E] [--kv-events E] [--workload NAME]

MODE: ``plain`` (prefix caching, no offloading), ``offload`` (vLLM's OffloadingConnector with
``KvscopeOffloadingSpec`` around ``CPUOffloadingSpec``) or ``corrupt`` (as offload, but every
promotion reads a zeroed CPU pool: the negative control showing the outputs depend on the bytes
the worker copies). Writes ``{"outputs": [[token ids]...], "bytes_per_block": int, ...}``.

The model: a 2-layer Llama (hidden 64, 2 heads of 32, 2 KV heads, vocab 512) written to a temp
dir as config.json only, ``load_format="dummy"``, ``skip_tokenizer_init=True``, float32;
GPU (here: CPU-resident) KV cache of ``GPU_BLOCKS`` blocks of ``BLOCK`` tokens, so that a few
long prompts push each other's blocks out and shared prefixes come back from the CPU tier.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # kvscope from this checkout

BLOCK = 32          # tokens per block (vLLM's CPU attention needs a multiple of 32)
GPU_BLOCKS = 24     # 768 tokens of "GPU" KV cache
CPU_CHUNKS = 64     # CPU tier capacity in blocks (blocks_per_chunk 1)
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
         "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
# K and V, 2 layers, BLOCK tokens, 2 KV heads of 32 dims, 4-byte floats
BYTES_PER_BLOCK = 2 * 2 * BLOCK * 2 * 32 * 4


def write_model(directory: str) -> str:
    path = Path(directory) / "tiny-llama"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL))
    return str(path)


def prompts(workload: str) -> list[list[int]]:
    """Token-id prompts. ``shared``: three rounds of [prefix A + tail, two 400-token pushers,
    prefix B + tail, two pushers]: the pushers evict A and B from the GPU blocks, so their next
    use is promoted from the CPU tier; pushers are distinct, so the CPU tier also evicts."""
    if workload == "small":
        return [list(range(3, 3 + 100)), list(range(3, 3 + 100)) + [7, 8]]
    a = [(i * 7) % 500 + 3 for i in range(256)]
    b = [(i * 11 + 5) % 500 + 3 for i in range(288)]
    out = []
    for r in range(3):
        pusher = lambda k: [(r * 131 + k * 17 + i * 13) % 500 + 3 for i in range(400)]  # noqa: E731
        out += [a + [10 + r, 20 + r, 30 + r], pusher(0), pusher(1),
                b + [40 + r] * (5 + r), pusher(2), pusher(3)]
    return out


def engine_args(mode: str, model: str, endpoint: str, kv_events: str | None) -> dict:
    args = dict(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
                max_model_len=512, block_size=BLOCK, num_gpu_blocks_override=GPU_BLOCKS,
                kv_cache_memory_bytes=GPU_BLOCKS * BYTES_PER_BLOCK, enforce_eager=True, seed=0,
                max_num_seqs=2, max_num_batched_tokens=512, enable_prefix_caching=True)
    if mode in ("offload", "corrupt"):
        args["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "KvscopeOffloadingSpec", "spec_module_path": "kvscope.agent.taps.vllm",
                "kvscope_endpoint": endpoint, "cpu_bytes_to_use": CPU_CHUNKS * BYTES_PER_BLOCK}}
    if kv_events:
        args["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": kv_events, "topic": "kv"}
    return args


def context_sensitive_weights(scale: float = 0.5) -> None:
    """vLLM's dummy weights are uniform in +-1e-3: attention is then nearly uniform and the next
    token hardly depends on the KV cache, so equal outputs would prove little. Draw them in
    +-``scale`` instead (same seeded generator): outputs then depend on every cached block.
    Patches vLLM's dummy loader in this process (the engine core runs here)."""
    from vllm.model_executor.model_loader import dummy_loader

    original = dummy_loader.initialize_single_dummy_weight
    dummy_loader.initialize_single_dummy_weight = (
        lambda param, low=-scale, high=scale, seed=1234: original(param, low, high, seed))


def corrupt_promotions() -> None:
    """Negative control: zero the CPU pool before every promotion."""
    from kvscope.agent.taps.vllm_cpu_worker import CpuBlockCopyWorker

    original = CpuBlockCopyWorker.submit_load

    def submit_load(self, job_id, src_spec, dst_spec):
        for pool in self._pool:
            pool.zero_()
        return original(self, job_id, src_spec, dst_spec)

    CpuBlockCopyWorker.submit_load = submit_load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["plain", "offload", "corrupt"])
    parser.add_argument("out")
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5560")
    parser.add_argument("--kv-events", default=None)
    parser.add_argument("--workload", default="shared")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    context_sensitive_weights()
    if args.mode == "corrupt":
        corrupt_promotions()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(**engine_args(args.mode, write_model(tmp), args.endpoint, args.kv_events))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False,
                                ignore_eos=True)
        outputs = []
        for prompt in prompts(args.workload):  # one at a time: a deterministic eviction order
            result = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            outputs.append(list(result[0].outputs[0].token_ids))
        try:
            llm.llm_engine.engine_core.shutdown()  # closes the tap's emitters (flushes them)
        except Exception as exc:  # noqa: BLE001 - best effort; the sleep below still flushes
            print(f"engine shutdown: {exc!r}", file=sys.stderr)
        time.sleep(1.0)  # let ZMQ's I/O threads send what the emitters and publisher queued
    Path(args.out).write_text(json.dumps({
        "outputs": outputs, "bytes_per_block": BYTES_PER_BLOCK, "block_size": BLOCK,
        "gpu_blocks": GPU_BLOCKS, "cpu_blocks": CPU_CHUNKS, "seconds": time.time() - started}))
    os._exit(0)  # skip vLLM's slow interpreter teardown; the output is written


if __name__ == "__main__":
    main()
