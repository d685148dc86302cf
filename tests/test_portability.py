"""A chapter runs outside this repository: its ``.ipynb`` alone in an empty folder, executed by papermill in a
fresh virtual environment where ``sphereml`` comes from its built wheel, never from the checkout.

This is what a reader does with a downloaded notebook (or Colab, where the chapter's set-up cell installs
``sphereml`` itself): nothing may rely on the repository's files, the editable install or the working
directory.  The fresh environment gets the wheel and nothing else of ``sphereml``; the other dependencies
(torch, papermill, the kernel) are borrowed read-only from the test environment's site-packages through a
``.pth`` line, which does not run that environment's own ``.pth`` files, so the editable install stays out.
The data comes through ``$SPHEREML_DATA``.
"""

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OFFLINE = REPO / "tests" / "offline"  # the kernels' network guard (sitecustomize), as for every chapter run
FASHION = Path("/usr/share/datasets/fashion-mnist")
CHAPTER = "01_hypersphere"

pytestmark = [pytest.mark.notebook, pytest.mark.subprocess,
              pytest.mark.skipif(not FASHION.is_dir(), reason="needs Fashion-MNIST")]


def _run(*args, **kwargs):
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, f"{args[:4]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory):
    """A virtual environment holding sphereml's wheel; its other dependencies borrowed from this one."""
    root = tmp_path_factory.mktemp("portable")
    source = root / "source"  # a copy, so the build writes nothing into the checkout
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", root / "wheels", source)
    (wheel,) = (root / "wheels").glob("sphereml-*.whl")
    env = root / "env"
    _run(sys.executable, "-m", "venv", env)
    python = env / "bin" / "python"
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    borrowed = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    (purelib / "_borrowed_dependencies.pth").write_text("\n".join(sorted(borrowed)) + "\n")
    _run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel)
    return env


def test_the_wheel_not_the_checkout_provides_sphereml(fresh_env):
    where = _run(fresh_env / "bin" / "python", "-c", "import sphereml; print(sphereml.__file__)", cwd=fresh_env)
    assert Path(where.strip()).is_relative_to(fresh_env) and "src" not in Path(where.strip()).parts


def _run_alone(fresh_env, tmp_path, chapter: str, **extra_env) -> tuple[dict, Path]:
    """Execute ``chapter``'s .ipynb, copied alone into an empty folder, in ``fresh_env``; (executed, folder)."""
    folder = tmp_path / "reader"
    folder.mkdir()
    notebook = folder / f"{chapter}.ipynb"
    notebook.write_bytes((REPO / "notebooks" / f"{chapter}.ipynb").read_bytes())
    data = tmp_path / "data"
    data.mkdir()
    (data / "fashion-mnist").symlink_to(FASHION)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SPHEREML_", "PYTHON"))}
    env.update(PATH=f"{fresh_env / 'bin'}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(OFFLINE),
               SPHEREML_PROFILE="smoke", SPHEREML_DATA=str(data), SPHEREML_NO_DOWNLOAD="1", MPLBACKEND="Agg",
               **extra_env)
    _run(fresh_env / "bin" / "python", "-m", "papermill", "--no-progress-bar", "-k", "python3", notebook.name,
         "executed.ipynb", cwd=folder, env=env)
    executed = json.loads((folder / "executed.ipynb").read_text())
    errors = [o for c in executed["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors[:1]
    return executed, folder


def test_a_chapter_notebook_runs_alone_in_an_empty_folder(fresh_env, tmp_path):
    executed, folder = _run_alone(fresh_env, tmp_path, CHAPTER)
    printed = "".join("".join(o.get("text", "")) for c in executed["cells"] for o in c.get("outputs", [])
                      if o.get("name") == "stdout")
    assert "profile=smoke" in printed
    metrics = json.loads((folder / "_build" / "runs" / "smoke" / CHAPTER / "metrics.json").read_text())
    assert metrics["profile"] == "smoke" and metrics["claims"] and metrics["figures"]


def test_the_conclusion_runs_alone_from_a_clone_of_the_repository(fresh_env, tmp_path):
    """Chapter 10 reads the ledger, the benchmark results and the errata page; outside the repository it clones
    them (here from this checkout's committed state, as ``$SPHEREML_REPO``, into a fresh home's cache)."""
    home = tmp_path / "home"
    home.mkdir()
    executed, folder = _run_alone(fresh_env, tmp_path, "10_conclusion", HOME=str(home),
                                  SPHEREML_REPO=f"file://{REPO}")
    assert (home / ".cache" / "sphereml" / "sources" / "book" / "claims.json").is_file()
    metrics = json.loads((folder / "_build" / "runs" / "smoke" / "10_conclusion" / "metrics.json").read_text())
    assert metrics["figures"] and metrics["params"]["ledger"] == ""

