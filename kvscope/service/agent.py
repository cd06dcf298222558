"""The agent: wires sources -> pipeline -> sinks for one node and owns their lifecycle."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

import zmq

from kvscope import catalog as m
from kvscope.agent.capture import KINDS as CAPTURE_KINDS, CaptureWriter
from kvscope.agent.collectors import CollectorSet
from kvscope.agent.collectors.metrics import collector_samples
from kvscope.agent.config import AgentSettings, ConfigError
from kvscope.agent.memory_budget import memory_samples
from kvscope.agent.metrics import snapshot_samples
from kvscope.agent.pipeline import Pipeline
from kvscope.agent.requests import RequestTable
from kvscope.agent.sources import REGISTRY as SOURCES
from kvscope.agent.sources import build_sources
from kvscope.agent.sources.ingest import STATE_FILE as INGEST_STATE_FILE
from kvscope.agent.store import RequestStore
from kvscope.agent.worker import Worker
from kvscope.catalog import Samples
from kvscope.samples import join_key
from kvscope.exporter.otlp import SPAN_RESULTS, RequestSpanExporter
from kvscope.exporter.prometheus import Exposition
from kvscope.files import check_writable

log = logging.getLogger(__name__)


def _unusable(key: str, directory, exc: OSError) -> ConfigError:
    """The error refusing the directory of the sink set by ``key``: what failed, and what to
    fix (but for another agent holding it)."""
    flag = "--" + key.replace("_", "-")  # the agent's and the demo's flag for the key
    fix = ("" if exc.errno == errno.EBUSY else
           f" (the agent writes its files there: make it a directory this user can create "
           f"files in, or set {key} ({flag}) to one)")
    return ConfigError(f"cannot use {key} {directory}: {exc.strerror or exc}{fix}")


def _keyed(samples: Samples, spec: m.MetricSpec) -> dict[str, float]:
    """``samples[spec]`` as a dashboard sample's dict: label values joined as its keys."""
    return {join_key(labels): value for labels, value in samples[spec]}


class Agent(Worker):
    """One node's agent, built from ``settings``.

    ``with_ingest``: bind the ZMQ ingest source (the demo feeds the pipeline in-process instead).
    ``collectors``: the host/GPU collectors (default: as the settings enable them).
    ``clock``: Unix-seconds clock. ``start()`` / ``shutdown()`` are safe to repeat, and
    ``shutdown()`` is safe without ``start()``; ``start()`` raises
    :class:`~kvscope.agent.config.ConfigError` when a part cannot start (see :meth:`prepare`).
    """

    def __init__(self, settings: AgentSettings | None = None, *, with_ingest: bool = True,
                 collectors: CollectorSet | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.settings = settings = settings or AgentSettings()
        self.pipeline = Pipeline(settings.prefill_tokens_per_second,
                                 table=RequestTable(settings.requests_capacity),
                                 open_per_source=settings.requests_open_per_source,
                                 recent_per_source=settings.requests_recent_per_source)
        self.collectors = collectors or CollectorSet.from_config(settings.collectors.model_dump())
        self.store = (RequestStore(settings.store_dir, max_bytes=settings.store_max_bytes,
                                   max_age=settings.store_max_age, clock=clock)
                      if settings.store_dir else None)
        # every registered source whose table is enabled (agent/sources/), by name
        self.sources = build_sources({name: getattr(settings, name) for name in SOURCES},
                                     self.pipeline, skip=() if with_ingest else ("ingest",))
        self.ingest, self.kv_events, self.otlp_receiver, self.vllm_metrics = (
            self.sources.get(name) for name in ("ingest", "kv_events", "otlp_receiver",
                                                 "vllm_metrics"))
        if self.ingest is not None and self.store is not None:
            # beside the requests they counted: a restart counts what was lost meanwhile
            self.ingest.state_path = self.store.directory / INGEST_STATE_FILE
        numa = self.collectors.get("numa")
        if numa is not None and self.ingest is not None:
            # without [collectors.numa] engine_pid: the processes the taps run in
            numa.follow(self.ingest.engine_pids)
        self.otlp = (RequestSpanExporter(settings.otlp_endpoint)
                     if settings.otlp_endpoint else None)
        self.capture = (CaptureWriter(settings.capture_dir, max_bytes=settings.capture_max_bytes,
                                      clock=clock)
                        if settings.capture_dir else None)
        # subscribed now: the API serves (spans come) before the parts start; the store only
        # once the requests it restores are in
        if self.otlp is not None:
            self.pipeline.subscribe(self.otlp.export)
        if self.capture is not None:
            self.pipeline.subscribe_lookups(self.capture.add_lookup)
            self.pipeline.subscribe(self.capture.add_request)
        self.exposition = Exposition(lambda: snapshot_samples(self.pipeline.snapshot()),
                                     self._scrape_samples)
        self.sample_interval = settings.sample_interval
        self.started_at = clock()
        self.ready = False
        # until the stored requests are back: what a span joins may not be in the table yet
        self.restoring = self.store is not None
        self._clock = clock

    thread_name = "kvscope-sampler"

    def _scrape_samples(self) -> Samples:
        """The metrics read at scrape time outside the pipeline: the host and GPU collectors',
        the memory budget breakdown (the collectors' readings with the engines' memory reports;
        its budgets, the engines' with the configured ones over them, replace the collector's
        configured ones), the OTLP exporter's span counts and the store's and capture's lost
        records (0 without them: nothing sent or lost)."""
        results = self.collectors.collect()
        samples = collector_samples(results)
        host, gpu = (results[name].reading if name in results else None
                     for name in ("host", "gpu"))
        samples.update(memory_samples(host, gpu, self.pipeline.engine_memory()))
        spans = self.otlp.spans if self.otlp is not None else dict.fromkeys(SPAN_RESULTS, 0)
        samples[m.OTLP_SPANS] = [([result], n) for result, n in spans.items()]
        store = self.store.lost + self.store.unwritable if self.store is not None else 0
        capture = self.capture.dropped if self.capture is not None else {}
        samples[m.RECORDS_DROPPED] = [(["store"], store)] + [
            ([f"capture_{kind}"], capture.get(kind, 0)) for kind in CAPTURE_KINDS]
        return samples

    def _components(self) -> list[tuple[str, object]]:
        """(what to name in an error, component) for every optional part, in start order."""
        s = self.settings
        parts = [(f"store_dir {s.store_dir}", self.store),
                 (f"capture_dir {s.capture_dir}", self.capture),
                 *((SOURCES[name].describe(getattr(s, name)), part)
                   for name, part in self.sources.items())]
        return [(name, part) for name, part in parts if part is not None]

    def prepare(self) -> None:
        """Restore stored requests, subscribe the store and start every part; raises
        :class:`~kvscope.agent.config.ConfigError` naming the part that could not start (a
        port or endpoint taken, a directory where no file can be written: every sink that
        writes files refuses one, before the store is restored), with nothing left running."""
        if self.capture is not None:
            try:
                check_writable(self.capture.directory)
            except OSError as exc:
                raise _unusable("capture_dir", self.capture.directory, exc) from None
        if self.store is not None:
            try:
                self.store.take()
                restored = self.store.load(self.pipeline.requests.capacity)
            except OSError as exc:  # another agent's, or a segment this user cannot read
                raise _unusable("store_dir", self.store.directory, exc) from None
            self.pipeline.restore(restored)
            self.pipeline.subscribe(self.store.add, early=True)  # kill -9 loses 1 s at most
        self.restoring = False
        for name, part in self._components():
            try:
                part.start()
            except (zmq.ZMQError, OSError) as exc:
                self.shutdown()
                # ZMQ's own words do not say what to fix (and repeat the endpoint named)
                if exc.errno == errno.EADDRINUSE:
                    hint = ("; another process (a second agent?) or another of this agent's "
                            "own endpoints (its --port, [ingest], a source's) holds it: "
                            "choose a free one")
                elif isinstance(exc, zmq.ZMQError):
                    hint = ("; an endpoint is tcp://ADDRESS:PORT with an address of this host, "
                            "or ipc:///PATH")
                else:
                    hint = ""
                # a directory another writer holds: its words say all ("[Errno 16]" does not)
                said = exc.strerror if exc.errno == errno.EBUSY else exc
                raise ConfigError(f"cannot start {name}: {said}{hint}") from None

    def start(self) -> None:
        super().start()
        self.ready = True

    def shutdown(self) -> None:
        self.ready = False
        super().shutdown()
        sinks = (self.capture, self.store)
        # each step guarded: the sinks must close whatever fails before them (an unclosed
        # capture segment is lost at the next start)
        for name, part in reversed(self._components()):  # the sources first, ...
            if part not in sinks:
                self._guarded(f"stopping {name}", part.shutdown)
        # ... so what they sent last is stored, and a last sample: the capture's totals count
        # every transfer, not those to the last once-a-second sample (a capture stopped after
        # 7 s read 23% low)
        self._guarded("publishing the last requests",
                      lambda: self.pipeline.publish_settled(everything=True))
        self._guarded("recording the last sample", self.sample)
        for sink in (*sinks, self.otlp):
            if sink is not None:
                self._guarded(f"closing {type(sink).__name__}", sink.shutdown)
        self._guarded("stopping the collectors", self.collectors.shutdown)

    def _guarded(self, what: str, step: Callable[[], object]) -> None:
        """Run ``step``; an exception is logged as a bug (``what`` was being done), not raised."""
        try:
            step()
        except Exception:  # noqa: BLE001 (logged; the rest goes on)
            self.log_bug(what)

    def run(self) -> None:
        while not self.stopping.wait(self.sample_interval):
            self._guarded("recording a sample", self.sample)  # one lost, not every later one

    def sample(self) -> None:
        """Record one dashboard sample now, with the host and GPU readings that are up."""
        host = self.collectors.reading("host")
        gpu = self.collectors.reading("gpu")
        engine = self.collectors.reading("engine_args")
        links = ({d.gpu: d.link_max_bytes_per_second for d in gpu.gpus
                  if d.link_max_bytes_per_second} if gpu else None)
        memory = memory_samples(host, gpu, self.pipeline.engine_memory())
        self.pipeline.publish_settled()  # first, so that the sample counts what just settled
        sample = self.pipeline.record_sample(
            self._clock(), host.available if host else None,
            host_memory_reserve=host.reserve if host else None,
            host_memory_headroom=host.headroom if host else None,
            offload_budgets=_keyed(memory, m.OFFLOAD_BUDGET_BYTES) if host else None,
            pcie_link_max=links, host_memory_parts=_keyed(memory, m.HOST_MEMORY_PART_BYTES),
            gpu_memory_parts=_keyed(memory, m.GPU_MEMORY_PART_BYTES),
            host_memory_limit=host.limit if host else None,
            gpu_memory_total={d.gpu: d.memory_total_bytes for d in gpu.gpus} if gpu else None,
            host_swap_in=host.swap_in if host else None,
            engine_weight_offload=engine.weight_offload_bytes if engine else None)
        if self.capture is not None:  # the transfer cost compare reads, stores included
            self.capture.add_sample(sample)
