"""The papermill runner: execute a chapter with your own parameters (``python -m sphereml.book``).

The chapter runtime itself (profiles, ``Chapter``) is :mod:`sphereml.book.chapter`; this module is
only the command line and the execution cache (``python -m sphereml.book`` runs it), and the package does not
import it.

Command line::

    python -m sphereml.book list
    python -m sphereml.book run 01_hypersphere -p profile smoke [-p epochs 3] [--output DIR]
    python -m sphereml.book ledger [--runs _build/runs]
    python -m sphereml.book estimate 02_large_margin [-p profile paper] [--runs _build/runs]

``run`` executes ``notebooks/NAME.ipynb`` through papermill into DIR (default
``_build/runs/NAME``; ``_build/runs/smoke/NAME`` for a smoke run and ``_build/runs/tiny/NAME`` for a tiny gpu run,
which the ledger skips), which then holds the executed notebook, the figures and ``metrics.json``; it exits
non-zero when the chapter fails.  Parameter names are checked against the chapter's ``parameters`` cell and values
are converted to the type of their default.  ``ledger`` merges the claims of the runs under ``--runs`` (``cpu``,
``gpu`` and ``paper`` runs; :mod:`sphereml.book.ledger`) into ``book/claims.json`` and rewrites ``book/claims.md``.
``estimate`` reads the chapter's measured ``gpu`` run under ``--runs`` (without it, ``_build/runs`` and then the run
recorded in ``benchmarks/results/chapters-gpu``) and prints how long its ``paper`` profile would take on that device
(:func:`sphereml.book.recipes.paper_estimate`).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from pathlib import Path

from .runs import default_output_dir, repo_root

__all__ = ["chapter_parameters", "readers_settings", "run_chapter", "cache_executed_notebook", "write_ledger",
           "estimate_text", "main"]


def _notebooks_dir(notebooks_dir=None) -> Path:
    if notebooks_dir is not None:
        return Path(notebooks_dir)
    root = repo_root()
    if root is None:
        raise FileNotFoundError("not inside the sphereml repository (no _toc.yml found); pass notebooks_dir")
    return root / "notebooks"


def chapter_parameters(notebook: str | os.PathLike) -> dict:
    """The names and default values of a notebook's ``parameters`` cell."""
    import papermill

    info = papermill.inspect_notebook(str(notebook))
    return {name: ast.literal_eval(p["default"]) for name, p in info.items()}


def _convert(name: str, value, default):
    """Convert a command-line string to the type of the parameter's default (nanoGPT's configurator check)."""
    if not isinstance(value, str) or isinstance(default, str):
        target = value
    else:
        try:
            target = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            target = value
    if isinstance(default, bool) or isinstance(target, bool):
        ok = isinstance(target, bool) and isinstance(default, bool)
    elif isinstance(default, float):
        ok = isinstance(target, (int, float))
        target = float(target) if ok else target
    else:
        ok = isinstance(target, type(default))
    if not ok:
        raise ValueError(
            f"parameter {name!r} must be {type(default).__name__} (default {default!r}), got {value!r}"
        )
    return target


def run_chapter(name: str, parameters: dict | None = None, output_dir=None, notebooks_dir=None,
                kernel_name: str | None = None) -> Path:
    """Execute chapter ``name`` through papermill; return the executed notebook's path.

    Figures and ``metrics.json`` go to ``output_dir`` (default ``_build/runs/<name>``, or ``_build/runs/smoke/<name>``,
    ``_build/runs/tiny/<name>`` and, with :func:`readers_settings`, ``_build/runs/custom/<name>`` for the runs the
    ledger skips: :func:`~sphereml.book.chapter.default_output_dir`),
    passed to the notebook as its ``output_dir`` parameter.  With no parameters the
    notebook runs unchanged (no injected cell), which lets the book's execution cache
    reuse the result (see :func:`cache_executed_notebook`).

    Raises:
        FileNotFoundError: no such chapter.
        ValueError: an unknown parameter name or a value of the wrong type.
        papermill.PapermillExecutionError: a cell failed.
    """
    import papermill

    source = _notebooks_dir(notebooks_dir) / f"{name}.ipynb"
    if not source.is_file():
        known = sorted(p.stem for p in source.parent.glob("*.ipynb"))
        raise FileNotFoundError(f"no chapter {name!r} in {source.parent}; chapters: {known}")
    defaults = chapter_parameters(source)
    params = {}
    for key, value in (parameters or {}).items():
        if key not in defaults:
            raise ValueError(f"unknown parameter {key!r} for {name}; its parameters are {sorted(defaults)}")
        params[key] = _convert(key, value, defaults[key])
    custom = bool(readers_settings(params, defaults))  # its metrics are not the ledger's: kept apart
    out = Path(output_dir) if output_dir else default_output_dir(name, source, params.get("profile", "auto"), custom)
    out.mkdir(parents=True, exist_ok=True)
    if params and "output_dir" in defaults:
        params.setdefault("output_dir", str(out.resolve()))
    executed = out / f"{name}.ipynb"
    env_before = os.environ.get("SPHEREML_OUTPUT")
    os.environ["SPHEREML_OUTPUT"] = str(out.resolve())  # used when no parameter is injected
    if os.environ.get("SPHEREML_RESUME"):  # the kernel runs in notebooks/: a relative folder is the caller's
        os.environ["SPHEREML_RESUME"] = str(Path(os.environ["SPHEREML_RESUME"]).resolve())
    try:
        papermill.execute_notebook(
            str(source), str(executed), parameters=params, cwd=str(source.parent),
            kernel_name=kernel_name, progress_bar=False, log_output=False,
        )
    finally:
        if env_before is None:
            os.environ.pop("SPHEREML_OUTPUT", None)
        else:
            os.environ["SPHEREML_OUTPUT"] = env_before
    return executed


def cache_executed_notebook(source: str | os.PathLike, executed: str | os.PathLike, cache_dir) -> str:
    """Store the outputs of ``executed`` in the jupyter-cache at ``cache_dir`` under ``source``'s hash.

    Jupyter Book (``execute_notebooks: cache``) then reuses them instead of executing
    the chapter again.  The cache key is the code of ``source``; the outputs are copied
    onto ``source`` cell by cell so no papermill metadata changes the key.  Only
    valid when the notebook ran without injected parameters.
    """
    import nbformat
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    nb = nbformat.read(str(source), as_version=4)
    run = nbformat.read(str(executed), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    run_code = [c for c in run.cells if c.cell_type == "code"]
    if [c.source for c in code] != [c.source for c in run_code]:
        raise ValueError(f"{executed} is not an unparameterised run of {source}")
    for cell, done in zip(code, run_code):
        cell.outputs, cell.execution_count = done.outputs, done.execution_count
    record = get_cache(str(cache_dir)).cache_notebook_bundle(
        CacheBundleIn(nb, str(Path(source).resolve())), check_validity=False, overwrite=True
    )
    return record.hashkey


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m sphereml.book", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the chapters and their parameters")
    run = sub.add_parser("run", help="execute one chapter through papermill")
    run.add_argument("name", help="notebook stem, e.g. 01_hypersphere")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    run.add_argument("--output", default=None, help="output folder (default _build/runs/NAME)")
    run.add_argument("--notebooks", default=None, help="folder of the notebooks (default <repo>/notebooks)")
    ledger = sub.add_parser("ledger", help="gather the chapters' claims into book/claims.json and book/claims.md")
    ledger.add_argument("--runs", default=None, help="folder of chapter runs (default <repo>/_build/runs)")
    estimate = sub.add_parser("estimate", help="how long a chapter's paper profile takes, from its gpu run")
    estimate.add_argument("name", help="notebook stem, e.g. 02_large_margin")
    estimate.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                          help="only 'profile paper' (the default)")
    estimate.add_argument("--runs", default=None, help="folder of chapter runs (default <repo>/_build/runs, then the "
                          "project's recorded runs in benchmarks/results/chapters-gpu)")
    return parser.parse_args(argv)


def _minutes(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.1f} min"


RECORDED_GPU_RUNS = Path("benchmarks") / "results" / "chapters-gpu"  # the project's measured gpu runs, in the repo


def _gpu_run(name: str, runs_dir) -> tuple[dict | None, str]:
    """(the chapter's gpu run's metrics, what it is): from ``runs_dir`` (default ``<repo>/_build/runs``) or, when no
    folder was named, the run the project recorded (:data:`RECORDED_GPU_RUNS`), a full gpu run first; (None, where
    it was looked for) when there is neither."""
    from .recipes import full_gpu_run

    root = repo_root() or Path.cwd()
    folder = Path(runs_dir) if runs_dir is not None else root / "_build" / "runs"
    places = [(folder / name / "metrics.json", "the gpu run")]
    if runs_dir is None:
        places.append((root / RECORDED_GPU_RUNS / name / "metrics.json", "the project's recorded gpu run"))
    found = [(json.loads(path.read_text()), what) for path, what in places if path.is_file()]
    full = [run for run in found if full_gpu_run(run[0])]
    return (full or found or [(None, " or ".join(str(path) for path, _ in places))])[0]


def estimate_text(name: str, runs_dir=None, current_device: str | None = None) -> str:
    """What ``python -m sphereml.book estimate NAME`` prints: the ``paper`` profile's expected time, scaled from
    the chapter's ``gpu`` run in ``runs_dir`` (default ``<repo>/_build/runs``, else the run recorded in the
    repository, :data:`RECORDED_GPU_RUNS`).  A chapter with no source's recipe runs its ``paper`` profile as its
    ``gpu`` profile, which is said, with the run's time where there is one.

    Raises:
        FileNotFoundError: no such chapter, or no run of it there (for a chapter with a recipe).
        ValueError: the run is not a full gpu run, or it trained nothing with a recipe.
    """
    from .recipes import PAPER, full_gpu_run, paper_estimate, recipe_for, run_seconds

    chapters = sorted(p.stem for p in _notebooks_dir().glob("*.ipynb"))
    if name not in chapters:
        raise FileNotFoundError(f"no chapter {name!r}; chapters: {chapters}")
    metrics, what = _gpu_run(name, runs_dir)
    if name not in PAPER:
        same = f"{name} trains nothing with a source's recipe: its paper profile runs as its gpu profile"
        if metrics is None or not full_gpu_run(metrics):
            return same + " (no full gpu run here to time it)"
        device = metrics.get("device_name", "an unnamed device")
        return same + f", which took {_minutes(run_seconds(metrics))} on {device} ({what})"
    if metrics is None:
        raise FileNotFoundError(f"no run of {name} at {what}: run `python -m sphereml.book run {name} -p profile "
                                f"gpu` on the GPU first")
    est = paper_estimate(metrics)
    lines = [f"{name}: {what} took {_minutes(est['measured_s'])} on {est['device_name']}; its trainings with a "
             f"source's recipe, scaled to the source's length:"]
    for row in est["rows"]:
        runs = f" x {row['runs']} runs" if row["runs"] > 1 else ""
        lines.append(f"  {row['section']:>10}: {row['epochs']:>3} epochs in {_minutes(row['seconds'])} -> "
                     f"{row['paper_epochs']} epochs{runs}: {_minutes(row['estimated_s'])}")
    lines += [f"  {section} recipe: {recipe_for(name, section).source}"
              for section in dict.fromkeys(row["section"] for row in est["rows"])]
    lines.append(f"paper profile: about {_minutes(est['estimated_s'])} on {est['device_name']} "
                 "(time per image taken as independent of the batch size)")
    if current_device is not None and current_device != est["device_name"]:
        lines.append(f"this machine has {current_device}: the estimate holds for {est['device_name']}")
    return "\n".join(lines)


def readers_settings(params: dict, defaults: dict) -> dict:
    """The chapter parameters of a run that differ from the parameters cell's, but those that choose where and how
    it runs (``profile``, ``device``, ``output_dir``): e.g. ``{"epochs": 10}``."""
    return {key: value for key, value in params.items()
            if key not in ("profile", "device", "output_dir") and value != defaults.get(key)}


def write_ledger(runs_dir=None, book_dir=None) -> Path:
    """Merge ``<runs_dir>/*/metrics.json`` into ``<book_dir>/claims.json``; rewrite ``claims.md``."""
    from . import ledger

    root = repo_root()
    runs_dir = Path(runs_dir) if runs_dir is not None else root / "_build" / "runs"
    book_dir = Path(book_dir) if book_dir is not None else root / "book"
    snapshot_path = book_dir / "claims.json"
    skipped = []
    snapshot = ledger.collect(sorted(runs_dir.glob("*/metrics.json")), ledger.load_snapshot(snapshot_path),
                              skipped=skipped)
    for path, settings in skipped:
        shown = ", ".join(f"{key}={value}" for key, value in settings.items())
        print(f"skipped {path}: run with {shown} (the ledger holds each profile's own settings)", file=sys.stderr)
    snapshot_path.write_text(json.dumps(snapshot, indent=1, ensure_ascii=False) + "\n")
    page = book_dir / "claims.md"
    page.write_text(ledger.render(snapshot))
    return page


def _estimate(args) -> int:
    import torch

    profile = dict(args.parameter).get("profile", "paper")
    if profile != "paper" or set(dict(args.parameter)) - {"profile"}:
        print("error: estimate takes only '-p profile paper' (it scales a measured gpu run)", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        print(estimate_text(args.name, args.runs, device))
    except (FileNotFoundError, ValueError, KeyError) as err:
        print(f"error: {str(err).strip(chr(39))}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.command == "ledger":
        print(f"wrote {write_ledger(args.runs)}")
        return 0
    if args.command == "estimate":
        return _estimate(args)
    if args.command == "list":
        for nb in sorted(_notebooks_dir().glob("*.ipynb")):
            print(f"{nb.stem}: {chapter_parameters(nb)}")
        return 0
    try:
        executed = run_chapter(args.name, dict(args.parameter), args.output, args.notebooks)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # papermill's execution error carries the failing cell
        print(f"chapter {args.name} failed: {err}", file=sys.stderr)
        return 1
    print(f"executed notebook, figures and metrics.json in {executed.parent}")
    return 0
