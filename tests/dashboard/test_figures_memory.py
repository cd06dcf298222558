"""The memory budget figure (kvscope/dashboard/figures_memory.py) on literal samples."""

from __future__ import annotations

from kvscope.dashboard.figures_memory import MEMORY_BUDGET_TITLE, memory_budget, wholes

GiB = 1 << 30


def _sample(**fields) -> dict:
    return {"ts": 1.0, "host_memory_part_bytes": {}, "gpu_memory_part_bytes": {},
            "host_memory_limit_bytes": None, "gpu_memory_total_bytes": {}, **fields}


HOST = {"kv_offload": 16 * GiB, "engine_other": 4 * GiB, "other": 4 * GiB, "reserve": 8 * GiB,
        "free": 32 * GiB}
GPU = {"0->kv_cache": 40 * GiB, "0->weights": 16 * GiB, "0->workspace": 20 * GiB,
       "0->free": 4 * GiB, "1->other": 10 * GiB, "1->free": 70 * GiB}


def test_one_stacked_bar_per_whole_with_its_total():
    """The host (64 GiB limit: its parts add up to it) and two GPUs of 80 GiB: one bar per
    whole, a trace per part in stack order, zero-free wholes left without the part (GPU 1 has
    no kv_cache: None, not 0), and a total mark on each; nothing is noted as not measured."""
    fig = memory_budget([_sample(host_memory_part_bytes=HOST, gpu_memory_part_bytes=GPU,
                                 host_memory_limit_bytes=64.0 * GiB,
                                 gpu_memory_total_bytes={"0": 80.0 * GiB, "1": 80.0 * GiB})])
    assert fig.layout.title.text == MEMORY_BUDGET_TITLE and fig.layout.barmode == "stack"
    bars = {t.legendgroup: list(t.y) for t in fig.data if t.type == "bar"}
    assert list(bars) == ["kv_cache", "weights", "workspace", "kv_offload", "engine_other",
                          "other", "reserve", "free"]
    # the legend in words, not the ids (a tryout read "engine_other" off the chart)
    assert [t.name for t in fig.data][:4] == ["KV cache", "model weights",
                                              "activations and workspace", "KV offload budget"]
    assert list(fig.data[0].x) == ["host", "GPU 0", "GPU 1"]
    assert bars["kv_cache"] == [None, 40 * GiB, None]
    assert bars["free"] == [32 * GiB, 4 * GiB, 70 * GiB]
    for i in range(3):  # each bar's parts add up to its total
        assert sum(ys[i] or 0 for ys in bars.values()) == [64 * GiB, 80 * GiB, 80 * GiB][i]
    total = next(t for t in fig.data if t.name == "total")
    assert list(total.x) == ["host", "GPU 0", "GPU 1"]
    assert list(total.y) == [64.0 * GiB, 80.0 * GiB, 80.0 * GiB]
    assert not fig.layout.annotations


def test_what_was_not_measured_is_named_not_drawn_as_zero():
    """No GPU (no NVML) and no engine process: only the host bar, its parts without
    engine_other, and a note naming both."""
    host = {k: v for k, v in HOST.items() if k != "engine_other"}
    fig = memory_budget([_sample(host_memory_part_bytes=host, host_memory_limit_bytes=60.0 * GiB)])
    assert {t.legendgroup or t.name for t in fig.data} == {*host, "total"}
    assert [a.text for a in fig.layout.annotations] == [
        "engine memory: not measured (collectors.host engine_pid); GPU: not measured (no NVML)"]
    nothing = memory_budget([_sample()])
    assert [a.text for a in nothing.layout.annotations] == ["not measured: no host or GPU reading"]
    assert [a.text for a in memory_budget([]).layout.annotations] == ["no data yet"]


def test_wholes_split_gpu_keys_and_keep_totals_only_for_wholes_with_parts():
    """A GPU total without parts (no memory split for it) marks nothing."""
    parts, totals = wholes(_sample(gpu_memory_part_bytes={"0->free": 1.0},
                                   gpu_memory_total_bytes={"0": 2.0, "1": 3.0}))
    assert parts == {"GPU 0": {"free": 1.0}} and totals == {"GPU 0": 2.0}
