"""One style check for the whole repository: pyflakes and at most 120 columns (``[tool.ruff]`` in pyproject.toml)
over the library, the tests, the benchmarks and the chapters' code cells (their ``.ipynb`` pairs)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    chapters = sorted(str(p.relative_to(REPO)) for p in (REPO / "notebooks").glob("*.ipynb"))
    paths = ["src", "tests", "benchmarks", *chapters]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *paths],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
