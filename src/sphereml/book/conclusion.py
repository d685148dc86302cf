"""The book's conclusion, read from its records: claims by kind and method, effects against noise, cost.

Chapter 10 weighs the thesis's closing claims (thesis Ch. 8: hyperspherical learning "yields better
generalization, faster convergence and stronger adversarial robustness") with nothing but the files the
other chapters and the benchmarks wrote, so that it changes whenever they change:

* the claims ledger ``book/claims.json`` (:mod:`sphereml.book.ledger`): every claim record carries the verdict of
  :mod:`sphereml.book.verdicts` and a ``kind``, one of :data:`sphereml.book.chapter.CLAIM_KINDS`;
* the benchmark results ``benchmarks/results/*.json`` (``benchmarks/harness.py``): seconds, ``ratio_to_<baseline>``
  and ``peak_bytes`` per candidate, with the device that timed them;
* the table of ``book/errata.md``, read by :mod:`sphereml.book.errata`.

Every function takes the paths or the loaded data as arguments, so tests point them at temporary copies.

Note [an effect and its noise]
------------------------------
A claim's ``ours`` is whatever its chapter recorded.  :func:`effect` finds one effect with its noise where the
record holds one: an explicit ``difference``; exactly two compared values (what
:meth:`~sphereml.book.verdicts.SeedComparison.numbers` writes beside ``seeds``, ``noise`` and ``seed s.d.``); one
recorded difference named ``"a - b"``; or one ratio named ``"a / b"`` (compared with 1).  The noise is the
record's ``noise`` (or ``... noise``, ``2 s.e.``).  Records with several comparisons (a claim "for every
variant"), no noise, or a list of values have no single effect: they are counted, not drawn.  The metrics are
written with sorted keys, so two compared values no longer say which was claimed larger: the direction of such
an effect comes from its verdict (holds: the claimed way, does not hold: the other way) and stays unknown
when the verdict did not decide.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .chapter import CLAIM_KINDS
from .runs import PROFILES
from .verdicts import NOT_TESTABLE, VERDICTS

__all__ = ["FAMILIES", "THESIS_KINDS", "VERDICT_ORDER", "NO_KIND", "BENCHMARKS", "load_snapshot",
           "family_of", "claim_records", "ledger_profiles", "main_profile", "verdict_counts", "count_rows", "Effect",
           "effect", "effect_rows", "cost_rows", "benefit_rows", "scale_changes", "too_small_to_decide",
           "verdict_phrase", "kind_summary", "markdown_table", "verdict_table"]

FAMILIES = {  # chapter -> the method family whose claims it tests
    "01_hypersphere": "hypersphere", "02_large_margin": "margins", "03_spherenet": "SphereConv",
    "04_decoupled": "decoupled", "05_sharpened_cosine": "SCS", "06_mhe": "MHE", "07_comhe": "CoMHE",
    "08_convsim": "ConvSim", "09_opt": "OPT",
}
THESIS_KINDS = ("generalisation", "convergence", "robustness")  # the three claims of thesis Ch. 8
VERDICT_ORDER = tuple(VERDICTS.values())  # holds, does not hold, not distinguishable, not testable
NO_KIND = "no kind"  # a record written before claims carried a kind
HOLDS, FAILS = VERDICTS[True], VERDICTS[False]


@dataclass(frozen=True)
class Benchmark:
    """Where a family's cost is measured: the benchmark's name, what one call does, and its candidates."""

    name: str
    what: str
    member: Callable[[str], bool] = lambda label: True


_NOT_A_METHOD = ("(compiled)", "unfold", "port style")  # compiled variants and readable references
BENCHMARKS = {  # family -> the benchmark that times it against a baseline (benchmarks/bench_*.py)
    "margins": Benchmark("margin_heads_fwd_bwd",
                         "a margin head, forward and backward, against nn.Linear + cross_entropy"),
    "SphereConv": Benchmark("sphereconv_fwd_bwd", "a SphereConv layer, forward and backward, against nn.Conv2d"),
    "decoupled": Benchmark("decoupled_fwd_bwd", "a decoupled layer, forward and backward, against nn.Conv2d"),
    "SCS": Benchmark("scs_fwd_bwd", "an SCS layer, forward and backward, against nn.Conv2d"),
    "MHE": Benchmark("comhe_train_step_cnn9_b128", "a training step of CNN-9 against one without regulariser",
                     lambda label: "MHE" in label and "CoMHE" not in label),
    "CoMHE": Benchmark("comhe_train_step_cnn9_b128", "a training step of CNN-9 against one without regulariser",
                       lambda label: "CoMHE" in label),
    "OPT": Benchmark("opt_train_step_cnn6_w64_b128", "a training step of CNN-6 against the plain network",
                     lambda label: "(unrolled)" not in label),  # gs (unrolled): the thesis's loop, a reference
}


# ------------------------------------------------------------------------------------------- the ledger
def load_snapshot(path: str | os.PathLike) -> dict:
    """The ledger snapshot at ``path`` (``book/claims.json``, written by :func:`sphereml.book.ledger.collect`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no claims ledger at {path}: run the chapters, then "
                                "`python -m sphereml.book ledger`")
    snapshot = json.loads(path.read_text())
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("chapters"), dict):
        raise ValueError(f"{path} is not a ledger snapshot: expected {{'chapters': {{name: {{profile: run}}}}}}")
    return snapshot


def family_of(chapter: str) -> str:
    """The method family of a chapter (:data:`FAMILIES`), e.g. ``"06_mhe"`` -> ``"MHE"``."""
    if chapter not in FAMILIES:
        raise ValueError(f"chapter must be one of {sorted(FAMILIES)} (add new chapters to FAMILIES), got {chapter!r}")
    return FAMILIES[chapter]


def claim_records(snapshot: dict) -> list[dict]:
    """Every claim of the snapshot as one flat record: chapter, family, profile, id, statement, source, kind,
    verdict, ours, paper; in chapter order.  A record without a kind gets :data:`NO_KIND`."""
    out = []
    for chapter in sorted(snapshot["chapters"]):
        for profile, run in snapshot["chapters"][chapter].items():
            for record in run.get("claims", []):
                kind = record.get("kind") or NO_KIND
                if kind not in CLAIM_KINDS + (NO_KIND,):
                    raise ValueError(f"claim {chapter}/{record.get('id')}: kind must be one of {CLAIM_KINDS}, "
                                     f"got {kind!r}")
                if record.get("verdict") not in VERDICT_ORDER:
                    raise ValueError(f"claim {chapter}/{record.get('id')}: verdict must be one of {VERDICT_ORDER}, "
                                     f"got {record.get('verdict')!r}")
                out.append({"chapter": chapter, "family": family_of(chapter), "profile": profile,
                            "id": record["id"], "statement": record.get("statement", ""),
                            "source": record.get("source", ""), "kind": kind, "verdict": record["verdict"],
                            "ours": record.get("ours"), "paper": record.get("paper")})
    return out


def ledger_profiles(records: list[dict]) -> list[str]:
    """The profiles the records come from, in the book's order (``cpu`` before ``gpu``)."""
    present = {r["profile"] for r in records}
    return [p for p in PROFILES if p in present] + sorted(present - set(PROFILES))


def main_profile(records: list[dict]) -> str:
    """The profile the chapter's derived views read: ``gpu`` once it covers every chapter that ``cpu`` covers
    (the larger scale, complete), else ``cpu`` (or whatever single profile there is)."""
    chapters = {p: {r["chapter"] for r in records if r["profile"] == p} for p in ledger_profiles(records)}
    if "gpu" in chapters and chapters["gpu"] >= chapters.get("cpu", set()):
        return "gpu"
    return "cpu" if "cpu" in chapters else next(iter(chapters), "cpu")


def _kinds(records) -> list[str]:
    present = {r["kind"] for r in records}
    return [k for k in CLAIM_KINDS + (NO_KIND,) if k in present]


def _families(records) -> list[str]:
    present = {r["family"] for r in records}
    return [f for f in dict.fromkeys(FAMILIES.values()) if f in present]


def verdict_counts(records: list[dict]) -> dict[tuple[str, str, str], dict[str, int]]:
    """``{(kind, family, profile): {verdict: count}}`` with every verdict of :data:`VERDICT_ORDER` present."""
    counts: dict = {}
    for r in records:
        cell = counts.setdefault((r["kind"], r["family"], r["profile"]), dict.fromkeys(VERDICT_ORDER, 0))
        cell[r["verdict"]] += 1
    return counts


def count_rows(records: list[dict], profile: str) -> list[dict]:
    """The rows of the verdict table of one profile: per kind, one row per family with claims of that kind
    and, where there are several, a row ``all`` that sums them.  Each row: kind, family, the four verdict
    counts, claims."""
    mine = [r for r in records if r["profile"] == profile]
    counts = verdict_counts(mine)
    rows = []
    for kind in _kinds(mine):
        families = [f for f in _families(mine) if (kind, f, profile) in counts]
        for family in families + (["all"] if len(families) > 1 else []):
            cells = ([counts[(kind, family, profile)]] if family != "all"
                     else [counts[(kind, f, profile)] for f in families])
            row = {"kind": kind, "family": family} | {v: sum(c[v] for c in cells) for v in VERDICT_ORDER}
            rows.append(row | {"claims": sum(row[v] for v in VERDICT_ORDER)})
    return rows


# ------------------------------------------------------------------------------------------- effects
_META = {"seeds", "seed s.d.", "margin", "steps", "step", "draws", "time repeats", "repeats", "chance"}
_NOISE = re.compile(r"^(noise|.* noise|2 s\.e\.)$")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Effect:
    """One effect of a claim record and its noise, in the record's own units (Note [an effect and its noise]).

    ``size`` is the absolute effect, ``difference`` the signed one where the record says which way it goes,
    ``equivalence`` marks a claim of no difference (its record states a ``margin``), and ``scale`` is 100 when
    the values are fractions (accuracies in [0, 1]: every value within 1 and the noise below 0.25), so that
    ``size * scale`` is in points.
    """

    size: float
    noise: float
    difference: float | None = None
    equivalence: bool = False
    margin: float | None = None
    scale: float = 1.0

    @property
    def ratio(self) -> float:
        """The effect in units of its noise: a directional claim is decided only beyond 1."""
        return self.size / self.noise


def effect(ours) -> Effect | None:
    """The one effect of a claim's ``ours`` with its noise, or None (Note [an effect and its noise])."""
    if not isinstance(ours, dict) or any(isinstance(v, (list, tuple)) for v in ours.values()):
        return None
    nested = [v for v in ours.values() if isinstance(v, dict)]
    if nested:  # a claim of several parts, each with its own difference and noise
        return effect(nested[0]) if len(nested) == 1 and len(ours) - len(nested) <= 1 else None
    noises = [v for k, v in ours.items() if _NOISE.match(k)]
    if len(noises) != 1 or not _number(noises[0]) or noises[0] <= 0:
        return None
    noise = float(noises[0])
    values = {k: float(v) for k, v in ours.items() if k not in _META and not _NOISE.match(k) and _number(v)}
    margin = ours.get("margin") if _number(ours.get("margin")) else None
    arms = {k: v for k, v in values.items() if " - " not in k and k != "difference"}
    differences = {k: v for k, v in values.items() if k not in arms}
    difference = None
    if "difference" in values:
        difference = values["difference"]
        size, used = abs(difference), [difference]
    elif len(arms) == 2 or (len(arms) == 1 and len(values) == 2):  # "1 - confidence" can be a variant's name
        pair = list(arms.values()) if len(arms) == 2 else list(values.values())
        size, used = abs(pair[0] - pair[1]), pair
    elif not arms and len(differences) == 1:
        difference = next(iter(differences.values()))
        size, used = abs(difference), [difference]
    elif len(values) == 1 and " / " in next(iter(values)):  # a ratio (of two times), compared with 1
        ratio = next(iter(values.values()))  # its claimed direction (slower? faster?) is the verdict's to say
        return Effect(abs(ratio - 1.0), noise, None, margin is not None, margin, 1.0)
    else:
        return None
    return Effect(size, noise, difference, margin is not None, margin, _scale(used, noise))


def _scale(values, noise=0.0) -> float:
    """100 for fractions (every value within 1 and a noise below 0.25, i.e. 25 points), else 1: a record in
    percent whose values all lie within 1 (a recall of 0 %) keeps its units."""
    return 100.0 if all(abs(v) <= 1 for v in values) and noise < 0.25 else 1.0


def _signed(e: Effect, verdict: str) -> float | None:
    """The effect in the claimed direction (positive: the way the source claims), where it is known."""
    if e.equivalence:
        return None
    if e.difference is not None:
        return e.difference
    return e.size if verdict == HOLDS else -e.size if verdict == FAILS else None


def effect_rows(records: list[dict], profile: str, kinds=None) -> tuple[list[dict], list[dict]]:
    """(rows with an effect, records without one) of ``profile``; a row: kind, family, chapter, id, verdict,
    size, noise, ratio (size / noise), signed (the effect in the claimed direction, None where unknown),
    equivalence, and for the accuracy kinds (:data:`THESIS_KINDS`; else None) points, size_points and
    noise_points: ``signed``, ``size`` and ``noise`` in points of accuracy."""
    kinds = tuple(kinds or CLAIM_KINDS + (NO_KIND,))
    rows, without = [], []
    for r in records:
        if r["profile"] != profile or r["kind"] not in kinds:
            continue
        e = effect(r["ours"])
        if e is None:
            without.append(r)
            continue
        signed = _signed(e, r["verdict"])
        accuracy = r["kind"] in THESIS_KINDS
        rows.append({**{k: r[k] for k in ("kind", "family", "chapter", "id", "verdict")},
                     "size": e.size, "noise": e.noise, "ratio": e.ratio, "signed": signed,
                     "equivalence": e.equivalence,
                     "points": e.scale * signed if accuracy and signed is not None else None,
                     "size_points": e.scale * e.size if accuracy else None,
                     "noise_points": e.scale * e.noise if accuracy else None})
    order = {k: i for i, k in enumerate(CLAIM_KINDS + (NO_KIND,))}
    family = {f: i for i, f in enumerate(dict.fromkeys(FAMILIES.values()))}
    rows.sort(key=lambda row: (order[row["kind"]], family[row["family"]]))
    return rows, without


# ------------------------------------------------------------------------------------------- cost
def cost_rows(results_dir: str | os.PathLike) -> list[dict]:
    """The cost of each family on each device from ``results_dir`` (``benchmarks/results``, :data:`BENCHMARKS`).

    Returns one row per family and device: family, device (``cpu`` or ``gpu``), device_name, what (what one
    call times), baseline, times and memory (``{candidate: ratio to the baseline}``; memory only where the
    benchmark recorded peak bytes of both).
    """
    results = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        result = json.loads(path.read_text())
        if isinstance(result, dict) and "benchmark" in result:
            results[(result["benchmark"], "gpu" if result.get("cuda") else "cpu")] = result
    rows = []
    for family, bench in BENCHMARKS.items():
        for device in ("cpu", "gpu"):
            result = results.get((bench.name, device))
            if result is None:
                continue
            key = next((k for k in result if k.startswith("ratio_to_")), None)
            if key is None:
                continue
            baseline = key[len("ratio_to_"):]
            times = {label: float(r) for label, r in result[key].items()
                     if label != baseline and bench.member(label) and not any(m in label for m in _NOT_A_METHOD)}
            peaks = result.get("peak_bytes") or {}
            memory = {label: peaks[label] / peaks[baseline] for label in times
                      if peaks.get(label) and peaks.get(baseline)}
            if times:
                rows.append({"family": family, "device": device, "device_name": result.get("device", device),
                             "what": bench.what, "baseline": baseline, "times": times, "memory": memory})
    return rows


def benefit_rows(records: list[dict], costs: list[dict], profile: str) -> list[dict]:
    """Per method family: its generalisation effects (in points, in the claimed direction where known) from the
    ``profile`` ledger beside its cost per device, with a note for whatever is not measured.

    A row: family; effects (``[{"id", "verdict", "points", "size_points", "noise_points"}]``, ``points`` None
    where the direction is unknown, see :func:`effect_rows`); per device ``time_<device>`` and
    ``memory_<device>`` as (median, low, high) over the family's candidates, or None; notes (sentences).
    Chapter 1 (*hypersphere*) has no method to cost and no row.
    """
    rows_with, _ = effect_rows(records, profile, kinds=("generalisation",))
    rows = []
    for family in [f for f in dict.fromkeys(FAMILIES.values()) if f != FAMILIES["01_hypersphere"]]:
        effects = [{k: r[k] for k in ("id", "verdict", "points", "size_points", "noise_points")}
                   for r in rows_with if r["family"] == family]
        row = {"family": family, "effects": effects, "notes": []}
        for device in ("cpu", "gpu"):
            cost = next((c for c in costs if c["family"] == family and c["device"] == device), None)
            for measure, key in (("time", "times"), ("memory", "memory")):
                values = list((cost or {}).get(key, {}).values())
                row[f"{measure}_{device}"] = (statistics.median(values), min(values), max(values)) if values else None
        timed = [d for d in ("cpu", "gpu") if row[f"time_{d}"]]
        if not effects:
            row["notes"].append(f"no generalisation claim of the `{profile}` ledger records one effect with its "
                                "noise, so its benefit is not measured here")
        if not timed:
            row["notes"].append("no benchmark in benchmarks/results times it against a baseline, so its cost is not "
                                "measured here")
        elif len(timed) == 1:
            row["notes"].append(f"its cost is measured on the {timed[0]} only")
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------- scale
def scale_changes(records: list[dict], low: str = "cpu", high: str = "gpu") -> list[dict]:
    """Claims with a verdict in both profiles whose verdicts differ: chapter, family, kind, id, and the two
    verdicts under the profiles' names."""
    by = {(r["chapter"], r["id"], r["profile"]): r for r in records}
    out = []
    for (chapter, claim_id, profile), r in by.items():
        other = by.get((chapter, claim_id, high))
        if profile == low and other is not None and other["verdict"] != r["verdict"]:
            out.append({"chapter": chapter, "family": r["family"], "kind": r["kind"], "id": claim_id,
                        low: r["verdict"], high: other["verdict"]})
    return out


def too_small_to_decide(records: list[dict], profile: str) -> list[dict]:
    """Not-distinguishable accuracy claims (:data:`THESIS_KINDS`; claims of no difference aside) whose source
    gives two values: the source's gap beside our noise, both in points.  Where the gap is smaller than the
    noise, this scale could not have decided the claim even if the source's effect is real.  A row: family,
    kind, id, gap, noise, factor (noise / gap, how many times too large our noise is; inf for a gap of 0)."""
    out = []
    for r in records:
        if r["profile"] != profile or r["kind"] not in THESIS_KINDS or r["verdict"] != VERDICTS[None]:
            continue
        e = effect(r["ours"])
        paper = r["paper"] if isinstance(r["paper"], dict) else {}
        values = [float(v) for v in paper.values() if _number(v)]
        if e is None or e.equivalence or len(values) != 2 or len(paper) != 2:
            continue
        gap = abs(values[0] - values[1]) * _scale(values)
        noise = e.noise * e.scale
        out.append({"family": r["family"], "kind": r["kind"], "id": r["id"], "gap": gap, "noise": noise,
                    "factor": noise / gap if gap > 0 else math.inf})
    return out


# ------------------------------------------------------------------------------------------- rendering
def verdict_phrase(counts: dict[str, int]) -> str:
    """``"holds 2, does not hold 1, not distinguishable 5, not testable 0"``: counts in the verdicts' own words."""
    return ", ".join(f"{verdict} {counts.get(verdict, 0)}" for verdict in VERDICT_ORDER)


def kind_summary(records: list[dict], kind: str | tuple[str, ...], profile: str) -> str:
    """One paragraph on the claims of ``kind`` (one kind or a tuple of kinds) in ``profile``: how many, their
    verdicts, how many the evidence decides, and which families hold and which do not."""
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    mine = [r for r in records if r["kind"] in kinds and r["profile"] == profile]
    if not mine:
        return f"No claim of kind {' or '.join(kinds)} in the `{profile}` ledger."
    counts = {v: sum(r["verdict"] == v for r in mine) for v in VERDICT_ORDER}
    decided, undecided, untestable = counts[HOLDS] + counts[FAILS], counts[VERDICTS[None]], counts[NOT_TESTABLE]
    families = _families(mine)
    text = (f"{len(mine)} claim{'s' * (len(mine) != 1)} from {len(families)} method "
            f"famil{'ies' if len(families) != 1 else 'y'}: {verdict_phrase(counts)}. "
            f"The evidence decides {decided} of {len(mine)} ({100 * decided / len(mine):.0f} %). ")
    if undecided:
        text += f"For {undecided} (not distinguishable) our evidence is too small to decide. "
    if untestable:
        text += f"Not testable at this scale (the comparison cannot speak to the claim): {untestable}. "
    for verdict in (HOLDS, FAILS):
        by_family = {f: sum(r["verdict"] == verdict and r["family"] == f for r in mine) for f in families}
        named = [f"{f} {n}" for f, n in by_family.items() if n]
        if named:
            text += f"{verdict.capitalize()}: {', '.join(named)}. "
    return text.strip()


_NUMERIC = re.compile(r"^([+\-−]?\d[\d.,]*\s*[×%]?(\s*\(.*\))?|–|)$")  # a number, a dash, or empty


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A Markdown table of already formatted cells; pipes escaped; a column of numbers is right-aligned."""
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    numeric = [bool(rows) and all(_NUMERIC.match(cell(row[i]).strip()) for row in rows) for i in range(len(columns))]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict_table(records: list[dict], profile: str) -> str:
    """The Markdown of :func:`count_rows` (the chapter's Table 1): a bold row per kind, then one row per family
    and the kind's total; columns: the four verdicts and all claims."""
    lines, kind = [], None
    for r in count_rows(records, profile):
        if r["kind"] != kind:
            kind = r["kind"]
            lines.append([f"**{kind}**", *[""] * (len(VERDICT_ORDER) + 1)])
        lines.append([f"*all {r['kind']}*" if r["family"] == "all" else r["family"],
                      *[r[v] for v in VERDICT_ORDER], r["claims"]])
    return markdown_table(["family", *VERDICT_ORDER, "all"], lines)
