"""The pipeline's snapshot as catalog samples: what ``/metrics`` shows of the aggregated events.

Pure: :func:`snapshot_samples` maps one :class:`~kvscope.agent.pipeline.Snapshot` onto the
catalog's specs; the exposition (``exporter/prometheus.py``) encodes them.
"""

from __future__ import annotations

from kvscope import __version__
from kvscope import catalog as m
from kvscope.agent.pipeline import Snapshot
from kvscope.catalog import Samples


def _labelled(mapping: dict) -> list[tuple[list[str], object]]:
    return [(list(key) if isinstance(key, tuple) else [key], value) for key, value in mapping.items()]


def snapshot_samples(snap: Snapshot) -> Samples:
    """Per catalog metric the pipeline owns: ``(label values, value)`` pairs; a value is a
    number or a :class:`~kvscope.agent.histograms.Histogram`."""
    tiers = snap.tiers.items()
    return {
        m.PROMPT_TOKENS: _labelled(snap.prompt_tokens),
        m.LOOKUP_BLOCKS: _labelled(snap.lookup_blocks),
        m.PROMPT_PREFIX_BLOCKS: _labelled(snap.prompt_prefix_blocks),
        m.PREFILL_SECONDS_SAVED: _labelled(snap.prefill_seconds_saved),
        m.TRANSFER_BYTES: _labelled(snap.transfer_bytes),
        m.TRANSFER_BLOCKS: _labelled(snap.transfer_blocks),
        m.TRANSFER_SECONDS: _labelled(snap.transfer_seconds),
        m.TRANSFER_FAILURES: _labelled(snap.transfer_failures),
        m.EVICTED_BLOCKS: _labelled(snap.evicted_blocks),
        m.DROPPED_BLOCKS: _labelled(snap.dropped_blocks),
        m.EVICTED_BLOCK_HITS: _labelled(snap.evicted_block_hits),
        m.BLOCK_RESIDENCY_SECONDS: _labelled(snap.block_residency_seconds),
        m.BLOCK_IDLE_SECONDS: _labelled(snap.block_idle_seconds),
        m.STORE_ADMISSIONS: _labelled(snap.store_admissions),
        # a capacity of 0 or a residency of None is one no source knows (events.TierSnapshot):
        # absent
        m.TIER_CAPACITY_BYTES: [([t], s.capacity_bytes) for t, s in tiers if s.capacity_bytes],
        m.TIER_RESIDENT_BYTES: [([t], s.resident_bytes) for t, s in tiers
                                if s.resident_bytes is not None],
        m.TIER_CAPACITY_BLOCKS: [([t], s.capacity_blocks) for t, s in tiers if s.capacity_blocks],
        m.TIER_RESIDENT_BLOCKS: [([t], s.resident_blocks) for t, s in tiers
                                 if s.resident_blocks is not None],
        m.REQUESTS: [([], snap.requests)],
        m.TTFT_SECONDS: [([], snap.ttft_seconds)],
        m.PROMOTION_WAIT_SECONDS: [([], snap.promotion_wait_seconds)],
        m.ITL_SECONDS: [([], snap.itl_seconds)],
        # each source's own, and only a source's that reported it: never 0 for "not measured"
        m.REQUESTS_WAITING: _labelled(snap.requests_waiting),
        m.REQUESTS_RUNNING: _labelled(snap.requests_running),
        m.PREEMPTIONS: _labelled(snap.preemptions),
        m.GPU_KV_CACHE_USAGE_RATIO: _labelled(snap.gpu_kv_cache_usage),
        m.TRANSFERS_IN_FLIGHT: _labelled(snap.transfers_in_flight),
        m.TRANSFER_BLOCKS_IN_FLIGHT: _labelled(snap.transfer_blocks_in_flight),
        m.EVENTS_RECEIVED: _labelled(snap.events_received),
        m.EVENTS_DROPPED: _labelled({**dict.fromkeys(sorted(snap.expected_drops), 0),
                                     **snap.events_dropped}),
        m.TAP_ERRORS: _labelled(snap.tap_errors),
        m.SOURCE_UP: [([s], float(up)) for s, up in snap.source_up.items()],
        m.ENGINE_INFO: [([s, e, model], 1) for s, (e, model) in snap.source_info.items()],
        m.ENGINE_CACHE_CONFIG_INFO: [([s, prefix, dtype], 1)
                                     for s, (prefix, dtype) in snap.cache_config.items()],
        m.BUILD_INFO: [([__version__], 1)],
    }
