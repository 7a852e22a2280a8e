"""What `pip install kvrt` ships: every package of the source tree, so that an installed kvrt
(not only an editable checkout) imports, and its command line (`kvrt bench`, `kvrt demo`) runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import kvrt

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
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression: setuptools warns at a table, and stops building one
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_the_changelog_has_a_section_for_the_released_version() -> None:
    """A release (`0.2.0`) has its section; a development version (`0.3.0.dev0`) is what the
    Unreleased section lists, on top of the last release, whose section is there."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    if ".dev" in version:
        assert re.search(r"^## \[\d+\.\d+\.\d+\] - \d{4}-\d{2}-\d{2}$", changelog, re.MULTILINE)
    else:
        assert f"## [{version}]" in changelog


def test_the_package_says_the_version_its_metadata_declares() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert kvrt.__version__ == declared
