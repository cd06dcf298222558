"""The memory budget breakdown: the host's memory and each GPU's, split into parts that add up
to the whole, from the collectors' readings and what the engines reported
(:class:`~kvscope.events.EngineMemory`). docs/collectors.md, "Memory budgets".

Pure: no I/O; the agent hands in one host reading, one GPU reading and the pipeline's
``engine_memory`` (dict[(source, device), dict[field, bytes]]) per scrape or sample. Every value
is bytes. A part nobody measured is absent, never 0.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvscope import catalog as m
from kvscope.agent.collectors.gpu import GpuDevice, GpuReading
from kvscope.agent.collectors.host import HostReading
from kvscope.catalog import Samples

EngineMemory = Mapping[tuple[str, str], Mapping[str, int]]  # (source, device) -> {field: bytes}
HOST = ""  # the device of host memory in an EngineMemory report
# kvscope.agent.sources.vllm_metrics.NAME (a test holds them equal): importing it would import
# every source, compiled ones among them, where only the collectors are wanted (bench/gpu_check.py)
VLLM_METRICS = "vllm_metrics"


def reported(engine_memory: EngineMemory, device: str, name: str) -> int | None:
    """Field ``name`` of ``device``'s reports added up over the senders that reported it (two
    engines on one host each have their pool), or None when none did. vLLM's scraped metrics
    (source ``vllm_metrics``) count only where no other sender reports the field: a tap in
    that vLLM reports the same pool, which would otherwise count twice."""
    found = {source: fields[name] for (source, dev), fields in engine_memory.items()
             if dev == device and name in fields}
    own = {source: n for source, n in found.items() if source != VLLM_METRICS}
    values = own or found
    return sum(values.values()) if values else None


def offload_budgets(configured: Mapping[str, int],
                    engine_memory: EngineMemory) -> dict[str, int]:
    """dict[tier, bytes]: the offload budget of each tier. The engines report the ``cpu`` tier's
    (vLLM's tap: ``cpu_bytes_to_use``; the reference engine: its cpu tier), so it is typed once,
    in the engine's config; a tier in ``configured`` (the host collector's ``budgets``)
    overrides what the engines say."""
    budget = reported(engine_memory, HOST, "kv_offload_budget")
    return {**({"cpu": budget} if budget is not None else {}), **configured}


def host_parts(reading: HostReading, kv_offload: int | None) -> dict[str, int]:
    """dict[part, bytes] of the host's memory limit (``reading.limit``: physical memory or the
    cgroup's memory limit), parts of :data:`~kvscope.vocabulary.HOST_MEMORY_PARTS`:

    - ``kv_offload``: the host KV tier's budget (``kv_offload``; absent when None);
    - ``engine_other``: the engine's memory (``reading.engine``) beyond that budget, at least 0;
      absent when the engine's memory is not read;
    - ``other``: memory in use (``limit - available``) that is not the engine's, at least 0;
      without the engine's memory, what is in use beyond the budget;
    - ``reserve``: the operator's reserve;
    - ``free``: what the others leave of the limit, at least 0.

    They add up to the limit, unless the budget and reserve overcommit it: ``free`` stops at 0
    and the parts exceed the limit by as much. The budget counts whole although an engine
    may not have touched all of it yet (vLLM allocates its pool up front); what it has not
    comes out of ``free`` (its share of the engine's memory is less than the budget, so
    ``engine_other`` is 0 and ``other`` counts the engine's memory out).

    Example: limit 64 GiB, available 40 GiB (24 in use), engine 20 GiB, budget 16 GiB, reserve
    8 GiB -> kv_offload 16, engine_other 4, other 4, reserve 8, free 32 (64 in all).
    """
    in_use = reading.limit - reading.available
    budget = kv_offload or 0
    parts: dict[str, int] = {}
    if kv_offload is not None:
        parts["kv_offload"] = kv_offload
    if reading.engine is not None:
        parts["engine_other"] = max(reading.engine - budget, 0)
        parts["other"] = max(in_use - reading.engine, 0)
    else:
        parts["other"] = max(in_use - budget, 0)
    parts["reserve"] = reading.reserve
    parts["free"] = max(reading.limit - sum(parts.values()), 0)
    return parts


def gpu_parts(device: GpuDevice, kv_cache: int | None, allocated: int | None) -> dict[str, int]:
    """dict[part, bytes] of one GPU's memory (NVML's total), parts of
    :data:`~kvscope.vocabulary.GPU_MEMORY_PARTS`:

    - ``kv_cache``: the engine's KV cache tensors on it (``kv_cache``, reported);
    - ``weights``: the engine's allocator's bytes in use when the KV cache was handed over, less
      the KV cache (``allocated - kv_cache``): the weights with the engine's persistent buffers;
      derived, and only when both were reported;
    - ``workspace``: NVML's used less that allocation (``used - allocated``): activations and
      workspace, CUDA graphs, the CUDA context, the allocator's cache, and any other process
      on the GPU; only when ``allocated`` was reported;
    - ``other``: memory in use that no report accounts for (all of NVML's used when the engine
      reported nothing for this GPU);
    - ``free``: NVML's total less used.

    Values are at least 0; they add up to NVML's total. Example: total 80 GiB, used 76 GiB,
    kv_cache 40 GiB, allocated 56 GiB -> kv_cache 40, weights 16, workspace 20, free 4.
    """
    used = device.memory_used_bytes
    parts: dict[str, int] = {}
    if kv_cache is not None:
        parts["kv_cache"] = kv_cache
        if allocated is not None:
            parts["weights"] = max(allocated - kv_cache, 0)
    if allocated is not None:
        parts["workspace"] = max(used - allocated, 0)
    unaccounted = used - sum(parts.values())
    if unaccounted > 0 or not parts:
        parts["other"] = max(unaccounted, 0)
    parts["free"] = max(device.memory_total_bytes - used, 0)
    return parts


def memory_samples(host: HostReading | None, gpu: GpuReading | None,
                   engine_memory: EngineMemory) -> Samples:
    """Catalog samples of ``kvscope_offload_budget_bytes`` (the budgets in force:
    :func:`offload_budgets`), ``kvscope_host_memory_part_bytes`` and
    ``kvscope_gpu_memory_part_bytes``. ``host``/``gpu``: the collectors' readings, None when
    the collector is off or failed (then its parts are absent: not measured). A GPU's
    reports are matched by its PCI address (``GpuDevice.pci_bus_id``)."""
    out: Samples = {m.OFFLOAD_BUDGET_BYTES: [], m.HOST_MEMORY_PART_BYTES: [],
                    m.GPU_MEMORY_PART_BYTES: []}
    if host is not None:
        budgets = offload_budgets(host.budgets, engine_memory)
        out[m.OFFLOAD_BUDGET_BYTES] = [([tier], float(n)) for tier, n in sorted(budgets.items())]
        out[m.HOST_MEMORY_PART_BYTES] = [
            ([part], float(n)) for part, n in host_parts(host, budgets.get("cpu")).items()]
    for device in gpu.gpus if gpu is not None else ():
        bus = device.pci_bus_id
        parts = gpu_parts(device, reported(engine_memory, bus, "kv_cache") if bus else None,
                          reported(engine_memory, bus, "allocated") if bus else None)
        out[m.GPU_MEMORY_PART_BYTES] += [([device.gpu, part], float(n))
                                         for part, n in parts.items()]
    return out
