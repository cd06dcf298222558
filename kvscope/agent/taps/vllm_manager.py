# cython: annotation_typing=False
# (setup.py compiles this module for speed; its annotations stay Python's, not C types)
"""The scheduler side of the vLLM tap: an ``OffloadingManager`` that wraps vLLM's own and reports
what it does as kvscope events, without changing a single decision.

Every method calls the inner manager first and returns exactly what it returned (its exceptions
propagate untouched: they are vLLM's). Observation runs afterwards inside try blocks that
catch everything, count it in :attr:`TapManager.errors` and log once, so the tap never raises
into vLLM; events go to a non-blocking emitter. Per call it does dictionary work only.

What it reports (times are Unix seconds, sizes bytes; see :mod:`kvscope.events`):

- ``RequestStarted`` when vLLM first sees a request (``ts``: vLLM's ``arrival_time``; trace id
  from the request's W3C ``traceparent`` header, when it has one).
- ``Lookup`` when the request is first scheduled, from vLLM's own split of the prompt
  (``Request.prefill_stats``: local prefix-cache tokens -> ``gpu``, tokens loaded through this
  connector -> ``cpu`` (``disk`` for keys a tiering manager says came from disk), the rest ->
  ``recompute``), with the prefix hashes (``Request.block_hashes``) of the prompt's blocks
  sampled at ``block_sample_rate`` (:func:`kvscope.sampling.sample`, SHARDS: every block
  whose hash falls under the threshold, in every request), their positions and sources, for
  ``kvscope analyze`` of a capture. At most
  :data:`~kvscope.sampling.MAX_SAMPLED_PER_LOOKUP` a lookup: the rest are counted in
  :attr:`TapManager.sampled_blocks_dropped`.
- ``Eviction`` of CPU-tier chunks (``prepare_store``'s ``evicted_keys``; with a tiering
  manager also removals in ``take_events``) with each chunk's age, the loads it served and
  its idle time (since its last load, or since it was stored if it served none).
  Every chunk is counted; ages and loads are tracked for the chunks of 1 in ``sample_one_in``
  stores (chosen by the hash of the store's first key), whose evictions carry that ``weight``;
  the others are sent unmeasured, summed over at most ``UNMEASURED_EVERY`` seconds (sent by the
  next eviction or :meth:`TapManager.tick`, so vLLM idling keeps none back; one event per
  scheduler step cost the ``connector`` sequence of bench/tap_overhead.py about 5 us per
  request). Per-chunk bookkeeping in a map as large as the tier was most of the
  tap's cost (bench/tap_overhead.py); a sample keeps the map small. With a tiering manager
  every chunk is tracked (its keys decide what a lower tier holds);
  lower tiers' removals from ``take_events`` (only when vLLM's KV events are enabled: only then
  do vLLM's tier managers record them; vLLM drains ``take_events`` every step). With a tiering
  manager a CPU-tier eviction is ``offloaded`` when a lower tier reported storing that block (a
  stored event of its medium, e.g. vLLM's fs tier with ``enable_kv_events``) or it was promoted
  from one; such evictions are emitted at the step's ``take_events``, after the lower tiers'
  stores of the same step (the tiering manager processes a finished cascade, which unpins the
  chunk, right before it may evict it).
- ``Admission`` of the CPU tier, in blocks: ``stored`` (chunks of store jobs vLLM completed
  with success), ``failed`` (completed without), ``skipped`` (the keys of a ``prepare_store``
  the manager answered None: it could not make room; each once, though vLLM offers them again
  at every step until they fit). Plain int additions per call, sent as
  deltas with the unmeasured evictions (at most once per ``UNMEASURED_EVERY``). Keys vLLM's
  manager declines by its store threshold are not seen here (vLLM counts them in
  ``vllm:kv_offload_stores_skipped``, which the vLLM metrics source maps).
- ``Transfer`` ``disk->cpu`` / ``cpu->disk`` seen only as manager events (untimed); a
  ``disk->cpu`` promotion names the request whose lookup started it (its lookup answered
  ``HIT_PENDING`` for a key the CPU tier did not hold).
- ``TierSnapshot`` of the CPU tier at most once per ``snapshot_interval``: at scheduler steps,
  from :meth:`TapManager.tick` while vLLM is idle, and at shutdown.
- ``RequestFinished`` when vLLM finishes the request: TTFT (first output token seen at a
  scheduler step, so up to one step late), promotion wait (``prepare_load`` to
  ``complete_load``), prefill (first scheduled to first token), queueing (the rest) and the
  mean inter-token latency (first token to finish, over the output tokens after the first);
  ``RequestAborted`` instead when it finishes without an output token (aborted while waiting
  or in prefill: it has no TTFT).

The request object is taken, read-only, from the caller's frame of ``on_new_request`` (vLLM's
``OffloadingConnectorScheduler.on_new_request(request)``): the manager API carries only a
request id. Where that frame has no ``request``, per-request events are skipped and counted in
:attr:`TapManager.unattributed`; cache events still flow. Request ids are vLLM's external ids
(the 8-hex-digit suffix vLLM appends for uniqueness is removed), so they match the OpenAI
response id and vLLM's ``gen_ai.request.id`` span attribute.
"""

from __future__ import annotations

import itertools
import logging
import re
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable

import msgspec
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager

from kvscope import events as ev
from kvscope.agent.taps.forwarding import (bind_forwarded, calling_each, forwards_to_inner,
                                           reading)
from kvscope.errors import describe
from kvscope.vocabulary import LOCAL_TIERS, VLLM_MEDIUM_TIER

try:
    from kvscope import sampling
except ImportError:  # kvscope's compiled modules not built: the tap runs, lookups carry no blocks
    sampling = None

# under vLLM's "vllm" logger, so the tap's lines come out in vLLM's log format and level
log = logging.getLogger("vllm." + __name__)

_HEX = frozenset("0123456789abcdef")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")
DEFAULT_SAMPLE_ONE_IN = 8  # stores whose chunks' ages and loads are tracked: 1 in this many
# share of blocks (by hash) whose prefix hashes lookups carry: kvscope.sampling's default, the
# same where that module is not built (the tap then says it cannot sample and sends none)
DEFAULT_BLOCK_SAMPLE_RATE = sampling.DEFAULT_RATE if sampling is not None else 1 / 16
# Frames up from the tap's method to vLLM's caller: setup.py compiles this module (Cython), and
# a compiled function pushes no frame of its own; the .py, where that is not built, does.
_CALLER_FRAME = 1 if __file__.endswith((".py", ".pyc")) else 0
# seconds: an idle, unchanged CPU tier is reported again this often, so an agent restarted
# while vLLM idles shows the tier within it (a snapshot is one small event)
SNAPSHOT_REFRESH = 10.0
UNMEASURED_EVERY = 0.05  # seconds: untracked evictions are summed this long (the emitter's interval)
# vLLM CacheHitSource value -> kvscope token source (p2p and unspecified count as cpu: they
# arrive through host memory)
HIT_SOURCE = {"device": "gpu", "host": "cpu", "disk": "disk"}


def external_request_id(request_id: str) -> str:
    """vLLM's internal request id without the ``-xxxxxxxx`` suffix (8 lowercase hex digits) it
    adds for uniqueness, cut to :data:`kvscope.events.MAX_REQUEST_ID` characters (a client may
    name its request anything; the agent refuses longer ids)."""
    if len(request_id) > 9 and request_id[-9] == "-" and _HEX.issuperset(request_id[-8:]):
        request_id = request_id[:-9]
    return request_id[:ev.MAX_REQUEST_ID]


def trace_id_of(headers) -> str:
    """The trace id of a W3C ``traceparent`` header in ``headers`` (a mapping), or ""."""
    if not headers:
        return ""
    match = _TRACEPARENT.match(str(headers.get("traceparent", "")).strip().lower())
    return match.group(1) if match and ev.w3c_trace_id(match.group(1)) else ""


class _Req(msgspec.Struct, gc=False):
    """What the tap tracks of one request. A msgspec struct: built in C, and never tracked by
    the garbage collector (it cannot be part of a cycle), so vLLM's collections stay cheap."""

    request: object
    rid: str
    arrival: float
    scheduled: float | None = None
    load_start: float | None = None
    load_wait: float = 0.0
    first_token: float | None = None
    sources: Counter | None = None  # loaded chunks by tier (tiering only)
    declined_from: object = None  # the first key of its last store the manager declined
    declined: int = 0  # keys of that store counted as skipped


class _Observer:
    """The tap's state and its observation of each manager call (see :class:`TapManager`, whose
    arguments it takes): setup.py compiles it to an extension type (vllm_manager.pxd types its
    fields), so vLLM's thread reads and writes the tap's counters, times and maps as C fields,
    not through an instance dictionary. TapManager binds its observed methods onto itself."""

    def __init__(self, inner: OffloadingManager, emit: Callable[[object], None], *,
                 tokens_per_block: int, blocks_per_chunk: int, bytes_per_block: int,
                 capacity_chunks: int, multi_tier: bool = False,
                 sample_one_in: int = DEFAULT_SAMPLE_ONE_IN,
                 block_sample_rate: float = DEFAULT_BLOCK_SAMPLE_RATE,
                 clock: Callable[[], float] = time.time, snapshot_interval: float = 1.0,
                 max_requests: int = 100_000) -> None:
        if sample_one_in < 1:
            raise ValueError(f"sample_one_in must be >= 1, not {sample_one_in}")
        if not 0 <= block_sample_rate <= 1:
            raise ValueError(f"block_sample_rate must be in [0, 1], not {block_sample_rate}")
        self.inner = inner
        self.multi_tier = multi_tier
        if block_sample_rate and sampling is None:
            log.warning("kvscope vLLM tap: kvscope's compiled modules are not built, so lookups "
                        "carry no block hashes (`kvscope analyze` cannot size the CPU tier from "
                        "this server's captures) and the tap runs as plain Python, slower; "
                        "`pip install <kvscope checkout>` into vLLM's environment builds them, "
                        "or `pip install -e .` in the checkout that PYTHONPATH names")
            block_sample_rate = 0.0
        # sampling threshold of block hashes (0: none sampled) and the exact rate it gives
        self._block_t = sampling.threshold(block_sample_rate) if block_sample_rate else 0
        self._block_rate = sampling.rate_of(self._block_t) if self._block_t else 0.0
        self.sampled_blocks_dropped = 0  # sampled blocks beyond a lookup's cap
        self.errors = 0        # observations that failed (each caught, never raised)
        self.unattributed = 0  # requests whose vLLM Request object the tap could not see
        self._emit = emit
        self._tpb = tokens_per_block
        self._bpc = blocks_per_chunk
        self._block_bytes = bytes_per_block
        self._capacity = capacity_chunks
        self._consulted = dict.fromkeys(LOCAL_TIERS if multi_tier else LOCAL_TIERS[:2], 0)
        self._clock = clock
        self._interval = snapshot_interval
        self._max_requests = max_requests
        self._reqs: OrderedDict[str, _Req] = OrderedDict()  # oldest first, dropped in O(1)
        self._awaiting_first: dict[str, _Req] = {}
        # Plain floats and ints only (no per-key containers), so the garbage collector never
        # has to walk these maps: vLLM's scheduler allocates a lot and triggers it often.
        self._one_in = 1 if multi_tier else sample_one_in
        self._resident: dict[bytes, float] = {}        # tracked key -> stored at (Unix seconds)
        self._hits: dict[bytes, int] = {}              # tracked key -> loads served (if > 0)
        self._last_hit: dict[bytes, float] = {}        # the same keys -> last load (Unix s)
        self._chunks = 0  # resident chunks, every one counted
        # untracked chunks evicted since the start, by reason: written by vLLM's thread alone
        # (no lock per eviction); of them, sent (by either thread, under the lock)
        self._unmeasured: dict[str, int] = {}
        self._unmeasured_sent: dict[str, int] = {}
        self._unmeasured_at = 0.0  # when to send them at the latest
        self._unmeasured_lock = threading.Lock()  # tick() sends them from the emitter's thread
        # chunks offered for storing since the start, by outcome (plain ints, vLLM's thread
        # alone writes them), and the totals last sent (under the lock): sent as Admission
        # deltas with the unmeasured evictions, at most once per UNMEASURED_EVERY
        self._stored = self._skipped = self._store_failed = 0
        self._admissions_sent = (0, 0, 0)
        # tiering only: resident keys a lower tier also holds, and CPU evictions held until the
        # step's take_events (key lists with their stored-at times and hits; one step's worth)
        self._below: set[bytes] = set()
        self._held: list[tuple] = []
        # Chunks whose eviction the tap never hears of (tiering without vLLM's KV events) would
        # pile up here: past twice the tier's size only the newest tier's worth is kept.
        self._max_tracked = 2 * capacity_chunks if capacity_chunks > 0 else 1 << 20
        self.unseen_evictions = 0  # chunks forgotten that way
        self._next_snapshot = 0.0
        self._reported = -1  # chunks resident at the last snapshot
        self._refresh_at = 0.0  # when an unchanged tier is reported again (see tick)
        # tiering only: keys a lower tier is promoting -> the request whose lookup started it
        self._promoting: dict[bytes, str] = {}
        # tiering only: keys that were promoting at a reset, until the next take_events; vLLM's
        # reset finishes their promotions, then clears the tier, but still sends them stored
        self._promoted_at_reset: set[bytes] = set()
        # take_events ran since the step before: held (tiering) evictions wait for it
        self._took_events = True

    def _failed(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning("kvscope vLLM tap: %s failed (%s); counting further failures "
                        "silently", where, describe(exc))

    def tiering_lookup(self, key, req_context, **kwargs):
        result = self.inner.lookup(key, req_context, **kwargs)
        try:
            # pending and not being stored by us: a lower tier promotes it for this request
            if result is LookupResult.HIT_PENDING and key not in self._resident:
                self._promoting[key] = req_context.req_id
                if len(self._promoting) > self._max_tracked:
                    del self._promoting[next(iter(self._promoting))]
        except Exception as exc:
            self._failed("lookup", exc)
        return result

    def prepare_load(self, keys: Collection, req_context):
        spec = self.inner.prepare_load(keys, req_context)
        try:
            # vLLM loads resident keys only: tracked ones are resident (1 in sample_one_in);
            # one clock read serves the last-hit times and the request's load start
            now, hits, last = self._clock(), self._hits, self._last_hit
            for key in filter(self._resident.__contains__, keys):
                hits[key] = hits.get(key, 0) + 1
                last[key] = now
            req = self._reqs.get(req_context.req_id)
            if req is not None:
                req.load_start = now
                if self.multi_tier:
                    if req.sources is None:
                        req.sources = Counter()
                    for key in keys:
                        source = getattr(self.inner.get_load_source(key, req_context), "value", "")
                        req.sources[HIT_SOURCE.get(source, "cpu")] += 1
        except Exception as exc:  # the tap boundary: never raise into vLLM
            self._failed("prepare_load", exc)
        return spec

    def complete_load(self, keys, req_context):
        result = self.inner.complete_load(keys, req_context)
        try:
            req = self._reqs.get(req_context.req_id)
            if req is not None and req.load_start is not None:
                req.load_wait += max(0.0, self._clock() - req.load_start)
                req.load_start = None
        except Exception as exc:
            self._failed("complete_load", exc)
        return result

    def prepare_store(self, keys: Collection, req_context):
        output = self.inner.prepare_store(keys, req_context)
        try:
            if output is None:  # the manager could not make room: every key offered skipped
                self._declined(keys, req_context)
            elif output.evicted_keys:
                self._evict(output.evicted_keys, "cpu", "capacity", self._clock())
        except Exception as exc:
            self._failed("prepare_store", exc)
        return output

    def _declined(self, keys, req_context) -> None:
        """Count a store the manager declined as skipped, each key once: vLLM's connector
        offers a request's keys again at every step, from the same first key, until they fit
        (keys of it the tier holds already are counted too: the tap cannot tell them)."""
        n = len(keys)
        req = self._reqs.get(req_context.req_id)
        if req is not None and n:
            first = next(iter(keys))
            if first == req.declined_from:  # offered again: only the keys past the last offer
                n, req.declined = n - req.declined, max(n, req.declined)
            else:
                req.declined_from, req.declined = first, n
        if n > 0:
            self._skipped += n

    def complete_store(self, keys, req_context, success: bool = True):
        result = self.inner.complete_store(keys, req_context, success)
        try:
            if not success:
                self._store_failed += len(keys)
            elif keys:  # vLLM completes a store job with exactly the keys it stored
                n = len(keys)
                self._chunks += n
                self._stored += n
                if self._one_in == 1 or hash(next(iter(keys))) % self._one_in == 0:
                    # a plain loop: measured faster than update(dict.fromkeys(...)), which
                    # builds a temporary dict first (bench/tap_overhead.py)
                    now, resident = self._clock(), self._resident
                    for key in keys:
                        resident[key] = now
                    if len(resident) > self._max_tracked:
                        self._forget_oldest()
        except Exception as exc:
            self._failed("complete_store", exc)
        return result

    def on_new_request(self, req_context):
        result = self.inner.on_new_request(req_context)
        try:
            rid = req_context.req_id
            reqs = self._reqs
            if rid not in reqs:
                request = sys._getframe(_CALLER_FRAME).f_locals.get("request")
                try:
                    prompt = int(request.num_prompt_tokens)
                except AttributeError:  # no request in the caller's frame (None included)
                    self.unattributed += 1
                    return result
                arrival = float(getattr(request, "arrival_time", 0.0) or self._clock())
                req = reqs[rid] = _Req(request, external_request_id(rid), arrival)
                if len(reqs) > self._max_requests:
                    self._awaiting_first.pop(reqs.popitem(last=False)[0], None)
                    self.unattributed += 1
                headers = getattr(request, "trace_headers", None)
                self._emit(ev.RequestStarted(ts=arrival, request_id=req.rid, prompt_tokens=prompt,
                                             trace_id=trace_id_of(headers) if headers else ""))
        except Exception as exc:
            self._failed("on_new_request", exc)
        return result

    def on_request_finished(self, req_context):
        result = self.inner.on_request_finished(req_context)
        try:
            self._finished(req_context.req_id)
        except Exception as exc:
            self._failed("on_request_finished", exc)
        return result

    def take_events(self) -> Iterable:
        events = list(self.inner.take_events())
        try:
            self._took_events = True
            if events or self._held:
                self._manager_events(events)
            if self._promoted_at_reset:
                self._promoted_at_reset = set()
        except Exception as exc:
            self._failed("take_events", exc)
        return events

    def on_schedule_end(self, context):
        result = self.inner.on_schedule_end(context)
        try:
            # Held evictions wait for the step's take_events, which vLLM calls after this
            # (0.33: this is the step's last manager call) or not at all (no KV events): a
            # whole step without one means it does not run, so send them as they are.
            if self._held and not self._took_events:
                self._release(())
            self._took_events = False
            now = self._clock()
            reqs = self._reqs
            for rid in context.new_req_ids:
                req = reqs.get(rid)
                if req is not None and req.scheduled is None:
                    req.scheduled = now
                    self._awaiting_first[rid] = req
                    self._emit(self._lookup_event(req, now))
            awaiting = self._awaiting_first
            if awaiting:
                for rid in [r for r, q in awaiting.items() if q.request.num_output_tokens > 0]:
                    awaiting.pop(rid).first_token = now
            if now >= self._next_snapshot:
                self._snapshot(now)
        except Exception as exc:
            self._failed("on_schedule_end", exc)
        return result

    def reset_cache(self) -> None:
        result = self.inner.reset_cache()
        try:
            now, untracked = self._clock(), self._chunks - len(self._resident)
            self._evict(list(self._resident), "cpu", "cleared", now)
            if self.multi_tier:
                self._promoted_at_reset = set(self._promoting)
            if untracked > 0:
                self._unmeasure("cleared", untracked)
            self._send_unmeasured(now)
            self._chunks = 0
            self._hits.clear()
            self._last_hit.clear()
            self._snapshot(self._clock(), force=True)
        except Exception as exc:
            self._failed("reset_cache", exc)
        return result

    def shutdown(self) -> None:
        result = self.inner.shutdown()
        # The last word: held evictions, the tier as it ends (snapshots are rate-limited), and
        # requests vLLM finished but reports only at a next step (an offline run's last one).
        try:
            if self._held:
                self._release(())
            self._send_unmeasured(self._clock())
            self._snapshot(self._clock(), force=True)
            for rid in [rid for rid, req in self._reqs.items() if req.request.is_finished()]:
                self._finished(rid)
        except Exception as exc:
            self._failed("shutdown", exc)
        return result

    def tick(self) -> None:
        """Report the tier if it changed since the last snapshot (rate-limited as at scheduler
        steps), and an unchanged one every :data:`SNAPSHOT_REFRESH` seconds: called from the
        emitter's thread, so a tier left changed when vLLM goes idle is not shown stale until
        the next request, and an agent restarted meanwhile learns the tier. Never raises."""
        try:
            now = self._clock()
            if now >= self._next_snapshot and (self._chunks != self._reported
                                               or now >= self._refresh_at):
                self._snapshot(now)
            if now >= self._unmeasured_at and (
                    self._unmeasured != self._unmeasured_sent or self._admissions_sent
                    != (self._stored, self._skipped, self._store_failed)):
                self._send_unmeasured(now)
        except Exception as exc:
            self._failed("tick", exc)

    def _lookup_event(self, req: _Req, now: float) -> ev.Lookup:
        request = req.request
        prompt = int(request.num_prompt_tokens)
        stats = getattr(request, "prefill_stats", None)
        if stats is not None and stats.num_prompt_tokens:
            local, external = stats.num_local_cached_tokens, stats.num_external_cached_tokens
        else:  # stats already taken: what the scheduler had computed when it admitted it
            local, external = min(int(request.num_computed_tokens), prompt), 0
        tpb = self._tpb
        # every tier vLLM consulted gets an entry, 0 included: the agent counts a tier's misses
        # only where it knows the tier exists (vLLM's GPU and lower tiers send no snapshots)
        hits = self._consulted.copy()
        sources = req.sources
        total = sum(sources.values()) if external and sources else 0
        if total:  # tiering: split by where the loaded keys came from
            tokens: dict[str, int] = {"gpu": local} if local else {}
            for tier, chunks in sources.items():
                tokens[tier] = tokens.get(tier, 0) + external * chunks // total
            tokens["cpu"] = tokens.get("cpu", 0) + external - sum(
                external * c // total for c in sources.values())
            for tier, n in tokens.items():
                if n:
                    hits[tier] = n // tpb
            tokens = {k: v for k, v in tokens.items() if v}
        else:  # the usual case, in a few dict stores
            tokens = {}
            if local:
                tokens["gpu"] = local
                hits["gpu"] = local // tpb
            if external:
                tokens["cpu"] = external
                hits["cpu"] = external // tpb
        if prompt > local + external:
            tokens["recompute"] = prompt - local - external
        if self._block_t:
            return self._sampled_lookup(request, now, req.rid, tokens, prompt // tpb, hits,
                                        local // tpb, (local + external) // tpb, total)
        return ev.Lookup(ts=now, request_id=req.rid, tokens=tokens, blocks=prompt // tpb,
                         block_hits=hits)

    def _sampled_lookup(self, request, now: float, rid: str, tokens: dict, blocks: int,
                        hits: dict, local: int, cached: int, tiers: int) -> ev.Lookup:
        """The Lookup with the sampled blocks of the prompt (``blocks`` full blocks; the first
        ``local`` served by the GPU, up to ``cached`` loaded; ``tiers``: loaded chunks by tier
        were counted, tiering, so a loaded block's tier is not known). A failure to sample
        is counted in ``errors`` and the Lookup goes without blocks."""
        try:
            keys, depths, dropped = sampling.sample(request.block_hashes, blocks, self._block_t)
        except Exception as exc:  # the tap boundary: the lookup itself still goes
            self._failed("block sampling", exc)
            return ev.Lookup(ts=now, request_id=rid, tokens=tokens, blocks=blocks,
                             block_hits=hits)
        if dropped:
            self._dropped_blocks(dropped)
        sources: tuple = ()
        if not tiers:
            sources = tuple(["gpu" if d < local else "cpu" if d < cached else "recompute"
                             for d in depths])
        return ev.Lookup(ts=now, request_id=rid, tokens=tokens, blocks=blocks, block_hits=hits,
                         block_hashes=tuple(keys), block_sources=sources,
                         block_tokens=self._tpb, block_sample_rate=self._block_rate,
                         block_depths=tuple(depths))

    def _dropped_blocks(self, n: int) -> None:
        if not self.sampled_blocks_dropped:
            log.warning("kvscope vLLM tap: a prompt had more than %d sampled blocks; the rest "
                        "are left out of its lookup (counted in sampled_blocks_dropped; lower "
                        "kvscope_block_sample_rate)", sampling.MAX_SAMPLED_PER_LOOKUP)
        self.sampled_blocks_dropped += n

    def _forget_oldest(self) -> None:
        """Keep the newest half of ``_max_tracked`` chunks (their ages and hits); count the rest
        in ``unseen_evictions``. Rare: each call makes room for a tier's worth of stores."""
        items = list(self._resident.items())
        keep = max(1, self._max_tracked // 2)
        if self.unseen_evictions == 0:
            log.warning("kvscope vLLM tap: tracking %d CPU chunks in a tier of %d: evictions "
                        "are not reaching the tap (with TieringOffloadingSpec, enable vLLM's KV "
                        "events); forgetting the oldest", len(items), self._capacity)
        self.unseen_evictions += len(items) - keep
        self._chunks -= len(items) - keep
        resident = self._resident = dict(items[-keep:])
        self._hits = {k: n for k, n in self._hits.items() if k in resident}
        self._last_hit = {k: t for k, t in self._last_hit.items() if k in resident}
        self._below.intersection_update(resident)

    def _finished(self, rid: str) -> None:
        req = self._reqs.pop(rid, None)
        if req is None:
            return
        now = self._clock()
        first = req.first_token
        if first is None:  # still awaiting its first token
            self._awaiting_first.pop(rid, None)
            if not req.request.num_output_tokens:  # none will come: no TTFT to make up
                self._emit(ev.RequestAborted(ts=now, request_id=req.rid))
                return
            first = now  # it came in this step
        # conditionals rather than max() and min(): no builtin calls on the hot path
        ttft = first - req.arrival
        if not ttft > 0.0:
            ttft = 0.0
        wait = req.load_wait
        if wait > ttft:
            wait = ttft
        prefill = 0.0 if req.scheduled is None else first - req.scheduled
        if prefill > ttft - wait:
            prefill = ttft - wait
        if not prefill > 0.0:
            prefill = 0.0
        queueing = ttft - wait - prefill
        request = req.request
        output = int(request.num_output_tokens)
        itl = (now - first) / (output - 1) if req.first_token is not None and output > 1 else 0.0
        self._emit(ev.RequestFinished(
            ts=now, request_id=req.rid, ttft=ttft, prompt_tokens=int(request.num_prompt_tokens),
            output_tokens=output, queueing=queueing if queueing > 0.0 else 0.0,
            promotion_wait=wait, prefill=prefill, itl=itl if itl > 0.0 else 0.0))

    def _evict(self, keys, tier: str, reason: str, now: float) -> None:
        """Forget ``keys`` and report them evicted (tiering: at the step's take_events)."""
        n = len(keys)
        if not n:
            return
        resident, hits, last = self._resident, self._hits, self._last_hit
        if self.multi_tier:  # every key tracked: one never seen stored counts as age 0
            before = len(resident)
            stored = list(map(resident.pop, keys, itertools.repeat(now, n)))
            # the keys it held alone were counted resident: not a promotion it never saw
            # (without KV events) nor one forgotten already (_forget_oldest)
            self._chunks -= before - len(resident)
            counts = lasts = ()
            if hits:
                counts = list(map(hits.pop, keys, itertools.repeat(0, n)))
                lasts = list(map(last.pop, keys, itertools.repeat(now, n)))
            self._held.append((keys, stored, counts, lasts, tier, reason, now))
            return
        self._chunks -= n
        # the tracked ones (a sample), found in C without touching the others
        tracked = resident.keys() & keys
        m = len(tracked)
        if m < n:
            self._unmeasure(reason, n - m)
            if now >= self._unmeasured_at:
                self._send_unmeasured(now)
        if m:
            stored = list(map(resident.pop, tracked))
            counts = lasts = ()
            if hits:
                counts = list(map(hits.pop, tracked, itertools.repeat(0, m)))
                lasts = list(map(last.pop, tracked, itertools.repeat(now, m)))
            self._evictions(tier, reason, now, stored, counts, lasts, False, self._one_in)

    def _release(self, stored_below) -> None:
        """Emit the held (tiering) evictions: ``offloaded`` for keys a lower tier holds
        (``_below``) or reported storing in this step (``stored_below``)."""
        held, self._held = self._held, []
        below = self._below
        for keys, stored, hits, lasts, tier, reason, now in held:
            flags = [key in below or key in stored_below for key in keys]
            below.difference_update(keys)
            if all(flags) or not any(flags):
                self._evictions(tier, reason, now, stored, hits, lasts, flags[0])
                continue
            for offloaded in (True, False):
                pick = [flag is offloaded for flag in flags]
                self._evictions(tier, reason, now, list(itertools.compress(stored, pick)),
                                list(itertools.compress(hits, pick)) if hits else (),
                                list(itertools.compress(lasts, pick)) if hits else (),
                                offloaded)

    def _unmeasure(self, reason: str, chunks: int) -> None:
        """Count untracked chunks evicted (vLLM's thread only, so no lock)."""
        unmeasured = self._unmeasured
        unmeasured[reason] = unmeasured.get(reason, 0) + chunks

    def _send_unmeasured(self, now: float) -> None:
        """One unmeasured CPU Eviction per reason for the untracked chunks evicted since the
        last one, and one CPU Admission of the chunks offered for storing since then, in
        blocks, when any were (from vLLM's thread or the emitter's)."""
        with self._unmeasured_lock:
            total, sent = self._unmeasured.copy(), self._unmeasured_sent
            self._unmeasured_sent = total
            self._unmeasured_at = now + UNMEASURED_EVERY
            before = self._admissions_sent
            offered = self._admissions_sent = (self._stored, self._skipped, self._store_failed)
        for reason, chunks in total.items():
            chunks -= sent.get(reason, 0)
            if chunks > 0:
                # not offloaded, not measured, weight 1, no idle time (positional: a C call)
                self._eviction(now, "cpu", reason, 0, chunks, 0.0, False, False, 1, None)
        if offered != before:
            bpc = self._bpc
            stored, skipped, failed = (max(0, (a - b) * bpc) for a, b in zip(offered, before))
            self._emit(ev.Admission(ts=now, tier="cpu", stored=stored, skipped=skipped,
                                    failed=failed))

    def _evictions(self, tier: str, reason: str, now: float, stored: list, hits, lasts,
                   offloaded: bool, weight: int = 1) -> None:
        """One Eviction per distinct hit count (the event carries one ``hits`` for its blocks),
        with the chunks' mean age and mean idle time. ``stored``, ``hits``, ``lasts``: per
        chunk, when stored, loads served and the last load's time (``hits``, ``lasts``: () when
        none was loaded)."""
        n = len(stored)
        if not n:
            return
        if not any(hits):  # never loaded: idle since stored; max(): rounding must not go < 0
            age = max(0.0, now - sum(stored) / n)
            self._eviction(now, tier, reason, 0, n, age, offloaded, True, weight, age)
            return
        # Most evicted chunks were never loaded: only the loaded ones are grouped in Python.
        hit_counts = list(itertools.compress(hits, hits))
        hit_stored = list(itertools.compress(stored, hits))
        hit_lasts = list(itertools.compress(lasts, hits))
        unloaded = sum(stored) - sum(hit_stored)
        # count: [chunks, sum of stored-at, sum of last-used-at]
        groups = {0: [n - len(hit_counts), unloaded, unloaded]}
        for count, at, used in zip(hit_counts, hit_stored, hit_lasts):
            group = groups.get(count)
            if group is None:
                groups[count] = [1, at, used]
            else:
                group[0] += 1
                group[1] += at
                group[2] += used
        for count, (chunks, total, used) in groups.items():
            if chunks:
                self._eviction(now, tier, reason, count, chunks, max(0.0, now - total / chunks),
                               offloaded, True, weight, max(0.0, now - used / chunks))

    def _eviction(self, now: float, tier: str, reason: str, hits: int, chunks: int,
                  age: float, offloaded: bool, measured: bool, weight: int,
                  idle: float | None) -> None:
        blocks = chunks * self._bpc
        self._emit(ev.Eviction(ts=now, tier=tier, blocks=blocks, bytes=blocks * self._block_bytes,
                               age=age, hits=hits, offloaded=offloaded, reason=reason,
                               measured=measured, weight=weight, idle=idle))

    def _manager_events(self, events) -> None:
        now = self._clock()
        stored_below: set = set()
        if self.multi_tier:  # first what the lower tiers stored: it decides ``offloaded``
            for event in events:
                tier = VLLM_MEDIUM_TIER.get(getattr(event.medium, "value", str(event.medium)))
                if tier not in (None, "gpu", "cpu") and not event.removed:
                    stored_below.update(event.keys)
            self._below.update(stored_below.intersection(self._resident))
        for event in events:
            if getattr(event, "metadata_only", False):
                continue  # vLLM 0.33: a failed store's chunks freed, never stored or evicted
            medium = getattr(event.medium, "value", str(event.medium))
            tier = VLLM_MEDIUM_TIER.get(medium)
            # A plain CPU manager's own events repeat what prepare_store / complete_store
            # already told the tap (and, read a step late, would look like new stores).
            if tier is None or tier == "gpu" or (tier == "cpu" and not self.multi_tier):
                continue
            keys = list(event.keys)
            if tier == "cpu":
                if event.removed:  # removals prepare_store did not announce (tiering)
                    gone = [k for k in keys if k in self._resident]
                    if gone:
                        self._evict(gone, "cpu", "capacity", now)
                else:  # stored without our store: a promotion from a lower tier
                    new = [k for k in keys if k not in self._resident]
                    for key in new:
                        self._resident[key] = now
                        self._below.add(key)  # the lower tier keeps its copy
                    self._chunks += len(new)
                    # one transfer per request whose lookup started the promotion ("" unknown)
                    by_request = Counter(map(self._promoting.pop, new, itertools.repeat("")))
                    for rid, chunks in by_request.items():
                        self._untimed("disk", "cpu", chunks, now,
                                      external_request_id(rid) if rid else "")
                    # finished by a reset, which then cleared them: copied in, and gone
                    reset = self._promoted_at_reset
                    cleared = [k for k in new if k in reset] if reset else ()
                    if cleared:
                        self._evict(cleared, "cpu", "cleared", now)
            elif event.removed:
                blocks = len(keys) * self._bpc
                self._emit(ev.Eviction(ts=now, tier=tier, blocks=blocks,
                                       bytes=blocks * self._block_bytes, age=0.0, hits=0,
                                       measured=False))
            else:
                self._untimed("cpu", tier, len(keys), now)
        if self._held:
            self._release(stored_below)

    def _untimed(self, src: str, dst: str, chunks: int, now: float,
                 request_id: str = "") -> None:
        blocks = chunks * self._bpc
        # a tier's manager events carry no failed copy (0.33 marks a failed store's
        # metadata_only, skipped): its failures are not seen here
        self._emit(ev.Transfer(ts=now, src=src, dst=dst, blocks=blocks,
                               bytes=blocks * self._block_bytes, duration=0.0,
                               request_id=request_id, timed=False, sees_failures=False))

    def _snapshot(self, now: float, force: bool = False) -> None:
        if not force and now < self._next_snapshot:
            return
        self._next_snapshot = now + self._interval
        self._refresh_at = now + SNAPSHOT_REFRESH
        blocks = self._capacity * self._bpc
        chunks = self._reported = self._chunks  # > capacity only if evictions go unseen
        resident = (min(chunks, self._capacity) if self._capacity > 0 else chunks) * self._bpc
        self._emit(ev.TierSnapshot(ts=now, tier="cpu", capacity_bytes=blocks * self._block_bytes,
                                   resident_bytes=resident * self._block_bytes,
                                   capacity_blocks=blocks, resident_blocks=resident))


# the manager calls the tap observes: each is _Observer's method of the same name
OBSERVED = ("on_new_request", "prepare_load", "complete_load", "prepare_store", "complete_store",
            "on_schedule_end", "take_events", "on_request_finished", "reset_cache", "shutdown")


@forwards_to_inner(OffloadingManager)
@calling_each("_observer", OBSERVED)  # through the class; vLLM calls the instance's (__init__)
class TapManager(OffloadingManager):
    """Wraps ``inner`` (vLLM's manager) and ``emit``s kvscope events. Every member of vLLM's
    ``OffloadingManager`` the tap does not observe (``lookup``, ``touch``, ``lock``,
    ``config_info``, ``on_reset_flushed``, ... and what later releases add) is the inner
    manager's (:mod:`kvscope.agent.taps.forwarding`). A specific manager's other members (a
    tiering manager's ``poll_tiers``) are reached through ``inner``: vLLM calls managers through
    ``OffloadingManager``'s members only, and a ``__getattr__`` for the rest would make every
    attribute read of the tap slower (CPython consults it on each: 1.5 to 2.5 us a request in
    bench/tap_overhead.py's ``connector`` sequence).

    ``tokens_per_block``: vLLM block size in tokens. ``blocks_per_chunk``: GPU blocks per
    offloaded chunk. ``bytes_per_block``: KV bytes of one GPU block across workers.
    ``capacity_chunks``: chunks the CPU tier holds. ``multi_tier``: ask the inner manager where
    each loaded key comes from (tiering; every chunk is then tracked). ``sample_one_in``: track
    the age and loads of the chunks of 1 in this many stores (1: all; see the module
    docstring). ``clock``: Unix seconds. ``max_requests``: requests tracked at once (oldest
    dropped beyond it, counted in ``unattributed``). ``block_sample_rate``: the share of
    blocks (0-1, by hash) whose prefix hashes each Lookup carries (0: none). Raises ValueError
    for ``sample_one_in`` < 1 or a ``block_sample_rate`` outside [0, 1].
    """

    def __init__(self, inner: OffloadingManager, emit: Callable[[object], None],
                 **options) -> None:
        self.inner = inner
        self._observer = observer = _Observer(inner, emit, **options)
        # vLLM's calls go straight to the observer's methods (compiled: no Python frame, so
        # on_new_request's caller is vLLM's; through the class, as a subclass's super() call
        # would, a frame comes between and the request is not found: unattributed), and pure
        # pass-throughs to the inner manager's bound methods: no extra frame on the hottest
        # call (lookup runs once per block of every prompt); with tiering a lookup may start a
        # promotion, attributed to the request.
        bind_forwarded(self)
        cls = type(self)
        for name in OBSERVED:
            if getattr(cls, name) is getattr(TapManager, name):  # a subclass's own stays
                setattr(self, name, getattr(observer, name))
        if observer.multi_tier:
            self.lookup = observer.tiering_lookup

    def tick(self) -> None:
        """See :meth:`_Observer.tick`."""
        self._observer.tick()

    errors = reading("_observer", "errors",
                     "Observations that failed (each caught, never raised).")
    unattributed = reading("_observer", "unattributed",
                           "Requests whose vLLM Request object the tap could not see.")
    unseen_evictions = reading("_observer", "unseen_evictions",
                               "Tracked chunks forgotten, their eviction never seen.")
    sampled_blocks_dropped = reading("_observer", "sampled_blocks_dropped",
                                     "Sampled blocks beyond a lookup's cap.")

