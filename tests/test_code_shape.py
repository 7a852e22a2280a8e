"""The runtime's code keeps a shape a reader can hold: no class of the request path (the runtime:
`kvrt/` but its engine integrations, `kernels/`, `transports/`) passes 300 lines; a class that
grows so gives a part of its work to one of its own, handed what it uses."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_CLASS_LINES = 300


def runtime_modules() -> list[Path]:
    found = [*(ROOT / "kernels").rglob("*.py"), *(ROOT / "transports").rglob("*.py")]
    found += [path for path in (ROOT / "kvrt").rglob("*.py") if "integrations" not in path.parts]
    return sorted(found)


def test_no_class_of_the_runtime_passes_300_lines() -> None:
    modules = runtime_modules()
    assert len(modules) > 50  # the tree was found
    long = [
        f"{path.relative_to(ROOT)}: {node.name}, {node.end_lineno - node.lineno + 1} lines"
        for path in modules
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]  # fmt: skip
    assert long == []
