"""The book's machinery: everything the chapters need beyond the library, loaded on first use, so that
``import sphereml`` in a project of one's own brings no plotting, no chapter runtime and no papermill.

* :mod:`~sphereml.book.verdicts` — verdicts that know their noise: paired comparisons over seeds.
* :mod:`~sphereml.book.viz` — the book's plotting style and helpers.
* :mod:`~sphereml.book.chapter` — the chapter runtime: profiles, figures, metrics, claim records.
* :mod:`~sphereml.book.runs` — where and at what scale a chapter runs: profiles, the repository, output folders.
* :mod:`~sphereml.book.resume` — resumable chapter runs: finished trainings saved, and restored by a rerun.
* :mod:`~sphereml.book.recipes` — the sources' own training set-ups, which the ``paper`` profile trains with.
* :mod:`~sphereml.book.report` — claims as a reader sees them: verdict badges, claim cards, verdict tables.
* :mod:`~sphereml.book.ledger` — the claims ledger: every chapter's claim records gathered into one page.
* :mod:`~sphereml.book.conclusion` — chapter 10's reading of the ledger and the benchmarks.
* :mod:`~sphereml.book.errata` — the errata page as data: entries by source and kind.
* :mod:`~sphereml.book.runner` — the papermill runner (``python -m sphereml.book``); its functions are
  importable from here (``sphereml.book.run_chapter``), loaded when first asked for.
"""

import importlib

RUNNER = ("chapter_parameters", "run_chapter", "cache_executed_notebook", "write_ledger", "estimate_text", "main")

__all__ = list(RUNNER)


def __getattr__(name: str):
    """The runner's functions, imported when first asked for (PEP 562)."""
    if name in RUNNER:
        return getattr(importlib.import_module(".runner", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
