"""The event schema: round trips, and every kind of bad payload is refused with SchemaError."""

import msgspec
import pytest

from kvscope import events as ev


def _batch(events, version=ev.SCHEMA_VERSION):
    return ev.Batch(version=version, source="engine", seq=7, events=events)


def test_round_trip_keeps_every_event_kind():
    events = [
        ev.RequestStarted(ts=1.0, request_id="r1", prompt_tokens=40, trace_id="ab" * 16),
        ev.Lookup(ts=1.0, request_id="r1", tokens={"gpu": 16, "cpu": 16, "recompute": 8}),
        ev.Transfer(ts=1.1, src="cpu", dst="gpu", blocks=1, bytes=32768, duration=2e-4, request_id="r1"),
        ev.Eviction(ts=1.2, tier="gpu", blocks=1, bytes=32768, age=3.5, hits=2, offloaded=True),
        ev.TierSnapshot(ts=1.3, tier="cpu", capacity_bytes=100, resident_bytes=50,
                        capacity_blocks=10, resident_blocks=5),
        ev.RequestFinished(ts=1.4, request_id="r1", ttft=0.25, prompt_tokens=40, output_tokens=3),
        ev.RequestAborted(ts=1.45, request_id="r2"),
        ev.SchedulerStats(ts=1.5, waiting=4, running=2, preemptions=1, gpu_kv_usage=0.75),
        ev.SchedulerStats(ts=1.6, waiting=0),  # the rest unknown: None, not 0
        ev.Eviction(ts=1.7, tier="cpu", blocks=2, bytes=64, age=9.0, hits=1, idle=4.0),
        ev.IdleHistogram(ts=1.8, tier="gpu", bounds=[0.5, 2.0], counts=[1, 0, 2], sum=9.5),
        ev.Admission(ts=1.9, tier="cpu", stored=3, skipped=1, failed=0),
        ev.Admission(ts=1.9, tier="cpu", skipped=2),  # stored, failed unseen: None, not 0
    ]
    decoded = ev.decode_batch(ev.encode_batch(_batch(events)))
    assert decoded.events == events
    assert decoded.seq == 7 and decoded.source == "engine"


def test_wrong_schema_version_is_refused():
    with pytest.raises(ev.SchemaError, match="version 99"):
        ev.decode_batch(ev.encode_batch(_batch([], version=99)))


@pytest.mark.parametrize("field, value", [("tier", "nvme"), ("weight", 0)])
def test_unknown_tier_or_a_weight_below_one_is_refused(field, value):
    """A weight below 1 would subtract from the histograms."""
    eviction = {"kind": "eviction", "ts": 0.0, "tier": "cpu", "blocks": 1, "bytes": 1,
                "age": 0.0, "hits": 0, field: value}
    raw = {"version": ev.SCHEMA_VERSION, "source": "x", "seq": 0, "events": [eviction]}
    with pytest.raises(ev.SchemaError, match=field) as info:
        ev.decode_batch(msgspec.msgpack.encode(raw))
    assert info.value.reason == "invalid"


def test_scheduler_stats_leave_what_the_sender_does_not_know_as_none():
    stats = ev.SchedulerStats(ts=1.0, running=1)
    assert (stats.waiting, stats.preemptions, stats.gpu_kv_usage) == (None, None, None)


@pytest.mark.parametrize("field, value", [
    ("gpu_kv_usage", 1.0001),  # a share: vLLM's kv_cache_usage_perc, not a percentage
    ("gpu_kv_usage", -0.1), ("gpu_kv_usage", float("nan")), ("gpu_kv_usage", float("inf")),
    ("waiting", -1), ("running", 2.5), ("preemptions", -3), ("preemptions", 2**53 + 1)])
def test_scheduler_stats_out_of_bounds_are_refused(field, value):
    """A negative preemption delta would turn the counter down (rate() reads a reset); a usage
    beyond 0..1 is no share."""
    stats = {"kind": "scheduler_stats", "ts": 0.0, field: value}
    raw = {"version": ev.SCHEMA_VERSION, "source": "x", "seq": 0, "events": [stats]}
    with pytest.raises(ev.SchemaError, match=field) as info:
        ev.decode_batch(msgspec.msgpack.encode(raw))
    assert info.value.reason == "invalid"
    with pytest.raises(ev.SchemaError, match=field):
        ev.validate(ev.SchedulerStats(ts=0.0, **{field: value}))


@pytest.mark.parametrize("payload", [b"", b"\x00\x01garbage", b"\x93\x01", b"garbage"])
def test_bytes_that_are_not_a_batch_are_refused_as_malformed(payload):
    """Not a msgpack map, so no batch: malformed (b"garbage" read as the int 103 was counted
    "invalid", the reason for a batch with a bad field)."""
    with pytest.raises(ev.SchemaError) as refused:
        ev.decode_batch(payload)
    assert refused.value.reason == "malformed"


def test_truncated_batch_is_refused():
    data = ev.encode_batch(_batch([ev.Lookup(ts=0.0, request_id="r", tokens={"gpu": 1})]))
    with pytest.raises(ev.SchemaError):
        ev.decode_batch(data[:-3])


@pytest.mark.parametrize("event", [
    ev.Eviction(ts=0.0, tier="cpu", blocks=1, bytes=1, age=1.0, hits=0, idle=-1.0),
    ev.IdleHistogram(ts=0.0, tier="cache", bounds=[1.0], counts=[1, 0]),
    ev.IdleHistogram(ts=0.0, tier="gpu", bounds=[1.0], counts=[-1, 0]),
    ev.Admission(ts=0.0, tier="cpu", skipped=-1),
    ev.Admission(ts=0.0, tier="cache", stored=1),
])
def test_a_negative_idle_time_or_a_bad_idle_histogram_is_invalid(event):
    with pytest.raises(ev.SchemaError):
        ev.validate(event)


def test_idle_histogram_counts_one_more_than_its_bounds():
    with pytest.raises(ValueError):
        ev.IdleHistogram(ts=0.0, tier="gpu", bounds=[1.0, 2.0], counts=[1, 0])
    with pytest.raises(ValueError):
        ev.IdleHistogram(ts=0.0, tier="gpu", bounds=[2.0, 1.0], counts=[1, 0, 0])


def test_a_histogram_of_more_buckets_than_a_counter_holds_is_invalid():
    """1,025 counts of 2**53 each passed validation, and their sum, past 2**63, stopped the
    fold halfway through its batch (a finished request lost): past MAX_BUCKETS (1,000) bounds
    a histogram is invalid; 1,000 bounds of counts at 2**53 add up within 2**63."""
    def histogram(bounds):  # as a sender encodes it (built here, it is refused at once)
        return {"kind": "latency_histogram", "ts": 0.0, "metric": "ttft",
                "bounds": [float(b + 1) for b in range(bounds)], "counts": [2**53] * (bounds + 1)}

    with pytest.raises(ev.SchemaError, match="more than 1000"):
        ev.decode_batch(ev.encode_batch(_batch([histogram(1024)])))
    assert sum(ev.decode_batch(ev.encode_batch(_batch([histogram(1000)]))).events[0].counts) \
        < 2**63


@pytest.mark.parametrize("device, valid", [("", True), ("0000:3b:00.0", True),
                                           ("10000:01:00.0", True),  # a domain past 0xffff
                                           ("gpu-0", False), ("0000:3B:00.0", False),
                                           ("0000:3b:00.0x", False)])
def test_an_engine_memory_report_names_its_device_as_sysfs_does(device, valid):
    """A device is "" (host) or a sysfs PCI address, as the GPU collector matches it: a sender
    naming 200,000 devices otherwise kept 59 MB of reports, copied under the pipeline's lock at
    every scrape."""
    batch = ev.encode_batch(_batch([ev.EngineMemory(ts=0.0, device=device, kv_cache=1)]))
    if valid:
        assert ev.decode_batch(batch).events[0].device == device
    else:
        with pytest.raises(ev.SchemaError):
            ev.decode_batch(batch)


def _lookup(**detail):
    fields = {"blocks": 4, "block_hashes": (11, 12, 13, 14),
              "block_sources": ("gpu", "cpu", "recompute", "recompute")}
    return ev.Lookup(ts=0.0, request_id="r", tokens={"gpu": 16, "cpu": 16, "recompute": 32},
                     **{**fields, **detail})


@pytest.mark.parametrize("detail, problem", [
    ({"blocks": 2}, "4 block hashes for a lookup of 2 blocks"),
    ({"block_sources": ("gpu",)}, "1 block_sources for 4 block hashes"),
    ({"block_depths": (0, 1)}, "2 block_depths for 4 block hashes"),
    ({"block_depths": (0, 1, 2, 4)}, "a block depth of 4 in a lookup of 4 blocks"),
    ({"block_sample_rate": 0.0}, "block hashes sampled at a rate of 0"),
    # each block counted 1/rate times in kvscope_prompt_prefix_blocks_total: +Inf for good
    ({"block_sample_rate": 5e-324}, "block hashes sampled at a rate of 4.94066e-324"),
    ({"block_sources": ("gpu", "recompute", "cpu", "recompute")},
     "a block served from cache after a recomputed one"),
])
def test_a_lookup_whose_block_detail_contradicts_it_is_invalid(detail, problem):
    """A tryout sent a 2-block lookup with 100 block hashes: the agent counted 100 blocks in
    kvscope_prompt_prefix_blocks_total and wrote 100 capture rows. Each contradiction of the
    Lookup's documented shape (one source and depth per hash, depths within its blocks, prefix
    semantics) is refused as invalid, at decoding as by validate()."""
    with pytest.raises(ev.SchemaError, match=problem) as refused:
        ev.decode_batch(ev.encode_batch(_batch([_lookup(**detail)])))
    assert refused.value.reason == "invalid"


@pytest.mark.parametrize("detail", [
    {},  # the reference engine's: every block, first to last
    {"blocks": 9, "block_hashes": (12, 14), "block_sources": (), "block_depths": (3, 8),
     "block_sample_rate": 0.25},  # the vLLM tap's sample: fewer hashes than blocks, depths
    {"block_hashes": (), "block_sources": (), "block_sample_rate": 0.0625},  # none sampled
])
def test_lookups_the_taps_send_are_valid(detail):
    event = _lookup(**detail)
    assert ev.decode_batch(ev.encode_batch(_batch([event]))).events == [event]
