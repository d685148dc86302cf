"""The conclusion's reading of the book (sphereml.book.conclusion, sphereml.book.errata): counts by kind and
family, effects and their noise from every shape of record the chapters write, costs from the real benchmark
results, the errata table, and a chapter that follows its ledger."""

import copy
import json
import math
from pathlib import Path

import pytest

from sphereml import book
from sphereml.book import conclusion, errata
from sphereml.book.chapter import CLAIM_KINDS
from sphereml.book.verdicts import NOT_TESTABLE, VERDICTS, compare_over_seeds

REPO = Path(__file__).resolve().parents[1]
HOLDS, FAILS, UNDECIDED = VERDICTS[True], VERDICTS[False], VERDICTS[None]


def _claim(id, verdict=HOLDS, kind="generalisation", ours=None, paper=None):
    return {"id": id, "statement": f"claim {id}", "source": "thesis Table 1", "paper": paper, "ours": ours,
            "verdict": verdict, "kind": kind}


def _run(claims, device="cpu"):
    return {"device_name": device, "torch": "2.x", "threads": 2, "claims": claims}


@pytest.fixture
def snapshot():
    """A small hand-made ledger: three chapters, a gpu column for one of them."""
    return {"chapters": {
        "02_large_margin": {"cpu": _run([_claim("a", HOLDS), _claim("b", UNDECIDED),
                                         _claim("c", FAILS, "geometry/theory")])},
        "06_mhe": {"cpu": _run([_claim("d", UNDECIDED, ours={"MHE": 84.4, "baseline": 84.0, "noise": 1.0}),
                                _claim("e", NOT_TESTABLE, "robustness")]),
                   "gpu": _run([_claim("d", HOLDS, ours={"MHE": 85.0, "baseline": 84.0, "noise": 0.5}),
                                _claim("e", NOT_TESTABLE, "robustness")], "NVIDIA H100")},
        "09_opt": {"cpu": _run([_claim("f", HOLDS), _claim("g", FAILS, "convergence")])},
    }}


def _write(tmp_path, snapshot, name="claims.json"):
    path = tmp_path / name
    path.write_text(json.dumps(snapshot))
    return path


# ------------------------------------------------------------------------------------------- counts
def test_counts_by_kind_family_and_profile(snapshot, tmp_path):
    records = conclusion.claim_records(conclusion.load_snapshot(_write(tmp_path, snapshot)))
    assert len(records) == 9 and conclusion.ledger_profiles(records) == ["cpu", "gpu"]
    counts = conclusion.verdict_counts(records)
    assert counts[("generalisation", "margins", "cpu")] == {HOLDS: 1, FAILS: 0, UNDECIDED: 1, NOT_TESTABLE: 0}
    assert counts[("generalisation", "MHE", "gpu")][HOLDS] == 1
    rows = conclusion.count_rows(records, "cpu")
    assert [(r["kind"], r["family"]) for r in rows] == [
        ("generalisation", "margins"), ("generalisation", "MHE"), ("generalisation", "OPT"), ("generalisation", "all"),
        ("convergence", "OPT"), ("robustness", "MHE"), ("geometry/theory", "margins")]  # "all" only over several
    total = rows[3]
    assert (total[HOLDS], total[FAILS], total[UNDECIDED], total[NOT_TESTABLE], total["claims"]) == (2, 0, 2, 0, 4)
    assert [r["family"] for r in conclusion.count_rows(records, "gpu")] == ["MHE", "MHE"]


def test_verdict_table_groups_families_under_their_kind(snapshot):
    table = conclusion.verdict_table(conclusion.claim_records(snapshot), "cpu").splitlines()
    assert table[:2] == ["| family | holds | does not hold | not distinguishable | not testable | all |",
                         "|---|---:|---:|---:|---:|---:|"]
    assert table[2:7] == ["| **generalisation** |  |  |  |  |  |", "| margins | 1 | 0 | 1 | 0 | 2 |",
                          "| MHE | 0 | 0 | 1 | 0 | 1 |", "| OPT | 1 | 0 | 0 | 0 | 1 |",
                          "| *all generalisation* | 2 | 0 | 2 | 0 | 4 |"]
    assert table[7:9] == ["| **convergence** |  |  |  |  |  |", "| OPT | 0 | 1 | 0 | 0 | 1 |"]


def test_main_profile_is_gpu_only_when_it_covers_every_chapter(snapshot):
    records = conclusion.claim_records(snapshot)
    assert conclusion.main_profile(records) == "cpu"  # gpu has only 06_mhe
    for chapter in ("02_large_margin", "09_opt"):
        snapshot["chapters"][chapter]["gpu"] = copy.deepcopy(snapshot["chapters"][chapter]["cpu"])
    assert conclusion.main_profile(conclusion.claim_records(snapshot)) == "gpu"


def test_summaries_use_the_verdicts_own_words(snapshot):
    records = conclusion.claim_records(snapshot)
    text = conclusion.kind_summary(records, "generalisation", "cpu")
    assert text.startswith("4 claims from 3 method families: holds 2, does not hold 0, not distinguishable 2, "
                           "not testable 0. The evidence decides 2 of 4 (50 %).")
    assert "Holds: margins 1, OPT 1." in text and "Does not hold" not in text
    assert "too small to decide" in text
    assert conclusion.kind_summary(records, "efficiency", "cpu") == "No claim of kind efficiency in the `cpu` ledger."
    both = conclusion.kind_summary(records, conclusion.THESIS_KINDS, "cpu")
    assert both.startswith("6 claims from 3 method families") and "Not testable" in both
    assert conclusion.verdict_phrase({HOLDS: 3}) == "holds 3, does not hold 0, not distinguishable 0, not testable 0"


def test_bad_records_and_chapters_are_refused(snapshot, tmp_path):
    with pytest.raises(FileNotFoundError, match="sphereml.book ledger"):
        conclusion.load_snapshot(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="not a ledger snapshot"):
        conclusion.load_snapshot(_write(tmp_path, {"claims": []}))
    bad = copy.deepcopy(snapshot)
    bad["chapters"]["09_opt"]["cpu"]["claims"][0]["kind"] = "speed"
    with pytest.raises(ValueError, match="kind must be one of"):
        conclusion.claim_records(bad)
    bad = copy.deepcopy(snapshot)
    bad["chapters"]["09_opt"]["cpu"]["claims"][0]["verdict"] = "maybe"
    with pytest.raises(ValueError, match="verdict must be one of"):
        conclusion.claim_records(bad)
    bad = copy.deepcopy(snapshot)
    bad["chapters"]["11_new"] = {"cpu": _run([_claim("x")])}
    with pytest.raises(ValueError, match="add new chapters to FAMILIES"):
        conclusion.claim_records(bad)
    old = copy.deepcopy(snapshot)  # a record from before claims had kinds: counted apart, not refused
    del old["chapters"]["09_opt"]["cpu"]["claims"][0]["kind"]
    assert sum(r["kind"] == conclusion.NO_KIND for r in conclusion.claim_records(old)) == 1


def test_every_chapter_but_the_conclusion_has_a_family():
    notebooks = {p.stem for p in (REPO / "notebooks").glob("*.md")}
    assert set(conclusion.FAMILIES) == notebooks - {"10_conclusion"}


# ------------------------------------------------------------------------------------------- effects
def _roundtrip(ours):
    """As the chapters write it: metrics.json is dumped with sorted keys."""
    return json.loads(json.dumps(ours, sort_keys=True))


def test_effect_of_a_seed_comparison_as_numbers_writes_it():
    result = compare_over_seeds([0.80, 0.82, 0.81], [0.78, 0.79, 0.80], floor=0.005, n_eval=2000)
    e = conclusion.effect(_roundtrip(result.numbers("MHE", "baseline", scale=100, digits=2)))
    assert e.size == pytest.approx(100 * result.difference, abs=0.02)
    assert e.noise == pytest.approx(100 * result.noise, abs=0.01) and e.scale == 1.0  # percent already
    assert e.difference == pytest.approx(e.size, abs=0.02) and not e.equivalence  # signed: a - b, a larger
    fraction = conclusion.effect(_roundtrip(result.numbers("MHE", "baseline")))
    assert fraction.scale == 100.0 and fraction.size * fraction.scale == pytest.approx(e.size, abs=0.02)
    assert fraction.ratio == pytest.approx(result.difference / result.noise, rel=1e-3)


@pytest.mark.parametrize("ours, size, noise, difference", [
    ({"difference": -0.85, "noise": 19.27}, 0.85, 19.27, -0.85),  # an explicit difference (chapter 5)
    ({"SCS: ReLU - none": {"difference": 1.5, "noise": 3.0}, "seeds": 2}, 1.5, 3.0, 1.5),  # one nested part
    ({"with ReLU - without": -0.012, "noise": 0.0186}, 0.012, 0.0186, -0.012),  # a recorded difference "a - b"
    ({"1 - confidence": 0.5653, "AVH": 0.5261, "noise": 0.01, "seeds": 1}, 0.0392, 0.01, None),  # a name with " - "
    ({"Conv at eps 0.03": 58.42, "SCS at eps 0.03": 1.42, "clean: SCS - Conv": 1.08, "noise": 5.29, "seeds": 2},
     57.0, 5.29, None),  # two values beside a recorded side difference
    ({"SCS / Conv time": 2.33, "time ratio noise": 0.606, "time repeats": 5}, 1.33, 0.606, None),  # a ratio vs 1
    ({"top-10% share: SCS - Conv": 0.32, "2 s.e.": 0.0074}, 0.32, 0.0074, 0.32),  # a noise named "2 s.e."
    ({"baseline": 20.05, "gs": 23.7, "seeds": 3, "noise": 1.2, "seed s.d.": 0.4}, 3.65, 1.2, None),  # errors
])
def test_effect_of_the_record_shapes_of_the_chapters(ours, size, noise, difference):
    e = conclusion.effect(ours)
    assert e.size == pytest.approx(size) and e.noise == pytest.approx(noise)
    assert e.difference == (None if difference is None else pytest.approx(difference))


@pytest.mark.parametrize("ours", [
    {"CNN": 0.62, "LinearConv": 0.64, "SegConv": 0.68, "noise": 0.03, "seeds": 1},  # a claim for every variant
    {"Conv: ReLU - none": {"difference": -0.85, "noise": 19.27},
     "SCS: ReLU - none": {"difference": -0.43, "noise": 10.16}, "seeds": 2},  # two parts
    {"MHE": 0.5, "baseline": 0.6},  # no noise
    {"MHE": 0.5, "baseline": 0.6, "noise": 0.0},  # no noise to speak of
    {"SCS growth (Adam)": [1.05, 2.19], "noise": [0.15, 0.73], "seeds": 2},  # lists
    {"share of rising steps": 0.986, "noise": 0.4, "seeds": 2},  # one value with no reference
    {"lowest accuracy": 0.4, "chance": 0.1},
    0.93, None, "text",
])
def test_records_without_one_effect_are_not_drawn(ours):
    assert conclusion.effect(ours) is None


def test_equivalence_scale_and_sign():
    e = conclusion.effect({"best SCS": 84.47, "best conv": 84.78, "margin": 2.0, "noise": 12.92, "seeds": 2})
    assert e.equivalence and e.margin == 2.0 and e.scale == 1.0
    recall = conclusion.effect({"noise": 0.5, "seeds": 2, "softmax": 0.0, "with output MHE": 0.0})
    assert recall.scale == 1.0 and recall.size == 0.0  # percent with every value within 1: a recall of 0 %
    snap = {"chapters": {"06_mhe": {"cpu": _run([
        _claim("up", HOLDS, ours={"a": 0.80, "b": 0.75, "noise": 0.02}),
        _claim("down", FAILS, ours={"a": 0.80, "b": 0.75, "noise": 0.02}),
        _claim("open", UNDECIDED, ours={"a": 0.80, "b": 0.79, "noise": 0.02}),
        _claim("same", HOLDS, ours={"a": 0.80, "b": 0.79, "noise": 0.002, "margin": 0.02}),
        _claim("energy", HOLDS, "geometry/theory", ours={"a": 0.5, "b": 0.4, "noise": 0.02}),
        _claim("many", HOLDS, ours={"a": 1, "b": 2, "c": 3, "noise": 0.1})])}}}
    rows, without = conclusion.effect_rows(conclusion.claim_records(snap), "cpu")
    by = {r["id"]: r for r in rows}
    assert [w["id"] for w in without] == ["many"]
    assert by["up"]["points"] == pytest.approx(5.0) and by["down"]["points"] == pytest.approx(-5.0)
    assert by["open"]["points"] is None and by["open"]["size_points"] == pytest.approx(1.0)
    assert by["same"]["signed"] is None and by["same"]["equivalence"]
    assert by["energy"]["points"] is None and by["energy"]["signed"] == pytest.approx(0.1)  # not an accuracy
    assert list(by) == ["up", "down", "open", "same", "energy"]  # generalisation first, geometry after
    assert by["up"]["ratio"] == pytest.approx(2.5)


# ------------------------------------------------------------------------------------------- cost
def test_cost_rows_from_the_real_benchmark_results():
    costs = conclusion.cost_rows(REPO / "benchmarks" / "results")
    by = {(c["family"], c["device"]): c for c in costs}
    assert {f for f, _ in by} <= set(conclusion.BENCHMARKS) and ("margins", "cpu") in by
    for c in costs:
        assert c["times"] and all(r > 0 and math.isfinite(r) for r in c["times"].values())
        assert c["baseline"] not in c["times"]
        assert not any(m in label for label in c["times"] for m in ("(compiled)", "unfold", "port style"))
        assert set(c["memory"]) <= set(c["times"]) and c["device"] in ("cpu", "gpu")
        assert c["device_name"]
    if ("MHE", "cpu") in by:
        assert list(by[("MHE", "cpu")]["times"]) == ["HS-MHE"]
        assert all("CoMHE" in label for label in by[("CoMHE", "cpu")]["times"])
    if ("OPT", "cpu") in by:
        assert "gs" in by[("OPT", "cpu")]["times"] and "gs (unrolled)" not in by[("OPT", "cpu")]["times"]


def test_benefit_rows_say_what_is_missing(snapshot, tmp_path):
    result = {"benchmark": "margin_heads_fwd_bwd", "device": "x86_64 (2 threads)", "cuda": None,
              "seconds": {"base": 1.0, "ArcFace": 1.5, "ArcFace (compiled)": 1.1},
              "ratio_to_base": {"base": 1.0, "ArcFace": 1.5, "ArcFace (compiled)": 1.1},
              "peak_bytes": {"base": 100, "ArcFace": 150, "ArcFace (compiled)": None}}
    (tmp_path / "margin_heads_fwd_bwd-cpu.json").write_text(json.dumps(result))
    (tmp_path / "unrelated-cpu.json").write_text(json.dumps({"benchmark": "energy_fwd_bwd", "runs": []}))
    costs = conclusion.cost_rows(tmp_path)
    assert costs == [{"family": "margins", "device": "cpu", "device_name": "x86_64 (2 threads)",
                      "what": conclusion.BENCHMARKS["margins"].what, "baseline": "base", "times": {"ArcFace": 1.5},
                      "memory": {"ArcFace": 1.5}}]
    snap = copy.deepcopy(snapshot)
    snap["chapters"]["02_large_margin"]["cpu"]["claims"].append(
        _claim("h", HOLDS, ours={"ArcFace": 0.81, "softmax": 0.78, "noise": 0.01}))
    rows = conclusion.benefit_rows(conclusion.claim_records(snap), costs, "cpu")
    by = {r["family"]: r for r in rows}
    assert by["margins"]["time_cpu"] == (1.5, 1.5, 1.5) and by["margins"]["time_gpu"] is None
    assert by["margins"]["effects"] == [{"id": "h", "verdict": HOLDS, "points": pytest.approx(3.0),
                                         "size_points": pytest.approx(3.0), "noise_points": pytest.approx(1.0)}]
    assert by["margins"]["notes"] == ["its cost is measured on the cpu only"]
    assert by["ConvSim"]["notes"][-1].startswith("no benchmark in benchmarks/results")
    assert by["OPT"]["notes"][0].startswith("no generalisation claim of the `cpu` ledger")
    assert "hypersphere" not in by  # chapter 1 has no method to cost


# ------------------------------------------------------------------------------------------- scale
def test_scale_changes_and_claims_too_small_to_decide(snapshot):
    records = conclusion.claim_records(snapshot)
    assert conclusion.scale_changes(records) == [
        {"chapter": "06_mhe", "family": "MHE", "kind": "generalisation", "id": "d", "cpu": UNDECIDED, "gpu": HOLDS}]
    snap = copy.deepcopy(snapshot)
    claims = snap["chapters"]["06_mhe"]["cpu"]["claims"]
    claims[0]["paper"] = {"MHE error": 27.15, "baseline error": 28.13}  # a gap of 0.98 points, our noise 1.0
    claims.append(_claim("wide", UNDECIDED, ours={"a": 0.80, "b": 0.79, "noise": 0.02}, paper={"a": 0.9, "b": 0.7}))
    claims.append(_claim("no-paper", UNDECIDED, ours={"a": 80.0, "b": 79.0, "noise": 2.0}))
    rows = conclusion.too_small_to_decide(conclusion.claim_records(snap), "cpu")
    found = [(r["id"], round(r["gap"], 2), round(r["noise"], 2)) for r in rows]
    assert found == [("d", 0.98, 1.0), ("wide", 20.0, 2.0)]
    assert rows[0]["factor"] > 1 > rows[1]["factor"]


# ------------------------------------------------------------------------------------------- errata
def test_every_erratum_has_a_kind():
    rows = errata.parse_errata(REPO / "book" / "errata.md")
    table_lines = [line for line in (REPO / "book" / "errata.md").read_text().splitlines() if line.startswith("| ")]
    assert len(rows) == len(table_lines) - 1 > 0  # every row of the table, the header aside
    assert all(r["kind"] in errata.ERRATA_KINDS for r in rows)
    assert all(r["primary"] and "{cite}" not in r["primary"] and " and " not in r["primary"] for r in rows)
    counts = errata.errata_counts(rows)
    assert sum(sum(c.values()) for c in counts.values()) == len(rows) and "thesis" in counts
    assert list(counts.values())[0] == max(counts.values(), key=lambda c: sum(c.values()))
    assert errata.errata_table(rows).splitlines()[-1].endswith(f"| {len(rows)} |")


def test_errata_parser_refuses_bad_tables(tmp_path):
    good = ("| source | place | what | kind |\n|---|---|---|---|\n"
            "| thesis {cite}`liu2020thesis` | eq. 1 | $a \\| b$ | formula |\n"
            "| thesis and OPT code | eq. 2 | x | ambiguity |\n")
    path = tmp_path / "errata.md"
    path.write_text("# Errata\n\n" + good + "\nLater text.\n")
    rows = errata.parse_errata(path)
    assert [r["primary"] for r in rows] == ["thesis", "thesis"] and rows[0]["what"] == "$a \\| b$"
    path.write_text(good.replace("| ambiguity |", "| typo |"))
    with pytest.raises(ValueError, match="kind must be one of"):
        errata.parse_errata(path)
    path.write_text(good.replace("| eq. 2 | x |", "| eq. 2 |"))
    with pytest.raises(ValueError, match="3 cells, the header has 4"):
        errata.parse_errata(path)
    path.write_text(good.replace(" kind |", " sort |"))
    with pytest.raises(ValueError, match="no table with a 'kind' column"):
        errata.parse_errata(path)


def test_markdown_table_escapes_and_aligns():
    table = conclusion.markdown_table(["claim", "n", "ratio"], [["a | b", 3, "1.20× (1.1–1.3)"], ["c", 10, "–"]])
    assert table.splitlines() == ["| claim | n | ratio |", "|---|---:|---:|", "| a \\| b | 3 | 1.20× (1.1–1.3) |",
                                  "| c | 10 | – |"]


# ------------------------------------------------------------------------------------------- the ledger itself
def test_every_claim_of_the_ledger_carries_a_kind():
    snapshot = conclusion.load_snapshot(REPO / "book" / "claims.json")
    for chapter, runs in snapshot["chapters"].items():
        for profile, run in runs.items():
            for record in run["claims"]:
                assert record.get("kind") in CLAIM_KINDS, f"{chapter}/{profile}/{record['id']} has no valid kind"


def test_the_table_follows_one_changed_claim(tmp_path):
    """Change one record in a copy of the committed ledger: Table 1 changes, by exactly that record."""
    snapshot = conclusion.load_snapshot(REPO / "book" / "claims.json")
    chapter = next(c for c, runs in snapshot["chapters"].items() if runs.get("cpu", {}).get("claims"))
    record = snapshot["chapters"][chapter]["cpu"]["claims"][0]
    before_path = _write(tmp_path, snapshot, "before.json")
    old = record["verdict"]
    new = FAILS if old != FAILS else HOLDS
    record["verdict"] = new
    after_path = _write(tmp_path, snapshot, "after.json")
    before = conclusion.claim_records(conclusion.load_snapshot(before_path))
    after = conclusion.claim_records(conclusion.load_snapshot(after_path))
    assert conclusion.verdict_table(before, "cpu") != conclusion.verdict_table(after, "cpu")
    kind = record.get("kind") or conclusion.NO_KIND
    family = conclusion.family_of(chapter)

    def row(records):
        return next(r for r in conclusion.count_rows(records, "cpu") if r["kind"] == kind and r["family"] == family)

    assert row(after)[new] == row(before)[new] + 1 and row(after)[old] == row(before)[old] - 1
    assert row(after)["claims"] == row(before)["claims"]


@pytest.mark.notebook
def test_the_chapter_reads_the_ledger_it_is_given(tmp_path, monkeypatch):
    """The chapter, run on a hand-made ledger, shows that ledger's counts: nothing on the page is typed in."""
    import nbformat  # with papermill, which runs the chapter; neither is on a GPU box

    monkeypatch.setenv("SPHEREML_PROFILE", "smoke")
    snapshot = {"chapters": {"06_mhe": {"cpu": _run([
        _claim("x1", HOLDS, ours={"MHE": 84.9, "baseline": 84.0, "noise": 0.5}),
        _claim("x2", UNDECIDED, ours={"MHE": 84.2, "baseline": 84.0, "noise": 0.5},
               paper={"MHE error": 27.15, "baseline error": 28.13}),
        _claim("x3", FAILS, "robustness"), _claim("x4", HOLDS, "geometry/theory")])}}}
    ledger = _write(tmp_path, snapshot)
    executed = book.run_chapter("10_conclusion", {"ledger": str(ledger)}, tmp_path / "run")
    outputs = "\n".join(o.get("data", {}).get("text/markdown", "") + o.get("text", "")
                        for c in nbformat.read(executed, as_version=4).cells if c.cell_type == "code"
                        for o in c.outputs)
    after = outputs.split("**Table 1.**")[1].split("\n\n", 1)[1].splitlines()
    table1 = after[:next(i for i, line in enumerate(after + [""]) if not line.startswith("|"))]
    assert table1[2:] == ["| **generalisation** |  |  |  |  |  |", "| MHE | 1 | 0 | 1 | 0 | 2 |",
                                       "| **robustness** |  |  |  |  |  |", "| MHE | 0 | 1 | 0 | 0 | 1 |",
                                       "| **geometry/theory** |  |  |  |  |  |", "| MHE | 1 | 0 | 0 | 0 | 1 |"]
    assert "| x1 | MHE | holds | +0.9 | 0.5 | 1.80 |" in outputs
    assert "The ledger holds no `gpu` run yet" in outputs
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["counts_cpu"][0] == {"kind": "generalisation", "family": "MHE", HOLDS: 1, FAILS: 0, UNDECIDED: 1,
                                        NOT_TESTABLE: 0, "claims": 2}
