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


def test_the_package_ships_its_type_hints() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert (ROOT / "kvrt" / "py.typed").is_file()
    assert "py.typed" in config["package-data"]["kvrt"]


def test_the_license_file_is_the_license_the_package_declares() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert declared == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_the_changelog_has_a_section_for_the_released_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{version}]" in changelog and "## [Unreleased]" in changelog
