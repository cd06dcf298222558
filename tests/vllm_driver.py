"""Runs a tiny vLLM engine (CPU build, dummy weights) for the vLLM integration tests.

Run with the vLLM environment's python (``KVSCOPE_VLLM_PYTHON``), never imported by pytest:

    python tests/vllm_driver.py MODE OUT.json [--endpoint E] [--kv-events E] [--workload NAME]

MODE: ``plain`` (prefix caching, no offloading), ``offload`` (vLLM's OffloadingConnector with
``KvscopeOffloadingSpec`` around ``CPUOffloadingSpec``), ``corrupt`` (as offload, but every
promotion reads a zeroed CPU pool: the negative control showing the outputs depend on the bytes
the worker copies) or ``tiering`` (``KvscopeOffloadingSpec`` around ``TieringOffloadingSpec``: a
CPU tier of only ``TIER_CPU_CHUNKS`` blocks over vLLM's file-system tier in a temp dir, so
shared prefixes come back disk -> cpu -> gpu). Writes ``{"outputs": [[token ids]...],
"bytes_per_block": int, ...}``; tiering adds ``"vllm"``: what vLLM itself did (blocks written
to and promoted from the file-system tier, CPU-tier evictions, ``.bin`` files left in its
root dir, ...), counted by wrapping vLLM's own tier objects, ``"tap"``: the tap's error
counters, and ``"tap_resident_blocks"``: the CPU-tier blocks the tap's manager holds at the end.

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
# tiering: CPU tier in blocks. Fewer than the 56-57 blocks ``shared`` stores between two uses of
# a prefix (so A and B leave it); more than 24 + 12 (two pushers' blocks pinned by in-flight disk
# writes while the next pusher stores: a full CPU tier refuses a store it cannot make room for).
TIER_CPU_CHUNKS = 40
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


def engine_args(mode: str, model: str, endpoint: str, kv_events: str | None,
                fs_root: str = "") -> dict:
    args = dict(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
                max_model_len=512, block_size=BLOCK, num_gpu_blocks_override=GPU_BLOCKS,
                kv_cache_memory_bytes=GPU_BLOCKS * BYTES_PER_BLOCK, enforce_eager=True, seed=0,
                max_num_seqs=2, max_num_batched_tokens=512, enable_prefix_caching=True)
    if mode in ("offload", "corrupt"):
        args["served_model_name"] = "tiny"  # the tap must report it, not the path
        args["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "KvscopeOffloadingSpec", "spec_module_path": "kvscope.agent.taps.vllm",
                "kvscope_endpoint": endpoint, "cpu_bytes_to_use": CPU_CHUNKS * BYTES_PER_BLOCK}}
    if mode == "tiering":
        args["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "KvscopeOffloadingSpec", "spec_module_path": "kvscope.agent.taps.vllm",
                "kvscope_endpoint": endpoint, "kvscope_inner_spec": "TieringOffloadingSpec",
                "cpu_bytes_to_use": TIER_CPU_CHUNKS * BYTES_PER_BLOCK,
                # enable_kv_events: the fs tier reports its stores (the tap's cpu->disk)
                "secondary_tiers": [{"type": "fs", "root_dir": fs_root, "n_read_threads": 1,
                                     "n_write_threads": 1, "enable_kv_events": True}]}}
        # The tiering managers record their events (CPU removals made by promotions, CPU stores
        # of promoted blocks, fs stores) only with vLLM's KV events on: CPUOffloadingManager
        # (enable_events), FileSystemTierManager (vllm/v1/kv_offload/tiering/fs/manager.py,
        # "enable_kv_events ... Effective only when KV cache events are enabled globally").
        # The scheduler drains take_events() every step either way; "null" publishes nowhere.
        args["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "null"}
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


def count_tiering() -> tuple[dict, list]:
    """Ground truth for the tiering mode, counted by wrapping vLLM's own objects in this process
    (they still do all the work): blocks submitted to the fs tier (stores: cascades from the
    CPU tier; loads: promotions back), blocks whose fs jobs finished ok, keys the CPU tier
    evicted (``evicted_keys`` of every primary-tier ``prepare_store``, including the room a
    promotion makes), and the tiering manager's GPU-facing calls: blocks stored from the GPU
    (``complete_store`` ok) and loaded to it (``prepare_load``). Also collects the kvscope spec
    objects (for their error counters)."""
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
    from vllm.v1.kv_offload.tiering.manager import (CPUPrimaryTierOffloadingManager,
                                                    TieringOffloadingManager)

    from kvscope.agent.taps.vllm import KvscopeOffloadingSpec

    counts = {"fs_store_blocks": 0, "fs_load_blocks": 0, "fs_store_ok_blocks": 0,
              "fs_load_ok_blocks": 0, "fs_failed_jobs": 0, "cpu_evicted_blocks": 0,
              "gpu_to_cpu_blocks": 0, "cpu_to_gpu_blocks": 0}
    specs: list = []
    tiers: dict = {}  # the fs tier objects
    jobs: dict[int, tuple[str, int]] = {}
    submit_store = FileSystemTierManager.submit_store
    submit_load = FileSystemTierManager.submit_load
    finished = FileSystemTierManager.get_finished_jobs
    prepare = CPUPrimaryTierOffloadingManager.prepare_store
    spec_init = KvscopeOffloadingSpec.__init__
    complete_store, prepare_load = (TieringOffloadingManager.complete_store,
                                    TieringOffloadingManager.prepare_load)

    def store(self, job):
        tiers[id(self)] = self
        counts["fs_store_blocks"] += len(job.keys)
        jobs[job.job_id] = ("fs_store_ok_blocks", len(job.keys))
        return submit_store(self, job)

    def load(self, job):
        counts["fs_load_blocks"] += len(job.keys)
        jobs[job.job_id] = ("fs_load_ok_blocks", len(job.keys))
        return submit_load(self, job)

    def get_finished_jobs(self):
        results = list(finished(self))
        for result in results:
            name, blocks = jobs.pop(result.job_id, ("", 0))
            if result.success and name:
                counts[name] += blocks
            elif not result.success:
                counts["fs_failed_jobs"] += 1
        return results

    def prepare_store(self, keys, req_context):
        output = prepare(self, keys, req_context)
        if output is not None:
            counts["cpu_evicted_blocks"] += len(output.evicted_keys)
        return output

    def gpu_stored(self, keys, req_context, success=True):
        if success:
            counts["gpu_to_cpu_blocks"] += len(keys)
        return complete_store(self, keys, req_context, success)

    def gpu_load(self, keys, req_context):
        counts["cpu_to_gpu_blocks"] += len(keys)
        return prepare_load(self, keys, req_context)

    def init(self, config):
        spec_init(self, config)
        specs.append(self)

    FileSystemTierManager.submit_store, FileSystemTierManager.submit_load = store, load
    FileSystemTierManager.get_finished_jobs = get_finished_jobs
    CPUPrimaryTierOffloadingManager.prepare_store = prepare_store
    TieringOffloadingManager.complete_store = gpu_stored
    TieringOffloadingManager.prepare_load = gpu_load
    KvscopeOffloadingSpec.__init__ = init
    counts["_tiers"] = tiers
    return counts, specs


def residency(specs: list) -> tuple[int, int]:
    """Blocks resident in the CPU tier: ``(as vLLM's primary tier counts them, as the tap's
    manager tracks them)``."""
    vllm = tap = 0
    for spec in specs:
        manager = spec.__dict__.get("_manager")
        if manager is not None:
            primary = manager.inner.primary_tier
            vllm += primary._num_allocated_chunks - len(primary._free_list)
            tap += len(manager._observer._resident)
    return vllm, tap


def tap_errors(specs: list) -> dict:
    """Error counters of the kvscope spec, manager and worker objects vLLM built."""
    out = {"spec": 0, "manager": 0, "worker": 0, "unattributed": 0, "unseen_evictions": 0,
           "managers": 0, "workers": 0}
    for spec in specs:
        out["spec"] += spec.errors
        manager, worker = spec.__dict__.get("_manager"), spec.__dict__.get("_worker")
        if manager is not None:
            out["managers"] += 1
            out["manager"] += getattr(manager, "errors", 0)
            out["unattributed"] += getattr(manager, "unattributed", 0)
            out["unseen_evictions"] += getattr(manager, "unseen_evictions", 0)
        if worker is not None:
            out["workers"] += 1
            out["worker"] += getattr(worker, "errors", 0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["plain", "offload", "corrupt", "tiering"])
    parser.add_argument("out")
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5560")
    parser.add_argument("--kv-events", default=None)
    parser.add_argument("--workload", default="shared")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    context_sensitive_weights()
    if args.mode == "corrupt":
        corrupt_promotions()
    counts, specs = count_tiering() if args.mode == "tiering" else ({}, [])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.time()
    extra: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        fs_root = str(Path(tmp) / "fs-tier")
        llm = LLM(**engine_args(args.mode, write_model(tmp), args.endpoint, args.kv_events,
                                fs_root))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False,
                                ignore_eos=True)
        outputs = []
        for prompt in prompts(args.workload):  # one at a time: a deterministic eviction order
            result = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            outputs.append(list(result[0].outputs[0].token_ids))
        if args.mode == "tiering":
            # The last disk writes finish after the last scheduler step, and vLLM's tiering
            # manager learns of finished writes only by polling in a step: wait for the fs
            # tier's threads, then run one step (a 10-token prompt: no full block to look up
            # or store) so that they are reported. Not part of ``outputs``.
            for tier in counts.pop("_tiers").values():
                tier.drain_jobs()
            llm.generate([TokensPrompt(prompt_token_ids=list(range(400, 410)))],
                         SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                        ignore_eos=True), use_tqdm=False)
            counts["cpu_resident_blocks"], tap_resident = residency(specs)
        try:
            llm.llm_engine.engine_core.shutdown()  # closes the tap's emitters (flushes them)
        except Exception as exc:  # noqa: BLE001 - best effort; the sleep below still flushes
            print(f"engine shutdown: {exc!r}", file=sys.stderr)
        time.sleep(1.0)  # let ZMQ's I/O threads send what the emitters and publisher queued
        if args.mode == "tiering":
            files = [p for p in Path(fs_root).rglob("*.bin")]
            counts["fs_files"] = len(files)
            counts["fs_file_bytes"] = sum(p.stat().st_size for p in files)
            extra = {"vllm": counts, "tap": tap_errors(specs),
                     "tap_resident_blocks": tap_resident}
    cpu_blocks = TIER_CPU_CHUNKS if args.mode == "tiering" else CPU_CHUNKS
    Path(args.out).write_text(json.dumps({
        "outputs": outputs, "bytes_per_block": BYTES_PER_BLOCK, "block_size": BLOCK,
        "gpu_blocks": GPU_BLOCKS, "cpu_blocks": cpu_blocks, "seconds": time.time() - started,
        **extra}))
    os._exit(0)  # skip vLLM's slow interpreter teardown; the output is written


if __name__ == "__main__":
    main()
