"""Claims as a reader sees them: a verdict badge, a card per claim, a chapter's verdict table, the ledger table.

Every claim of the book is a record (statement, source, the source's value, ours, verdict, kind: see
:meth:`sphereml.book.chapter.Chapter.claim`).  This module turns records into HTML for the rendered book and into
plain text for a terminal or a script run, so a verdict always reads the same: one of the four words of
:mod:`sphereml.book.verdicts` on a coloured badge, the claim, where the source makes it, and the numbers behind
the verdict in words (``difference +1.2 (noise level 0.8)``) rather than a key-value dump.

* :class:`ClaimCard` — one claim where a chapter tests it; its HTML carries the anchor ``claim-<id>`` that
  the ledger links to;
* :class:`VerdictTable` — every claim of a chapter, for its summary;
* :func:`ledger_table` — every claim of every chapter as one sortable, filterable table
  (``_static/ledger.js`` sorts and filters it; on a phone each row becomes a card);
* :class:`Table` — a chapter's table of results (ours beside the source's), instead of printed columns.

:func:`show` displays them with IPython's rich display: a notebook shows the HTML, a script the text.
"""

from __future__ import annotations

import html
import re
from numbers import Number

from .verdicts import VERDICTS

__all__ = ["LEDGER_PROFILES", "describe", "ours_text", "badge", "claim_anchor", "ClaimCard", "VerdictTable",
           "ledger_table", "Table", "Markdown", "show"]

LEDGER_PROFILES = ("cpu", "gpu", "paper")  # the profiles whose claims the ledger reports, in this order
_BADGE_CLASS = {name: "verdict-" + name.replace(" ", "-") for name in VERDICTS.values()}
_LEAD_KEYS = ("difference", "noise", "margin", "seeds", "seed s.d.")  # described after the compared values


def show(obj) -> None:
    """Rich display in a notebook (the object's HTML), its text where IPython is not installed."""
    try:
        from IPython.display import display
    except ImportError:  # a plain script without IPython
        print(repr(obj))
    else:
        display(obj)


class Markdown:
    """Generated prose: rendered as Markdown in a notebook, printed as it is by a script (no IPython needed, as
    on a GPU box that runs a chapter as a plain script)."""

    def __init__(self, text: str):
        self.text = text

    def _repr_markdown_(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text


def _number(value: float) -> str:
    return f"{value:.4g}"


def _plain(value) -> str:
    """One value in words: booleans as yes / no, numbers to four significant digits."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "–"
    if isinstance(value, Number):
        return _number(value)
    if isinstance(value, dict):
        return describe(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(_plain(v) for v in value)
    return str(value)


def describe(value) -> str:
    """The numbers behind a verdict in words.

    A dict from :meth:`sphereml.book.verdicts.SeedComparison.numbers` reads as ``A 91.2, B 90.1; difference
    +1.1 (noise level 0.8, margin 2), 3 seeds``: the compared values first, then the signed difference and
    the noise level it was weighed against.  Other dicts read as ``key value`` pairs separated by ``;``;
    nested dicts in parentheses.
    """
    if not isinstance(value, dict):
        return _plain(value)
    parts = [f"{key} {('(' + describe(v) + ')') if isinstance(v, dict) else _plain(v)}"
             for key, v in value.items() if key not in _LEAD_KEYS]
    tail = []
    weighed = [f"{name} ({describe(value[key])})" if isinstance(value[key], dict) else f"{name} {_plain(value[key])}"
               for key, name in (("noise", "noise level"), ("margin", "margin")) if key in value]
    if "difference" in value:
        tail.append(f"difference {value['difference']:+.4g}" + (f" ({', '.join(weighed)})" if weighed else ""))
    else:
        tail += weighed
    if "seeds" in value:
        seeds = value["seeds"]
        tail.append(f"{seeds} seed{'s' if seeds != 1 else ''}"
                    + (f" (s.d. {_plain(value['seed s.d.'])})" if "seed s.d." in value else ""))
    return "; ".join(p for p in ("; ".join(parts), ", ".join(tail)) if p)


def badge(verdict: str) -> str:
    """The HTML badge of a verdict word ("holds", "does not hold", "not distinguishable", "not testable")."""
    if verdict not in _BADGE_CLASS:
        raise ValueError(f"verdict must be one of {tuple(_BADGE_CLASS)}, got {verdict!r}")
    return f'<span class="verdict-badge {_BADGE_CLASS[verdict]}">{verdict}</span>'


def claim_anchor(claim_id: str) -> str:
    """The HTML id of a claim's card: ``claim-`` and the id with anything but letters, digits, ``-`` and
    ``_`` replaced by ``-``."""
    return "claim-" + re.sub(r"[^A-Za-z0-9_-]", "-", claim_id)


def ours_text(record: dict) -> str:
    """A claim record's own numbers in words, after the scale they are on when the record names it
    (``unit``: e.g. "test error %; differences in accuracy points")."""
    unit = record.get("unit")
    return (f"({unit}) " if unit else "") + describe(record["ours"])


def _numbers_text(record: dict) -> str:
    text = f"ours: {ours_text(record)}"
    return text + (f" — source: {describe(record['paper'])}" if record.get("paper") is not None else "")


class ClaimCard:
    """One claim as its chapter shows it: badge, statement, source, and the numbers behind the verdict."""

    def __init__(self, record: dict):
        self.record = record

    def _repr_html_(self) -> str:
        r, e = self.record, html.escape
        paper = (f'<div class="claim-numbers">source: {e(describe(r["paper"]))}</div>'
                 if r.get("paper") is not None else "")
        return (f'<div class="claim-card" id="{claim_anchor(r["id"])}">{badge(r["verdict"])} '
                f'<span class="claim-statement">{e(r["statement"])}</span> '
                f'<span class="claim-source">({e(r["source"])})</span>'
                f'<div class="claim-numbers">ours: {e(ours_text(r))}</div>{paper}</div>')

    def __repr__(self) -> str:
        r = self.record
        return f"[{r['verdict']}] {r['statement']} ({r['source']})\n    {_numbers_text(r)}"


class VerdictTable:
    """A chapter's claims in one table (its summary): verdict, claim, source, kind."""

    def __init__(self, records: list[dict]):
        self.records = list(records)

    def _repr_html_(self) -> str:
        e = html.escape
        rows = "".join(f'<tr><td>{badge(r["verdict"])}</td><td><a href="#{claim_anchor(r["id"])}">'
                       f'{e(r["statement"])}</a></td><td>{e(r["source"])}</td><td>{e(r["kind"])}</td></tr>'
                       for r in self.records)
        return (f'<table class="verdict-table"><caption>{e(self.counts())}</caption><thead><tr><th>verdict</th>'
                f'<th>claim</th><th>source</th><th>kind</th></tr></thead><tbody>{rows}</tbody></table>')

    def counts(self) -> str:
        """The table's caption: how many claims, and how many of each verdict (those that occur)."""
        counts = {name: sum(r["verdict"] == name for r in self.records) for name in VERDICTS.values()}
        parts = ", ".join(f"{name} {n}" for name, n in counts.items() if n)
        total = f"{len(self.records)} claim{'s' * (len(self.records) != 1)} in this run"
        return f"{total}: {parts}" if parts else total

    def __repr__(self) -> str:
        return "\n".join(f"- [{r['verdict']}] {r['statement']} ({r['source']})" for r in self.records)


def claim_records(runs: dict, claim_id: str, profiles: tuple[str, ...] = LEDGER_PROFILES) -> dict:
    """One claim's record in each profile of a chapter's ledger entry (None where that profile did not run it)."""
    return {p: next((r for r in runs.get(p, {}).get("claims", []) if r["id"] == claim_id), None) for p in profiles}


def scale_changes(records: dict) -> dict[str, str]:
    """For one claim's records by profile (in ledger order, None where not run): each profile whose verdict differs
    from the one of the last smaller profile that ran the claim, mapped to that smaller profile."""
    changes, previous = {}, None
    for profile, record in records.items():
        if record is None:
            continue
        if previous is not None and record["verdict"] != previous[1]["verdict"]:
            changes[profile] = previous[0]
        previous = (profile, record)
    return changes


def _ledger_row(chapter: str, number: str, runs: dict, claim_id: str, profiles: tuple[str, ...]) -> str:
    e = html.escape
    records = claim_records(runs, claim_id, profiles)
    record = next(r for r in records.values() if r is not None)
    link = f"../notebooks/{chapter}.html#{claim_anchor(claim_id)}"
    cells = [f'<td data-label="chapter" data-sort="{e(chapter)}">{e(number)}</td>',
             f'<td data-label="claim"><a href="{link}">{e(record["statement"])}</a></td>',
             f'<td data-label="kind">{e(record["kind"])}</td>',
             f'<td data-label="source">{e(record["source"])}</td>',
             f'<td data-label="source\'s value">{e(describe(record["paper"]))}</td>']
    changes = scale_changes(records)  # a verdict that differs from a smaller profile's: scale matters
    for profile in profiles:
        found = records[profile]
        change = f' <span class="scale-change">changed from {changes[profile]}</span>' if profile in changes else ""
        cells.append(f'<td data-label="ours ({profile})">{e(ours_text(found)) if found else "not run"}</td>')
        cells.append(f'<td data-label="verdict ({profile})" data-sort="{found["verdict"] if found else "~"}">'
                     f'{badge(found["verdict"]) + change if found else "not run"}</td>')
    return ('<tr class="scale-change">' if changes else "<tr>") + "".join(cells) + "</tr>"


def ledger_table(snapshot: dict) -> str:
    """Every claim of a ledger snapshot (:func:`sphereml.book.ledger.collect`) as one HTML table.

    One row per claim: chapter, the claim (a link to its card in the chapter), kind, source, the source's
    value, and per profile our numbers and the verdict; a ``gpu`` (``paper``) pair of columns only when some
    chapter has ``gpu`` (``paper``) records.  A verdict that differs from the one of the smaller profile before it
    says "changed from cpu" (the row gets the class ``scale-change``).  The table has no blank line, so Markdown
    keeps it as one HTML block.
    """
    profiles = tuple(p for p in LEDGER_PROFILES if any(p in runs for runs in snapshot["chapters"].values()))
    head = ["chapter", "claim", "kind", "source", "source's value"]
    head += [f"{what} ({p})" for p in profiles for what in ("ours", "verdict")]
    rows = []
    for chapter, runs in snapshot["chapters"].items():
        number = chapter.split("_")[0].lstrip("0") or "0"
        ids = dict.fromkeys(r["id"] for p in profiles for r in runs.get(p, {}).get("claims", []))
        rows += [_ledger_row(chapter, number, runs, claim_id, profiles) for claim_id in ids]
    header = "".join(f'<th scope="col">{html.escape(h)}</th>' for h in head)
    # wide-table: on a wide screen the table also takes the page's empty right margin (_static/sphereml.css)
    return (f'<div class="wide-table"><table class="ledger" id="claims-table"><thead><tr>{header}</tr></thead>\n'
            "<tbody>\n" + "\n".join(rows) + "\n</tbody></table></div>")


class Table:
    """A table of results as a chapter shows it: an HTML table in the book, aligned columns in a script.

    Args:
        columns (list[str]): the headings.
        rows (list[list]): one list of cells per row; floats are shown to ``digits`` significant digits,
            integers whole (``None`` as "–"), strings as given (e.g. ``"81.6 (80.7)"``: ours and, in parentheses, the
            source's).
        caption (str, optional): one sentence under the table: what the numbers are and where the source's
            come from.
        digits (int): significant digits of a number. Default: 4.

    Raises:
        ValueError: a row whose length differs from the number of columns.
    """

    def __init__(self, columns, rows, caption: str | None = None, digits: int = 4):
        self.columns = [str(c) for c in columns]
        self.rows = [list(r) for r in rows]
        bad = [i for i, r in enumerate(self.rows) if len(r) != len(self.columns)]
        if bad:
            raise ValueError(f"rows {bad} do not have {len(self.columns)} cells")
        self.caption, self.digits = caption, digits

    def _text(self, value) -> str:
        if isinstance(value, bool):
            return _plain(value)
        if isinstance(value, int):
            return str(value)
        if isinstance(value, Number):
            return f"{value:.{self.digits}g}"
        return _plain(value)

    def _repr_html_(self) -> str:
        e = html.escape
        head = "".join(f"<th>{e(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f'<td class="{"num" if isinstance(v, Number) and not isinstance(v, bool) else ""}">'
                             f"{e(self._text(v))}</td>" for v in row) + "</tr>" for row in self.rows)
        caption = f'<p class="result-caption">{e(self.caption)}</p>' if self.caption else ""
        return (f'<div class="result-table"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
                f"{caption}</div>")

    def __repr__(self) -> str:
        cells = [self.columns] + [[self._text(v) for v in row] for row in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                 .rstrip() for row in cells]
        return "\n".join(lines + ([self.caption] if self.caption else []))
