"""The kvscope event schema: the one language engines, taps, the agent and analysis speak.

Every event is a msgspec ``Struct`` tagged by its ``kind`` so a heterogeneous list decodes
without guessing. Events travel in a :class:`Batch` that carries the schema version; a
decoder refuses any other version (:class:`SchemaError`) rather than misread fields.

Units: timestamps are Unix seconds (float, wall clock), durations are seconds, sizes are bytes.
Tiers are ``gpu``, ``cpu``, ``disk``, ``remote``; a prompt token's source is ``gpu``, ``cpu``,
``disk`` or ``recompute`` (README.md, What it does; docs/agent.md, Events).
"""

from __future__ import annotations

import re
import sys
from typing import Annotated, Generic, Literal, TypeVar, Union

import msgspec

# the vocabulary the schema's fields use, re-exported for the modules that read events
from kvscope.vocabulary import (TIERS, TOKEN_SOURCES, EvictionReason, Tier,  # noqa: F401
                                TokenSource)

SCHEMA_VERSION = 1
# What a batch's ``source`` (and ``scope``) may be: it becomes a metric label value.
MAX_SOURCE_NAME = 32  # characters
SOURCE_NAME = re.compile(rf"[a-z][a-z0-9_-]{{0,{MAX_SOURCE_NAME - 1}}}")
# The agent's own sources (its ingest socket, OTLP receiver, KV events, vLLM metrics,
# TensorRT-LLM and SGLang metrics sources) count under these names: a tap named so would merge
# its series with theirs.
RESERVED_SOURCES = frozenset({"ingest", "otlp", "kv_events", "vllm_metrics", "trtllm",
                              "sglang_metrics"})


def w3c_trace_id(trace_id: str) -> bool:
    """Whether ``trace_id`` is a valid W3C trace id: 32 lowercase hex characters, not all 0
    (W3C Trace Context, section 3.2.2.3; OTLP calls the same invalid)."""
    return _HEX32(trace_id) is not None and trace_id != _ZERO_TRACE


_HEX32 = re.compile("[0-9a-f]{32}").fullmatch
_ZERO_TRACE = "0" * 32


def source_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a tap's source (a phrase to follow the name), or None."""
    if not SOURCE_NAME.fullmatch(name):
        return (f"is not a lowercase word of up to {MAX_SOURCE_NAME} characters "
                f"({SOURCE_NAME.pattern})")
    if name in RESERVED_SOURCES:
        return f"is the agent's own (so are {', '.join(sorted(RESERVED_SOURCES - {name}))})"
    return None



# Counts and sizes are never negative, and times and rates are finite and never negative: one
# such value would turn a counter down (PromQL's rate() reads that as a reset) or a histogram's
# sum into NaN. An event breaking this is invalid, and the agent drops it (see salvage_batch).
# Counts stop at 2**53, where float64 (every Prometheus sample) stops holding integers exactly,
# far inside the 64-bit integers the store and the Parquet capture write. Durations stop at 1e9 s
# (31 years): a Unix time before 2100 plus one is still an int64 of nanoseconds (OTLP's times).
MAX_COUNT = 2**53
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
MAX_SECONDS = 1e9
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
# A timestamp is Unix seconds before 2100: a sender in milliseconds (1.7e12) or a corrupt time
# would otherwise sort first in the request table forever and outlive the store's age limit.
Timestamp = Annotated[float, msgspec.Meta(ge=0.0, le=4_102_444_800.0)]  # 2100-01-01T00:00Z
Rate = Annotated[float, msgspec.Meta(ge=0.0, le=sys.float_info.max)]  # per second
Ratio = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]  # a share: 1 is all
# finite bucket bounds a histogram event may have (vLLM's TTFT histogram has 20, an engine's
# custom ones more): their counts, each up to 2**53, then add up within a 64-bit counter
MAX_BUCKETS = 1000
# the least share of block hashes a lookup may say it sampled: kvscope.sampling's (one step of
# its 2**32); a rate of 5e-324 made each sampled block count as 2e323, +Inf for good
MIN_BLOCK_SAMPLE_RATE = 2.0**-32
# Request ids are kept per request (100,000 by default) and trace ids are W3C's 32 hex digits:
# both bounded, so a sender cannot grow the agent's memory through them.
MAX_REQUEST_ID = 256  # characters; senders cut longer ids to this (the same cut on every side)
RequestId = Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID)]
TraceId = Annotated[str, msgspec.Meta(max_length=32)]
# The agent follows each emitter by its session (a few per source): the emitter's is 16 hex.
Session = Annotated[str, msgspec.Meta(max_length=64)]



class SchemaError(ValueError):
    """A payload is not a valid kvscope batch.

    ``reason``: ``malformed`` (not msgpack, or truncated), ``invalid`` (a field of the wrong
    type or value, e.g. an unknown tier or event kind, a negative count, a NaN or infinite
    time, or an event that cannot be true: :func:`event_problem`) or ``version`` (another
    schema version).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Event(msgspec.Struct, frozen=True, tag_field="kind", kw_only=True, gc=False):
    ts: Timestamp  # Unix seconds when the event happened (a transfer: when it started)


class RequestStarted(_Event, tag="request_started"):
    """A request arrived at the engine.

    ``prompt_tokens``: tokens in the prompt. ``trace_id``: W3C trace id (32 lowercase hex
    chars) or ""; the agent takes any other as "" and makes one.
    """

    request_id: RequestId
    prompt_tokens: Count
    trace_id: TraceId = ""


class Lookup(_Event, tag="lookup"):
    """Where each prompt token of a request came from.

    ``tokens``: dict[source, tokens]; the values sum to the prompt length. A source absent
    from the dict had zero tokens; one the engine measures may be named with 0, and one the
    engine cannot measure must be absent (the agent exports a source from the first lookup that
    names it, here, in ``block_hits`` or as a tier its engine reports). ``blocks``: blocks
    looked up; ``block_hits``: dict[tier, blocks found resident there] (each block counted in
    the first tier, top down, that held it).
    ``prefill_tokens_per_second``: the engine's prefill rate for the saved-seconds estimate
    (0, or anything under 1 token/s: unknown, the agent's configured rate is used).

    Optional per-block detail, for captures and offline analysis (empty when the engine does not
    record it): ``block_hashes``: the prefix hash of each block looked up, first to last
    (unsigned 64-bit), at most ``blocks`` of them; ``block_sources``: the source that served each
    of those blocks, one per hash (prefix semantics: after the first ``recompute`` block every
    later one is ``recompute``). ``block_tokens``: tokens per full block (0: unknown).

    A spatially sampled lookup (the vLLM tap: SHARDS, see :mod:`kvscope.sampling`) carries only
    its sampled blocks: ``block_sample_rate`` (0-1, a share of the block-hash space) is the rate
    its blocks were kept at (1: every block), and ``block_depths`` the position in the prompt
    (0 = first) of each of ``block_hashes`` (empty: they are the prompt's blocks, first to
    last). ``block_sources`` may then be empty (the engine cannot say which tier served each).
    A sampled lookup with no block sampled carries a rate below 1 and no hashes: its
    ``blocks`` still count in the full stream's accesses.
    """

    request_id: RequestId
    tokens: dict[TokenSource, Count]
    blocks: Count = 0
    block_hits: dict[Tier, Count] = {}
    prefill_tokens_per_second: Rate = 0.0
    block_hashes: tuple[int, ...] = ()
    block_sources: tuple[TokenSource, ...] = ()
    block_tokens: Count = 0
    block_sample_rate: Ratio = 1.0
    block_depths: tuple[Count, ...] = ()


def block_token_counts(prompt_tokens: int, blocks: int, block_tokens: int) -> list[int]:
    """Tokens in each of ``blocks`` blocks of ``block_tokens`` (a lookup's blocks, first to
    last): full blocks, then the remainder of ``prompt_tokens`` in the last one.

    A trace may list fewer blocks than the prompt needs; tokens beyond the listed blocks are
    not counted here (the engine treats them as recomputed).
    """
    counts = []
    for i in range(blocks):
        counts.append(max(0, min(block_tokens, prompt_tokens - i * block_tokens)))
    return counts


class Transfer(_Event, tag="transfer"):
    """One timed copy of ``blocks`` KV blocks (``bytes`` in all) from ``src`` to ``dst`` tier.

    ``duration``: seconds the copy took. ``ok``: False when it failed (then ``reason`` says why).
    ``request_id``: the request it served, "" for background work. ``timed``: False when the
    source saw the copy but not its duration (e.g. vLLM KV events): count bytes and blocks, but
    ``duration`` is not a measurement and stays out of transfer-time histograms. ``bytes`` 0
    with ``blocks`` above 0: the source does not know a block's size (e.g. ``block_bytes`` not
    configured); the blocks count, the bytes are not measured (no bytes series, not 0).
    ``sees_failures``: False when the source would not see this copy fail (it counts what moved:
    KV events, scraped byte counters); the direction's failures are then not measured by it
    (no failure series started at 0 for it).
    """

    src: Tier
    dst: Tier
    blocks: Count
    bytes: Count
    duration: Seconds
    ok: bool = True
    reason: str = ""
    request_id: RequestId = ""
    timed: bool = True
    sees_failures: bool = True


class Eviction(_Event, tag="eviction"):
    """``blocks`` blocks (``bytes`` in all) left ``tier``.

    ``age``: seconds each spent resident; ``hits``: hits each got while resident (0 means it was
    stored for nothing). ``offloaded``: True when the blocks were copied to the next tier down,
    False when they were dropped. ``reason``: ``capacity`` (made room), ``cleared`` (the engine
    reset its cache) or ``failed`` (the copy could not be read back). ``measured``: False when
    the source cannot see ``age`` and ``hits`` (e.g. vLLM KV events carry neither): count the
    blocks, but keep ``age`` and ``hits`` out of the residency and hits histograms.
    ``weight``: evicted blocks each of these stands for in those histograms, for a source that
    tracks the age and hits of a sample of 1 in ``weight`` blocks (its unsampled blocks come
    unmeasured); ``blocks`` itself counts as is. ``idle``: seconds each had gone unused when
    evicted, since its last hit (since it was stored when ``hits`` is 0), the signal for sizing
    a tier; None when the source does not see it (kept out of the idle histogram, never 0).
    A source that groups blocks into one event sends their mean ``age`` and mean ``idle``.
    """

    tier: Tier
    blocks: Count
    bytes: Count
    age: Seconds
    hits: Count
    offloaded: bool = False
    reason: EvictionReason = "capacity"
    measured: bool = True
    weight: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 1  # 1 in a million at most
    idle: Seconds | None = None


class TierSnapshot(_Event, tag="tier_snapshot"):
    """What a tier holds now: capacity and resident bytes and blocks. A capacity of 0 is one
    the sender does not know; a resident count of None one it does not report (a source that
    tells the tier's capacity alone, or its blocks without their size): never read as 0,
    which would say "empty"."""

    tier: Tier
    capacity_bytes: Count
    resident_bytes: Count | None
    capacity_blocks: Count
    resident_blocks: Count | None


def bytes_of(blocks: int | None, block_bytes: int) -> int | None:
    """``blocks`` of ``block_bytes`` each, in bytes; None where the blocks are not reported
    (None) or their size is not known (0: a source's ``block_bytes`` unset), for a
    :class:`TierSnapshot`'s residency."""
    return blocks * block_bytes if blocks is not None and block_bytes else None


class RequestFinished(_Event, tag="request_finished"):
    """A request produced its first token (``ttft``, seconds after arrival) and finished.

    The parts of TTFT, in seconds and in this order: ``queueing`` before the engine took the
    request, ``lookup`` of cached blocks, ``promotion_wait`` for promotions, ``prefill`` of the
    recomputed tokens. ``lookup`` and ``promotion_wait`` are None where the source does not
    measure them (vLLM's spans report neither, vLLM's tap does not time the lookup): never read
    as 0, which would say "no wait". ``output_tokens``: tokens generated. ``itl``: mean
    inter-token latency, seconds between consecutive output tokens after the first (0: unknown
    or one token).
    """

    request_id: RequestId
    ttft: Seconds
    prompt_tokens: Count
    output_tokens: Count = 0
    queueing: Seconds = 0.0
    lookup: Seconds | None = None
    promotion_wait: Seconds | None = None
    prefill: Seconds = 0.0
    itl: Seconds = 0.0


class RequestAborted(_Event, tag="request_aborted"):
    """A request ended without producing its first token (vLLM: aborted by its client, or
    refused, while waiting or in prefill). It has no TTFT, so it is no finished request: its
    record is closed and counted nowhere (vLLM's TTFT histogram and its spans leave such
    requests out too)."""

    request_id: RequestId


class LatencyHistogram(_Event, tag="latency_histogram"):
    """Latency observations an engine aggregated itself, without request ids (e.g. vLLM's
    ``vllm:time_to_first_token_seconds`` between two scrapes).

    ``metric``: which latency (``ttft``). ``bounds``: the engine's finite bucket upper bounds,
    seconds, ascending. ``counts``: observations per bucket since the previous event (not
    cumulative), ``len(bounds) + 1`` entries, the last one above every bound. ``sum``: seconds,
    the sum of those observations.
    """

    metric: Literal["ttft"]
    bounds: list[Seconds]
    counts: list[Count]
    sum: Seconds = 0.0

    def __post_init__(self) -> None:
        _check_buckets(self.bounds, self.counts)


def _check_buckets(bounds: list[float], counts: list[int]) -> None:
    """ValueError unless ``counts`` has one entry per bucket of ascending ``bounds`` and one
    above them, at most :data:`MAX_BUCKETS` (msgspec turns it into a ValidationError when
    decoding: the event is invalid)."""
    if len(bounds) > MAX_BUCKETS:
        raise ValueError(f"a histogram has {len(bounds)} bounds, more than {MAX_BUCKETS}")
    if len(counts) != len(bounds) + 1:
        raise ValueError(f"a histogram has {len(bounds)} bounds, so "
                         f"{len(bounds) + 1} counts, not {len(counts)}")
    if any(low >= high for low, high in zip(bounds, bounds[1:])):
        raise ValueError("a histogram's bounds must ascend")


class IdleHistogram(_Event, tag="idle_histogram"):
    """Idle seconds before eviction that an engine aggregated itself over a sample of its
    blocks (vLLM's ``vllm:kv_block_idle_before_evict_seconds`` between two scrapes): each
    observation is one evicted block's time since its last hit, or since it was stored.

    ``tier``: the tier the blocks left. ``bounds``: the engine's finite bucket upper bounds,
    seconds, ascending. ``counts``: observations per bucket since the previous event (not
    cumulative), ``len(bounds) + 1`` entries, the last one above every bound. ``sum``: seconds,
    the sum of those observations.
    """

    tier: Tier
    bounds: list[Seconds]
    counts: list[Count]
    sum: Seconds = 0.0

    def __post_init__(self) -> None:
        _check_buckets(self.bounds, self.counts)


class Admission(_Event, tag="admission"):
    """Blocks offered to ``tier`` for storing since the sender's previous ``Admission`` of that
    tier (deltas, never cumulative), by outcome; blocks, not chunks or calls.

    ``stored``: written into the tier. ``skipped``: declined without a write, by the admission
    policy (a store threshold, a minimum priority) or because the tier could not make room.
    ``failed``: admitted, but the write failed. None: the sender does not see that outcome
    (its series stays absent, never a 0); 0: it saw none.
    """

    tier: Tier
    stored: Count | None = None
    skipped: Count | None = None
    failed: Count | None = None


class SchedulerStats(_Event, tag="scheduler_stats"):
    """What an engine's scheduler holds now, and what it preempted since its last report: the
    signal that says whether GPU memory is the limiter (a queue that grows, preemptions, a GPU
    KV cache near full) or not.

    ``waiting``: requests arrived and not yet scheduled; ``running``: requests in the engine's
    batches (prefilling or decoding); ``preemptions``: requests the scheduler preempted (their
    GPU KV blocks freed, to be recomputed or reloaded when resumed) since this sender's previous
    report: a delta, which the agent adds up into a counter; ``gpu_kv_usage``: the share of the
    GPU KV cache held by running requests, 0 to 1 (vLLM's ``kv_cache_usage_perc``, a share
    despite its name; blocks cached for reuse and held by no request do not count: a warm
    cache is always full, and its fill is a ``TierSnapshot``'s).

    Each is None when the sender does not know it (an engine that never preempts has no
    preemptions to report, not 0): its metric stays absent until a report carries it, and a
    report without it leaves the last value as it was.
    """

    waiting: Count | None = None
    running: Count | None = None
    preemptions: Count | None = None
    gpu_kv_usage: Ratio | None = None


class TransfersInFlight(_Event, tag="transfers_in_flight"):
    """The copies from ``src`` to ``dst`` the sender submitted and has not seen finish, now:
    ``transfers`` jobs (vLLM's worker jobs, the reference engine's batched copies) of
    ``blocks`` KV blocks in all. A gauge per sender and direction, sent when it changes: a
    count that climbs while the finished ones stay flat is a copy engine that fell behind, or
    a job that never completes.
    """

    src: Tier
    dst: Tier
    transfers: Count
    blocks: Count


class EngineMemory(_Event, tag="engine_memory"):
    """Memory an engine set aside, as the engine itself sized or measured it; bytes. The node's
    memory budget breakdown (docs/collectors.md, "Memory budgets") is built from these and the
    collectors' readings. Each field is None where the sender does not know it (absent, never
    0), and a report without it leaves the last value as it was; a sender repeats its report
    now and then, so that an agent restarted meanwhile learns it.

    ``device``: "" for host memory, else the GPU it lies on, as its PCI address in sysfs form
    (``"0000:3b:00.0"``: domain, bus, device, function; what the GPU collector matches to NVML's
    device). ``kv_offload_budget``: host bytes the engine's configuration gives its host KV
    offload tier, as the operator typed it (vLLM's ``cpu_bytes_to_use``; the reference engine's
    cpu tier size); host only. ``kv_cache``: bytes of the engine's KV cache tensors on
    ``device`` (vLLM: the tensors handed to the offloading connector). ``allocated``: bytes the
    engine's allocator had in use on ``device`` when the KV cache was handed over, after the
    weights were loaded and before any request (torch's ``memory_allocated``): weights, the KV
    cache and the engine's persistent buffers.
    """

    # the form alone, or one sender's made-up names grew the agent's reports per device
    device: Annotated[str, msgspec.Meta(
        pattern=r"^([0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])?$")] = ""
    kv_offload_budget: Count | None = None
    kv_cache: Count | None = None
    allocated: Count | None = None


Event = Union[RequestStarted, Lookup, Transfer, Eviction, TierSnapshot, RequestFinished,
              RequestAborted, LatencyHistogram, SchedulerStats, IdleHistogram, Admission,
              TransfersInFlight, EngineMemory]


E = TypeVar("E")


class Batch(msgspec.Struct, Generic[E], frozen=True, gc=False):
    """A batch of events from one emitter (``events``: a list of :data:`Event`; generic only so
    that one batch may be decoded with its events left undecoded, see :func:`salvage_batch`).

    ``version``: :data:`SCHEMA_VERSION` of the sender. ``source``: the emitter's name (a short
    word, e.g. "engine", "vllm"). ``seq``: the emitter's batch counter, for gap detection.
    ``session``: random per emitter instance, so a restarted emitter is told apart.
    ``dropped``: events the emitter dropped since it started (cumulative). ``engine``,
    ``model``: what the emitter observes (e.g. "vllm", "meta-llama/Llama-3.1-8B"), or "".
    ``scope``: the source whose requests this emitter's request ids name, when that is another
    emitter (vLLM's worker tap names the scheduler tap's requests): the agent joins its events to
    that source's request records. "" for its own. ``final``: the emitter's last batch (sent by
    ``close``): the engine stopped, and its tiers leave the tier gauges. ``errors``: the tap's
    own failures since its emitter started (cumulative, like ``dropped``), by reason
    (:data:`~kvscope.vocabulary.TAP_ERROR_REASONS`); empty from an emitter that counts none.
    ``pid``: the emitter's process (``os.getpid()`` when the batch was made: a forked worker's
    own), the engine process the tap runs in, whose ``/proc/<pid>/numa_maps`` places its host KV
    pool (the numa collector); 0: not sent (an older tap). ``prefix_caching``,
    ``kv_cache_dtype``: the KV cache settings of the engine the emitter observes, GPU prefix
    caching on or off and the KV cache's dtype as the engine names it (e.g. vLLM's
    ``enable_prefix_caching`` and ``cache_dtype``: "auto", "fp8"); None and "": not sent.
    """

    version: int
    source: str
    seq: int
    events: list[E]
    session: Session = ""
    dropped: Count = 0
    engine: str = ""
    model: str = ""
    scope: str = ""
    final: bool = False
    errors: dict[str, Count] = {}
    pid: Count = 0
    prefix_caching: bool | None = None
    kv_cache_dtype: Annotated[str, msgspec.Meta(max_length=32)] = ""


def _transfer_problem(event: Transfer) -> str | None:
    if event.src == event.dst:
        return f"a transfer from the {event.src} tier to itself"
    return None


def _snapshot_problem(event: TierSnapshot) -> str | None:
    for unit in ("bytes", "blocks"):
        held = getattr(event, f"resident_{unit}")
        capacity = getattr(event, f"capacity_{unit}")
        if held is not None and 0 < capacity < held:
            return (f"a {event.tier} tier snapshot holding {held} {unit}, over its capacity of "
                    f"{capacity}")
    return None


def _lookup_problem(event: Lookup) -> str | None:
    hashes = len(event.block_hashes)
    if not hashes:
        return None  # no per-block detail (what the sources or depths may say goes unused)
    if hashes > event.blocks:
        return f"{hashes} block hashes for a lookup of {event.blocks} blocks"
    for name in ("block_sources", "block_depths"):
        if 0 < len(getattr(event, name)) != hashes:
            return f"{len(getattr(event, name))} {name} for {hashes} block hashes"
    if event.block_depths and max(event.block_depths) >= event.blocks:
        return f"a block depth of {max(event.block_depths)} in a lookup of {event.blocks} blocks"
    if event.block_sample_rate < MIN_BLOCK_SAMPLE_RATE:
        return f"block hashes sampled at a rate of {event.block_sample_rate:g}"
    sources = event.block_sources
    try:  # prefix semantics: recompute from the first one on
        first = sources.index("recompute")
    except ValueError:
        return None
    if sources.count("recompute") != len(sources) - first:
        return "a block served from cache after a recomputed one"
    return None


# the kinds whose fields can contradict each other, and the check of each (a kind absent here
# costs the decoder one dict lookup, no call)
_PROBLEMS = {Transfer: _transfer_problem, TierSnapshot: _snapshot_problem,
             Lookup: _lookup_problem}


def event_problem(event: object) -> str | None:
    """Why ``event``, each field valid on its own, cannot be true, or None: a transfer from a
    tier to itself, a tier snapshot holding more than its capacity, in bytes or blocks (a
    capacity of 0 is unknown and holds anything: the vLLM tap's before vLLM says it), or a
    lookup whose per-block detail contradicts it (more block hashes than blocks, sources or
    depths that are not one per hash, a depth past its blocks, hashes sampled at a rate of 0,
    a block served from cache after a recomputed one). Not a constraint of the structs: a tap
    builds events in the engine, where nothing may raise."""
    check = _PROBLEMS.get(type(event))
    return check(event) if check is not None else None


def validate(event: Event) -> Event:
    """``event`` checked against the schema's constraints and :func:`event_problem`, as the
    decoder checks what arrives (an event built in Python is checked for nothing). Raises
    :class:`SchemaError` (``invalid``) naming the field or the problem."""
    try:
        checked = msgspec.convert(msgspec.to_builtins(event), Event)
    except msgspec.ValidationError as exc:
        raise SchemaError(str(exc), "invalid") from exc
    problem = event_problem(checked)
    if problem is not None:
        raise SchemaError(problem, "invalid")
    return checked


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Batch[Event])
_raw_decoder = msgspec.msgpack.Decoder(Batch[msgspec.Raw])
_event_decoder = msgspec.msgpack.Decoder(Event)


def encode_batch(batch: Batch) -> bytes:
    """Encode a batch as msgpack bytes."""
    return _encoder.encode(batch)


# One event as msgpack bytes, as a batch holds it (``msgspec.Raw`` of them encode as the events
# would): the bound method itself, as the emitter calls it on the engine's thread at each event.
encode_event = _encoder.encode


# the first byte of a msgpack map (fixmap, map 16, map 32): what every encoded Batch starts with
_MAP_MARKERS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))


def decode_batch(data: bytes) -> Batch:
    """Decode msgpack bytes into a :class:`Batch`.

    Raises :class:`SchemaError` for bytes that are not a batch, for an unknown event kind, a
    field of the wrong type or value (e.g. an unknown tier), or a version other than ours.
    """
    if not len(data) or data[0] not in _MAP_MARKERS:  # b"garbage" reads as the int 103
        raise SchemaError("not a batch: a batch is a msgpack map", "malformed")
    try:
        batch = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        header = read_header(data)  # a future schema may have changed the events
        if header is not None and header.version != SCHEMA_VERSION:
            raise SchemaError(f"schema version {header.version}, expected {SCHEMA_VERSION}",
                              "version") from exc
        raise SchemaError(str(exc), "invalid") from exc
    # RecursionError: nesting past msgspec's depth bound; UnicodeDecodeError: a string that is
    # not UTF-8 (a ValueError, not a DecodeError)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise SchemaError(str(exc), "malformed") from exc
    if batch.version != SCHEMA_VERSION:
        raise SchemaError(f"schema version {batch.version}, expected {SCHEMA_VERSION}", "version")
    for event in batch.events:
        if (problem := event_problem(event)) is not None:
            raise SchemaError(problem, "invalid")
    return batch


# Events a batch may carry for its valid ones to be kept when others are invalid: an emitter
# sends at most 1,024; a sender's 4 MiB of one-byte events would each be decoded on its own.
MAX_SALVAGED = 4096


def salvage_batch(data: bytes, header: BatchHeader | None = None) -> tuple[Batch, int] | None:
    """For a batch :func:`decode_batch` refused as ``invalid``: the batch of its valid events,
    and how many of its events were not; None when the batch itself is not valid (a field of
    its own, or another version), so that nothing in it can be trusted, or when it carries more
    than :data:`MAX_SALVAGED` events. ``header``: its :func:`read_header`, when the caller has
    it. The events are counted from the header before any is decoded: a batch of millions of
    one-byte events costs no object per event."""
    header = header or read_header(data)
    if header is None or header.version != SCHEMA_VERSION or header.count > MAX_SALVAGED:
        return None
    try:
        raw = _raw_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return None
    events = []
    for event in raw.events:
        try:
            decoded = _event_decoder.decode(event)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError,
                UnicodeDecodeError):
            continue
        if event_problem(decoded) is None:
            events.append(decoded)
    return msgspec.structs.replace(raw, events=events), len(raw.events) - len(events)


_NO_EVENTS = msgspec.Raw(b"\x90")  # an empty msgpack array


class BatchHeader(msgspec.Struct):
    """What can be read of a batch whose events do not decode: its version, sender and sequence
    (for drop accounting), and how many events it carried (:attr:`count`).

    ``events``: the array undecoded, as one :class:`msgspec.Raw` (msgspec steps over its items
    without building an object for any: a refused batch of 8 MiB of one-byte events once cost
    480 MB, an object per event, and now costs the header's few fields)."""

    version: int
    source: str = ""
    seq: int = 0
    events: msgspec.Raw = _NO_EVENTS
    session: Session = ""
    dropped: Count = 0
    errors: dict[str, Count] = {}

    @property
    def count(self) -> int:
        """Events in the batch, read off the msgpack array's own header (-1: not an array)."""
        return _array_length(self.events)


def _array_length(raw: msgspec.Raw) -> int:
    """The length of the msgpack array ``raw`` holds (a whole value msgspec has stepped over,
    so its header is complete), or -1 when it holds no array."""
    with memoryview(raw) as view:
        head = bytes(view[:5])
    if head and 0x90 <= head[0] <= 0x9F:  # fixarray: up to 15 items
        return head[0] & 0x0F
    if head[:1] == b"\xdc":  # array 16
        return int.from_bytes(head[1:3], "big")
    if head[:1] == b"\xdd":  # array 32
        return int.from_bytes(head[1:5], "big")
    return -1


_header_decoder = msgspec.msgpack.Decoder(BatchHeader)


def read_header(data: bytes) -> BatchHeader | None:
    """The header of a batch that :func:`decode_batch` refused (a future schema, an invalid
    field, or one over a size limit), or None when even that is unreadable (``events`` not an
    array among them). Its cost does not grow with the events: see :class:`BatchHeader`."""
    try:
        header = _header_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):  # see decode_batch
        return None
    return header if header.count >= 0 else None
