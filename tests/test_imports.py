"""Imports flow one way: no import circle among the project's own modules.

The graph is built from the source with `ast`, not by importing, so a circle that Python happens
to tolerate (a function-level import, a `TYPE_CHECKING` block) still fails here. Every import
statement counts, wherever it is in the file: a lazy import inside a function only hides a circle
from the interpreter, and a type-only import still ties the two modules' designs together (the
way out is a small protocol one level down, not a guarded import). `importlib.import_module`
calls are not followed: their target is data, not a static dependency.

One case per area, so a circle is reported where it lives; a circle that crosses areas fails
every area it touches.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP_PACKAGES = ("services", "shared", "sim", "bench")

# area name -> module-name prefix; "services" holds what its named sub-areas do not
AREAS = {
    "services.node": "services.node",
    "services.placer": "services.placer",
    "services.gateway": "services.gateway",
    "services": "services",
    "shared": "shared",
    "sim": "sim",
    "bench": "bench",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for top in TOP_PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            found[module_name(path)] = path
    return found


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name a (possibly relative) `from ... import` refers to."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The project module that `name` loads: itself, or its longest known parent package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `module` imports anywhere in its file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module)
            # `from pkg import sub` imports the submodule when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        out |= {k for t in targets if (k := _known(t, modules)) is not None and k != module}
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def one_cycle(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path a -> b -> ... -> a inside a component, to name in the failure."""
    members = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first from `start`, until some module imports `start` back
        nxt: list[str] = []
        for node in frontier:
            if start in graph[node] and (node != start or not came_from):
                if node != start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
            for child in sorted(graph[node] & members):
                if child != start and child not in came_from:
                    came_from[child] = node
                    nxt.append(child)
        frontier = nxt
    return [start, start]  # unreachable for a real component


def area_of(module: str) -> str:
    for area, prefix in AREAS.items():
        if area != "services" and (module == prefix or module.startswith(prefix + ".")):
            return area
    return module.split(".")[0]


def test_the_graph_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    """The parser counts imports inside functions and under TYPE_CHECKING, and a relative one."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .c import X\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    modules = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py",
               "pkg.c": pkg / "c.py"}
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert one_cycle(["pkg.a", "pkg.b", "pkg.c"], graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]


@pytest.mark.parametrize("area", list(AREAS))
def test_no_import_circle(area: str) -> None:
    graph = import_graph()
    mine = [c for c in circles(graph) if any(area_of(m) == area for m in c)]
    assert not mine, "import circles:\n" + "\n".join(
        " -> ".join(one_cycle(c, graph)) + f"   (all of: {', '.join(c)})" for c in mine)
