"""Dependencies point one way: every import in ``backend/`` (at module level, inside a function, or
only for type checking) goes from a later stage of the pipeline to an earlier one, and no set of
modules imports itself around a circle. A stage that needs something of a later one is handed it
(the cache gets the driver's backward compiler and the runtime's wrap as arguments); a type that
two stages share lives below both (``cgtrees.compiled``, ``cgtrees.context``)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent / "backend"

# Lower first: a module may import its own package and anything of a lower rank.
RANKS = {
    "config": 0, "counters": 0, "logs": 0, "compiled": 0, "capture": 0, "marks": 0,
    "context": 1, "progress": 1,  # progress: the compile's progress line, above counters, below api
    "compiled_function": 1,  # the level-1 value: built by aot, stored by the cache, saved by precompile
    "runtime": 2,
    "codegen": 3,
    "cache": 4,
    "aot": 5,
    "precompile": 6, "demo": 6,
    "api": 7, "__main__": 7,
    "__init__": 8,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("cgtrees", *path.relative_to(ROOT).with_suffix("").parts)  # installed as cgtrees
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _resolve(base, modules)
                if target:
                    found.add(target)
        elif isinstance(node, ast.Import):
            found |= {t for t in (_resolve(a.name, modules) for a in node.names) if t}
    found.discard(name)
    return found


def _part(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, target) for target in _imports(name, path, modules))
    return graph


def test_every_part_of_the_backend_has_a_rank():
    assert {_part(name) for name in _graph()} <= set(RANKS), set(map(_part, _graph())) - set(RANKS)


def test_imports_point_from_later_stages_to_earlier_ones():
    wrong = [f"{a} -> {b}" for a, b in _graph().edges
             if _part(a) != _part(b) and RANKS[_part(a)] <= RANKS[_part(b)]]
    assert not wrong, wrong


def test_no_module_imports_itself_around_a_circle():
    cycles = [" -> ".join(c) for c in nx.simple_cycles(_graph())]
    assert not cycles, cycles
