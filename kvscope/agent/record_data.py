"""A request record as data: what the store writes, the API serves and the OTLP exporter reads.

:class:`~kvscope.agent.requests.RequestRecord` keeps its numbers in C fields for the pipeline's
fold; :meth:`~kvscope.agent.requests.RequestRecord.data` gives this msgspec form of it (field
for field the same, so the store's segments and the API's JSON keep their shape) and
:meth:`~kvscope.agent.requests.RequestRecord.from_data` takes one back.
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
    lookup: float = 0.0
    promotion_wait: float = 0.0
    prefill: float = 0.0
    finished: float | None = None
    itl: float = 0.0
