"""The claims ledger: every chapter's claim records gathered into one page of the book.

Each chapter states the seeds' headline claims with :meth:`~sphereml.book.chapter.Chapter.claim`, which
stores a record (statement, source, the paper's value, ours, verdict, kind) in the chapter's
``metrics.json``.  This module turns those records into ``book/claims.md``:

* :func:`collect` reads the ``metrics.json`` of executed chapters (one run per chapter and profile) and
  merges their claims into a *snapshot*, a JSON-serialisable dict that is committed as
  ``book/claims.json``: the numbers on the page come from runs of the notebooks, never from a hand;
* :func:`render` writes the page from a snapshot, so the page can always be regenerated (a test
  checks that the committed page is exactly ``render(snapshot)``).

The command line (``python -m sphereml.book ledger``) does both after a ``cpu`` (or ``gpu``, or ``paper``) run
of the chapters.  Every verdict is decided by the one rule of :mod:`sphereml.book.verdicts`, and the page uses
its four words (holds, does not hold, not distinguishable, not testable), explained once at the top.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .chapter import CLAIM_KINDS
from .runs import PROFILES
from .report import LEDGER_PROFILES, claim_records, ledger_table, scale_changes
from .verdicts import VERDICTS

__all__ = ["LABELS", "collect", "custom_settings", "render", "load_snapshot"]

LABELS = {name: name for name in VERDICTS.values()}  # the page uses the verdicts' own words
# what the page says about the run behind each column; CPUs with other vector kernels (AVX2, AVX512), or other
# processors with the same kernels, round differently, so a cpu run on another machine may train to other numbers
RUN_FIELDS = ("device_name", "torch", "threads", "cpu_capability", "cpu_model")


def load_snapshot(path: str | os.PathLike) -> dict:
    """A snapshot written by :func:`collect` (an empty one when the file does not exist)."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else {"chapters": {}}


def custom_settings(metrics: dict) -> dict:
    """The settings in which a chapter's run left its profile's own: a first seed other than 0, or a parameter
    given a value (the chapters' knobs mean "the profile's default" at 0 or empty), e.g. ``{"num_seeds": 5}``."""
    settings = {key: value for key, value in metrics.get("params", {}).items() if value not in (0, "", None)}
    return ({"seed": metrics["seed"]} if metrics.get("seed", 0) != 0 else {}) | settings


def collect(metrics_paths, snapshot: dict | None = None, profiles: tuple[str, ...] = LEDGER_PROFILES,
            skipped: list | None = None) -> dict:
    """Merge the claims of executed chapters into ``snapshot`` (a new one when None).

    Args:
        metrics_paths: ``metrics.json`` files of chapter runs; runs of a profile not in ``profiles`` (a
            ``smoke`` run), tiny gpu runs (``SPHEREML_GPU_TINY``) and runs without claims are skipped, and a
            run replaces the earlier entry of its chapter and profile.  Runs with :func:`custom_settings` (a
            reader's ``-p epochs 10`` or ``-p num_seeds 5``) are skipped too: the ledger holds each profile's
            own settings.
        snapshot (dict, optional): the snapshot to update.
        profiles (tuple[str]): the profiles the ledger reports.
        skipped (list, optional): receives ``(path, settings)`` for each run skipped for its custom settings.

    Returns:
        ``{"chapters": {name: {profile: run}}}``, each run a dict of the ``RUN_FIELDS`` (``device_name``,
        ``torch``, ``threads``, ``cpu_capability``, ``cpu_model``: the last two None for runs recorded before they
        were) and ``"claims": [...]``.
    """
    snapshot = {"chapters": {}} if snapshot is None else json.loads(json.dumps(snapshot))
    for path in metrics_paths:
        metrics = json.loads(Path(path).read_text())
        profile = metrics.get("profile")
        if profile not in profiles or profile not in PROFILES or metrics.get("tiny") or not metrics.get("claims"):
            continue  # a smoke or tiny run, or a chapter that makes no claim (the conclusion)
        settings = custom_settings(metrics)
        if settings:
            if skipped is not None:
                skipped.append((path, settings))
            continue
        entry = {field: metrics.get(field) for field in RUN_FIELDS}
        entry["claims"] = [_check_record(record, path) for record in metrics.get("claims", [])]
        snapshot["chapters"].setdefault(metrics["chapter"], {})[profile] = entry
    snapshot["chapters"] = dict(sorted(snapshot["chapters"].items()))
    return snapshot


def _check_record(record: dict, path) -> dict:
    missing = [key for key in ("id", "statement", "source", "verdict", "kind") if not record.get(key)]
    if missing or record["verdict"] not in VERDICTS.values() or record["kind"] not in CLAIM_KINDS:
        raise ValueError(f"claim record in {path} lacks {missing or 'a valid verdict and kind'}: {record}")
    kept = {key: record.get(key) for key in ("id", "statement", "source", "paper", "ours", "verdict", "kind")}
    return kept | ({"unit": record["unit"]} if record.get("unit") else {})


def _summary(snapshot: dict) -> list[str]:
    lines = []
    for profile in LEDGER_PROFILES:
        records = [r for runs in snapshot["chapters"].values() for r in runs.get(profile, {}).get("claims", [])]
        if not records:
            lines.append(f"- `{profile}` profile: not yet run for the ledger.")
            continue
        counts = {label: sum(LABELS[r["verdict"]] == label for r in records) for label in LABELS.values()}
        chapters = sum(profile in runs for runs in snapshot["chapters"].values())
        parts = ", ".join(f"{n} {label}" for label, n in counts.items())
        lines.append(f"- `{profile}` profile: {_count(len(records), 'claim')} from {_count(chapters, 'chapter')}: "
                     f"{parts}.")
    return lines + _scale_changes(snapshot)


def _count(n: int, noun: str) -> str:
    """``1 claim``, ``2 claims``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _scale_changes(snapshot: dict) -> list[str]:
    """How many claims run in more than one profile change their verdict from one profile to the next that ran them
    (the rows the table marks "changed from ...", :func:`~sphereml.book.report.scale_changes`)."""
    several = changed = 0
    for runs in snapshot["chapters"].values():
        ids = dict.fromkeys(r["id"] for p in LEDGER_PROFILES for r in runs.get(p, {}).get("claims", []))
        for claim_id in ids:
            records = claim_records(runs, claim_id)
            several += sum(r is not None for r in records.values()) > 1
            changed += bool(scale_changes(records))
    if not several:
        return []
    return [f"- Verdicts that change with scale: {changed} of the {several} claims run in more than one profile "
            '(marked "changed from" the smaller profile in the table).']


def _runs(snapshot: dict) -> list[str]:
    """One line per chapter: the device and torch behind each profile's run."""
    lines = []
    for name, runs in snapshot["chapters"].items():
        devices = "; ".join(f"`{p}` on {_device(runs[p])}, torch {runs[p]['torch']}"
                            for p in LEDGER_PROFILES if p in runs)
        lines.append(f"- {{doc}}`/notebooks/{name}`: {devices}.")
    return lines


def _device(run: dict) -> str:
    """The run's device, with the CPU's name and vector kernels where they were recorded (``cpu (AMD EPYC,
    AVX512)``, ``cpu (AVX512)``)."""
    if run["device_name"] != "cpu":
        return run["device_name"]
    details = ", ".join(d for d in (run.get("cpu_model"), run.get("cpu_capability")) if d)
    return f"cpu ({details})" if details else "cpu"


def render(snapshot: dict) -> str:
    """The Markdown of ``book/claims.md`` for ``snapshot`` (see the module docstring)."""
    lines = [
        "<!-- Generated by `python -m sphereml.book ledger` from book/claims.json: do not edit by hand. -->",
        "",
        "(claims-ledger)=",
        "# Claims ledger",
        "",
        "Every chapter tests the headline claims of its source and records the claim, where the source",
        "makes it, the source's value, ours, and the verdict. This page gathers those records from the last",
        "run of each chapter in each profile.",
        "",
        "```{include} verdicts.md",
        "```",
        "",
        "The table lists every claim once, with the chapter that tests it (the link opens the claim where",
        "the chapter shows it). Click a column's heading to sort by it; type in the box to keep only the rows",
        "that contain the text (a chapter number, a word of the claim, a verdict). Values are shown as each",
        "chapter records them, so their scales differ (fractions, percentages, error rates, energies): each",
        "claim names its scale in parentheses before its numbers. A `cpu` verdict is about a small network",
        "trained briefly on a data subset: it speaks for the direction of an effect at that scale, not for the",
        "source's setting.",
        "",
        "**Summary.**",
        "",
        *_summary(snapshot),
        "",
        '<input type="search" id="claims-filter" class="ledger-filter" placeholder="Filter the claims" '
        'aria-label="Filter the claims">',
        "",
        ledger_table(snapshot),
        "",
        "**Runs behind the table.**",
        "",
        *_runs(snapshot),
    ]
    return "\n".join(lines).rstrip() + "\n"
