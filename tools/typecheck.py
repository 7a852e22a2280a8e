"""Run mypy over the package as it is installed: `kernels/` and `transports/` are `kvrt.kernels`
and `kvrt.transports` (setuptools package-dir), a mapping mypy cannot read from pyproject.
So build a tree of links in that shape under `.typecheck/` and check it there.

    python tools/typecheck.py          (what `make lint` runs; exit status: mypy's)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def link_tree(root: Path, tree: Path) -> Path:
    """Make `tree`/kvrt: links to `root`/kvrt's modules and folders, with `kernels` and
    `transports` linked in as subpackages. Returns the package folder."""
    shutil.rmtree(tree, ignore_errors=True)
    package = tree / "kvrt"
    package.mkdir(parents=True)
    for source in (root / "kvrt").iterdir():
        if source.suffix == ".py" or (source.is_dir() and source.name != "__pycache__"):
            (package / source.name).symlink_to(source)
    (package / "kernels").symlink_to(root / "kernels")
    (package / "transports").symlink_to(root / "transports")
    return package


def main(root: Path = ROOT) -> int:
    """Check `root`'s package with `root`/pyproject.toml's settings; mypy's exit status."""
    tree = root / ".typecheck"
    link_tree(root, tree)
    command = [sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml"), "kvrt"]
    return subprocess.call(command, cwd=tree)


if __name__ == "__main__":
    sys.exit(main())
