"""The Tiers page's topology panel (kvscope/dashboard/topology_view.py) on literal node series:
a two-GPU, two-node host with a label NVML did not give, a host without a GPU, a fleet; and the
page's refresh when the node cannot be read. Headless Chromium on the demo:
tests/dashboard/test_e2e_dashboard.py."""

from __future__ import annotations

from dash import html

from kvscope.dashboard import topology_view as tv
from kvscope.dashboard.backend import BackendUnavailable
from kvscope.dashboard.pages import tiers as tiers_page


def _s(name, value=1.0, **labels):
    return {"name": name, "labels": labels, "value": value}


def _topology(gpu_labels=({"gpu": "0", "pcie_generation": "4", "pcie_width": "16",
                           "pcie_max_generation": "5", "pcie_max_width": "16", "numa_node": "1"},
                          {"gpu": "1", "pcie_generation": "4", "pcie_width": "8",
                           "pcie_max_generation": "", "pcie_max_width": "", "numa_node": ""}),
              **common):
    return [_s("kvscope_collector_up", 1.0, collector="gpu", **common),
            _s("kvscope_collector_up", 1.0, collector="numa", **common),
            *(_s("kvscope_gpu_topology_info", **g, **common) for g in gpu_labels),
            _s("kvscope_pcie_link_max_bytes_per_second", 31.5e9, gpu="0", **common),
            _s("kvscope_host_numa_nodes", 2.0, **common),
            _s("kvscope_process_numa_bytes", 3 * 2**30, numa_node="0", **common),
            _s("kvscope_process_numa_bytes", 2**30, numa_node="1", **common)]


def _text(component) -> str:
    """Every string under a Dash component, cells separated by " | "."""
    if isinstance(component, str):
        return component
    if isinstance(component, (list, tuple)):
        return " | ".join(_text(c) for c in component)
    children = getattr(component, "children", None)
    return _text(children) if children is not None else ""


def _parts(children) -> dict:
    """{class name: (data-state, text)} of the panel's parts."""
    out = {}

    def walk(c):
        if isinstance(c, (list, tuple)):
            for x in c:
                walk(x)
        elif hasattr(c, "children"):
            state = getattr(c, "data-state", None)
            if state is not None:
                out[c.className] = (state, _text(c))
            else:
                walk(c.children)
    walk(children)
    return out


def test_two_gpus_two_nodes_with_what_nvml_did_not_give_not_measured():
    (t,) = tv.topologies(_topology())
    assert t.instance == "" and t.gpu_up and t.numa_up and t.numa_nodes == 2
    assert [g.gpu for g in t.gpus] == ["0", "1"]
    assert t.gpus[0] == tv.GpuLink("0", "4", "16", "5", "16", "1", 31.5e9)
    assert t.gpus[1] == tv.GpuLink("1", "4", "8", None, None, None, None)
    assert t.engine_bytes == {"0": 3 * 2**30, "1": 2**30}
    parts = _parts(tv.section(_topology()))
    state, gpus = parts["topology-gpus"]
    assert state == "measured"
    assert "0 | Gen 4 x16 | Gen 5 x16 | 31.5 GB/s | 1" in gpus
    assert "1 | Gen 4 x8 | not measured | not measured | not measured" in gpus
    assert parts["topology-numa-nodes"] == ("measured", "host NUMA nodes online: 2")
    assert parts["topology-engine-numa"][1].endswith("node 0: 3.00 GiB (75%) · node 1: 1.00 GiB (25%)")


def test_a_host_without_a_gpu_says_no_gpu_never_zero():
    series = [_s("kvscope_collector_up", 0.0, collector="gpu"),
              _s("kvscope_collector_up", 1.0, collector="numa"),
              _s("kvscope_host_numa_nodes", 1.0)]
    parts = _parts(tv.section(series))
    state, text = parts["topology-gpus"]
    assert state == "no-gpu" and "no GPU (NVML is not there: no NVIDIA driver)" in text and "not measured" in text
    assert " 0" not in text
    assert parts["topology-engine-numa"] == (
        "not-measured", "engine process memory by NUMA node: not measured (no "
        "[collectors.numa] engine_pid set and no tap heard from, or the kernel has no "
        "numa_maps)")
    # collectors switched off or down say so, not a number
    parts = _parts(tv.section([_s("kvscope_collector_up", 0.0, collector="numa")]))
    assert "the gpu collector is off" in parts["topology-gpus"][1]
    assert parts["topology-numa-nodes"][0] == "not-measured"
    assert "numa collector is down" in parts["topology-engine-numa"][1]
    assert _text(tv.section([])).endswith("not measured: the agent reports no node collectors")


def test_a_fleet_shows_each_instance_under_its_name():
    series = _topology(instance="node2:9400") + [
        _s("kvscope_collector_up", 0.0, collector="gpu", instance="node1:9400")]
    assert [t.instance for t in tv.topologies(series)] == ["node1:9400", "node2:9400"]
    names = [c.children for c in tv.section(series) if isinstance(c, html.H5)]
    assert names == ["node1:9400", "node2:9400"]


def test_link_text_never_reads_a_missing_part_as_zero():
    assert tv.link_text("5", "16") == "Gen 5 x16"
    assert tv.link_text(None, None) == "not measured"
    assert tv.link_text("4", None) == "Gen 4 x not measured"


class NodeBackend:
    kind, base_url = "agent", "http://agent:9400"

    def __init__(self, node=None, error=None):
        self._node, self._error, self.asked = node or [], error, []

    def timeseries(self, window_seconds, instance=None):
        return [{"ts": 1000.0 + i, "transfer_bytes": {"gpu->cpu": 1e6 * i}} for i in range(3)]

    def node(self, metrics, instance=None):
        self.asked.append((tuple(metrics), instance))
        if self._error:
            raise self._error
        return self._node


def test_the_tiers_page_reads_the_topology_beside_its_transfer_charts():
    backend = NodeBackend(_topology())
    out = tiers_page.refresh(backend, 900)
    assert len(out) == len(tiers_page.GRAPHS) + 2
    assert backend.asked == [(tv.METRICS, None)]
    assert _parts(out[-2])["topology-gpus"][0] == "measured"
    throughput = out[list(tiers_page.GRAPHS).index("tiers-transfer-throughput")]
    assert [t.name for t in throughput.data] == ["gpu->cpu"]


def test_an_agent_without_the_node_endpoint_still_draws_the_charts():
    backend = NodeBackend(error=BackendUnavailable("http://agent:9400", "HTTP 404 from "
                                                   "/api/v1/node"))
    out = tiers_page.refresh(backend, 900)
    assert _text(out[-2]).endswith("not measured: agent unreachable: http://agent:9400 "
                                   "(HTTP 404 from /api/v1/node)")
    assert "unreachable" not in out[-1]
