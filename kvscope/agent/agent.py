"""The agent: owns the pipeline, the collectors and the Prometheus registry; samples once a second."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from kvscope.agent.collectors.host import HostCollector
from kvscope.agent.pipeline import Pipeline
from kvscope.exporter.collector import KvscopeCollector


class Agent:
    """One node's agent. ``sample_interval``: seconds between dashboard samples.
    ``clock``: Unix-seconds clock. ``start()``/``shutdown()`` are safe to repeat, and
    ``shutdown()`` is safe without ``start()``."""

    def __init__(self, sample_interval: float = 1.0, host: HostCollector | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.pipeline = Pipeline()
        self.host = host or HostCollector()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(KvscopeCollector(self.pipeline, self.host))
        self.started_at = clock()
        self._clock = clock
        self.sample_interval = sample_interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._sample_loop, name="kvscope-sampler",
                                            daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def sample(self) -> None:
        """Record one dashboard sample now."""
        self.pipeline.record_sample(self._clock(), self.host.collect().available)

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.sample_interval):
            self.sample()
