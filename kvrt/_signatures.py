"""Parameters written once. A public call of a producer or a consumer is made by one of its
parts, whose method declares the call's parameters, where they are used; the public method
passes them on and takes its signature from there (`takes`), and so does `kvrt.blocking`'s
plain method from the public one. `inspect.signature` and type checkers see the parameters
that were written; each public method keeps its docstring, the contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

_P = ParamSpec("_P")
_R = TypeVar("_R")


def takes(
    source: Callable[Concatenate[Any, _P], Any],
) -> Callable[[Callable[..., _R]], Callable[Concatenate[Any, _P], _R]]:
    """Decorates a method that passes its arguments on to `source` (a method of another
    object, or of the async API): it takes `source`'s parameters, as `inspect.signature`
    (through `__wrapped__`, as `functools.wraps` sets it) and type checkers tell."""

    def decorate(method: Callable[..., _R]) -> Callable[Concatenate[Any, _P], _R]:
        method.__wrapped__ = source  # type: ignore[attr-defined]
        return cast(Callable[Concatenate[Any, _P], _R], method)

    return decorate
