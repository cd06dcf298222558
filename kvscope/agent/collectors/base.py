"""What every node collector shares: the registry, the result type and the typed errors.

Modelled on node_exporter's ``collector/collector.go``: each collector module calls
``register(name, default_enabled)`` at import time, and the set of enabled collectors is chosen
by name in config (``--[no-]collector.<name>`` there, ``enabled``/``disabled`` names here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class CollectorError(Exception):
    """A collector could not read its source this time (logged once, ``collector_up`` 0)."""


class EngineNotRunning(CollectorError):
    """The configured ``engine_pid`` is not a running process (in this agent's PID
    namespace); ``why`` adds how it was found so."""

    def __init__(self, pid: int, why: str = "") -> None:
        super().__init__(f"engine process {pid} (engine_pid) is not running"
                         + (f" ({why})" if why else ""))


class NoDataError(CollectorError):
    """The source does not exist on this node (e.g. no NVIDIA driver): ``collector_up`` 0 and one
    info-level log line, not a warning (node_exporter's ``ErrNoData``)."""


class UnknownCollectorError(ValueError):
    """Config named a collector that is not registered."""


class Collector(Protocol):
    """One node collector. ``collect()`` reads its source once and returns a typed reading or
    raises (typed errors preferred); ``shutdown()`` releases what it holds, safe twice."""

    name: str

    def collect(self) -> object: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class CollectorResult:
    """One collector's last run. ``up``: it returned a reading. ``duration``: seconds the run
    took. ``reading``: the collector's typed reading (``HostReading``, ``GpuReading``), or None
    when it failed."""

    up: bool
    duration: float
    reading: object | None


@dataclass(frozen=True)
class Registration:
    """``factory(**options)`` builds the collector; ``default_enabled``: on unless config says
    otherwise."""

    name: str
    factory: Callable[..., Collector]
    default_enabled: bool


REGISTRY: dict[str, Registration] = {}


def register(name: str, default_enabled: bool = True) -> Callable:
    """Class decorator: register a collector factory under ``name``.

    Raises ValueError when ``name`` is already registered (two modules claiming one name)."""

    def decorate(factory):
        if name in REGISTRY and REGISTRY[name].factory is not factory:
            raise ValueError(f"collector {name!r} registered twice")
        REGISTRY[name] = Registration(name, factory, default_enabled)
        return factory

    return decorate
