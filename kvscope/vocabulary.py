"""kvscope's vocabulary, declared once: the bounded values of every label and event field that
names a tier, a token source, a reason, and how engines' own names map onto them. Every other
module imports them from here (``events.py`` re-exports the ones its schema uses).

- **tier**: where KV blocks live, nearest the GPU first (``gpu``, ``cpu`` host RAM, ``disk``,
  ``remote``); a copy toward the front is a promotion, toward the back an offload.
- **token source**: where each prompt token came from: a tier that held it, or ``recompute``
  (prefill computed it).
- **direction**: a transfer's ``(src, dst)`` tiers.
- **eviction reason**: why blocks left a tier (``capacity``: made room; ``cleared``: a cache
  reset; ``failed``: a store that failed).
- **admission result**: what became of blocks offered to a tier for storing (``stored``:
  written there; ``skipped``: declined unwritten, by the admission policy or for want of room;
  ``failed``: admitted, but the write failed).
- **failure reason**: why a transfer failed; a label, so the set is fixed (any other reason
  counts as ``other``).
- **tap error reason**: what an in-engine tap could not observe (``internal``: its own code
  failed at its boundary, or it had to forget state it tracks; ``unattributed``: a request it
  could not follow).
- **memory part**: a share of the host's or a GPU's memory in a budget breakdown.
- **cache setting**: whether an engine's GPU prefix caching is ``on`` or ``off``, and its KV
  cache element type by width (:func:`kv_cache_dtype`).

Imports only the standard library (the in-engine taps import it).
"""

from __future__ import annotations

from typing import Literal, get_args

# what a value no source measured reads as, wherever kvscope shows it: never 0, never a pass
NOT_MEASURED = "not measured"

Tier = Literal["gpu", "cpu", "disk", "remote"]
TokenSource = Literal["gpu", "cpu", "disk", "recompute"]
EvictionReason = Literal["capacity", "cleared", "failed"]
AdmissionResult = Literal["stored", "skipped", "failed"]

TIERS: tuple[str, ...] = get_args(Tier)
TOKEN_SOURCES: tuple[str, ...] = get_args(TokenSource)
EVICTION_REASONS: tuple[str, ...] = get_args(EvictionReason)
ADMISSION_RESULTS: tuple[str, ...] = get_args(AdmissionResult)
DIRECTIONS: tuple[tuple[str, str], ...] = tuple((src, dst) for src in TIERS for dst in TIERS)
FAILURE_REASONS: tuple[str, ...] = ("checksum", "corrupt", "disk_full", "io", "missing",
                                    "permission", "timeout", "truncated", "unknown", "other")
TAP_ERROR_REASONS: tuple[str, ...] = ("internal", "unattributed")
# The parts of a memory budget breakdown (``kvscope_host_memory_part_bytes``,
# ``kvscope_gpu_memory_part_bytes``; docs/collectors.md, "Memory budgets"), each set summing to
# its whole: the host's memory limit, a GPU's NVML total. Host: ``kv_offload`` the engine's KV
# offload budget, ``engine_other`` the engine process's memory beyond it, ``other`` what every
# other process and the kernel hold, ``reserve`` the operator's reserve, ``free`` the rest.
# GPU: ``kv_cache`` the KV cache tensors, ``weights`` (with the engine's persistent buffers),
# ``workspace`` the rest the engine's allocation leaves of what is in use (activations, CUDA
# graphs and context, allocator cache, other processes), ``other`` in use and in no engine's
# report, ``free``.
HOST_MEMORY_PARTS: tuple[str, ...] = ("kv_offload", "engine_other", "other", "reserve", "free")
GPU_MEMORY_PARTS: tuple[str, ...] = ("kv_cache", "weights", "workspace", "other", "free")

# An engine's KV cache settings (``kvscope_engine_cache_config_info``): GPU prefix caching, and
# the KV cache's element type by width, which is what sets its bytes (``auto``: the model's
# type, 16-bit as a rule; ``8bit``: fp8 and int8; ``other``: mixed widths such as vLLM's
# turboquant_k8v4, and names kvscope does not know).
PREFIX_CACHING: tuple[str, ...] = ("on", "off")
# A prompt block's prefix, seen before or new (``kvscope_prompt_prefix_blocks_total``).
PREFIX_REUSE: tuple[str, ...] = ("seen", "new")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "32bit", "16bit", "8bit", "4bit", "other")
_DTYPE_WIDTHS = {"auto": "auto", "float32": "32bit", "float": "32bit", "fp32": "32bit",
                 "float16": "16bit", "half": "16bit", "fp16": "16bit", "bfloat16": "16bit",
                 "bf16": "16bit"}


def kv_cache_dtype(name: str) -> str:
    """The :data:`KV_CACHE_DTYPES` value of an engine's KV cache dtype ``name`` (vLLM 0.32's
    ``CacheDType``: ``auto``, ``float16``, ``fp8_e4m3``, ``int8_per_token_head``, ``nvfp4``, ...;
    torch's ``float8_e4m3fn``); case-insensitive, ``other`` for a name it does not know."""
    name = name.strip().lower()
    if name in _DTYPE_WIDTHS:
        return _DTYPE_WIDTHS[name]
    if name.startswith(("fp8", "float8", "int8")):
        return "8bit"
    if name.startswith(("nvfp4", "int4")) or "4bit" in name:
        return "4bit"
    return "other"


# The tiers of an engine without a remote one (the reference engine; vLLM's KV events, whose
# media are GPU, CPU and STORAGE).
LOCAL_TIERS: tuple[str, ...] = TIERS[:3]
# The tiers below the GPU, where an offload connector keeps KV (KVBM's, LMCache's).
OFFLOAD_TIERS: tuple[str, ...] = TIERS[1:]
# vLLM's medium -> tier. Every STORAGE tier is disk: an event's ``ownership`` names no tier type
# (vLLM 0.32 and 0.33: only the kvcr tier sets it, to "kvcr"; fs and obj tiers leave it None).
VLLM_MEDIUM_TIER: dict[str, str] = {"GPU": "gpu", "CPU": "cpu", "STORAGE": "disk"}
# SGLang's medium -> tier (0.5.23 ``srt/disaggregation/kv_events.py`` ``StorageMedium``: device
# HBM, host pinned memory, SSD, a shared or remote pool such as Mooncake).
SGLANG_MEDIUM_TIER: dict[str, str] = {"GPU": "gpu", "CPU_PINNED": "cpu", "DISK": "disk",
                                      "EXTERNAL": "remote"}
# TensorRT-LLM's ``cache_tier`` label (main ``tensorrt_llm/metrics/enums.py``
# ``CACHE_TIER_LABELS``; the KV cache manager's tier of each level) -> the token source of the
# tokens it served. A KV connector's external store (remote) counts as cpu, as vLLM's external
# hits do; ``none`` (tokens skipped outside every sliding window) is no source.
TRTLLM_CACHE_TIER_SOURCE: dict[str, str] = {"gpu": "gpu", "host": "cpu", "cpu": "cpu",
                                            "disk": "disk", "remote": "cpu"}
