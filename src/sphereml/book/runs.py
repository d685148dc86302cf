"""Where and at what scale a chapter runs: its profile, the repository (or its published copy outside one) and the
folder its figures and ``metrics.json`` go to.  :mod:`sphereml.book.chapter` imports these for the chapters.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

__all__ = ["PROFILES", "FULL_SCALE", "REPOSITORY", "resolve_profile", "is_tiny", "repo_root", "published_sources",
           "default_output_dir", "resolve_output_dir"]

PROFILES = ("smoke", "cpu", "gpu", "paper")
FULL_SCALE = ("gpu", "paper")  # the profiles that train the sources' CIFAR networks
REPOSITORY = "https://github.com/sphereml/sphereml"  # where the book is published from (_config.yml)


def resolve_profile(profile: str = "auto") -> str:
    """Map ``auto`` to ``$SPHEREML_PROFILE``, else ``gpu`` with CUDA, else ``cpu``; validate the name."""
    if profile == "auto":
        profile = os.environ.get("SPHEREML_PROFILE") or ("gpu" if torch.cuda.is_available() else "cpu")
    if profile not in PROFILES:
        raise ValueError(f"profile must be 'auto' or one of {PROFILES}, got {profile!r}")
    return profile


def repo_root(start: str | os.PathLike | None = None) -> Path | None:
    """The nearest folder at or above ``start`` (default: cwd) that holds ``_toc.yml``."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "_toc.yml").is_file():
            return folder
    return None


def published_sources(url: str | None = None, dest: str | os.PathLike | None = None) -> Path:
    """The book's repository as files, for a notebook run outside it (Colab, a downloaded ``.ipynb``): chapter
    10 reads the claims ledger, the benchmark results and the errata page from there.

    A shallow ``git clone`` of ``url`` (default ``$SPHEREML_REPO``, else :data:`REPOSITORY`) into ``dest``
    (default ``~/.cache/sphereml/sources``), made on first use; an existing clone is used as it is.

    Raises:
        RuntimeError: the clone is missing, ``url`` is remote and ``$SPHEREML_NO_DOWNLOAD`` is set, or git fails.
    """
    url = url or os.environ.get("SPHEREML_REPO") or REPOSITORY
    dest = Path(dest) if dest is not None else Path.home() / ".cache" / "sphereml" / "sources"
    if repo_root(dest) == dest.resolve():
        return dest
    if os.environ.get("SPHEREML_NO_DOWNLOAD") and "://" in url and not url.startswith("file://"):
        raise RuntimeError(f"refusing to clone {url}: $SPHEREML_NO_DOWNLOAD is set")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["git", "clone", "--quiet", "--depth", "1", url, str(dest)], capture_output=True,
                              text=True)
    except FileNotFoundError:
        raise RuntimeError(f"could not clone {url}: git is not installed") from None
    if done.returncode != 0:
        raise RuntimeError(f"could not clone {url} into {dest}: {done.stderr.strip()[-300:]}")
    return dest


def is_tiny(profile: str) -> bool:
    """Whether a run of the resolved ``profile`` is a tiny one: ``gpu`` or ``paper`` with ``SPHEREML_GPU_TINY=1``."""
    return profile in FULL_SCALE and os.environ.get("SPHEREML_GPU_TINY") == "1"


def default_output_dir(chapter: str, start: str | os.PathLike | None = None, profile: str = "auto",
                       custom: bool = False) -> Path:
    """``<repo>/_build/runs/<chapter>`` for a run that the ledger records (``cpu``, ``gpu``, ``paper`` at the
    profile's own settings), and ``<repo>/_build/runs/smoke/<chapter>``, ``.../tiny/<chapter>`` or
    ``.../custom/<chapter>`` for one it skips (``smoke``, a tiny gpu run, a run with a reader's ``custom``
    settings such as ``-p epochs 10``), so that a quick check or an experiment never overwrites a recorded run's
    metrics; the repository is found from ``start`` (default: cwd), outside one ``./_build/runs``.  ``profile`` as
    :func:`resolve_profile` takes it."""
    profile = resolve_profile(profile)
    runs = (repo_root(start) or Path.cwd()) / "_build" / "runs"
    if profile == "smoke":
        runs = runs / "smoke"
    elif is_tiny(profile):
        runs = runs / "tiny"
    elif custom:
        runs = runs / "custom"
    return runs / chapter


def resolve_output_dir(chapter: str, output_dir: str | os.PathLike = "", profile: str = "auto") -> Path:
    """Where a chapter writes figures and metrics: ``output_dir`` if given, else ``$SPHEREML_OUTPUT``,
    else :func:`default_output_dir` for ``profile``."""
    if output_dir:
        return Path(output_dir)
    if os.environ.get("SPHEREML_OUTPUT"):
        return Path(os.environ["SPHEREML_OUTPUT"])
    return default_output_dir(chapter, profile=profile)
