"""What `pip install kvrt` ships: every package of the source tree, so that an installed kvrt
(not only an editable checkout) imports, and its command line (`kvrt bench`, `kvrt demo`) runs."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_distribution_lists_every_package_of_the_source_tree() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(config["packages"])
    on_disk = set()
    for package, directory in config["package-dir"].items():
        for init in (ROOT / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / directory)
            on_disk.add(".".join([package, *relative.parts]))
    assert on_disk == declared
    assert "kvrt._bench" in declared  # `python -m kvrt` imports it first thing
