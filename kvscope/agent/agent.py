"""The agent: wires sources -> pipeline -> sinks for one node and owns their lifecycle."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq
from prometheus_client import CollectorRegistry

from kvscope.agent.capture import CaptureWriter
from kvscope.agent.collectors import CollectorSet
from kvscope.agent.config import AgentSettings
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.requests import RequestTable
from kvscope.agent.sources.ingest import IngestSource
from kvscope.agent.sources.kv_events import KvEventsSource, KvResidency
from kvscope.agent.sources.otlp_receiver import OtlpReceiver
from kvscope.agent.sources.vllm_metrics import MetricsMapper, VllmMetricsSource
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
        kv, vm = settings.kv_events, settings.vllm_metrics
        self.kv_events = (KvEventsSource(self.pipeline, kv.endpoint,
                                         replay_endpoint=kv.replay_endpoint, topic=kv.topic,
                                         residency=KvResidency(kv.block_bytes, kv.capacity_blocks))
                          if kv.enabled else None)
        self.vllm_metrics = (VllmMetricsSource(self.pipeline, vm.url, interval=vm.interval,
                                               mapper=MetricsMapper(vm.block_bytes,
                                                                    gpu_snapshot=not kv.enabled))
                             if vm.enabled else None)
        self.otlp_receiver = (OtlpReceiver(self.pipeline, settings.otlp_receiver.source)
                              if settings.otlp_receiver.enabled else None)
        self.otlp = (RequestSpanExporter(settings.otlp_endpoint)
                     if settings.otlp_endpoint else None)
        self.capture = (CaptureWriter(settings.capture_dir, max_bytes=settings.capture_max_bytes,
                                      clock=clock)
                        if settings.capture_dir else None)
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
        if self.capture is not None:
            self.pipeline.subscribe_lookups(self.capture.add_lookup)
            self.pipeline.subscribe(self.capture.add_request)
            self.capture.start()
        if self.ingest is not None:
            try:
                self.ingest.start()
            except zmq.ZMQError:
                self.shutdown()
                raise
        if self.kv_events is not None:
            try:
                self.kv_events.start()
            except zmq.ZMQError:
                self.shutdown()
                raise
        for source in (self.vllm_metrics, self.otlp_receiver):
            if source is not None:
                source.start()
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
        for source in (self.kv_events, self.vllm_metrics, self.otlp_receiver):
            if source is not None:
                source.shutdown()
        if self.store is not None:
            self.store.shutdown()
        if self.otlp is not None:
            self.otlp.shutdown()
        if self.capture is not None:
            self.capture.shutdown()
        self.collectors.shutdown()

    def sample(self) -> None:
        """Record one dashboard sample now, with the host and GPU readings that are up."""
        host = self.collectors.reading("host")
        gpu = self.collectors.reading("gpu")
        links = ({d.gpu: d.link_max_bytes_per_second for d in gpu.gpus
                  if d.link_max_bytes_per_second} if gpu else None)
        self.pipeline.record_sample(
            self._clock(), host.available if host else None,
            host_memory_reserve=host.reserve if host else None,
            host_memory_headroom=host.headroom if host else None,
            offload_budgets=host.budgets if host else None, pcie_link_max=links)

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.sample_interval):
            self.sample()
