"""The set-up around the code: `make` without the PyTorch CPU index, conda's environment file, and the publishing
workflow."""

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_falls_back_at_once_when_the_cpu_wheel_index_is_unreachable():
    start = time.perf_counter()
    run = subprocess.run(["make", "-s", "torch-index", "TORCH_CPU_INDEX=http://127.0.0.1:9/whl/cpu"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    assert run.stdout.strip() == ""  # no --extra-index-url: pip will not retry an index it cannot reach
    assert "unreachable" in run.stderr
    assert time.perf_counter() - start < 20


def test_the_publishing_workflow_builds_and_uploads_the_book():
    flow = yaml.safe_load((REPO / ".github" / "workflows" / "book.yml").read_text())
    build = flow["jobs"]["build"]["steps"]
    commands = " ".join(step.get("run", "") for step in build)
    assert "make setup" in commands and "make book" in commands
    upload = next(step for step in build if str(step.get("uses", "")).startswith("actions/upload-pages-artifact"))
    assert upload["with"]["path"] == "_build/html"  # where `make book` writes the site
    assert "_build/html" in (REPO / "Makefile").read_text()
    assert flow["jobs"]["deploy"]["steps"][0]["uses"].startswith("actions/deploy-pages")
    assert flow["permissions"]["pages"] == "write" and flow["permissions"]["id-token"] == "write"


def test_the_conda_environment_installs_what_make_installs():
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    torch_version = re.search(r"^TORCH_VERSION \?= (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert f"torch=={torch_version}" in pip  # the version the book is tested with, not conda's older builds
    assert "-e .[book,test]" in pip and '$(BIN)/pip install -e ".[book,test]"' in (REPO / "Makefile").read_text()
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    required = re.search(r'requires-python = ">=(\d+\.\d+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert tuple(map(int, python.split("=")[1].split("."))) >= tuple(map(int, required.split(".")))
