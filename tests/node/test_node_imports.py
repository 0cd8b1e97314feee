"""The node package's files import one way: no circle among the modules of services/node (every
import counts, also those under TYPE_CHECKING or inside a function), so the composition root
(worker.py) sits on top and the runtime, book and outbox at the bottom. No servers needed."""

from __future__ import annotations

import ast
from pathlib import Path

NODE = Path(__file__).resolve().parents[2] / "services" / "node"
PREFIX = "services.node."


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The services/node modules (top-level files) that `path` imports."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith(PREFIX):
                head = name[len(PREFIX):].split(".")[0]
                if head in modules:
                    out.add(head)
    return out


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, as the modules along it (None: there is none)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def node_graph() -> dict[str, set[str]]:
    files = {p.stem: p for p in NODE.glob("*.py")}
    modules = set(files) - {"__init__", "__main__"}
    return {m: _imports(files[m], modules) - {m} for m in modules}


def test_the_circle_finder_finds_a_circle():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_among_the_node_modules():
    graph = node_graph()
    assert "worker" in graph and graph["worker"]  # the files were read
    assert _circle(graph) is None, " -> ".join(_circle(graph))


def test_the_plug_ins_never_import_the_worker():
    graph = node_graph()
    for plug_in in ("layer_moves", "pipeline_mode", "preload", "observe"):
        assert "worker" not in graph[plug_in], plug_in
