"""The claims ledger: the committed page is the rendering of the committed snapshot, every claim on it has a
source and was made by a chapter that exists, and the renderer escapes, counts and labels correctly."""

import json
import re
from pathlib import Path

import pytest

from sphereml.book import ledger, runner
from sphereml.book.chapter import CLAIM_KINDS

REPO = Path(__file__).resolve().parents[1]
SNAPSHOT = REPO / "book" / "claims.json"
# chapters that make no claim of their own: the conclusion weighs the other chapters' claims from the ledger
NO_CLAIMS = {"10_conclusion"}


def _metrics(tmp_path, chapter, profile, claims, **run):
    path = tmp_path / chapter / "metrics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"chapter": chapter, "profile": profile, "device_name": "cpu", "torch": "2.x",
                                "threads": 2, "claims": claims, **run}))
    return path


def _claim(id, verdict="holds", ours=0.5, paper=None, statement="a | b"):
    return {"id": id, "statement": statement, "source": "thesis Table 1", "paper": paper, "ours": ours,
            "profile": "cpu", "verdict": verdict, "kind": "generalisation"}


def test_committed_page_is_the_rendering_of_the_committed_snapshot():
    snapshot = ledger.load_snapshot(SNAPSHOT)
    assert (REPO / "book" / "claims.md").read_text() == ledger.render(snapshot), \
        "book/claims.md was edited by hand or is stale: run `python -m sphereml.book ledger`"


def test_every_claim_of_the_ledger_comes_from_a_chapter_that_makes_it():
    snapshot = ledger.load_snapshot(SNAPSHOT)
    assert snapshot["chapters"], "the ledger is empty"
    for chapter, runs in snapshot["chapters"].items():
        source = (REPO / "notebooks" / f"{chapter}.md").read_text()
        templates = [re.compile("^" + re.sub(r"\\\{[^}]*\\\}", ".+", re.escape(t)) + "$")
                     for t in re.findall(r'f"([a-z0-9.\-{}_]+)"', source)]  # ids built by f-strings
        for profile, run in runs.items():
            assert profile in ("cpu", "gpu") and run["device_name"]
            for record in run["claims"]:
                assert record["statement"] and record["source"], record
                assert record["verdict"] in ledger.LABELS, record
                assert record["kind"] in CLAIM_KINDS, record
                made = f'"{record["id"]}"' in source or any(t.match(record["id"]) for t in templates)
                assert made, f"{chapter} names no claim {record['id']!r}"


def test_every_chapter_makes_claims_and_has_them_in_the_ledger():
    """A chapter without claims would leave its section of the ledger empty: every chapter tests something."""
    snapshot = ledger.load_snapshot(SNAPSHOT)
    for notebook in sorted((REPO / "notebooks").glob("*.md")):
        if notebook.stem in NO_CLAIMS:
            assert "ch.claim(" not in notebook.read_text(), f"{notebook.stem} is listed as making no claim"
            continue
        assert "ch.claim(" in notebook.read_text(), f"{notebook.stem} records no claim"
        runs = snapshot["chapters"].get(notebook.stem, {})
        assert any(run["claims"] for run in runs.values()), f"{notebook.stem} has no claim in the ledger"


def test_every_chapter_with_claims_is_in_the_ledger():
    snapshot = ledger.load_snapshot(SNAPSHOT)
    for notebook in sorted((REPO / "notebooks").glob("*.md")):
        if "ch.claim(" in notebook.read_text():
            assert notebook.stem in snapshot["chapters"], f"{notebook.stem} has claims but no ledger entry"


def test_collect_merges_profiles_skips_smoke_and_replaces_reruns(tmp_path):
    first = _metrics(tmp_path, "01_a", "cpu", [_claim("x", "does not hold")])
    smoke = _metrics(tmp_path / "s", "01_a", "smoke", [_claim("y")])
    no_claims = _metrics(tmp_path / "n", "10_z", "cpu", [])
    snapshot = ledger.collect([first, smoke, no_claims])
    assert list(snapshot["chapters"]["01_a"]) == ["cpu"] and "10_z" not in snapshot["chapters"]
    tiny = _metrics(tmp_path / "t", "01_a", "gpu", [_claim("x", "holds")])
    tiny.write_text(json.dumps({**json.loads(tiny.read_text()), "tiny": True}))  # SPHEREML_GPU_TINY: code paths only
    assert "gpu" not in ledger.collect([tiny], snapshot)["chapters"]["01_a"]
    gpu = _metrics(tmp_path / "g", "01_a", "gpu", [_claim("x", "holds")])
    snapshot = ledger.collect([gpu], snapshot)
    assert sorted(snapshot["chapters"]["01_a"]) == ["cpu", "gpu"]
    rerun = _metrics(tmp_path / "r", "01_a", "cpu", [_claim("x", "not distinguishable", ours={"a": 0.123456789})])
    snapshot = ledger.collect([rerun], snapshot)
    assert snapshot["chapters"]["01_a"]["cpu"]["claims"][0]["verdict"] == "not distinguishable"
    page = ledger.render(snapshot)
    assert '"verdict-badge verdict-not-distinguishable">not distinguishable<' in page
    assert "{include} verdicts.md" in page and "The four verdicts" in (REPO / "book" / "verdicts.md").read_text()
    assert "a | b</a>" in page and "a 0.1235" in page  # one HTML block, numbers shortened
    assert "\n\n" not in page[page.index("<table"):page.index("</table>")]  # no blank line ends the block
    assert "- `cpu` profile: 1 claim from 1 chapter: 0 holds, 0 does not hold, 1 not distinguishable, " \
           "0 not testable." in page


def test_collect_keeps_only_runs_at_their_profiles_own_settings(tmp_path, capsys):
    default = _metrics(tmp_path / "d", "01_a", "cpu", [_claim("x", "holds")], seed=0,
                       params={"train_size": 0, "epochs": 0, "num_seeds": 0})
    more_seeds = _metrics(tmp_path / "m", "01_a", "cpu", [_claim("x", "does not hold")], seed=0,
                          params={"train_size": 0, "epochs": 0, "num_seeds": 5})
    other_seed = _metrics(tmp_path / "o", "02_b", "cpu", [_claim("y")], seed=4, params={"epochs": 0})
    assert ledger.custom_settings(json.loads(default.read_text())) == {}
    assert ledger.custom_settings(json.loads(more_seeds.read_text())) == {"num_seeds": 5}
    assert ledger.custom_settings(json.loads(other_seed.read_text())) == {"seed": 4}
    skipped = []
    snapshot = ledger.collect([default, more_seeds, other_seed], skipped=skipped)
    assert snapshot["chapters"]["01_a"]["cpu"]["claims"][0]["verdict"] == "holds" and "02_b" not in snapshot["chapters"]
    assert skipped == [(more_seeds, {"num_seeds": 5}), (other_seed, {"seed": 4})]
    runs = tmp_path / "runs"
    (runs / "01_a").mkdir(parents=True)
    (runs / "01_a" / "metrics.json").write_text(more_seeds.read_text())
    (tmp_path / "book").mkdir()
    runner.write_ledger(runs, tmp_path / "book")
    assert "run with num_seeds=5 (the ledger holds each profile's own settings)" in capsys.readouterr().err


def test_render_marks_missing_profiles_and_collect_rejects_bad_records(tmp_path):
    snapshot = ledger.collect([_metrics(tmp_path, "02_b", "cpu", [_claim("z", paper=0.7)])])
    page = ledger.render(snapshot)
    assert "- `gpu` profile: not yet run for the ledger." in page
    assert "(gpu)" not in page  # no gpu columns while no chapter has gpu records
    both = ledger.collect([_metrics(tmp_path / "g", "02_b", "gpu", [_claim("y")])], snapshot)
    page = ledger.render(both)
    assert page.count("verdict (gpu)") == 3  # the heading and the two rows' phone labels
    assert page.count(">not run<") == 4  # ours and verdict: z has no gpu run, y no cpu run
    assert "changed from" not in page and "change with scale" not in page  # no claim was run in both
    bad = _metrics(tmp_path / "bad", "03_c", "cpu", [_claim("w", verdict="maybe")])
    with pytest.raises(ValueError, match="valid verdict"):
        ledger.collect([bad])
    no_source = _claim("v")
    no_source["source"] = ""
    with pytest.raises(ValueError, match="source"):
        ledger.collect([_metrics(tmp_path / "ns", "03_c", "cpu", [no_source])])
    unsorted = _claim("u")
    unsorted["kind"] = "speed"
    with pytest.raises(ValueError, match="kind"):
        ledger.collect([_metrics(tmp_path / "nk", "03_c", "cpu", [unsorted])])


def test_render_marks_verdicts_that_change_with_scale(tmp_path):
    cpu = [_claim("same"), _claim("moved", "not distinguishable"), _claim("cpu only"), _claim("skips gpu")]
    gpu = [_claim("same"), _claim("moved", "holds"), _claim("gpu only", "does not hold")]
    paper = [_claim("skips gpu", "does not hold")]
    snapshot = ledger.collect([_metrics(tmp_path, "04_d", "cpu", cpu), _metrics(tmp_path / "g", "04_d", "gpu", gpu),
                               _metrics(tmp_path / "p", "04_d", "paper", paper)])
    page = ledger.render(snapshot)
    assert "- Verdicts that change with scale: 2 of the 3 claims run in more than one profile" in page
    rows = {re.search(r'#([^"]+)">', row).group(1): row for row in page.split("\n") if row.startswith("<tr")}
    marked = {anchor: row for anchor, row in rows.items() if "changed from" in row}
    assert len(marked) == 2 and all(row.startswith('<tr class="scale-change">') for row in marked.values())
    assert [row.count("changed from cpu") for row in marked.values()] == [1, 1]  # gpu's and paper's verdicts
    assert any("moved" in anchor for anchor in marked) and any("skips" in anchor for anchor in marked)


def test_the_page_names_the_cpu_kernels_a_run_was_recorded_with(tmp_path):
    """Two CPUs with other vector kernels (AVX2, AVX512) round differently and may train to other numbers: the
    page says which a cpu run used, and says nothing for a run recorded before the field existed."""
    recorded = _metrics(tmp_path, "01_a", "cpu", [_claim("a")], cpu_capability="AVX512")
    older = _metrics(tmp_path, "02_b", "cpu", [_claim("b")])
    snapshot = ledger.collect([recorded, older])
    assert snapshot["chapters"]["01_a"]["cpu"]["cpu_capability"] == "AVX512"
    assert snapshot["chapters"]["02_b"]["cpu"]["cpu_capability"] is None
    page = ledger.render(snapshot)
    assert "`cpu` on cpu (AVX512), torch 2.x" in page
    assert "`cpu` on cpu, torch 2.x" in page


def test_the_page_names_the_processor_a_run_was_recorded_on(tmp_path):
    """Two processors with the same vector kernels round differently too (chapter 9's CNN, 2026-12-07): the page
    names the processor where the run recorded it."""
    runs = [_metrics(tmp_path, "01_a", "cpu", [_claim("a")], cpu_capability="AVX512", cpu_model="AMD EPYC"),
            _metrics(tmp_path, "02_b", "cpu", [_claim("b")], cpu_model="AMD EPYC"),
            _metrics(tmp_path, "03_c", "gpu", [_claim("c")], device_name="NVIDIA H100", cpu_model="AMD EPYC")]
    snapshot = ledger.collect(runs)
    assert snapshot["chapters"]["01_a"]["cpu"]["cpu_model"] == "AMD EPYC"
    page = ledger.render(snapshot)
    assert "`cpu` on cpu (AMD EPYC, AVX512), torch 2.x" in page
    assert "`cpu` on cpu (AMD EPYC), torch 2.x" in page
    assert "`gpu` on NVIDIA H100, torch 2.x" in page  # a GPU run is named by its GPU


def test_a_chapter_run_records_the_processor(tmp_path, monkeypatch):
    """The processor's name from /proc/cpuinfo, None where there is none (the ledger then names the kernels only)."""
    from sphereml import timing
    from sphereml.book.chapter import Chapter

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu\n\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC\n")
    real_path = timing.Path
    monkeypatch.setattr(timing, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    assert timing.cpu_model() == "AMD EPYC"
    ch = Chapter("demo", profile="smoke", device="cpu", seed=0, output_dir=str(tmp_path / "run"))
    assert ch.metrics["cpu_model"] == "AMD EPYC"
    monkeypatch.setattr(timing, "Path", lambda p: tmp_path / "absent" if p == "/proc/cpuinfo" else real_path(p))
    assert timing.cpu_model() is None
