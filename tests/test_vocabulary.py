"""kvscope's vocabulary is declared once (kvscope/vocabulary.py): no other module spells out the
tiers, token sources, reasons or vLLM's media again, and the event schema uses the very same
values."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args, get_type_hints

from kvscope import events as ev
from kvscope import vocabulary as v
from kvscope.engine import disk

PACKAGE = Path(__file__).resolve().parent.parent / "kvscope"
# a run of three of one vocabulary's words in a row, as a tuple, list or Literal spells it
REDECLARED = re.compile(
    r'"gpu",\s*"cpu",\s*"disk"|"cpu",\s*"disk",\s*"remote"|"capacity",\s*"cleared",\s*"failed"'
    r'|"checksum",\s*"corrupt",\s*"disk_full"|"GPU":\s*"gpu",\s*"CPU"')


def test_no_module_but_the_vocabulary_spells_it_out():
    """Each tier list, source list, reason list and medium map is declared in vocabulary.py
    alone (it once was in about ten modules); the others import it."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{text.count(chr(10), 0, m.start()) + 1}"
             for path in sorted(PACKAGE.rglob("*.py*")) if path.suffix in (".py", ".pyx", ".pxd")
             and path.name != "vocabulary.py"
             for text in [path.read_text()] for m in REDECLARED.finditer(text)]
    assert found == [], found


def test_the_schema_uses_the_vocabulary_itself():
    """The events' Literal fields are the vocabulary's (msgspec hands out these very strings,
    which the compiled records compare by identity), and the reference engine's disk failure
    reasons are among the labels' failure reasons."""
    assert ev.Tier is v.Tier and ev.TokenSource is v.TokenSource
    assert ev.TIERS is v.TIERS == get_args(v.Tier) == ("gpu", "cpu", "disk", "remote")
    assert v.TOKEN_SOURCES == ("gpu", "cpu", "disk", "recompute")
    hints = get_type_hints(ev.Eviction, include_extras=True)
    assert hints["reason"] is v.EvictionReason and hints["tier"] is v.Tier
    assert set(disk.REASONS) <= set(v.FAILURE_REASONS) and v.FAILURE_REASONS[-1] == "other"
    assert v.LOCAL_TIERS == v.TIERS[:3] and set(v.VLLM_MEDIUM_TIER.values()) == set(v.LOCAL_TIERS)
    assert len(v.DIRECTIONS) == 16 and ("gpu", "cpu") in v.DIRECTIONS


# vLLM 0.32's CacheDType (vllm/config/cache.py, typing.get_args of it in the CPU build) and the
# reference engine's presets' dtypes (torch names), each with its width
KV_CACHE_DTYPE_WIDTHS = {
    "auto": "auto", "float16": "16bit", "bfloat16": "16bit", "fp8": "8bit", "fp8_e4m3": "8bit",
    "fp8_e5m2": "8bit", "fp8_inc": "8bit", "fp8_ds_mla": "8bit", "nvfp4_ds_mla": "4bit",
    "turboquant_k8v4": "other", "turboquant_4bit_nc": "4bit", "turboquant_k3v4_nc": "other",
    "turboquant_3bit_nc": "other", "ultraquant_4bit": "4bit", "int4_per_token_head": "4bit",
    "int8_per_token_head": "8bit", "fp8_per_token_head": "8bit", "nvfp4": "4bit",
    "nvfp4_4over6": "4bit", "float32": "32bit", "float8_e4m3fn": "8bit", "FP8": "8bit",
    "no_such_dtype": "other"}


def test_every_kv_cache_dtype_maps_to_its_width():
    assert {name: v.kv_cache_dtype(name) for name in KV_CACHE_DTYPE_WIDTHS} \
        == KV_CACHE_DTYPE_WIDTHS
    assert set(KV_CACHE_DTYPE_WIDTHS.values()) == set(v.KV_CACHE_DTYPES)
