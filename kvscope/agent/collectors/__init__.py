"""Collectors: read the node (host memory, GPUs, NUMA placement) at scrape time.

Each collector module registers itself by name (``base.register``, node_exporter's
``registerCollector``) with a default-enabled flag; ``CollectorSet`` builds the enabled ones from
config and runs them, catching every failure at this one boundary (house rule 7): a failing
collector yields ``CollectorResult(up=False)``, is logged once when it starts failing and once
when it recovers, and never fails the scrape or the agent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping

from kvscope.agent.collectors.base import (REGISTRY, Collector, CollectorError, CollectorResult,
                                           NoDataError, UnknownCollectorError, register)
from kvscope.agent.collectors.engine_args import EngineArgsCollector, EngineArgsReading
from kvscope.agent.collectors.gpu import GpuCollector, GpuDevice, GpuReading
from kvscope.agent.collectors.host import HostCollector, HostReading
from kvscope.agent.collectors.numa import NumaCollector, NumaReading

__all__ = ["REGISTRY", "CollectorError", "CollectorResult", "CollectorSet",
           "EngineArgsCollector", "EngineArgsReading", "GpuCollector",
           "GpuDevice", "GpuReading", "HostCollector", "HostReading", "NoDataError",
           "NumaCollector", "NumaReading", "UnknownCollectorError", "default_enabled", "register", "resolve_enabled"]

log = logging.getLogger(__name__)


def default_enabled() -> set[str]:
    """Names of the registered collectors that are on by default."""
    return {name for name, reg in REGISTRY.items() if reg.default_enabled}


def resolve_enabled(switches: Mapping[str, bool] | None = None) -> set[str]:
    """The defaults with per-name switches applied (``{"gpu": False}`` = ``--no-collector.gpu``).

    Raises UnknownCollectorError for a name nobody registered."""
    enabled = default_enabled()
    for name, on in (switches or {}).items():
        if name not in REGISTRY:
            raise UnknownCollectorError(f"unknown collector {name!r}; known: {sorted(REGISTRY)}")
        (enabled.add if on else enabled.discard)(name)
    return enabled


class CollectorSet:
    """The enabled collectors, run together.

    ``enabled``: collector names (default: those registered as default-enabled).
    ``options``: dict[name, dict] of keyword arguments for each collector's factory, e.g.
    ``{"host": {"reserve_bytes": 4 << 30, "budgets": {"cpu": 64 << 30}}, "gpu": {"nvml": stub}}``.
    ``clock``: seconds, for durations (default ``time.perf_counter``).
    Raises UnknownCollectorError for an unregistered name and lets a factory's ValueError (bad
    options) through: configuration errors surface at start-up, not at scrape time.
    """

    def __init__(self, enabled: Iterable[str] | None = None,
                 options: Mapping[str, Mapping[str, object]] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        names = sorted(default_enabled() if enabled is None else set(enabled))
        options = dict(options or {})
        unknown = (set(names) | set(options)) - set(REGISTRY)
        if unknown:
            raise UnknownCollectorError(f"unknown collector(s) {sorted(unknown)}; "
                                        f"known: {sorted(REGISTRY)}")
        self._collectors: dict[str, Collector] = {
            name: REGISTRY[name].factory(**dict(options.get(name, {}))) for name in names}
        self._clock = clock
        self._lock = threading.Lock()  # scrapes and the sampler may run at once; GPU state is shared
        self._failing: set[str] = set()

    @classmethod
    def from_config(cls, config: Mapping[str, Mapping[str, object]],
                    overrides: Mapping[str, Mapping[str, object]] | None = None,
                    clock: Callable[[], float] = time.perf_counter) -> CollectorSet:
        """Build from config sections: dict[name, {"enabled": bool, **factory options}], e.g.
        ``settings.collectors.model_dump()``. A registered collector without a section keeps its
        default. ``overrides``: extra factory options per name (injected clients in tests).
        Raises UnknownCollectorError for a section no collector registered."""
        switches, options = {}, {}
        for name, section in config.items():
            section = dict(section)
            if "enabled" in section:
                switches[name] = bool(section.pop("enabled"))
            options[name] = section
        for name, extra in (overrides or {}).items():
            options[name] = {**options.get(name, {}), **extra}
        return cls(resolve_enabled(switches), options, clock)

    @property
    def names(self) -> list[str]:
        """Enabled collector names, sorted."""
        return list(self._collectors)

    def get(self, name: str) -> Collector | None:
        """The collector called ``name`` when enabled, else None."""
        return self._collectors.get(name)

    def collect(self, names: Collection[str] | None = None) -> dict[str, CollectorResult]:
        """Run every enabled collector (or only those in ``names``) once; never raises.

        Returns dict[name, CollectorResult]; names that are not enabled are left out."""
        with self._lock:
            return {name: self._run(name, collector) for name, collector in self._collectors.items()
                    if names is None or name in names}

    def reading(self, name: str) -> object | None:
        """Run collector ``name`` alone and return its reading; None when it is disabled or
        failed (never raises)."""
        result = self.collect([name]).get(name)
        return result.reading if result is not None else None

    def _run(self, name: str, collector: Collector) -> CollectorResult:
        start = self._clock()
        try:
            reading = collector.collect()
        except Exception as exc:  # the boundary of house rules 7 and 8
            self._log_failure(name, exc)
            return CollectorResult(up=False, duration=self._clock() - start, reading=None)
        if name in self._failing:
            self._failing.discard(name)
            log.info("collector %s recovered", name)
        return CollectorResult(up=True, duration=self._clock() - start, reading=reading)

    def _log_failure(self, name: str, exc: Exception) -> None:
        if name in self._failing:
            return
        self._failing.add(name)
        if isinstance(exc, NoDataError):
            log.info("collector %s has no data on this node (kvscope_collector_up 0): %s", name, exc)
        elif isinstance(exc, CollectorError):
            log.warning("collector %s failed (kvscope_collector_up 0): %s", name, exc)
        else:
            log.warning("collector %s failed (kvscope_collector_up 0)", name, exc_info=exc)

    def shutdown(self) -> None:
        """Shut every collector down; safe twice and without a collect. Never raises."""
        with self._lock:
            for name, collector in self._collectors.items():
                try:
                    collector.shutdown()
                except Exception:  # boundary: one collector's shutdown never stops the others
                    log.warning("collector %s failed to shut down", name, exc_info=True)
