"""Type-check the package and check its import layers, as it is installed: `kernels/` and
`transports/` are `kvrt.kernels` and `kvrt.transports` (setuptools package-dir), a mapping
neither mypy nor import-linter can read from pyproject. So build a tree of links in that
shape under `.typecheck/` and check it there: mypy (strict), then lint-imports (the
contracts in pyproject's `[tool.importlinter]`).

    python tools/typecheck.py          (what `make lint` runs; exit status 0 when both pass)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


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


def main(root: Path = ROOT, *, imports: bool = True) -> int:
    """Check `root`'s package with `root`/pyproject.toml's settings: mypy, then (unless
    `imports` is False) the import contracts. The first failing exit status, else 0."""
    tree = root / ".typecheck"
    link_tree(root, tree)
    config = str(root / "pyproject.toml")
    status = subprocess.call([sys.executable, "-m", "mypy", "--config-file", config, "kvrt"], cwd=tree)
    if status or not imports:
        return status
    # Run in the tree, so that `kvrt` is the linked package (the working directory comes
    # first on the path), with its kernels and transports.
    return subprocess.call([sys.executable, "-c", LINT_IMPORTS, "--no-cache", config], cwd=tree)


if __name__ == "__main__":
    sys.exit(main())
