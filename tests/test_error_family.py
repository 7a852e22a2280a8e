"""Every error kvrt raises is a `KVRTError`, and every class of the family lives in one module
(`kvrt._errors`), where its tree is drawn: a caller catches kvrt's failures with one `except`."""

from __future__ import annotations

import ast
import builtins
import inspect
from pathlib import Path

import pytest

import kvrt
import kvrt._errors
from kvrt._consensus import Outcome, Status
from kvrt._tensors import chunk_plan

PACKAGE = Path(kvrt.__file__).parent
TOOLS = {"_demo.py", "_attack.py", "_bench", "_bench.py"}
"""Programs, not the library: the demo, the attack suite and the benchmarks report their own
checks failing (a `RuntimeError` there is a finding, not an error a caller handles)."""
INVARIANTS = {"AssertionError", "NotImplementedError", "AttributeError"}
"""A broken invariant of kvrt's own code and an abstract method (bugs, not outcomes), and a
module's `__getattr__` (Python's protocol asks for AttributeError)."""


def library_modules() -> list[Path]:
    return [
        path for path in sorted(PACKAGE.rglob("*.py"))
        if not TOOLS.intersection(path.relative_to(PACKAGE).parts)
    ]  # fmt: skip


def test_no_module_of_the_library_raises_a_builtin_exception_by_name() -> None:
    raised = []
    for path in library_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                name = node.exc.func.id
                if isinstance(getattr(builtins, name, None), type) and name not in INVARIANTS:
                    raised.append(f"{path.relative_to(PACKAGE)}:{node.lineno} raises {name}")
    assert raised == []


def test_every_error_class_kvrt_exports_is_defined_in_the_errors_module_and_drawn_in_its_tree() -> None:
    exported = [value for value in vars(kvrt).values() if inspect.isclass(value) and issubclass(value, kvrt.KVRTError)]
    assert len(exported) > 10
    for error in exported:
        assert error.__module__ == "kvrt._errors", f"{error.__name__} is defined in {error.__module__}"
        assert error.__name__ in (kvrt._errors.__doc__ or ""), f"{error.__name__} is missing from the tree"


def test_a_chunk_plan_or_an_outcome_out_of_range_is_refused_with_a_typed_error() -> None:
    with pytest.raises(kvrt.InvalidInputError, match="layers_per_chunk must be >= 1"):
        chunk_plan(8, 0)
    with pytest.raises(kvrt.InvalidInputError, match="matched_tokens must be in"):
        Outcome(Status.OK, -2)
