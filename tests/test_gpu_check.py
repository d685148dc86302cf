"""``benchmarks/gpu_check.sh``'s chapter parts, with a stand-in for Python that records how each chapter was started."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.subprocess

STAND_IN = """#!/bin/sh
[ "$1" = -c ] && exit 0  # the script's own checks (GPU clocks): nothing to say here
echo "start $1 $OMP_NUM_THREADS ${SPHEREML_RUNS_BESIDE:-alone} $SPHEREML_PROFILE" >> "$RECORD"
sleep 1
echo "end $1" >> "$RECORD"
"""


def _run_parts(tmp_path: Path, *parts: str) -> tuple[list[str], str]:
    """Run gpu_check.sh with ``parts``; return the stand-in's record, line by line, and the summary."""
    stand_in, record, out = tmp_path / "python", tmp_path / "record.txt", tmp_path / "out"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PYTHON": str(stand_in), "RECORD": str(record), "OUT": str(out),
           "SPHEREML_RESUME": str(tmp_path / "resume"), "OMP_NUM_THREADS": "unset"}
    subprocess.run(["bash", "benchmarks/gpu_check.sh", *parts], cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=60)
    return record.read_text().splitlines(), (out / "summary.txt").read_text()


def test_listed_chapters_run_at_once_with_the_cores_shared_out(tmp_path):
    lines, summary = _run_parts(tmp_path, "chapters-at-once:01_a,02_b")
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert sorted(lines[:2]) == [f"start benchmarks/chapters/{name}.py {threads} 1 gpu" for name in ("01_a", "02_b")]
    assert sorted(lines[2:]) == ["end benchmarks/chapters/01_a.py", "end benchmarks/chapters/02_b.py"]  # together
    assert "chapter-01_a: exit 0" in summary and "chapter-02_b: exit 0" in summary


def test_listed_chapters_run_one_after_another(tmp_path):
    lines, summary = _run_parts(tmp_path, "chapter:01_a,02_b")
    assert lines == ["start benchmarks/chapters/01_a.py unset alone gpu", "end benchmarks/chapters/01_a.py",
                     "start benchmarks/chapters/02_b.py unset alone gpu", "end benchmarks/chapters/02_b.py"]
    assert "chapter-01_a: exit 0" in summary and "chapter-02_b: exit 0" in summary
