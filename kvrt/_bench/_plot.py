"""PNG plots of benchmark results (matplotlib, the `plot` extra), for `kvrt bench NAME --plot`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrt._errors import KVRTError


def require_pyplot() -> None:
    """Refuse `--plot` without matplotlib (a `KVRTError` saying what to install)."""
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise KVRTError("--plot needs matplotlib: pip install 'kvrt[plot]'") from None
    return plt


def lines(
    path: Path, title: str, x_label: str, y_label: str, series: dict[str, tuple[list[float], list[float]]], *,
    log_x: bool = False, log_y: bool = False,
) -> Path:  # fmt: skip
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for name, (xs, ys) in series.items():
        axes.plot(xs, ys, marker="o", label=name)
    axes.set(title=title, xlabel=x_label, ylabel=y_label)
    if log_x:
        axes.set_xscale("log")
    if log_y:
        axes.set_yscale("log")
    axes.grid(True, alpha=0.3)
    axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def bars(path: Path, title: str, y_label: str, values: dict[str, float]) -> Path:
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7.0, 4.0))
    axes.barh(list(values), list(values.values()))
    axes.set(title=title, xlabel=y_label)
    axes.invert_yaxis()
    axes.grid(True, axis="x", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
