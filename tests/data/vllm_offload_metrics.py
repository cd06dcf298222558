"""Prints what vLLM's /metrics shows of KV offloading, made by vLLM's own classes: run with a
vLLM environment's python (``tests/agent/test_vllm_metrics.py`` checks the recorded
``vllm-<version>-<spec>.prom`` files beside this one against it, and says how to record them).

    python tests/data/vllm_offload_metrics.py tiering|cpu > tests/data/vllm-<version>-<spec>.prom

The offloading connector's ``OffloadPromMetrics`` (``offloading/metrics.py``) is built for
``TieringOffloadingSpec`` (a CPU tier over an ``fs`` and an ``obj`` tier) or ``CPUOffloadingSpec``,
with the engine labels vLLM's ``PrometheusStatLogger`` gives it (``v1/metrics/loggers.py``), and
fed two scheduler steps' ``OffloadingConnectorStats`` payloads with the names and label values
``TieringMetricsTracker`` (``kv_offload/tiering/metrics.py``) and, 0.33, ``set_info`` of
``CPUOffloadingInfo`` (``kv_offload/cpu/common.py``) and ``TieringOffloadingManager.config_info``
would put there. A scrape follows each step; ``_created`` samples (creation times) are left out.
"""

import sys
from types import SimpleNamespace

import vllm
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadPromMetrics,
)
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics as T

SPEC = sys.argv[1] if len(sys.argv) > 1 else "tiering"
CHUNK = 65536  # bytes per chunk of 2 blocks; 64 chunks in the CPU tier
PRIMARY, FS, OBJ = ("0:primary",), ("1:fs",), ("2:obj",)
if SPEC == "tiering":
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 * CHUNK,
             "secondary_tiers": [{"type": "fs", "root_dir": "/kv"},
                                 {"type": "obj", "store_config": {}}]}
else:
    extra = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 64 * CHUNK}
config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
prom = OffloadPromMetrics(config, {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
                          ["model_name", "engine"], {0: ["m", "0"]})


def info() -> list[dict]:
    """What the scheduler's first payload carries (0.33): the managers' config_info()."""
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
    cpu = dict(CPUOffloadingInfo(cpu_num_chunks=64, cpu_blocks_per_chunk=2,
                                 cpu_kv_cache_size_bytes=64 * CHUNK,
                                 cpu_kv_cache_size_tokens=4096).as_config_info())
    if SPEC != "tiering":
        return [cpu]
    return [{**cpu, "tier": PRIMARY[0]}, {"tier": FS[0]}, {"tier": OBJ[0]}]


def step(first: bool, queries: dict, hits: dict, reads: dict, writes: dict, latencies: list,
         promotion_failures: dict, cascade_failures: dict) -> None:
    stats = OffloadingConnectorStats()
    if first and hasattr(stats, "set_info"):
        stats.set_info(info())
    stats.increase_counter("vllm:kv_offload_store_bytes", 8 * CHUNK)
    stats.increase_counter("vllm:kv_offload_allocation_failure", 1)
    stats.observe_histogram("vllm:kv_offload_lookup_sync_delay_seconds", 0.0002)
    if SPEC == "tiering":
        for name, counts, per in ((T.CHUNK_QUERIES, queries, 1), (T.CHUNK_HITS, hits, 1),
                                  (T.READ_BYTES, reads, CHUNK), (T.WRITE_BYTES, writes, CHUNK),
                                  (T.PROMOTION_JOB_FAILURES, promotion_failures, 1),
                                  (T.CASCADE_JOB_FAILURES, cascade_failures, 1)):
            for label, n in counts.items():
                stats.increase_counter(name, n * per, label)
        if hasattr(T, "PROMOTION_LATENCY"):  # 0.33
            for labels, seconds in latencies:
                stats.observe_histogram(T.PROMOTION_LATENCY, seconds, labels)
        stats.observe_histogram(T.LOOKUP_SYNC_DELAY, 0.0002, FS)
        stats.increase_counter(T.BACKPRESSURE_STORES_DROPPED, 1, FS)
        stats.increase_counter(T.PROMOTION_ALLOCATION_FAILURES, 1)
    prom.observe(stats.data, 0)


def scrape() -> str:
    def name(line: str) -> str:
        return line.split()[2] if line.startswith("#") else line.split("{")[0].split()[0]

    return "".join(line + "\n" for line in generate_latest(REGISTRY).decode().splitlines()
                   if name(line).startswith("vllm:") and not name(line).endswith("_created"))


OK, FAIL = ("success",), ("failure",)
out = [f"# vLLM {vllm.__version__} {SPEC}: made by tests/data/vllm_offload_metrics.py\n"]
step(True, {PRIMARY: 5, FS: 3, OBJ: 1}, {PRIMARY: 2, FS: 2}, {FS: 2}, {FS: 1},
     [(FS + OK, 0.04)], {}, {})
out.append(scrape())
out.append("# ---- the next scrape ----\n")
step(False, {PRIMARY: 10, FS: 6, OBJ: 3}, {PRIMARY: 4, FS: 3, OBJ: 1}, {FS: 3}, {FS: 5},
     [(FS + OK, 0.003), (FS + OK, 0.02), (FS + OK, 0.02), (FS + OK, 0.7), (FS + FAIL, 0.5)],
     {FS: 1}, {FS: 2})
out.append(scrape())
sys.stdout.write("".join(out))
