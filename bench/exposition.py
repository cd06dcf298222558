"""/metrics exposition time with the full catalog for 8 GPUs and 4 tiers: kvscope's collector
(one pipeline snapshot per scrape, families built on the fly) against prometheus-client's
``generate_latest`` on a registry of ordinary Counter/Gauge/Histogram objects holding the same
series. Goal: ratio (baseline time / kvscope time) >= 0.5.

Run: python bench/exposition.py [--scrapes N]
"""

from __future__ import annotations

import argparse
import itertools
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvscope import events as ev
from kvscope import catalog as m
from kvscope.agent.metrics import snapshot_samples
from kvscope.agent.pipeline import Pipeline
from kvscope.catalog import CATALOG
from kvscope.exporter.prometheus import Exposition

TIERS = ("gpu", "cpu", "disk", "remote")
GPUS = [str(i) for i in range(8)]


def fill(pipeline: Pipeline) -> None:
    """Events touching every series a 4-tier node has (the tiers reported first, as an engine
    does: a lookup counts misses in the tiers known by then)."""
    events = [ev.TierSnapshot(ts=1.0, tier=tier, capacity_bytes=1 << 30, resident_bytes=1 << 29,
                              capacity_blocks=1024, resident_blocks=512) for tier in TIERS]
    for i, (src, dst) in enumerate(itertools.permutations(TIERS, 2)):
        rid = f"r{i}"
        events += [
            ev.RequestStarted(ts=1.0, request_id=rid, prompt_tokens=64),
            ev.Lookup(ts=1.0, request_id=rid, tokens={"gpu": 16, "cpu": 16, "disk": 16, "recompute": 16},
                      blocks=4, block_hits={"gpu": 1, "cpu": 1, "disk": 1}),
            ev.Transfer(ts=1.0, src=src, dst=dst, blocks=1, bytes=1 << 16, duration=1e-4 * (i + 1),
                        request_id=rid),
            ev.Transfer(ts=1.0, src=src, dst=dst, blocks=1, bytes=1 << 16, duration=1e-3, ok=False,
                        reason="io"),
            ev.RequestFinished(ts=1.1, request_id=rid, ttft=0.05 * (i + 1), prompt_tokens=64),
        ]
    events += [ev.Eviction(ts=1.0, tier=tier, blocks=1, bytes=1, age=10.0, hits=1)
               for tier in TIERS]
    pipeline.ingest("engine", events)
    pipeline.set_source_up("ingest", True)
    pipeline.drop("ingest", "malformed")


def node() -> dict:
    """What the host and GPU collectors give on an 8-GPU node."""
    per_gpu = lambda v: [([g], v) for g in GPUS]  # noqa: E731
    return {
        m.HOST_MEMORY_TOTAL_BYTES: [([], 2e12)],
        m.HOST_MEMORY_AVAILABLE_BYTES: [([], 1e12)],
        m.HOST_MEMORY_LIMIT_BYTES: [([], 2e12)],
        m.HOST_SWAP_USED_BYTES: [([], 0.0)],
        m.HOST_MEMORY_RESERVE_BYTES: [([], 6.4e10)],
        m.HOST_MEMORY_HEADROOM_BYTES: [([], 9e11)],
        m.OFFLOAD_BUDGET_BYTES: [([t], 1e11) for t in TIERS[1:]],
        m.PCIE_BYTES: [([g, d], 1e12) for g in GPUS for d in ("tx", "rx")],
        m.PCIE_LINK_MAX_BYTES_PER_SECOND: per_gpu(3.15e10),
        m.GPU_MEMORY_USED_BYTES: per_gpu(1e11),
        m.GPU_MEMORY_TOTAL_BYTES: per_gpu(1.4e11),
        m.COLLECTOR_UP: [(["host"], 1.0), (["gpu"], 1.0)],
        m.COLLECTOR_DURATION_SECONDS: [(["host"], 1e-4), (["gpu"], 1e-3)],
    }


def baseline_registry(text: bytes) -> CollectorRegistry:
    """A registry of prometheus-client metric objects holding the series ``text`` holds."""
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    for spec in CATALOG:
        base = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
        family = families[base]
        if spec.type == "histogram":
            metric = Histogram(spec.name, spec.help, spec.labels, registry=registry,
                               buckets=spec.buckets)
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    child = metric.labels(**sample.labels) if spec.labels else metric
                    for _ in range(int(sample.value)):
                        child.observe(spec.buckets[0] / 2)
            continue
        cls = Counter if spec.type == "counter" else Gauge
        metric = cls(spec.name, spec.help, spec.labels, registry=registry)
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            child = metric.labels(**sample.labels) if spec.labels else metric
            child.inc(sample.value) if cls is Counter else child.set(sample.value)
    return registry


def per_scrape(registry, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        generate_latest(registry)
    return (time.perf_counter() - t0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=500)
    args = parser.parse_args()
    pipeline = Pipeline()
    fill(pipeline)
    ours = Exposition(lambda: snapshot_samples(pipeline.snapshot()), node).registry
    text = generate_latest(ours)
    series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))
    theirs = baseline_registry(text)
    kv = min(per_scrape(ours, args.scrapes) for _ in range(3))
    base = min(per_scrape(theirs, args.scrapes) for _ in range(3))
    print(f"series in one scrape: {series}")
    print(f"kvscope collector:           {kv * 1e3:7.3f} ms/scrape")
    print(f"prometheus-client registry:  {base * 1e3:7.3f} ms/scrape")
    print(f"ratio (baseline / kvscope): {base / kv:.2f}  (goal >= 0.5)")


if __name__ == "__main__":
    main()
