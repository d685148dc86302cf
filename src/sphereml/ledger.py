"""The claims ledger: every chapter's claim records gathered into one page of the book.

Each chapter states the seeds' headline claims with :meth:`~sphereml.chapter.Chapter.claim`, which
stores a record (statement, source, the paper's value, ours, verdict, kind) in the chapter's
``metrics.json``.  This module turns those records into ``book/claims.md``:

* :func:`collect` reads the ``metrics.json`` of executed chapters (one run per chapter and profile) and
  merges their claims into a *snapshot*, a JSON-serialisable dict that is committed as
  ``book/claims.json``: the numbers on the page come from runs of the notebooks, never from a hand;
* :func:`render` writes the page from a snapshot, so the page can always be regenerated (a test
  checks that the committed page is exactly ``render(snapshot)``).

The command line (``python -m sphereml.book ledger``) does both after a ``cpu`` (or ``gpu``) run of
the chapters.  Every verdict is decided by the one rule of :mod:`sphereml.verdicts`, and the page uses
its four words (holds, does not hold, not distinguishable, not testable), explained once at the top.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .chapter import CLAIM_KINDS, PROFILES, show_value
from .verdicts import VERDICTS

__all__ = ["LABELS", "collect", "render", "load_snapshot"]

LABELS = {name: name for name in VERDICTS.values()}  # the page uses the verdicts' own words
RUN_FIELDS = ("device_name", "torch", "threads")  # what the page says about the run behind each column


def load_snapshot(path: str | os.PathLike) -> dict:
    """A snapshot written by :func:`collect` (an empty one when the file does not exist)."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else {"chapters": {}}


def collect(metrics_paths, snapshot: dict | None = None, profiles: tuple[str, ...] = ("cpu", "gpu")) -> dict:
    """Merge the claims of executed chapters into ``snapshot`` (a new one when None).

    Args:
        metrics_paths: ``metrics.json`` files of chapter runs; runs of a profile not in ``profiles`` (a
            ``smoke`` run) and runs without claims are skipped, and a run replaces the earlier entry of its
            chapter and profile.
        snapshot (dict, optional): the snapshot to update.
        profiles (tuple[str]): the profiles the ledger reports.

    Returns:
        ``{"chapters": {name: {profile: {"device_name", "torch", "threads", "claims": [...]}}}}``.
    """
    snapshot = {"chapters": {}} if snapshot is None else json.loads(json.dumps(snapshot))
    for path in metrics_paths:
        metrics = json.loads(Path(path).read_text())
        profile = metrics.get("profile")
        if profile not in profiles or profile not in PROFILES or not metrics.get("claims"):
            continue  # a smoke run, or a chapter that makes no claim (the conclusion)
        entry = {field: metrics.get(field) for field in RUN_FIELDS}
        entry["claims"] = [_check_record(record, path) for record in metrics.get("claims", [])]
        snapshot["chapters"].setdefault(metrics["chapter"], {})[profile] = entry
    snapshot["chapters"] = dict(sorted(snapshot["chapters"].items()))
    return snapshot


def _check_record(record: dict, path) -> dict:
    missing = [key for key in ("id", "statement", "source", "verdict", "kind") if not record.get(key)]
    if missing or record["verdict"] not in VERDICTS.values() or record["kind"] not in CLAIM_KINDS:
        raise ValueError(f"claim record in {path} lacks {missing or 'a valid verdict and kind'}: {record}")
    return {key: record.get(key) for key in ("id", "statement", "source", "paper", "ours", "verdict", "kind")}


def _cell(value) -> str:
    """Text for one table cell: numbers shortened, pipes escaped, on one line."""
    text = value if isinstance(value, str) else show_value(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _summary(snapshot: dict) -> list[str]:
    lines = []
    for profile in ("cpu", "gpu"):
        records = [r for runs in snapshot["chapters"].values() for r in runs.get(profile, {}).get("claims", [])]
        if not records:
            lines.append(f"- `{profile}` profile: not yet run for the ledger.")
            continue
        counts = {label: sum(LABELS[r["verdict"]] == label for r in records) for label in LABELS.values()}
        chapters = sum(profile in runs for runs in snapshot["chapters"].values())
        parts = ", ".join(f"{n} {label}" for label, n in counts.items())
        lines.append(f"- `{profile}` profile: {len(records)} claims from {chapters} chapters: {parts}.")
    return lines


def _chapter_rows(name: str, runs: dict) -> list[str]:
    ids = list(dict.fromkeys(r["id"] for profile in ("cpu", "gpu") for r in runs.get(profile, {}).get("claims", [])))
    by_profile = {p: {r["id"]: r for r in runs.get(p, {}).get("claims", [])} for p in ("cpu", "gpu")}
    rows = ["| claim | source | paper | ours (`cpu`) | verdict (`cpu`) | verdict (`gpu`) |",
            "|---|---|---|---|---|---|"]
    for claim_id in ids:
        cpu, gpu = by_profile["cpu"].get(claim_id), by_profile["gpu"].get(claim_id)
        record = cpu or gpu
        paper = "–" if record.get("paper") is None else _cell(record["paper"])
        rows.append(f"| {_cell(record['statement'])} | {_cell(record['source'])} | {paper} | "
                    f"{_cell(cpu['ours']) if cpu else 'not yet run'} | "
                    f"{LABELS[cpu['verdict']] if cpu else 'not yet run'} | "
                    f"{LABELS[gpu['verdict']] if gpu else 'not yet run'} |")
    devices = "; ".join(f"`{p}`: {runs[p]['device_name']}, torch {runs[p]['torch']}" for p in ("cpu", "gpu")
                        if p in runs)
    return [f"## {{doc}}`/notebooks/{name}`", "", f"Runs: {devices}.", ""] + rows + [""]


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
        ":::{admonition} The four verdicts",
        "Every verdict of the book comes from one rule ({py:mod}`sphereml.verdicts`): variants are paired",
        "seed by seed, and a difference counts only beyond a *noise level*, the largest of a floor the",
        "chapter states, the binomial error of the evaluation set and the seed-to-seed spread (a 95 % t",
        "interval of the mean paired difference).",
        "",
        "- **holds** — the effect has the claimed sign and clears the noise level; for a claim of *no*",
        "  *difference*, the whole interval (difference ± noise) lies inside the margin the chapter states.",
        "- **does not hold** — the effect clears the noise level the other way (for no difference: the",
        "  whole interval lies outside the margin).",
        "- **not distinguishable** — neither: at this scale the data cannot decide.",
        "- **not testable** — the comparison cannot speak to the claim: an arm never trained (it stayed at",
        "  chance), the source says the measure is unreliable at our scale, or the control the claim rests",
        "  on failed.",
        "",
        "*not yet run* marks a profile that has not been run for the ledger. A `cpu` verdict is about a",
        "small network trained briefly on a data subset: it speaks for the direction of an effect at that",
        "scale, not for the paper's setting.",
        ":::",
        "",
        "Values are shown as each chapter records them, so their units differ (fractions, percentages,",
        "error rates): the chapter says which.",
        "",
        "**Summary.**",
        "",
        *_summary(snapshot),
        "",
    ]
    for name, runs in snapshot["chapters"].items():
        lines += _chapter_rows(name, runs)
    return "\n".join(lines).rstrip() + "\n"
