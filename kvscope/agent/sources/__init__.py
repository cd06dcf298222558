"""Sources: turn what an engine offers into kvscope events for the pipeline.

Each module here is one source and registers itself (:func:`~kvscope.agent.sources.base.register`)
when imported below; the contract it keeps is :mod:`~kvscope.agent.sources.base`. A source that
reads another while it is built imports after it.
"""

from kvscope.agent.sources import ingest, kv_events, otlp_receiver  # noqa: F401
from kvscope.agent.sources import kvbm_metrics, lmcache_metrics, trtllm  # noqa: F401
from kvscope.agent.sources import sglang_metrics  # noqa: F401  (yields to kv_events)
from kvscope.agent.sources import vllm_metrics  # noqa: F401  (yields to the ones above)
from kvscope.agent.sources.base import REGISTRY, build_sources, check_overlaps

__all__ = ["REGISTRY", "build_sources", "check_overlaps"]
