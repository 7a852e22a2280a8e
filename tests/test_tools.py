"""What `tools/README.md` documents runs against the current code (on the CPU: no GPU needed)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
RECORDS = ROOT / "docs" / "bench"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" tests="5">
<testcase classname="tests.test_gpu_nccl" name="test_every_dtype_arrives_bit_for_bit"/>
<testcase classname="tests.test_gpu_ipc" name="test_a_killed_producer_fails_the_call">
<failure message="assert 3 == 4">trace</failure></testcase>
</testsuite></testsuites>
"""


def load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvrt_tool_{name}", TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tools_folder_holds_only_what_its_readme_documents() -> None:
    readme = (TOOLS / "README.md").read_text()
    present = {str(path.relative_to(TOOLS)) for path in TOOLS.rglob("*") if path.is_file()}
    present = {path for path in present if "__pycache__" not in path and path != "README.md"}
    assert present, "tools/ is empty"
    for path in present:
        assert f"`{path}`" in readme, f"tools/{path} is not documented in tools/README.md"


def test_gpu_summary_prints_the_tests_and_every_benchmarks_ratios_from_a_check_output(tmp_path: Path) -> None:
    (tmp_path / "versions.txt").write_text("torch 2.11.0+cu130 triton 3.6.0 gpus 2\n")
    (tmp_path / "gpu-tests.xml").write_text(JUNIT)
    for record, name in (("nccl", "nccl"), ("kernels", "kernels"), ("pull", "pull"), ("stream", "stream")):
        shutil.copy(RECORDS / f"{record}-h200.json", tmp_path / f"{name}.json")
    ipc = json.loads((RECORDS / "ipc-h200.json").read_text())
    (tmp_path / "ipc-items.json").write_text(json.dumps(ipc["items"]))
    (tmp_path / "ipc-paged.json").write_text(json.dumps(ipc["paged"]))
    (tmp_path / "ipc-fused.json").write_text(json.dumps({"peer": {"best_s": 0.01089}, "4 warps": {"best_s": 0.01188}}))
    shutil.copy(RECORDS / "nixl-one-gpu-h200.json", tmp_path / "nixl.json")

    result = subprocess.run(
        [sys.executable, str(TOOLS / "gpu_summary.py"), str(tmp_path)], capture_output=True, text=True, check=False
    )

    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "torch 2.11.0+cu130" in out
    assert "gpu tests: 5 run, 1 failed, 0 errors, 2 skipped" in out
    assert "FAILED test_a_killed_producer_fails_the_call: assert 3 == 4" in out
    assert re.search(r"^\s+1024 \|\s+32 \|\s+368\.1 \|\s+344\.7 \|\s+94% \|", out, re.MULTILINE), out  # nccl, 1 GiB
    assert "cuda_ipc items: size MiB" in out
    assert re.search(r"kvrt gather, dp=4\s+\|\s+4092 \|\s+99\.0%", out), out
    assert re.search(r"^pull: raw NCCL 11\.44 ms", out, re.MULTILINE), out
    assert re.search(r"^pull over cuda_ipc: peer copy 10\.88 ms", out, re.MULTILINE), out
    assert "fused pool-to-pool kernel alone: peer copy 10.89 ms; 4 warps 11.88 ms (92%)" in out
    assert re.search(r"^\s+16 MiB pull, 16-slot pages \| 36\.882 \| 38\.800 \| 95%$", out, re.MULTILINE), out  # nixl
    assert re.search(r"stream: raw NCCL one layer 0\.131 ms .*\n\s+stream:\s+0\.216 ms median", out), out


def test_gpu_summary_of_an_empty_output_folder_prints_only_its_heading(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(TOOLS / "gpu_summary.py"), str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "==== kvrt GPU check ===="


def test_gpu_check_script_parses() -> None:
    result = subprocess.run(["bash", "-n", str(TOOLS / "gpu_check.sh")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_typecheck_links_kernels_and_transports_in_as_subpackages(tmp_path: Path) -> None:
    package = load_tool("typecheck").link_tree(ROOT, tmp_path / "tree")
    assert (package / "kernels" / "paged_kv.py").resolve() == ROOT / "kernels" / "paged_kv.py"
    assert (package / "transports" / "tcp.py").resolve() == ROOT / "transports" / "tcp.py"
    assert (package / "__init__.py").resolve() == ROOT / "kvrt" / "__init__.py"
    assert not (package / "__pycache__").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_typecheck_fails_on_a_type_error_in_a_subpackage_and_passes_without_it(tmp_path: Path) -> None:
    for folder in ("kvrt", "kernels", "transports"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "pyproject.toml").write_text("[tool.mypy]\nstrict = true\n")
    (tmp_path / "kernels" / "bad.py").write_text("def half(x: int) -> int:\n    return x / 2\n")
    typecheck = load_tool("typecheck")
    assert typecheck.main(tmp_path, imports=False) == 1
    (tmp_path / "kernels" / "bad.py").write_text("def half(x: int) -> int:\n    return x // 2\n")
    assert typecheck.main(tmp_path, imports=False) == 0


LAYERS = """
[tool.mypy]
strict = true

[tool.importlinter]
root_package = "kvrt"
exclude_type_checking_imports = true

[[tool.importlinter.contracts]]
name = "layers"
type = "layers"
containers = ["kvrt"]
layers = ["_consumer", "transports", "_messages"]
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_import_check_fails_on_an_import_against_the_layers_even_from_a_linked_subpackage(
    tmp_path: Path,
) -> None:
    for folder in ("kvrt", "kernels", "transports"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "pyproject.toml").write_text(LAYERS)
    (tmp_path / "kvrt" / "_messages.py").write_text("")
    (tmp_path / "kvrt" / "_consumer.py").write_text("from kvrt.transports import tcp as tcp\n")
    (tmp_path / "transports" / "tcp.py").write_text("from kvrt import _messages as _messages\n")
    typecheck = load_tool("typecheck")
    assert typecheck.main(tmp_path) == 0
    (tmp_path / "transports" / "tcp.py").write_text("from kvrt import _consumer as _consumer\n")  # a cycle
    assert typecheck.main(tmp_path) != 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_consensus_round_costs_diagnostic_times_kvrt_rounds_from_its_trace_events() -> None:
    result = subprocess.run(
        [sys.executable, str(TOOLS / "diagnostics" / "consensus_round_costs.py"),
         "--world", "2", "--rounds", "14", "--turns", "1"],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {line.split("|")[0].strip(): line for line in result.stdout.splitlines() if "|" in line}
    number = r"\d+\.\d+"
    assert re.fullmatch(rf"kvrt\s+\| {number}\s+\| {number}\s+\| {number}", rows["kvrt"]), result.stdout
    assert re.fullmatch(rf"minimal loop\s+\| {number}\s+\| {number}\s+\| {number}", rows["minimal loop"])
    assert re.fullmatch(rf"sync\s+\| {number}\s+\| -\s+\| -", rows["sync"])


@pytest.mark.timeout(120)
def test_the_route_tool_lists_the_files_a_request_passes_through_and_the_guide_walks_each() -> None:
    result = subprocess.run(
        [sys.executable, str(TOOLS / "route.py")], capture_output=True, text=True, timeout=100, check=False
    )
    assert result.returncode == 0, result.stderr
    route, touched = result.stdout.split("touched: ")
    files = re.findall(r"^  (\S+\.py): ", route, re.MULTILINE)
    assert route.startswith(f"route: {len(files)} files")
    assert {"kvrt/_producer/_producer.py", "kvrt/_consumer/_consumer.py", "transports/tcp.py"} <= set(files)
    assert set(files) <= set(re.findall(r"^  (\S+\.py): ", touched, re.MULTILINE))
    guide = (ROOT / "docs" / "guide.md").read_text().split("## Where a byte goes")[1].split("\n## ")[0]
    walked = re.findall(r"^\d+\. `(\S+\.py)`", guide, re.MULTILINE)
    assert sorted(walked) == sorted(files), "the guide's route is not the one the trace sees"
