"""The rates sizing prices transfers and prefills at: measured by a capture when it can say,
assumed (and labelled so) when it cannot.

- **Promotion bandwidth** (bytes/s, host to device): the capture's ``cpu->gpu`` bytes over the
  seconds its timed copies took (the agent's transfer totals, or its requests' transfers).
- **Prefill rate** (tokens/s): the recomputed prompt tokens over the requests' prefill seconds
  (first scheduled to first token: vLLM's tap; the reference engine's roofline), as
  ``kvscope compare`` measures it.
- **KV bytes per block**: the bytes over the blocks of the capture's transfers, every
  direction (the engine's own block size and KV layout, where a preset only approximates the
  model's); without transfers, a tier's capacity in bytes over its blocks, as the engine
  reported it.
- **Tier sizes** (blocks): the GPU prefix cache's and the CPU tier's capacity the engine
  reported.

Pure: the capture's figures come in as a :class:`~kvscope.analysis.compare.RequestSample`
(read by :mod:`~kvscope.analysis.capture_reader`). Sizing names where each rate came from:
``measured`` (with what it was measured over), ``modelled`` (held by the capture, but priced by
its engine's cost model: the reference engine's prefill), ``given`` (on the command line) or
``assumed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROMOTION = "cpu->gpu"


@dataclass(frozen=True)
class MeasuredRates:
    """What a capture measured. ``bandwidth``: host-to-device bytes/s, None when it timed no
    promotion. ``prefill_tokens_per_second``: None when it recorded no prefill time or no
    recomputed token. ``bytes_per_block``: KV bytes of one block, None when no transfer
    counted its blocks and no tier reported both. ``gpu_blocks``, ``cpu_blocks``: those tiers'
    capacity in blocks, None where the capture's engine reported none. ``evidence``: name
    (``bandwidth``, ``prefill``, ``kv_bytes``, ``gpu``) -> what it was measured over, in
    words. ``modelled``: the names of those the capture holds but its engine priced by a cost
    model rather than measured (the reference engine's prefill)."""

    bandwidth: float | None = None
    prefill_tokens_per_second: float | None = None
    bytes_per_block: float | None = None
    gpu_blocks: int | None = None
    cpu_blocks: int | None = None
    evidence: dict[str, str] = field(default_factory=dict)
    modelled: frozenset[str] = frozenset()

    def pick(self, name: str, given: float | None, flag: str) -> tuple[float | None, str | None]:
        """(value, where it came from) of the rate ``name`` (``bandwidth``, ``prefill``,
        ``kv_bytes`` or ``gpu``): ``given`` (on the command line as ``flag``) first, then the
        measured one; (None, None) when neither is there and the caller assumes one."""
        if given is not None:
            return given, f"given ({flag})"
        value = {"bandwidth": self.bandwidth, "prefill": self.prefill_tokens_per_second,
                 "kv_bytes": self.bytes_per_block, "gpu": self.gpu_blocks}[name]
        if value is None:
            return None, None
        return value, ("modelled: " if name in self.modelled else "measured: ") + \
            self.evidence[name]


def prefill_rate(recomputed_tokens: float, prefill_seconds: float) -> float | None:
    """Prefill tokens/s: ``recomputed_tokens`` over ``prefill_seconds``; None when either is 0
    (not measured, never 0 tokens/s)."""
    return recomputed_tokens / prefill_seconds if prefill_seconds > 0 and recomputed_tokens else None


def measured_rates(recomputed_tokens: int, prefill_seconds: float,
                   transfer_bytes: dict[str, int], transfer_seconds: dict[str, float],
                   transfer_blocks: dict[str, int] | None = None,
                   prefill_modelled: bool = False,
                   capacities: dict[str, tuple[int, int]] | None = None) -> MeasuredRates:
    """The rates a capture measured: its recomputed prompt tokens and prefill seconds (all
    requests), and its transfers' bytes, seconds and blocks by "src->dst". ``prefill_modelled``:
    its engine priced prefill by a cost model (every request at one exact rate).
    ``capacities``: tier -> (bytes, blocks) its engine reported (0: not reported)."""
    evidence = {}
    counted = [d for d, n in (transfer_blocks or {}).items() if n > 0 and transfer_bytes.get(d)]
    all_bytes = sum(transfer_bytes[d] for d in counted)
    blocks = sum(transfer_blocks[d] for d in counted) if counted else 0
    block_bytes = all_bytes / blocks if blocks else None
    capacities = capacities or {}
    if block_bytes is not None:
        evidence["kv_bytes"] = (f"{all_bytes:,} bytes in {blocks:,} blocks (the capture's "
                                "transfers)")
    elif sized := [(t, b, n) for t, (b, n) in capacities.items() if b > 0 and n > 0]:
        tier, nbytes, blocks = sized[0]  # nearest the GPU first, as the capture lists them
        block_bytes = nbytes / blocks
        evidence["kv_bytes"] = (f"the capture's {tier} tier, {nbytes:,} bytes in {blocks:,} "
                                "blocks as its engine reported it")
    gpu_blocks = capacities.get("gpu", (0, 0))[1] or None
    if gpu_blocks:
        evidence["gpu"] = f"the capture's gpu tier, {gpu_blocks:,} blocks as its engine reported it"
    nbytes, seconds = transfer_bytes.get(PROMOTION, 0), transfer_seconds.get(PROMOTION, 0.0)
    bandwidth = nbytes / seconds if nbytes > 0 and seconds > 0 else None
    if bandwidth is not None:
        evidence["bandwidth"] = (f"{nbytes:,} bytes of {PROMOTION} copies in {seconds:.4g} s "
                                 "(the capture's timed transfers)")
    prefill = prefill_rate(recomputed_tokens, prefill_seconds)
    modelled = prefill is not None and prefill_modelled
    if modelled:
        evidence["prefill"] = (f"every request's prefill in the capture is its recomputed "
                               f"tokens at exactly {prefill:,.0f} tokens/s, the engine's cost "
                               "model (the reference engine prices prefill)")
    elif prefill is not None:
        evidence["prefill"] = (f"{recomputed_tokens:,} recomputed prompt tokens in "
                               f"{prefill_seconds:.4g} s of prefill (the capture's requests)")
    return MeasuredRates(bandwidth, prefill, block_bytes, gpu_blocks,
                         capacities.get("cpu", (0, 0))[1] or None, evidence,
                         frozenset({"prefill"} if modelled else ()))
