"""The request schema: :class:`RecordData` declares what kvscope knows of one request, once.

Every other form follows from its fields, and ``tests/test_request_schema.py`` fails when one
drifts: :class:`~kvscope.agent.requests.RequestRecord` keeps the same fields in C for the
pipeline's fold (:meth:`~kvscope.agent.requests.RequestRecord.data` gives this msgspec form,
:meth:`~kvscope.agent.requests.RequestRecord.from_data` takes one back); the store's segments
(msgpack) and the API's JSON are this struct as is; the capture's ``requests`` columns and the
OTLP ``kv.request`` span's attributes (``exporter/otlp.py``, ``REQUEST_ATTRIBUTES``) cover
each field; and :class:`~kvscope.events.RequestFinished` names its fields as this does.
Adding a field: here, in ``requests.pyx`` (and ``.pxd``), and in each form the test names.
"""

from __future__ import annotations

import msgspec


class TransferRecord(msgspec.Struct, frozen=True, gc=False):
    """One transfer of a request: ``start`` Unix seconds, ``duration`` seconds, sizes in bytes."""

    src: str
    dst: str
    blocks: int
    bytes: int
    start: float
    duration: float
    ok: bool = True


class RecordData(msgspec.Struct, gc=False):
    """One request, as :class:`~kvscope.agent.requests.RequestRecord` describes it (the same
    fields, units and defaults)."""

    request_id: str
    trace_id: str
    source: str
    arrival: float
    prompt_tokens: int = 0
    output_tokens: int = 0
    tokens: dict[str, int] = {}
    transfers: tuple[TransferRecord, ...] = ()
    transfers_omitted: int = 0
    ttft: float | None = None
    queueing: float = 0.0
    lookup: float | None = None  # None: not measured
    promotion_wait: float | None = None  # None: not measured
    prefill: float = 0.0
    finished: float | None = None
    itl: float = 0.0
