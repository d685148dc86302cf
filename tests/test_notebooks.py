"""Every chapter listed in _toc.yml runs end to end in the smoke profile.

Each chapter executes through papermill without injected parameters (the profile comes
from $SPHEREML_PROFILE), so its code is byte-for-byte the book's; the executed notebook is
then stored in the smoke book's execution cache and `make book-smoke` reuses it instead
of executing the chapter a second time.
"""

import ast
import json
import time
from pathlib import Path

import jupytext
import nbformat
import pytest
import yaml

from sphereml import book

REPO = Path(__file__).resolve().parents[1]
SMOKE_CACHE = REPO / "_build" / "smoke" / "_build" / ".jupyter_cache"


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
    # papermill must see every parameter, or `-p name value` would be refused as unknown
    assert sorted(book.chapter_parameters(REPO / "notebooks" / f"{name}.ipynb")) == sorted(names)


@pytest.mark.notebook
@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_runs_in_smoke_profile(name, tmp_path, monkeypatch):
    monkeypatch.setenv("SPHEREML_PROFILE", "smoke")
    out = REPO / "_build" / "runs" / "smoke" / name
    start = time.perf_counter()
    executed = book.run_chapter(name, {}, out)
    seconds = time.perf_counter() - start
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["profile"] == "smoke" and metrics["chapter"] == name
    assert metrics.get("figures"), "a chapter saves at least one figure"
    for fig in metrics["figures"]:
        assert (out / fig).stat().st_size > 1000
    run = nbformat.read(executed, as_version=4)
    errors = [o for c in run.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    book.cache_executed_notebook(REPO / "notebooks" / f"{name}.ipynb", executed, SMOKE_CACHE)
    print(f"{name}: smoke run {seconds:.1f} s")


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
    plumbing = {"chapter", "viz", "data", "timing", "train", "book"}
    missing = sorted(m for m in imported - plumbing if f"{{py:mod}}`sphereml.{m}`" not in box)
    assert not missing, f"{name}'s code box does not link {missing}"
