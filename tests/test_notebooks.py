"""Every chapter listed in _toc.yml runs end to end in the smoke profile.

Each chapter executes through papermill without injected parameters (the profile comes
from $SPHEREML_PROFILE), so its code is byte-for-byte the book's; the executed notebook is
then stored in the smoke book's execution cache and `make book-smoke` reuses it instead
of executing the chapter a second time.
"""

import ast
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jupytext
import nbformat
import pytest
import yaml

from sphereml import book
from sphereml.book import recipes
from sphereml.book.chapter import PAGE_WIDTH
from sphereml.book.viz import LEGIBLE_PX, PHONE_COLUMN_PX

REPO = Path(__file__).resolve().parents[1]
SMOKE_CACHE = REPO / "_build" / "smoke" / "_build" / ".jupyter_cache"
OFFLINE = REPO / "tests" / "offline"  # its sitecustomize refuses every connection that leaves the machine
PINNED = REPO / "tests" / "regression"  # the pinned outputs of the cells tagged "regression"


def toc_chapters() -> list[str]:
    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    files = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("file"), str) and node["file"].startswith("notebooks/"):
                files.append(Path(node["file"]).name)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(toc)
    return files


CHAPTERS = toc_chapters()


def test_toc_lists_every_notebook_and_only_existing_ones():
    on_disk = sorted(p.stem for p in (REPO / "notebooks").glob("*.md"))
    assert sorted(CHAPTERS) == on_disk


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "notebooks").glob("*.md")))
def test_pairing_has_not_drifted(name):
    """notebooks/NAME.md (the source) and NAME.ipynb hold the same cells; run `make sync` to fix."""
    md = jupytext.read(REPO / "notebooks" / f"{name}.md")
    ipynb = jupytext.read(REPO / "notebooks" / f"{name}.ipynb")
    cells = lambda nb: [(c.cell_type, c.source.strip(), sorted(c.metadata.get("tags", []))) for c in nb.cells]  # noqa: E731
    assert cells(md) == cells(ipynb), f"{name}.md and {name}.ipynb differ: run `make sync`"
    assert ipynb.metadata["kernelspec"]["name"] == "python3"
    raw = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in raw.cells if c.cell_type == "code"), "commit notebooks without outputs"
    first_code = next(c for c in raw.cells if c.cell_type == "code")
    assert "parameters" in first_code.metadata.get("tags", []), "the first code cell must be tagged parameters"
    names = [t.id for node in ast.parse(first_code.source).body if isinstance(node, ast.Assign) for t in node.targets]
    for knob in ("profile", "device", "seed", "output_dir"):
        assert knob in names
    if "SEEDS = " in md_source(name):  # a chapter that trains comparisons takes a reader's number of seeds
        assert "num_seeds" in names and re.search(r"SEEDS = ch\.comparison_seeds\(num_seeds[,)]", md_source(name))
    # papermill must see every parameter, or `-p name value` would be refused as unknown
    assert sorted(book.chapter_parameters(REPO / "notebooks" / f"{name}.ipynb")) == sorted(names)


def md_source(name: str) -> str:
    return (REPO / "notebooks" / f"{name}.md").read_text()


def _offline_smoke_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPHEREML_PROFILE", "smoke")
    monkeypatch.setenv("SPHEREML_GLUE_FIGURES", "1")  # figures glued for the book's numbered captions (viz)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(OFFLINE), os.environ.get("PYTHONPATH")])))


@pytest.fixture
def offline_smoke(monkeypatch):
    """The smoke profile, and no network for the kernels papermill starts (they inherit PYTHONPATH)."""
    _offline_smoke_env(monkeypatch)


@dataclass(frozen=True)
class SmokeRun:
    executed: Path  # the executed notebook
    metrics: Path  # its metrics.json
    seconds: float


@pytest.fixture(scope="session")
def smoke_run():
    """``smoke_run(name)``: the chapter's smoke run (offline), made once per session by whichever test asks first,
    so every test that reads it gets the same run whatever the order the tests run in."""
    runs: dict[str, SmokeRun] = {}

    def run(name: str) -> SmokeRun:
        if name not in runs:
            out = REPO / "_build" / "runs" / "smoke" / name
            with pytest.MonkeyPatch.context() as monkeypatch:
                _offline_smoke_env(monkeypatch)
                start = time.perf_counter()
                executed = book.run_chapter(name, {}, out)
            runs[name] = SmokeRun(Path(executed), out / "metrics.json", time.perf_counter() - start)
        return runs[name]

    return run


def test_the_chapters_kernels_have_no_network(offline_smoke):
    """What the chapter kernels inherit refuses connections and name lookups that leave the machine."""
    probe = ("import socket, urllib.request\n"
             "for url in ('http://93.184.216.34/', 'https://download.pytorch.org/whl/cpu/'):\n"
             "    try:\n        urllib.request.urlopen(url, timeout=5)\n    except OSError as e:\n        print(e)\n"
             "s = socket.socket()\ntry:\n    s.connect(('127.0.0.1', 9))\nexcept ConnectionRefusedError:\n"
             "    print('loopback open')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60).stdout
    assert out.count("network access refused") == 2 and "loopback open" in out, out


def _measures(ours) -> bool:
    """Whether a claim's numbers hold a measured value (a number other than a count of seeds or repeats)."""
    if isinstance(ours, dict):
        return any(_measures(v) for k, v in ours.items() if k not in ("seeds", "time repeats", "draws"))
    if isinstance(ours, (list, tuple)):
        return any(_measures(v) for v in ours)
    return isinstance(ours, (int, float)) and not isinstance(ours, bool)


def test_a_claims_measured_values_are_found():
    assert _measures({"a": 0.5, "seeds": 3}) and _measures([True, 0.1]) and _measures(2.0)
    assert not _measures({"fails": True, "seeds": 3}) and not _measures("inferred") and not _measures(None)


@pytest.mark.notebook
@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_runs_in_smoke_profile(name, smoke_run):
    run = smoke_run(name)
    out = run.metrics.parent
    metrics = json.loads(run.metrics.read_text())
    assert metrics["profile"] == "smoke" and metrics["chapter"] == name
    assert metrics.get("figures"), "a chapter saves at least one figure"
    for fig in metrics["figures"]:
        assert (out / fig).stat().st_size > 1000
    small = {name: text for name, text in metrics["figure_text"].items()
             if text["px"] is not None and text["px"] < LEGIBLE_PX}
    print(f"{name}: smallest text on a phone (px)", {k: v["px"] for k, v in metrics["figure_text"].items()})
    assert not small, f"text under {LEGIBLE_PX} px on a {PHONE_COLUMN_PX}-px phone column: {small}"
    unnamed = [c["id"] for c in metrics["claims"] if _measures(c["ours"]) and not c.get("unit")]
    assert not unnamed, f"claims whose numbers name no scale (ch.claim(..., unit=...)): {unnamed}"
    notebook = nbformat.read(run.executed, as_version=4)
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    printed = [o.text for c in notebook.cells if c.cell_type == "code" for o in c.outputs
               if o.output_type == "stream" and o.name == "stdout"]
    wide = [line for text in printed for line in text.splitlines() if len(line) > PAGE_WIDTH]
    assert not wide, f"printed lines wider than the book's column ({PAGE_WIDTH} characters; ch.say wraps): {wide}"
    book.cache_executed_notebook(REPO / "notebooks" / f"{name}.ipynb", run.executed, SMOKE_CACHE)
    print(f"{name}: smoke run {run.seconds:.1f} s")


def _run_tiny(name: str, profile: str, monkeypatch, tmp_path) -> dict:
    """Run chapter ``name`` in ``profile`` with SPHEREML_GPU_TINY=1; its metrics, after checking the run was tiny,
    raised no error and trained exactly its sections with a paper recipe through ``ch.recipe``."""
    monkeypatch.setenv("SPHEREML_GPU_TINY", "1")
    executed = nbformat.read(book.run_chapter(name, {"profile": profile}, tmp_path), as_version=4)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["profile"] == profile and metrics["tiny"] is True
    assert not [o for c in executed.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    trained = {f["recipe"] for f in metrics["fits"] if f["recipe"]}
    assert trained == set(recipes.PAPER.get(name, {})), f"{name}: sections trained with a recipe {trained}"
    return metrics


@pytest.mark.notebook
@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_gpu_paths_run_tiny(name, offline_smoke, monkeypatch, tmp_path):
    """The gpu profile's own code (CIFAR sections, its branches) at the smoke profile's sizes and seeds, on this
    CPU (SPHEREML_GPU_TINY=1, :class:`sphereml.book.chapter.Chapter`): CI proves it executes before a GPU runs it,
    with the seeds of its comparisons trained together where they train alike (book/reproducing.md)."""
    metrics = _run_tiny(name, "gpu", monkeypatch, tmp_path)
    skipped = [k for k in metrics if k.startswith("cifar") and k.endswith("_skipped")]
    assert not skipped, f"{name} skipped {skipped}: the tiny CIFAR stands in for the archive"
    together = sum(1 for f in metrics["fits"] if f.get("together"))
    assert together == TOGETHER_TINY.get(name, 0), f"{name}: {together} trainings with their seeds together"


# Trainings of a tiny gpu run (two seeds) whose seeds train together: a callback or a setting that sent a comparison
# back to one network at a time would change these counts.
TOGETHER_TINY = {"01_hypersphere": 4, "02_large_margin": 20, "03_spherenet": 36, "04_decoupled": 78,
                 "05_sharpened_cosine": 30, "06_mhe": 34, "07_comhe": 40, "08_convsim": 10,
                 "09_opt": 64}


@pytest.mark.notebook
@pytest.mark.parametrize("name", ["05_sharpened_cosine", "09_opt"])  # a one-cycle recipe; a custom optimizer
def test_chapter_paper_paths_run_tiny(name, offline_smoke, monkeypatch, tmp_path):
    """The paper profile's code (the sources' own recipes, :mod:`sphereml.book.recipes`) for one epoch at tiny
    sizes: what ``-p profile paper`` changes runs on this CPU."""
    _run_tiny(name, "paper", monkeypatch, tmp_path)


@pytest.mark.notebook
@pytest.mark.parametrize("name", [c for c in CHAPTERS if "SEEDS = " in md_source(Path(c).stem)])
def test_chapter_runs_with_a_readers_number_of_seeds(name, smoke_run, offline_smoke, tmp_path):
    """``-p num_seeds 4`` in the smoke profile (two seeds by default, three or five in the others): the chapter runs
    with a seed count of the reader's, and its trained comparisons train the extra seeds (more trainings than the
    default run's)."""
    executed = nbformat.read(book.run_chapter(name, {"num_seeds": 4}, tmp_path), as_version=4)
    assert not [o for c in executed.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    default = json.loads(smoke_run(name).metrics.read_text())
    assert metrics["params"]["num_seeds"] == 4 and default["params"]["num_seeds"] == 0
    assert len(metrics["fits"]) > len(default["fits"]), f"{name}: no more trainings with four seeds than two"


# Values that measure the machine rather than the mathematics: wall times and ratios of times.
TIMING = re.compile(r"seconds|timing|time\b|time_ratio|step_ratios", re.I)


def _flatten(obj, path=""):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _flatten(value, f"{path}/{key}")
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _flatten(value, f"{path}/{i}")
    else:
        yield path, obj


def metrics_differences(a: dict, b: dict) -> list[str]:
    """Paths where two metrics.json differ, timings excluded (NaN equals NaN)."""
    fa, fb = dict(_flatten(a)), dict(_flatten(b))
    return sorted(f"{k}: {fa.get(k)!r} != {fb.get(k)!r}" for k in fa.keys() | fb.keys()
                  if not TIMING.search(k) and not _same(fa.get(k), fb.get(k)))


def _same(x, y) -> bool:
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


def test_metrics_comparison_sees_changes_but_not_timings():
    a = {"acc": 0.5, "curve": [1.0, float("nan")], "fit": {"seconds": 3.0}, "layer_timing_ms": {"conv": 1.0}}
    b = {"acc": 0.5, "curve": [1.0, float("nan")], "fit": {"seconds": 4.0}, "layer_timing_ms": {"conv": 2.0}}
    assert metrics_differences(a, b) == []
    b["curve"][0] = 1.0000001
    assert metrics_differences(a, b) == ["/curve/0: 1.0 != 1.0000001"]


@pytest.mark.notebook
@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_is_deterministic(name, smoke_run, offline_smoke, tmp_path):
    """Run again with the same seed and profile, a chapter writes the same metrics.json (timings aside)."""
    first = smoke_run(name).metrics
    book.run_chapter(name, {}, tmp_path / "second")
    differences = metrics_differences(json.loads(first.read_text()),
                                      json.loads((tmp_path / "second" / "metrics.json").read_text()))
    assert not differences, f"{name} is not deterministic:\n" + "\n".join(differences[:20])


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "notebooks").glob("*.md")))
def test_chapter_opens_with_a_box_linking_the_code_it_uses(name):
    """Right under its title, every chapter links the API reference of each sphereml module it imports."""
    import re

    source = (REPO / "notebooks" / f"{name}.md").read_text()
    after_title = source.split("\n# ", 1)[1].split("\n", 1)[1].lstrip()
    assert after_title.startswith("```{admonition} Code for this chapter"), f"{name} does not open with its code box"
    box = after_title.split("\n```", 1)[0]
    imported = set(re.findall(r"^from sphereml\.([a-z_]+) import", source, re.M))
    for group in re.findall(r"^from sphereml import \(?([a-z_, ]+)", source, re.M):
        imported |= {n.split(" as ")[0].strip() for n in group.split(",") if n.strip()}
    plumbing = {"chapter", "viz", "data", "timing", "train", "recalibration", "book", "report"}
    missing = sorted(m for m in imported - plumbing if f"{{py:mod}}`sphereml.{m}`" not in box)
    assert not missing, f"{name}'s code box does not link {missing}"


def pinned_cells(notebook) -> nbformat.NotebookNode:
    """The cells tagged ``regression`` with their source and text outputs (stdout, plain-text results, and the
    text of rich displays other than images: a claim card reads ``[holds] statement (source)`` and its numbers)."""
    kept = nbformat.v4.new_notebook()
    tagged = [c for c in notebook.cells if "regression" in c.metadata.get("tags", [])]
    for i, cell in enumerate(tagged):
        pinned = nbformat.v4.new_code_cell(cell.source, id=f"pinned-{i}")
        # stdout arrives in chunks that depend on when the kernel flushed: one output for all of it
        stdout = "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
        if stdout:
            pinned.outputs.append(nbformat.v4.new_output("stream", name="stdout", text=stdout))
        for out in cell.outputs:
            if out.output_type == "execute_result" and "text/plain" in out.data:
                pinned.outputs.append(nbformat.v4.new_output("execute_result", {"text/plain": out.data["text/plain"]},
                                                             execution_count=None))
            elif out.output_type == "display_data" and "text/plain" in out.data and not any(
                    mime.startswith("image/") for mime in out.data):
                pinned.outputs.append(nbformat.v4.new_output("display_data", {"text/plain": out.data["text/plain"]}))
        kept.cells.append(pinned)
    return kept


REGRESSION_CHAPTERS = [n for n in CHAPTERS if ":tags: [regression" in (REPO / "notebooks" / f"{n}.md").read_text()
                       or ", regression]" in (REPO / "notebooks" / f"{n}.md").read_text()]


@pytest.mark.notebook
@pytest.mark.parametrize("name", REGRESSION_CHAPTERS)
def test_pinned_outputs_are_unchanged(name, smoke_run):
    """The deterministic cells (proof checks, closed forms, exact tables: tagged ``regression``) print what
    tests/regression/NAME.ipynb pinned; a change fails with pytest-notebook's cell-by-cell diff.  After an
    intended change: SPHEREML_REGEN=1 python -m pytest tests/test_notebooks.py -k pinned."""
    from pytest_notebook import diffing

    ours = pinned_cells(nbformat.read(smoke_run(name).executed, as_version=4))
    assert ours.cells, f"{name} has no cell tagged regression"
    path = PINNED / f"{name}.ipynb"
    if os.environ.get("SPHEREML_REGEN") == "1":
        PINNED.mkdir(exist_ok=True)
        nbformat.write(ours, path)
    assert path.is_file(), f"no pinned outputs for {name}: run with SPHEREML_REGEN=1 once"
    pinned = nbformat.read(path, as_version=4)
    diff = diffing.filter_diff(diffing.diff_notebooks(pinned, ours), ["/metadata", "/nbformat_minor"])
    assert not diff, (f"{name}: pinned outputs changed (SPHEREML_REGEN=1 re-pins an intended change)\n"
                      + diffing.diff_to_string(pinned, diff, use_git=False, use_diff=True, use_color=False))
