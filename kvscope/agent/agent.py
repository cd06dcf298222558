"""The agent: wires sources -> pipeline -> sinks for one node and owns their lifecycle."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq
from prometheus_client import CollectorRegistry

from kvscope.agent.collectors import CollectorSet
from kvscope.agent.config import AgentSettings
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.requests import RequestTable
from kvscope.agent.sources.ingest import IngestSource
from kvscope.agent.store import RequestStore
from kvscope.exporter.collector import KvscopeCollector
from kvscope.exporter.node import node_samples
from kvscope.exporter.otlp import RequestSpanExporter

log = logging.getLogger(__name__)


class Agent:
    """One node's agent, built from ``settings``.

    ``with_ingest``: bind the ZMQ ingest source (the demo feeds the pipeline in-process instead).
    ``collectors``: the host/GPU collectors (default: as the settings enable them).
    ``clock``: Unix-seconds clock. ``start()`` / ``shutdown()`` are safe to repeat, and
    ``shutdown()`` is safe without ``start()``; ``start()`` raises ``zmq.ZMQError`` when the
    ingest endpoint cannot be bound (nothing is left running then).
    """

    def __init__(self, settings: AgentSettings | None = None, *, with_ingest: bool = True,
                 collectors: CollectorSet | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings = settings or AgentSettings()
        self.pipeline = Pipeline(settings.prefill_tokens_per_second,
                                 table=RequestTable(settings.requests_capacity))
        self.collectors = collectors or CollectorSet.from_config(settings.collectors.model_dump())
        self.store = (RequestStore(settings.store_dir, max_bytes=settings.store_max_bytes,
                                   max_age=settings.store_max_age, clock=clock)
                      if settings.store_dir else None)
        self.ingest = (IngestSource(self.pipeline, settings.ingest.endpoint,
                                    max_batch_bytes=settings.ingest.max_batch_bytes,
                                    max_sources=settings.ingest.max_sources)
                       if with_ingest and settings.ingest.enabled else None)
        self.otlp = (RequestSpanExporter(settings.otlp_endpoint)
                     if settings.otlp_endpoint else None)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(KvscopeCollector(
            self.pipeline, lambda: node_samples(self.collectors.collect())))
        self.sample_interval = settings.sample_interval
        self.started_at = clock()
        self.ready = False
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        if self.store is not None:
            for record in self.store.load(self.pipeline.requests.capacity):
                self.pipeline.requests.add(record)
            self.pipeline.subscribe(self.store.add)
            self.store.start()
        if self.otlp is not None:
            self.pipeline.subscribe(self.otlp.export)
        if self.ingest is not None:
            try:
                self.ingest.start()
            except zmq.ZMQError:
                self.shutdown()
                raise
        self._thread = threading.Thread(target=self._sample_loop, name="kvscope-sampler",
                                        daemon=True)
        self._thread.start()
        self.ready = True

    def shutdown(self) -> None:
        self.ready = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.ingest is not None:
            self.ingest.shutdown()
        if self.store is not None:
            self.store.shutdown()
        if self.otlp is not None:
            self.otlp.shutdown()
        self.collectors.shutdown()

    def sample(self) -> None:
        """Record one dashboard sample now (host memory when the host collector is up)."""
        host = self.collectors.reading("host")
        self.pipeline.record_sample(self._clock(), host.available if host else None)

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.sample_interval):
            self.sample()
