"""Run mypy over the package as it is installed: `kernels/` and `transports/` are `kvrt.kernels`
and `kvrt.transports` (setuptools package-dir), a mapping mypy cannot read from pyproject.
So build a tree of links in that shape under `.typecheck/` and check it there."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / ".typecheck"


def main() -> int:
    shutil.rmtree(TREE, ignore_errors=True)
    package = TREE / "kvrt"
    package.mkdir(parents=True)
    for source in (ROOT / "kvrt").iterdir():
        if source.suffix == ".py" or (source.is_dir() and source.name != "__pycache__"):
            (package / source.name).symlink_to(source)
    (package / "kernels").symlink_to(ROOT / "kernels")
    (package / "transports").symlink_to(ROOT / "transports")
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "kvrt"]
    return subprocess.call(command, cwd=TREE)


if __name__ == "__main__":
    sys.exit(main())
