"""Model presets: the KV-cache shape of a model and the cost model behind TTFT.

A KV block of ``block_tokens`` tokens holds keys and values for every layer:
``2 * layers * block_tokens * kv_heads * head_dim * dtype_bytes`` bytes.

Prefill rate follows the standard estimate that a transformer forward pass costs about
``2 * params`` FLOPs per token (Kaplan et al., "Scaling Laws for Neural Language Models",
2020, section 2.1), run at ``mfu`` (model FLOPs utilisation) of the accelerator's dense peak:
``prefill_tokens_per_second = peak_flops * mfu / (2 * params)``.

Decode at small batch is bound by memory bandwidth: every output token reads all weights once,
so ``decode_tokens_per_second = hbm_bytes_per_second * mbu / (params * dtype_bytes)`` (the
roofline argument of Pope et al., "Efficiently Scaling Transformer Inference", MLSys 2023,
section 2). ``mbu`` is the fraction of peak bandwidth reached.

The simulator (``payload=False``) prices transfers it does not run: ``h2d_bytes_per_second``
for ``cpu <-> gpu`` and ``disk_bytes_per_second`` for ``disk <-> cpu``.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}


class UnknownPreset(KeyError):
    """No preset of that name; the message lists the known ones."""


@dataclass(frozen=True)
class ModelPreset:
    """The KV-cache shape and compute cost of one model.

    ``params``: parameter count. ``peak_flops``: accelerator dense peak, FLOP/s. ``mfu``: the
    fraction of that peak prefill reaches (0-1). ``block_tokens``: default tokens per block.
    ``hbm_bytes_per_second``: device memory bandwidth (default 3.35e12, H100 SXM HBM3, NVIDIA
    H100 datasheet); ``mbu``: the fraction of it decode reaches (0-1). ``h2d_bytes_per_second``:
    host<->device copy rate (default 50e9: PCIe 5.0 x16 is 64 GB/s per direction, PCI-SIG, and
    pinned copies reach about 80% of it). ``disk_bytes_per_second``: local NVMe read rate
    (default 6.5e9, a PCIe 4.0 x4 data-center SSD's sequential read, e.g. Samsung PM9A3 spec).
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    params: float
    peak_flops: float
    mfu: float
    hbm_bytes_per_second: float = 3.35e12
    mbu: float = 0.6
    h2d_bytes_per_second: float = 50e9
    disk_bytes_per_second: float = 6.5e9

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers (keys and values)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_tokens: int | None = None) -> int:
        """KV bytes of one block of ``block_tokens`` tokens (default: the preset's)."""
        return self.bytes_per_token() * (block_tokens or self.block_tokens)

    @property
    def prefill_tokens_per_second(self) -> float:
        """Estimated prefill throughput, tokens/s (see the module docstring)."""
        return self.peak_flops * self.mfu / (2.0 * self.params)

    def prefill_seconds(self, tokens: int) -> float:
        """Estimated seconds to prefill ``tokens`` tokens."""
        return tokens / self.prefill_tokens_per_second

    @property
    def decode_tokens_per_second(self) -> float:
        """Estimated batch-1 decode throughput, tokens/s (see the module docstring)."""
        return self.hbm_bytes_per_second * self.mbu / (self.params * self.dtype_bytes)

    def decode_seconds(self, tokens: int) -> float:
        """Estimated seconds to decode ``tokens`` output tokens one after another."""
        return tokens / self.decode_tokens_per_second

    def transfer_seconds(self, src: str, dst: str, nbytes: int) -> float:
        """Modelled seconds to move ``nbytes`` bytes between tiers (``disk`` hops use the disk
        rate, ``cpu <-> gpu`` the host-device rate)."""
        rate = self.disk_bytes_per_second if "disk" in (src, dst) else self.h2d_bytes_per_second
        return nbytes / rate


PRESETS: dict[str, ModelPreset] = {
    # A tiny Llama-shaped KV cache (2 KiB per token) whose pools fit a laptop, priced as a 1B
    # model on one H100 SXM (989 TFLOP/s dense bf16, NVIDIA H100 datasheet) at 40% MFU: about
    # 198,000 prefill tokens/s.
    "tiny": ModelPreset(
        name="tiny", layers=4, kv_heads=2, head_dim=64, dtype="float16", block_tokens=16,
        params=1.0e9, peak_flops=989e12, mfu=0.4,
    ),
    # Llama-3-8B (Meta, model card): 32 layers, 8 KV heads (GQA), head dim 128, bf16 -> 128 KiB
    # per token. Compute on one H100 SXM: 989 TFLOP/s dense bf16 (NVIDIA H100 datasheet) at 40%
    # MFU -> about 24,700 prefill tokens/s.
    "llama-3-8b": ModelPreset(
        name="llama-3-8b", layers=32, kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=16,
        params=8.03e9, peak_flops=989e12, mfu=0.4,
    ),
}


def get_preset(name: str) -> ModelPreset:
    """Return the preset called ``name``; raise :class:`UnknownPreset` naming the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPreset(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
