"""Model presets: the KV-cache shape of a model and the cost model behind TTFT.

A KV block of ``block_tokens`` tokens holds keys and values for every layer:
``2 * layers * block_tokens * kv_heads * head_dim * dtype_bytes`` bytes.

Prefill rate follows the standard estimate that a transformer forward pass costs about
``2 * params`` FLOPs per token (Kaplan et al., "Scaling Laws for Neural Language Models",
2020, section 2.1), run at ``mfu`` (model FLOPs utilisation) of the accelerator's dense peak:
``prefill_tokens_per_second = peak_flops * mfu / (2 * params)``.
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
