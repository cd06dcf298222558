"""The topology panel beside the transfer charts (the Tiers page): each GPU's PCIe link (now and
at most), its one-direction maximum and the host NUMA node nearest the GPU; the host's NUMA
nodes; and where the engine process's memory, its pinned host KV pool among it, lies per node.
So a transfer figure is never read without the topology it was measured on (the guide's failure
mode 5: a pool on the far NUMA node of its GPU).

Pure: the node collectors' series (``Backend.node(METRICS)``: the catalog's
``kvscope_gpu_topology_info``, ``kvscope_pcie_link_max_bytes_per_second``,
``kvscope_host_numa_nodes``, ``kvscope_process_numa_bytes`` and ``kvscope_collector_up``;
docs/collectors.md) in, Dash components out. What no collector gives reads "not measured", a
node without a GPU "no GPU", never 0. The panel has the id :data:`SECTION_ID`; each instance's
GPU part, host NUMA nodes and engine placement carry ``data-state`` (tests read them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dash import html

from kvscope import catalog as m
from kvscope.dashboard.series import bytes_text
from kvscope.vocabulary import NOT_MEASURED

SECTION_ID = "topology"
TITLE = "Topology these transfers ran on"
METRICS = tuple(spec.name for spec in (
    m.GPU_TOPOLOGY_INFO, m.PCIE_LINK_MAX_BYTES_PER_SECOND, m.HOST_NUMA_NODES,
    m.PROCESS_NUMA_BYTES, m.COLLECTOR_UP))
NO_GPU = "no GPU"
PANEL_STYLE = {"border": "1px solid #ddd", "borderRadius": "6px", "padding": "8px 12px",
               "margin": "8px 16px 8px 0", "fontSize": "14px", "lineHeight": "1.5"}
CELL_STYLE = {"borderBottom": "1px solid #eee", "padding": "3px 8px", "textAlign": "left"}
GPU_COLUMNS = ("GPU", "PCIe link now", "link at most", "link maximum, one direction",
               "nearest NUMA node")


@dataclass(frozen=True)
class GpuLink:
    """One GPU's link. Strings as the info metric's labels; None where NVML or the kernel does
    not say. ``link_max``: bytes/s one direction, or None."""

    gpu: str
    generation: str | None = None
    width: str | None = None
    max_generation: str | None = None
    max_width: str | None = None
    numa_node: str | None = None
    link_max: float | None = None


@dataclass(frozen=True)
class Topology:
    """One node's topology. ``instance``: "" for the one agent. ``gpu_up``/``numa_up``: the
    collector's ``kvscope_collector_up`` (None: not reported, e.g. switched off).
    ``numa_nodes``: online host NUMA nodes, or None. ``engine_bytes``: dict[node, bytes] of the
    engine process's memory, or None (no ``engine_pid`` configured, or not readable)."""

    instance: str = ""
    gpus: tuple[GpuLink, ...] = ()
    gpu_up: bool | None = None
    numa_up: bool | None = None
    numa_nodes: int | None = None
    engine_bytes: Mapping[str, float] | None = None


@dataclass
class _Node:
    gpus: dict[str, dict] = field(default_factory=dict)
    links: dict[str, float] = field(default_factory=dict)
    up: dict[str, bool] = field(default_factory=dict)
    numa_nodes: int | None = None
    engine_bytes: dict[str, float] | None = None


def _known(value: object) -> str | None:
    return str(value) if value not in (None, "") else None


def topologies(series: Sequence[Mapping]) -> list[Topology]:
    """``Backend.node`` series -> one :class:`Topology` per instance, sorted by instance."""
    nodes: dict[str, _Node] = {}
    for s in series:
        labels = s.get("labels") or {}
        node = nodes.setdefault(str(labels.get("instance", "")), _Node())
        name, value = s.get("name"), float(s.get("value", 0.0))
        if name == m.GPU_TOPOLOGY_INFO.name and labels.get("gpu") is not None:
            node.gpus[str(labels["gpu"])] = labels
        elif name == m.PCIE_LINK_MAX_BYTES_PER_SECOND.name and labels.get("gpu") is not None:
            node.links[str(labels["gpu"])] = value
        elif name == m.COLLECTOR_UP.name:
            node.up[str(labels.get("collector"))] = value == 1.0
        elif name == m.HOST_NUMA_NODES.name:
            node.numa_nodes = int(value)
        elif name == m.PROCESS_NUMA_BYTES.name and _known(labels.get("numa_node")):
            node.engine_bytes = {**(node.engine_bytes or {}), str(labels["numa_node"]): value}
    out = []
    for instance, node in sorted(nodes.items()):
        gpus = tuple(GpuLink(gpu, *(_known(labels.get(k)) for k in (
            "pcie_generation", "pcie_width", "pcie_max_generation", "pcie_max_width",
            "numa_node")), node.links.get(gpu))
            for gpu, labels in sorted(node.gpus.items(), key=lambda kv: _gpu_order(kv[0])))
        out.append(Topology(instance, gpus, node.up.get("gpu"), node.up.get("numa"),
                            node.numa_nodes, node.engine_bytes))
    return out


def _gpu_order(gpu: str) -> tuple:
    return (0, int(gpu), "") if gpu.isdigit() else (1, 0, gpu)


def link_text(generation: str | None, width: str | None) -> str:
    """"Gen 4 x16"; a part NVML did not give reads "not measured"."""
    if generation is None and width is None:
        return NOT_MEASURED
    return (f"Gen {generation}" if generation else f"Gen {NOT_MEASURED}") + " " + (
        f"x{width}" if width else f"x {NOT_MEASURED}")


def placement_text(engine_bytes: Mapping[str, float]) -> str:
    """"node 0: 1.20 GiB (96%) · node 1: 50.0 MiB (4%)", nodes in order (binary units, as the
    Overview's other memory figures)."""
    total = sum(engine_bytes.values())
    return " · ".join(
        f"node {node}: {bytes_text(size)}" + (f" ({size / total:.0%})" if total else "")
        for node, size in sorted(engine_bytes.items(), key=lambda kv: _gpu_order(kv[0])))


def _gpu_part(t: Topology) -> html.Div:
    if not t.gpus:
        why = ("the gpu collector is off" if t.gpu_up is None else
               "NVML is not there: no NVIDIA driver" if not t.gpu_up else "NVML lists none")
        return html.Div(f"GPUs: {NO_GPU} ({why}); PCIe link and GPU NUMA node {NOT_MEASURED}",
                        className="topology-gpus", **{"data-state": "no-gpu"})
    cell = lambda text: html.Td(text, style=CELL_STYLE)  # noqa: E731
    rows = [html.Tr([cell(g.gpu), cell(link_text(g.generation, g.width)),
                     cell(link_text(g.max_generation, g.max_width)),
                     cell(f"{g.link_max / 1e9:.3g} GB/s" if g.link_max else NOT_MEASURED),
                     cell(g.numa_node if g.numa_node is not None else NOT_MEASURED)])
            for g in t.gpus]
    head = html.Tr([html.Th(c, style=CELL_STYLE) for c in GPU_COLUMNS])
    return html.Table([html.Thead(head), html.Tbody(rows)], className="topology-gpus",
                      style={"borderCollapse": "collapse"}, **{"data-state": "measured"})


def _numa_part(t: Topology) -> list[html.Div]:
    nodes = (html.Div(f"host NUMA nodes online: {t.numa_nodes}", className="topology-numa-nodes",
                      **{"data-state": "measured"}) if t.numa_nodes is not None else
             html.Div(f"host NUMA nodes: {NOT_MEASURED} (the kernel shows none, or the numa "
                      "collector is off)", className="topology-numa-nodes",
                      **{"data-state": "not-measured"}))
    if t.engine_bytes:
        placement = html.Div(f"engine process memory by NUMA node (its host KV pool among it): "
                             f"{placement_text(t.engine_bytes)}",
                             className="topology-engine-numa", **{"data-state": "measured"})
    else:
        why = ("no [collectors.numa] engine_pid set and no tap heard from, or the kernel "
               "has no numa_maps"
               if t.numa_up else
               "the numa collector is down: see kvscope_collector_up{collector=\"numa\"}"
               if t.numa_up is False else "the numa collector is off")
        placement = html.Div(f"engine process memory by NUMA node: {NOT_MEASURED} ({why})",
                             className="topology-engine-numa", **{"data-state": "not-measured"})
    return [nodes, placement]


def section(series: Sequence[Mapping]) -> list:
    """The panel's children from ``Backend.node(METRICS)``'s series."""
    found = topologies(series)
    if not found:
        return [html.H4(TITLE, style={"margin": "4px 0"}),
                html.Div(f"{NOT_MEASURED}: the agent reports no node collectors")]
    parts: list = [html.H4(TITLE, style={"margin": "4px 0"})]
    for t in found:
        if t.instance:
            parts.append(html.H5(t.instance, style={"margin": "6px 0 2px"}))
        parts += [_gpu_part(t), *_numa_part(t)]
    return parts


def placeholder(text: str = "loading…") -> list:
    """The panel before the first refresh, or when the node cannot be read."""
    return [html.H4(TITLE, style={"margin": "4px 0"}), html.Div(text)]
