"""The policy core imports no I/O framework and reads no clock or global randomness."""

import ast
from pathlib import Path

import shared.core

CORE = Path(shared.core.__file__).parent
FORBIDDEN = {"torch", "nats", "redis", "fastapi", "asyncio", "openvino", "vllm", "time",
             "datetime", "threading", "socket", "os", "msgpack", "numpy"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_core_imports_nothing_impure():
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 8
    for f in files:
        bad = _imports(f) & FORBIDDEN
        assert not bad, f"{f.name} imports {bad}"


def test_core_uses_no_global_random():
    for f in CORE.glob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                assert not (node.value.id == "random" and node.attr != "Random"), \
                    f"{f.name} uses random.{node.attr}: pass a seeded random.Random instead"
