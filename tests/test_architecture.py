"""The package's import graph keeps the architecture's shape (docs/architecture.md): no import
cycles, data flowing one way (vocabulary and catalog below everything; the agent's data path
never importing its sinks, the service or the consumers), and the heavy libraries each confined
to the part that owns them.

The graph is read from the source (``.py`` by ``ast``; ``.pyx``/``.pxd`` by their import lines),
so it holds every import, a lazy one inside a function included: a lazy import still ties two
modules together, it only hides the cycle until the day both load at once.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvscope"

# part -> parts it must never import (prefixes of module names)
FORBIDDEN = {
    "kvscope.vocabulary": ("kvscope.",),
    "kvscope.catalog": ("kvscope.events", "kvscope.samples", "kvscope.agent", "kvscope.engine",
                        "kvscope.exporter", "kvscope.service", "kvscope.dashboard",
                        "kvscope.analysis"),
    "kvscope.samples": ("kvscope.events", "kvscope.agent", "kvscope.engine", "kvscope.exporter",
                        "kvscope.service", "kvscope.dashboard", "kvscope.analysis"),
    "kvscope.percentiles": ("kvscope.events", "kvscope.agent", "kvscope.engine",
                            "kvscope.exporter", "kvscope.service", "kvscope.dashboard",
                            "kvscope.analysis"),
    "kvscope.events": ("kvscope.catalog", "kvscope.agent", "kvscope.engine", "kvscope.exporter",
                       "kvscope.service", "kvscope.dashboard", "kvscope.analysis"),
    "kvscope.agent": ("kvscope.engine", "kvscope.exporter", "kvscope.service", "kvscope.dashboard",
                      "kvscope.analysis", "kvscope.rollout", "kvscope.mixin", "kvscope.cli",
                      "kvscope.demo"),
    "kvscope.exporter": ("kvscope.service", "kvscope.dashboard", "kvscope.analysis",
                         "kvscope.rollout", "kvscope.mixin", "kvscope.cli", "kvscope.demo"),
    "kvscope.engine": ("kvscope.agent", "kvscope.exporter", "kvscope.service",
                       "kvscope.dashboard", "kvscope.rollout", "kvscope.cli", "kvscope.demo"),
}
# third-party library -> the only parts that may import it (STYLE.md, house rule 2)
CONFINED = {
    "prometheus_client": ("kvscope.exporter",),
    "dash": ("kvscope.dashboard",),
    "dash_ag_grid": ("kvscope.dashboard",),
    "fastapi": ("kvscope.service",),
    "uvicorn": ("kvscope.service",),
}
_CYTHON_IMPORT = re.compile(
    r"^\s*(?:from\s+([\w.]+)\s+c?import\s+\(?([\w\s,]+?)\)?\s*$|c?import\s+([\w.]+))", re.M)


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, package_dir: Path) -> set[str]:
    """Every dotted name ``path`` imports, and for ``from X import y`` both ``X`` and ``X.y``
    (``y`` may be a module); relative imports resolved."""
    text = path.read_text()
    names: set[str] = set()
    if path.suffix != ".py":
        for match in _CYTHON_IMPORT.finditer(text):
            if match[3]:
                names.add(match[3])
            else:
                names.add(match[1])
                names.update(f"{match[1]}.{n}" for n in re.split(r"[\s,]+", match[2]) if n)
        return names
    package = module_name(path, package_dir).split(".")
    if path.stem != "__init__":
        package = package[:-1]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(package: Path = PACKAGE) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(graph, external)``: per kvscope module, the kvscope modules it imports, and the
    top-level names of everything else it imports."""
    files: dict[str, list[Path]] = {}
    for path in package.rglob("*"):
        if path.suffix in (".py", ".pyx", ".pxd"):
            files.setdefault(module_name(path, package), []).append(path)
    graph, external = {}, {}
    for name, paths in files.items():
        imported = set().union(*(imported_names(p, package) for p in paths))
        graph[name] = {n for n in imported if n in files and n != name}
        external[name] = {n.split(".")[0] for n in imported if n.split(".")[0] != "kvscope"}
    return graph, external


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan 1972), each sorted:
    every import cycle lies in one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p.rstrip(".") or module.startswith(p.rstrip(".") + ".") for p in prefixes)


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    """Hand-made graphs: a -> b -> c -> a is one cycle, d -> e a chain, f -> g -> f a second."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "f": {"g"},
             "g": {"f"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["f", "g"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reader_sees_lazy_relative_and_cython_imports(tmp_path):
    """A function-level import, a relative one and a ``cimport`` all count as edges."""
    pkg = tmp_path / "kvscope"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "sub" / "b.py").write_text("from kvscope.sub.c import x\n")
    (pkg / "sub" / "c.pyx").write_text("from kvscope.sub.a cimport y\n")
    graph, _ = import_graph(pkg)
    assert graph["kvscope.sub.a"] == {"kvscope.sub", "kvscope.sub.b"}
    assert cycles(graph) == [["kvscope.sub.a", "kvscope.sub.b", "kvscope.sub.c"]]


def test_the_package_has_no_import_cycles():
    graph, _ = import_graph()
    assert len(graph) > 100  # the reader found the package
    assert cycles(graph) == []


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_data_flows_one_way(part):
    graph, _ = import_graph()
    wrong = sorted(f"{a} -> {b}" for a, imported in graph.items() if _in(a, (part,))
                   for b in imported if _in(b, FORBIDDEN[part]) and not _in(b, (part,)))
    assert wrong == []


@pytest.mark.parametrize("library", sorted(CONFINED))
def test_libraries_stay_in_the_part_that_owns_them(library):
    _, external = import_graph()
    assert sorted(m for m, names in external.items()
                  if library in names and not _in(m, CONFINED[library])) == []
