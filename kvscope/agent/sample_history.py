"""The dashboard's one-second samples: a bounded history, each sample built from one state of
the fold, its fields as :mod:`kvscope.samples` declares them."""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Mapping

from kvscope import events as ev
from kvscope import samples as sf
from kvscope.agent.histograms import window_counts
from kvscope.percentiles import bucket_percentiles


def by_key(counts: Mapping[tuple[str, ...], int]) -> dict[str, int]:
    """``counts`` keyed by their labels joined as the samples join them (``"src->dst"``)."""
    return {sf.join_key(k): v for k, v in counts.items()}


class SampleHistory:
    """The last ``history`` samples (default an hour of one a second). Percentiles in a sample
    cover the observations since the oldest of the last ``quantile_window`` samples (like
    PromQL's ``rate()[60s]``). Thread-safe: the sampler records while the API reads."""

    def __init__(self, history: int = 3600, quantile_window: int = 60) -> None:
        self._lock = threading.Lock()
        self._samples: deque[dict] = deque(maxlen=history)
        # histogram counts at the last ``quantile_window`` samples, oldest first
        self._hist_ring: deque[dict] = deque(maxlen=max(quantile_window, 1))

    def record(self, ts: float, state: dict, tiers: Mapping[str, ev.TierSnapshot],
               host_memory_available: float | None, *,
               host_memory_reserve: float | None = None,
               host_memory_headroom: float | None = None,
               offload_budgets: Mapping[str, int] | None = None,
               pcie_link_max: Mapping[str, float] | None = None,
               host_memory_parts: Mapping[str, float] | None = None,
               gpu_memory_parts: Mapping[str, float] | None = None,
               host_memory_limit: float | None = None,
               gpu_memory_total: Mapping[str, float] | None = None,
               host_swap_in: float | None = None,
               engine_weight_offload: float | None = None,
               cache_config: Mapping[str, tuple[str, str]] | None = None) -> dict:
        """Append a one-second sample, and return it: ``ts`` and every field of
        :data:`kvscope.samples.FIELDS` (their shapes, keys and units are declared there):
        cumulative counters and current gauges at ``ts``, and percentiles of the observations
        in the last ``quantile_window`` samples.

        ``state``: the fold's (:meth:`~kvscope.agent.fold.Fold.state`) at ``ts``; ``tiers``: the
        tier totals then. ``host_memory_available``, ``host_memory_reserve``,
        ``host_memory_headroom``: bytes, None when unknown. ``offload_budgets``: dict[tier,
        bytes]. ``pcie_link_max``: dict[gpu, bytes/s] of each GPU's current link, one
        direction. ``host_memory_parts``: dict[part, bytes]; ``gpu_memory_parts``:
        dict["gpu->part", bytes] (the memory budget breakdown, :mod:`kvscope.agent.memory_budget`),
        and the wholes they add up to: ``host_memory_limit``, bytes (None when unknown), and
        ``gpu_memory_total``: dict[gpu, bytes]. ``host_swap_in``: bytes read back in from swap
        since boot (a counter: 0 when unknown, as ``host_memory_limit`` then says);
        ``engine_weight_offload``: model weight bytes per GPU the engine keeps in host RAM,
        None when unknown. ``cache_config``: dict[source, (prefix caching, KV cache dtype)], the
        label values of each source's engine's KV cache settings.

        The percentile work happens here, once per sample, never per event.
        """
        evicted: Counter[str] = Counter()
        for (tier, _reason), n in state["evicted_blocks"].items():
            evicted[tier] += n
        failures: Counter[str] = Counter()  # a direction seen, 0 failures: there with 0
        for (src, dst, _reason), n in state["transfer_failures"].items():
            failures[sf.join_key((src, dst))] += n
        # a histogram's state: (buckets, counts, sum, exemplars)
        transfers = {sf.join_key(k): h for k, h in state["transfer_seconds"].items()}
        hists = {"ttft": state["ttft_seconds"][1], "wait": state["promotion_wait_seconds"][1],
                 **{key: h[1] for key, h in transfers.items()}}
        with self._lock:
            old = self._hist_ring[0] if self._hist_ring else {}
            self._hist_ring.append(hists)
            transfer_q = {}
            for key in transfers:
                window = window_counts(hists[key], old.get(key))
                if sum(window) > 0:
                    transfer_q[key] = bucket_percentiles(sf.TRANSFER_SECONDS.spec.buckets, window)
            self._samples.append(sf.record(ts, {
                sf.PROMPT_TOKENS: state["prompt_tokens"],
                sf.PROMPT_PREFIX_BLOCKS: state["prompt_prefix_blocks"],
                sf.TRANSFER_BYTES: by_key(state["transfer_bytes"]),
                sf.EVICTED_BLOCKS: dict(evicted),
                sf.TIER_RESIDENT_BYTES: {t: s.resident_bytes for t, s in tiers.items()
                                         if s.resident_bytes is not None},
                # a capacity of 0 is unknown: absent, as on /metrics
                sf.TIER_CAPACITY_BYTES: {t: s.capacity_bytes for t, s in tiers.items()
                                         if s.capacity_bytes},
                sf.HOST_MEMORY_AVAILABLE_BYTES: host_memory_available,
                sf.REQUESTS: state["requests"],
                sf.PREFILL_SECONDS_SAVED: state["prefill_seconds_saved"],
                sf.TRANSFER_BLOCKS: by_key(state["transfer_blocks"]),
                sf.TRANSFER_SECONDS_SUM: {key: h[2] for key, h in transfers.items()},
                sf.DROPPED_BLOCKS: state["dropped_blocks"],
                sf.EVICTED_BLOCK_HITS: {t: h[1] for t, h in state["evicted_block_hits"].items()},
                sf.BLOCK_RESIDENCY_SECONDS: {t: h[1] for t, h
                                             in state["block_residency_seconds"].items()},
                sf.TTFT_SECONDS: bucket_percentiles(
                    sf.TTFT_SECONDS.spec.buckets, window_counts(hists["ttft"], old.get("ttft"))),
                sf.PROMOTION_WAIT_SECONDS: bucket_percentiles(
                    sf.PROMOTION_WAIT_SECONDS.spec.buckets, window_counts(hists["wait"], old.get("wait"))),
                sf.TRANSFER_SECONDS: transfer_q,
                sf.TIER_RESIDENT_BLOCKS: {t: s.resident_blocks for t, s in tiers.items()
                                          if s.resident_blocks is not None},
                sf.TIER_CAPACITY_BLOCKS: {t: s.capacity_blocks for t, s in tiers.items()
                                          if s.capacity_blocks},
                sf.HOST_MEMORY_RESERVE_BYTES: host_memory_reserve,
                sf.HOST_MEMORY_HEADROOM_BYTES: host_memory_headroom,
                sf.OFFLOAD_BUDGET_BYTES: dict(offload_budgets or {}),
                sf.PCIE_LINK_MAX_BYTES_PER_SECOND: dict(pcie_link_max or {}),
                sf.REQUESTS_WAITING: state["requests_waiting"],
                sf.REQUESTS_RUNNING: state["requests_running"],
                sf.PREEMPTIONS: state["preemptions"],
                sf.GPU_KV_CACHE_USAGE_RATIO: state["gpu_kv_cache_usage"],
                sf.HOST_MEMORY_PART_BYTES: dict(host_memory_parts or {}),
                sf.GPU_MEMORY_PART_BYTES: dict(gpu_memory_parts or {}),
                sf.HOST_MEMORY_LIMIT_BYTES: host_memory_limit,
                sf.GPU_MEMORY_TOTAL_BYTES: dict(gpu_memory_total or {}),
                sf.HOST_SWAP_IN_BYTES: host_swap_in or 0.0,
                sf.ENGINE_WEIGHT_OFFLOAD_BYTES: engine_weight_offload,
                sf.ENGINE_CACHE_CONFIG: {sf.join_key((source, *values)): 1
                                         for source, values in (cache_config or {}).items()},
                sf.TRANSFER_FAILURES: dict(failures),
            }))
            return self._samples[-1]

    def since(self, since: float | None = None, window: float | None = None) -> list[dict]:
        """Samples with ``ts > since`` (all when None), oldest first; ``window``: seconds, only
        those no older than that before the newest sample."""
        with self._lock:
            out = [s for s in self._samples if since is None or s["ts"] > since]
        if window is not None and out:
            newest = out[-1]["ts"]
            out = [s for s in out if s["ts"] >= newest - window]
        return out
