"""The errata page as data: the table of ``book/errata.md``, each entry sorted by kind, counted by source.

Every chapter that finds a source wrong, ambiguous or silent adds a row to ``book/errata.md`` (source, place,
what it says, what is meant or missing, where it is shown, kind).  The ``kind`` column takes one of
:data:`ERRATA_KINDS`: a wrong **formula** (or a wrong statement about one), a wrong or inconsistent **table
value**, a claim that its own table does not support (**unsupported claim**), or an **ambiguity** (a setting
missing, or given two ways).  Chapter 10 counts them with :func:`errata_counts`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .conclusion import markdown_table

__all__ = ["ERRATA_KINDS", "parse_errata", "errata_counts", "errata_table"]

ERRATA_KINDS = ("formula", "table value", "unsupported claim", "ambiguity")
_CITE = re.compile(r"\{cite\}`[^`]*`")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def parse_errata(path: str | os.PathLike) -> list[dict]:
    """The rows of the errata table in ``path`` (``book/errata.md``) as dicts keyed by its header, plus
    ``primary``: the first source named, without citations (``"thesis and OPT code"`` -> ``"thesis"``).

    Raises:
        ValueError: no table with a ``kind`` column, a row with the wrong number of cells, or a kind not
            in :data:`ERRATA_KINDS`.
    """
    lines = Path(path).read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|") and "kind" in _cells(line)), None)
    if start is None:
        raise ValueError(f"{path} has no table with a 'kind' column")
    header = _cells(lines[start])
    rows = []
    for number, line in enumerate(lines[start + 2:], start + 3):
        if not line.startswith("|"):
            break
        cells = _cells(line)
        if len(cells) != len(header):
            raise ValueError(f"{path}, line {number}: {len(cells)} cells, the header has {len(header)}")
        row = dict(zip(header, cells))
        if row["kind"] not in ERRATA_KINDS:
            raise ValueError(f"{path}, line {number}: kind must be one of {ERRATA_KINDS}, got {row['kind']!r}")
        row["primary"] = re.split(r",| and ", _CITE.sub("", row["source"]))[0].strip()
        rows.append(row)
    return rows


def errata_counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    """``{primary source: {kind: count}}``, sources by their number of errata (most first)."""
    counts: dict = {}
    for row in rows:
        counts.setdefault(row["primary"], dict.fromkeys(ERRATA_KINDS, 0))[row["kind"]] += 1
    return dict(sorted(counts.items(), key=lambda item: -sum(item[1].values())))


def errata_table(rows: list[dict]) -> str:
    """The Markdown of :func:`errata_counts` with a row and a column of totals (the chapter's Table 5)."""
    counts = errata_counts(rows)
    total = [sum(c[k] for c in counts.values()) for k in ERRATA_KINDS]
    return markdown_table(["source", *ERRATA_KINDS, "all"],
                          [[source, *c.values(), sum(c.values())] for source, c in counts.items()]
                          + [["all", *total, len(rows)]])
