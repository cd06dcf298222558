"""The contract every source keeps: what it may ask of the pipeline, and how it is registered.

A source is one module under ``agent/sources/``: the part that turns what an engine offers into
kvscope events (a socket it binds, an endpoint it scrapes, a route it serves), its config table
(a :class:`~kvscope.agent.sections.Section`) beside it, and one ``register(SourceSpec(...))``
at import time. The agent builds every registered source whose table is enabled, in
registration order (a source reading another at build time registers after it), hands each the
:class:`Consumer` (the pipeline, seen through the methods a source may call), and starts and
stops it with the other parts. Rules between sources are declared on their specs and checked
when the settings are validated (:func:`check_overlaps`), not discovered at run time. Writing a
source: docs/agent.md, "Writing a source".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvscope import events as ev
from kvscope.agent.sections import Section
from kvscope.agent.worker import Worker

# A sequence number (a batch's, an event id) that jumps ahead by more than this is no loss but a
# confused sender (or another one): a source follows it from there, logs it once and counts no
# gap (an engine's buffers and a tap's send queue hold far fewer).
MAX_GAP = 1 << 20

if TYPE_CHECKING:  # the pipeline's types, for annotations only: sources hold a Consumer
    from kvscope.agent.pipeline import Snapshot


class Consumer(Protocol):
    """The pipeline as a source sees it (``agent/pipeline.py`` implements it). Every method is
    safe from any thread. ``source``: the name the events count under (a metric label: a
    short lowercase word, see :func:`kvscope.events.source_name_problem`)."""

    def ingest(self, source: str, events: Sequence[object], scope: str | None = None) -> None:
        """Fold ``events`` (kvscope events) of ``source``; ``scope``: the source whose requests
        their request ids name, when that is another one."""

    def drop(self, source: str, reason: str, events: int = 1) -> None:
        """Count ``events`` of ``source`` lost for ``reason`` (a short fixed word)."""

    def expect_drops(self, source: str, reasons: Iterable[str]) -> None:
        """Export ``source``'s drops for each of ``reasons`` at 0 until one happens."""

    def set_source_up(self, source: str, up: bool) -> None:
        """``kvscope_source_up{source}``: whether the source works now."""

    def set_source_info(self, source: str, engine: str, model: str) -> None:
        """``kvscope_engine_info``: the engine and model ``source`` observes."""

    def set_cache_config(self, source: str, prefix_caching: bool, kv_cache_dtype: str) -> None:
        """``kvscope_engine_cache_config_info``: whether the GPU prefix caching of the engine
        ``source`` observes is on, and its KV cache dtype as the engine names it."""

    def add_received(self, source: str, events: int) -> None:
        """Count ``events`` taken in that reach the pipeline otherwise, or not at all."""

    def forget_tiers(self, source: str) -> None:
        """``source``'s engine stopped: its tiers leave the tier gauges."""

    def abandon_requests(self, source: str) -> int:
        """``source``'s engine stopped, and every emitter that reports its requests closed: its
        requests in flight that started are counted abandoned and closed; how many."""

    def count_tap_errors(self, source: str, reason: str, errors: int) -> None:
        """Count ``errors`` a tap of ``source`` reported for ``reason``."""

    def join(self, source: str, window: float) -> None:
        """Hold ``source``'s finished requests ``window`` seconds for parts sent later."""

    def report(self, source: str, trace_id: str, started: ev.RequestStarted,
               finished: ev.RequestFinished, new_request: bool = True,
               samples: int = 1) -> bool:
        """Join a request another source saw whole (a span) to ``source``'s record of it (or
        to the records of its ``samples`` parallel samples)."""

    def snapshot(self) -> Snapshot:
        """A consistent copy of the aggregated state (to tell another source's share)."""


class SourceWorker(Worker):
    """A source that works on a thread of its own: :class:`~kvscope.agent.worker.Worker`'s
    lifecycle, reporting as ``name`` (a class attribute), and the one boundary every message it
    takes crosses (:meth:`guarded`)."""

    name = ""

    def __init__(self, consumer: Consumer) -> None:
        super().__init__()
        self.pipeline = consumer

    def report_up(self, up: bool) -> None:
        """``kvscope_source_up{source=name}``: whether the source works now."""
        self.pipeline.set_source_up(self.name, up)

    def guarded(self, handle: Callable[[object], None], message: object) -> None:
        """``handle(message)``; an exception there (a bug, or input nobody foresaw) costs that
        message alone: counted as dropped (``malformed``) and logged once per exception type,
        and the source goes on."""
        try:
            handle(message)
        except Exception:  # noqa: BLE001 (counted and logged; the source goes on)
            self.pipeline.drop(self.name, "malformed")
            self.log_bug("handling a message")


class Part(Protocol):
    """What the agent starts and stops: ``start()`` raises when the source cannot start (a port
    or endpoint taken); ``shutdown()`` is safe twice and without ``start()``."""

    def start(self) -> None: ...

    def shutdown(self) -> None: ...


@dataclass
class Built:
    """What a source's ``build`` may read of the others: ``configs``: every source's table by
    name; ``parts``: the sources built before it (an enabled one only)."""

    configs: Mapping[str, Section]
    parts: dict[str, Part]


@dataclass(frozen=True)
class SourceSpec:
    """One source, as the agent builds it.

    ``name``: its config table (``[kv_events]``), the key of ``AgentSettings`` and, for a
    source that reports under one name, that name. ``config``: the table's model (with an
    ``enabled`` field). ``build(config, consumer, built)``: the source; ``built``: every
    source's config and the sources built before it (:class:`Built`). ``describe(config)``:
    what an error that it cannot start names (e.g. its endpoint). ``banner(config, part,
    base_url)``: its line in the agent's start-up banner (``base_url``: the agent's, for a
    route it serves). ``tiers(config)``: the tiers it
    reports itself (residency, transfers into them, evictions from them), when config says;
    ``yields_to``: sources whose tiers it leaves to them (so two never count one tier twice).
    ``engine(config)``: the engine it observes, a short lowercase word (``kvscope_engine_info``'s
    ``engine`` label, with its table's ``model``: how the boards' ``$engine``, ``$model`` and
    ``$instance`` find the agent), for a source no tap names its engine to; "" for one that
    names none (the ingest source takes each tap's from its batches).
    """

    name: str
    config: type[Section]
    build: Callable[[Section, Consumer, Built], Part]
    describe: Callable[[Section], str] = lambda config: ""
    banner: Callable[[Section, Part, str], str] = lambda config, part, base_url: ""
    tiers: Callable[[Section], Iterable[str]] = lambda config: ()
    yields_to: tuple[str, ...] = ()
    engine: Callable[[Section], str] = lambda config: ""


REGISTRY: dict[str, SourceSpec] = {}


def register(spec: SourceSpec) -> SourceSpec:
    """Add ``spec`` to the sources the agent builds. Raises ValueError when its name is taken
    (two modules claiming one table) or when it yields to a source registered after it."""
    if spec.name in REGISTRY and REGISTRY[spec.name] is not spec:
        raise ValueError(f"source {spec.name!r} registered twice")
    later = [name for name in spec.yields_to if name not in REGISTRY]
    if later:
        raise ValueError(f"source {spec.name!r} yields to {later[0]!r}, which must register "
                         "first")
    REGISTRY[spec.name] = spec
    return spec


def yielded_tiers(spec: SourceSpec, configs: Mapping[str, Section]) -> set[str]:
    """The tiers ``spec``'s source leaves to the enabled sources it yields to."""
    return {tier for name in spec.yields_to if configs[name].enabled
            for tier in REGISTRY[name].tiers(configs[name])}


def check_overlaps(configs: Mapping[str, Section]) -> None:
    """Raise ValueError naming two enabled sources that would report one tier and neither
    yields to the other (its transfers and evictions would count twice)."""
    claims: dict[str, str] = {}
    for name, spec in REGISTRY.items():
        config = configs[name]
        if not config.enabled:
            continue
        for tier in set(spec.tiers(config)) - yielded_tiers(spec, configs):
            if tier in claims:
                raise ValueError(f"[{claims[tier]}] and [{name}] both report the {tier} tier, "
                                 "so its transfers and evictions would count twice: leave it "
                                 "to one of them")
            claims[tier] = name


def build_sources(configs: Mapping[str, Section], consumer: Consumer,
                  skip: Iterable[str] = ()) -> dict[str, Part]:
    """Every enabled registered source not in ``skip``, by name, in registration order, each
    with the engine and model it observes told to ``consumer`` (when its spec names one).
    ``configs``: each registered source's table by name."""
    built = Built(configs, {})
    for name, spec in REGISTRY.items():
        if configs[name].enabled and name not in skip:
            built.parts[name] = spec.build(configs[name], consumer, built)
            if engine := spec.engine(configs[name]):
                consumer.set_source_info(name, engine, getattr(configs[name], "model", ""))
    return built.parts
