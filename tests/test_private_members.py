"""A part does not touch another object's underscore members: it reaches a collaborator through
what the collaborator makes public (a port, a protocol), so either can change inside.

Checked from the source with `ast`: an attribute whose name starts with one underscore, read or
written on anything but `self` / `cls` (or `super()`), is a violation. One case per area that is
held to it (a folder, a file, or a glob of files); services/node's top level joins once the
worker is split (issue 22). The node scheduler's parts (shared/core/node_*.py) are held to it too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AREAS = ("services/placer", "services/node", "sim", "shared/core/node_*.py")


def foreign_private(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) \
                and owner.func.id == "super":
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_check_tells_own_members_from_another_objects() -> None:
    tree = ast.parse("class A(B):\n    def f(self, other):\n        self._x = other.y\n"
                     "        super()._g()\n        return self.port._command(other._z)\n")
    assert foreign_private(tree) == [(5, "self.port._command"), (5, "other._z")]


@pytest.mark.parametrize("area", AREAS)
def test_no_part_touches_another_objects_underscore_members(area: str) -> None:
    where = ROOT / area
    if "*" in area:
        files = sorted(ROOT.glob(area))
        assert files, f"{area} names no file"
    else:
        files = [where] if where.is_file() else sorted(where.rglob("*.py"))
    bad = [f"{path.relative_to(ROOT)}:{line}: {text}"
           for path in files
           for line, text in foreign_private(ast.parse(path.read_text()))]
    assert not bad, "underscore members of another object:\n" + "\n".join(bad)
