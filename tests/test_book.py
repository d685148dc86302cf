"""The papermill runner (python -m sphereml.book): parameters, exit codes, the execution cache."""

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from sphereml import book
from sphereml.book import runner

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value, default, expected", [
    ("3", 1, 3), ("0.5", 1.0, 0.5), ("2", 1.0, 2.0), ("True", False, True), ("cpu", "auto", "cpu"),
    ("[1, 2]", [0], [1, 2]), (7, 1, 7),
])
def test_parameter_conversion(value, default, expected):
    assert runner._convert("p", value, default) == expected


@pytest.mark.parametrize("value, default", [("abc", 1), ("1.5", 1), ("1", True), ("yes", False)])
def test_parameter_conversion_errors(value, default):
    with pytest.raises(ValueError, match="parameter 'p' must be"):
        runner._convert("p", value, default)


# ----------------------------------------------------------- papermill runner on a tiny notebook
@pytest.fixture
def tiny_chapter(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell('profile = "auto"\nrepeats = 2\noutput_dir = ""')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [
        params,
        nbformat.v4.new_code_cell(
            "from sphereml.book.chapter import Chapter\n"
            "ch = Chapter('tiny', profile, 'cpu', 0, output_dir)\n"
            "assert repeats >= 0, 'negative repeats'\n"
            "ch.record(repeats=repeats, profile_used=ch.profile)"
        ),
    ]
    nbformat.write(nb, folder / "tiny.ipynb")
    return folder


@pytest.mark.subprocess
def test_run_chapter_with_parameters(tiny_chapter, tmp_path):
    out = tmp_path / "out"
    executed = book.run_chapter("tiny", {"profile": "smoke", "repeats": "5"}, out, tiny_chapter)
    assert executed == out / "tiny.ipynb" and executed.is_file()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["repeats"] == 5 and metrics["profile_used"] == "smoke"


def test_readers_settings_name_what_differs_from_the_parameters_cell():
    defaults = {"profile": "auto", "device": "auto", "seed": 0, "output_dir": "", "epochs": 0, "num_seeds": 0}
    assert runner.readers_settings({"profile": "cpu", "device": "cpu", "output_dir": "x", "epochs": 0}, defaults) == {}
    assert runner.readers_settings({"epochs": 0, "num_seeds": 5, "seed": 2}, defaults) == {"num_seeds": 5, "seed": 2}


@pytest.mark.subprocess
def test_a_run_with_the_readers_settings_is_kept_apart_from_the_recorded_one(tiny_chapter, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside a repository the runs go under ./_build/runs
    runs = tmp_path / "_build" / "runs"
    assert book.run_chapter("tiny", {"profile": "cpu", "repeats": "5"}, notebooks_dir=tiny_chapter) == \
        runs / "custom" / "tiny" / "tiny.ipynb"
    assert book.run_chapter("tiny", {"profile": "cpu"}, notebooks_dir=tiny_chapter) == runs / "tiny" / "tiny.ipynb"


def test_run_chapter_rejects_unknown_parameters_and_chapters(tiny_chapter, tmp_path):
    with pytest.raises(ValueError, match="unknown parameter 'epochs'.*\\['output_dir', 'profile', 'repeats'\\]"):
        book.run_chapter("tiny", {"epochs": "3"}, tmp_path, tiny_chapter)
    with pytest.raises(ValueError, match="parameter 'repeats' must be int"):
        book.run_chapter("tiny", {"repeats": "many"}, tmp_path, tiny_chapter)
    with pytest.raises(FileNotFoundError, match="no chapter 'nope'.*\\['tiny'\\]"):
        book.run_chapter("nope", {}, tmp_path, tiny_chapter)


@pytest.mark.subprocess
def test_cli_exit_codes(tiny_chapter, tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "sphereml.book", "run", "tiny", "--notebooks",
                               str(tiny_chapter), "--output", str(tmp_path / "cli"), *args],
                              capture_output=True, text=True)

    ok = cli("-p", "repeats", "4")
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "cli" / "metrics.json").read_text())["repeats"] == 4
    failing = cli("-p", "repeats", "-1")
    assert failing.returncode == 1 and "negative repeats" in failing.stderr
    bad = cli("-p", "colour", "red")
    assert bad.returncode == 2 and "unknown parameter 'colour'" in bad.stderr
    assert "RuntimeWarning" not in ok.stderr  # the package does not import the runner it executes


def test_the_package_does_not_import_the_runner():
    code = "import sys, sphereml; print('sphereml.book' in sys.modules, 'sphereml.book.runner' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False False"


@pytest.mark.subprocess
def test_cache_seeding_matches_the_book_s_hash(tiny_chapter, tmp_path):
    from jupyter_cache import get_cache

    executed = book.run_chapter("tiny", {}, tmp_path / "run", tiny_chapter)
    book.cache_executed_notebook(tiny_chapter / "tiny.ipynb", executed, tmp_path / "cache")
    source = nbformat.read(tiny_chapter / "tiny.ipynb", as_version=4)  # what the book build reads
    record = get_cache(str(tmp_path / "cache")).match_cache_notebook(source)
    assert record is not None
    with pytest.raises(ValueError, match="not an unparameterised run"):
        parameterised = book.run_chapter("tiny", {"repeats": "3"}, tmp_path / "run2", tiny_chapter)
        book.cache_executed_notebook(tiny_chapter / "tiny.ipynb", parameterised, tmp_path / "cache")
