"""The NVIDIA Dynamo KVBM metrics source: scrapes the KV block manager's own Prometheus endpoint
(``DYN_KVBM_METRICS=true``; port ``DYN_KVBM_METRICS_PORT``, 6880 by default) and maps its block
counters onto kvscope's tiers (Dynamo's G1 device memory -> ``gpu``, G2 host -> ``cpu``, G3
disk -> ``disk``, object storage -> ``remote``).

The names and their meaning are Dynamo's ``lib/llm/src/block_manager/metrics_kvbm.rs`` (commit
3c24940c8284307d81f8d18d5cf29bdb5484ecff): plain ``IntCounter``s in a registry prefixed
``kvbm_``, without labels and without ``_total``, registered (at 0) when KVBM starts. Each
counter's increase between two scrapes becomes one untimed :class:`~kvscope.events.Transfer`
(KVBM says how many blocks moved, not how long they took):

==============================  =================  ==========================================
KVBM counter (blocks)           kvscope transfer   bytes
==============================  =================  ==========================================
``kvbm_offload_blocks_d2h``     gpu -> cpu         blocks x ``block_bytes``
``kvbm_offload_blocks_h2d``     cpu -> disk        blocks x ``block_bytes``
``kvbm_offload_blocks_d2d``     gpu -> disk        blocks x ``block_bytes`` (host bypassed)
``kvbm_offload_blocks_d2o``     gpu -> remote      ``kvbm_offload_bytes_object``'s increase
``kvbm_onboard_blocks_h2d``     cpu -> gpu         blocks x ``block_bytes``
``kvbm_onboard_blocks_d2d``     disk -> gpu        blocks x ``block_bytes``
``kvbm_onboard_blocks_o2d``     remote -> gpu      ``kvbm_onboard_bytes_object``'s increase
==============================  =================  ==========================================

Object-storage bytes that rise in a scrape where their blocks do not (KVBM adds the blocks
first) go with the next transfer in that direction. ``block_bytes`` (KV bytes per block,
config) is 0 when unknown: KVBM exports no block size, and its transfers then go with 0 bytes,
which the agent keeps out of the bytes counters (not measured, not 0). The ``d2h``/``h2d``
names mean different pairs in the two families (offload ``h2d`` is host to disk, onboard
``h2d`` host to device): the table is Dynamo's own help text.

Left out: ``kvbm_{host,disk,object}_cache_hit_rate``, gauges over a sliding window of KVBM's own
(a ratio a scrape samples at one instant, overwritten between scrapes: kvscope computes ratios
from counters in PromQL), and ``kvbm_matched_tokens``, the tokens KVBM's tiers matched for vLLM:
vLLM counts the same tokens among its external prefix-cache hits, beside the prompt total they
are a share of (``vllm_metrics`` maps both); KVBM alone has no prompt total, so a lookup made of
them would claim no token was recomputed. Counters a given Dynamo lacks (object storage before
it had one) are absent, never 0.

Parsing and mapping (:class:`KvbmMapper`) do no I/O; the scrape loop is
:class:`~kvscope.agent.sources.scrape.ScrapeSource`'s.
"""

from __future__ import annotations

from pydantic import Field

from kvscope import events as ev
from kvscope.agent.sections import ScrapeSection
from kvscope.agent.sources.base import Built, Consumer, SourceSpec, register
from kvscope.agent.sources.scrape import Counters, Samples, ScrapeSource, series
from kvscope.vocabulary import OFFLOAD_TIERS

NAME = "kvbm_metrics"
DEFAULT_URL = "http://127.0.0.1:6880/metrics"
# KVBM counter -> (src, dst, the counter of its bytes when KVBM reports them)
TRANSFERS: dict[str, tuple[str, str, str | None]] = {
    "kvbm_offload_blocks_d2h": ("gpu", "cpu", None),
    "kvbm_offload_blocks_h2d": ("cpu", "disk", None),
    "kvbm_offload_blocks_d2d": ("gpu", "disk", None),
    "kvbm_offload_blocks_d2o": ("gpu", "remote", "kvbm_offload_bytes_object"),
    "kvbm_onboard_blocks_h2d": ("cpu", "gpu", None),
    "kvbm_onboard_blocks_d2d": ("disk", "gpu", None),
    "kvbm_onboard_blocks_o2d": ("remote", "gpu", "kvbm_onboard_bytes_object"),
}


class KvbmMapper:
    """Successive scrapes of KVBM's ``/metrics`` -> kvscope events (see the module).
    ``block_bytes``: KV bytes per block, 0 when unknown. Not thread-safe."""

    def __init__(self, block_bytes: int = 0) -> None:
        self.block_bytes = block_bytes
        self.counters = Counters()
        # object-storage bytes of scrapes whose blocks did not rise (KVBM adds the blocks, then
        # the bytes: a scrape between the two), per block counter: sent with its next blocks
        self._rest_bytes: dict[str, int] = {}

    def map(self, samples: Samples, now: float) -> list[ev.Transfer]:
        """One untimed Transfer per direction whose blocks rose since the scrape before (the
        first scrape is the baselines, but for series created after the agent started: see
        :class:`~kvscope.agent.sources.scrape.Counters`)."""
        self.counters.begin(samples)
        increases = {name: self.counters.increase(name, series(samples, name))
                     for name in {*TRANSFERS, *(b for _, _, b in TRANSFERS.values() if b)}}
        self.counters.commit()
        events = []
        for name, (src, dst, bytes_name) in TRANSFERS.items():
            blocks = int(increases[name] or 0)
            counted = increases[bytes_name] if bytes_name else None
            if counted is not None:
                counted = int(counted) + self._rest_bytes.pop(name, 0)
            if blocks <= 0:
                if counted:
                    self._rest_bytes[name] = counted
                continue
            moved = blocks * self.block_bytes if counted is None else counted
            events.append(ev.Transfer(ts=now, src=src, dst=dst, blocks=blocks, bytes=moved,
                                      duration=0.0, timed=False, sees_failures=False))
        return events


class KvbmMetricsSource(ScrapeSource):
    """Scrapes KVBM's ``url`` every ``interval`` seconds into ``pipeline`` (see the module)."""

    name = NAME
    thread_name = "kvscope-kvbm-metrics"
    engine = "Dynamo KVBM"
    prefix = "kvbm_"
    mapper_class = KvbmMapper


class KvbmMetricsConfig(ScrapeSection):
    """Scrape Dynamo KVBM's ``/metrics`` (source ``kvbm_metrics``) every ``interval``
    seconds; ``block_bytes``: KV bytes per block (0: unknown, and so are the bytes moved)."""

    url: str = DEFAULT_URL
    block_bytes: int = Field(0, ge=0)


def _build(config: KvbmMetricsConfig, consumer: Consumer, built: Built) -> KvbmMetricsSource:
    return KvbmMetricsSource(consumer, config.url, interval=config.interval,
                             mapper=KvbmMapper(config.block_bytes))


# KVBM moves blocks into every tier below the GPU
SPEC = register(SourceSpec(
    NAME, KvbmMetricsConfig, _build, describe=lambda config: NAME,
    banner=lambda config, part, base_url: f"{NAME}: {config.url} every {config.interval:g} s",
    tiers=lambda config: OFFLOAD_TIERS, engine=lambda config: "dynamo"))
