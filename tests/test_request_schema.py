"""One request schema: :class:`~kvscope.agent.record_data.RecordData`'s fields are the request,
and every other form follows from them. The compiled record carries each field, the store and
the API write it as is, the capture's columns (derived from it) and the OTLP span's attributes
cover each one, and
the finish event names its fields as the schema does. Each test fails when one form drifts from
the schema: a field added to RecordData and not to a form, or the other way round."""

from __future__ import annotations

import msgspec
import pyarrow.parquet as pq
import pytest

from kvscope import events as ev
from kvscope.agent.capture import REQUESTS_ADDED, CaptureWriter
from kvscope.agent.record_data import RecordData, TransferRecord
from kvscope.agent.requests import RequestRecord
from kvscope.exporter.otlp import REQUEST_ATTRIBUTES, REQUEST_SPAN_SHAPE, _request_attributes

FIELDS = RecordData.__struct_fields__

# every field set, none at its default, no two alike
FULL = RecordData(
    request_id="req-1", trace_id="4bf92f3577b34da6a3ce929d0e0e4736", source="vllm",
    arrival=1_700_000_000.5, prompt_tokens=96, output_tokens=7,
    tokens={"gpu": 32, "cpu": 16, "disk": 16, "recompute": 32},
    transfers=(TransferRecord("cpu", "gpu", 1, 4096, 1_700_000_000.6, 0.002, ok=False),),
    transfers_omitted=3, ttft=0.25, queueing=0.01, lookup=0.02, promotion_wait=0.03,
    prefill=0.04, finished=1_700_000_001.5, itl=0.015)


def test_the_full_record_sets_every_field_of_the_schema():
    """The reference record below the other tests: a field the schema gains must be set here
    (and so checked in every form), else this fails."""
    defaults = RecordData(request_id="", trace_id="", source="", arrival=0.0)
    unset = [f for f in FIELDS if getattr(FULL, f) == getattr(defaults, f)]
    assert unset == [], f"set these in FULL: {unset}"


def test_the_compiled_record_carries_every_field():
    record = RequestRecord.from_data(FULL)
    assert record.data() == FULL
    assert {f: getattr(record, f) for f in FIELDS} == msgspec.structs.asdict(FULL)


def test_the_store_and_the_api_write_the_schema_as_is():
    """The store's segments hold msgpack RecordData and the API serves it as JSON: both
    round-trip every field."""
    for encode, decode in ((msgspec.msgpack.encode, msgspec.msgpack.Decoder(RecordData).decode),
                           (msgspec.json.encode, msgspec.json.Decoder(RecordData).decode)):
        assert decode(encode(RequestRecord.from_data(FULL).data())) == FULL


def test_the_capture_writes_every_field(tmp_path):
    """One row of the capture's requests segment gives the record back, field for field (its
    prompt tokens one column per source)."""
    writer = CaptureWriter(tmp_path)
    writer.add_request(RequestRecord.from_data(FULL))
    writer.close()
    (path,) = tmp_path.glob("requests-*.parquet")
    (row,) = pq.read_table(path).to_pylist()
    row["tokens"] = {s: row.pop(f"tokens_{s}") for s in ev.TOKEN_SOURCES}
    row["transfers"] = tuple(TransferRecord(**t) for t in row["transfers"])
    for column in REQUESTS_ADDED:  # the capture's own columns (the agent's tiers), no field
        row.pop(column)
    assert RecordData(**row) == FULL


def test_a_part_not_measured_stays_not_measured_in_every_form(tmp_path):
    """A request known from vLLM's span alone has no lookup or promotion wait: None in the
    record, the store and the API, NaN in the capture (which its reader leaves out), absent
    from the OTLP span; never 0, which would say that it waited for nothing."""
    unmeasured = msgspec.structs.replace(FULL, lookup=None, promotion_wait=None)
    record = RequestRecord.from_data(unmeasured)
    assert (record.lookup, record.promotion_wait) == (None, None)
    for encode, decode in ((msgspec.msgpack.encode, msgspec.msgpack.Decoder(RecordData).decode),
                           (msgspec.json.encode, msgspec.json.Decoder(RecordData).decode)):
        assert decode(encode(record.data())) == unmeasured
    writer = CaptureWriter(tmp_path)
    writer.add_request(record)
    writer.close()
    (path,) = tmp_path.glob("requests-*.parquet")
    row = pq.read_table(path).to_pylist()[0]
    assert all(row[f] is None or row[f] != row[f] for f in ("lookup", "promotion_wait")), row
    attributes = _request_attributes(record)
    assert {REQUEST_ATTRIBUTES["lookup"], REQUEST_ATTRIBUTES["promotion_wait"]}.isdisjoint(
        attributes) and attributes[REQUEST_ATTRIBUTES["queueing"]] == 0.01


def test_every_field_reaches_the_otlp_span_as_an_attribute_or_its_shape():
    assert set(REQUEST_ATTRIBUTES).isdisjoint(REQUEST_SPAN_SHAPE)
    assert set(REQUEST_ATTRIBUTES) | set(REQUEST_SPAN_SHAPE) == set(FIELDS)
    attributes = _request_attributes(RequestRecord.from_data(FULL))
    expected = {name for field, name in REQUEST_ATTRIBUTES.items() if field != "tokens"}
    expected |= {f"kv.tokens.{s}" for s in ev.TOKEN_SOURCES}
    assert set(attributes) == expected
    assert attributes["kv.itl_seconds"] == 0.015 and attributes["kv.transfers_omitted"] == 3


@pytest.mark.parametrize("field", [f for f in ev.RequestFinished.__struct_fields__
                                   if f != "ts"])
def test_the_finish_event_names_its_fields_as_the_schema_does(field):
    """What a source reports of a finished request lands in the record field of the same name
    (request_id, ttft, tokens, the TTFT parts, itl)."""
    assert field in FIELDS
