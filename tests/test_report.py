"""Claims as a reader sees them: numbers in words, one badge per verdict word, cards with anchors, the
chapter's verdict table and the ledger table (escaped, linked, gpu columns only when there are gpu runs)."""

import html
import re
from html.parser import HTMLParser

import pytest

from sphereml.book import report, verdicts


def _record(id="afs", verdict="holds", ours=None, paper=None, statement="A < B | C", kind="generalisation"):
    return {"id": id, "statement": statement, "source": "thesis Table 2.3", "paper": paper,
            "ours": {"A": 0.1, "B": 0.2} if ours is None else ours, "verdict": verdict, "kind": kind}


class _Tags(HTMLParser):
    """Checks that a fragment is well nested and collects ids and hrefs."""

    VOID = {"input", "br", "img"}

    def __init__(self):
        super().__init__()
        self.stack, self.ids, self.hrefs = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.ids += [attrs["id"]] if "id" in attrs else []
        self.hrefs += [attrs["href"]] if "href" in attrs else []
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"</{tag}> closes nothing open"


def _parse(fragment: str) -> _Tags:
    tags = _Tags()
    tags.feed(fragment)
    tags.close()
    assert not tags.stack, f"unclosed tags {tags.stack}"
    return tags


def test_describe_reads_a_seed_comparison_as_values_then_difference_and_noise():
    numbers = verdicts.compare_over_seeds([0.91, 0.92, 0.93], [0.90, 0.90, 0.91], floor=0.005).numbers(
        "SCS", "conv", scale=100, digits=2)
    text = report.describe(numbers)
    assert text.startswith("conv 90.33; SCS 92")
    assert re.search(r"difference \+1\.67 \(noise level [\d.]+\), 3 seeds \(s\.d\. 0\.58\)$", text)
    assert report.describe({"difference": -0.5, "noise": 2.0, "margin": 1.0}) == \
        "difference -0.5 (noise level 2, margin 1)"


def test_describe_turns_flags_nested_dicts_and_lists_into_words():
    assert report.describe({"LinearConv fails": True, "TanhConv fails": False}) == \
        "LinearConv fails yes; TanhConv fails no"
    assert report.describe({"Conv": {"difference": -0.85, "noise": 19.27}, "seeds": 2}) == \
        "Conv (difference -0.85 (noise level 19.27)); 2 seeds"
    assert report.describe([0.123456, 2]) == "0.1235, 2"
    assert report.describe(None) == "–" and report.describe(1 / 3) == "0.3333"
    assert report.describe({"noise": 0.05, "a": 1}) == "a 1; noise level 0.05"
    assert report.describe({"a": 1, "noise": 5.1, "margin": 1.0, "seeds": 3}) == \
        "a 1; noise level 5.1, margin 1, 3 seeds"  # a claim of no difference shows its margin


@pytest.mark.parametrize("verdict", list(verdicts.VERDICTS.values()))
def test_every_verdict_word_has_its_own_badge(verdict):
    badge = report.badge(verdict)
    assert f">{verdict}</span>" in badge and "verdict-" + verdict.replace(" ", "-") in badge


def test_badge_rejects_a_word_that_is_no_verdict():
    with pytest.raises(ValueError, match="verdict must be one of"):
        report.badge("HOLDS")


def test_claim_card_escapes_its_text_and_carries_the_anchor_the_ledger_links_to():
    card = report.ClaimCard(_record(id="x/y z", paper={"A": 0.3}))
    page = card._repr_html_()
    tags = _parse(page)
    assert tags.ids == ["claim-x-y-z"] == [report.claim_anchor("x/y z")]
    assert "A &lt; B | C" in page and "source: A 0.3" in page and "ours: A 0.1; B 0.2" in page
    assert repr(card) == "[holds] A < B | C (thesis Table 2.3)\n    ours: A 0.1; B 0.2 — source: A 0.3"


def test_verdict_table_has_one_linked_row_per_claim():
    records = [_record("a"), _record("b", "not testable", statement="<script>")]
    table = report.VerdictTable(records)
    tags = _parse(table._repr_html_())
    assert tags.hrefs == ["#claim-a", "#claim-b"]
    assert "&lt;script&gt;" in table._repr_html_() and "<script>" not in table._repr_html_()
    assert "<caption>2 claims in this run: holds 1, not testable 1</caption>" in table._repr_html_()
    assert report.VerdictTable([]).counts() == "0 claims in this run"
    assert repr(table).splitlines() == ["- [holds] A < B | C (thesis Table 2.3)",
                                        "- [not testable] <script> (thesis Table 2.3)"]


def test_ledger_table_lists_every_claim_once_with_a_link_and_gpu_columns_only_when_run():
    snapshot = {"chapters": {
        "01_a": {"cpu": {"claims": [_record("x"), _record("y", "does not hold")]}},
        "02_b": {"cpu": {"claims": [_record("z", "not distinguishable", ours=0.5)]}},
    }}
    table = report.ledger_table(snapshot)
    tags = _parse(table)
    assert tags.hrefs == ["../notebooks/01_a.html#claim-x", "../notebooks/01_a.html#claim-y",
                          "../notebooks/02_b.html#claim-z"]
    assert "(gpu)" not in table and table.count("<tr>") == 4 and "\n\n" not in table
    snapshot["chapters"]["02_b"]["gpu"] = {"claims": [_record("w", "holds")]}
    table = report.ledger_table(snapshot)
    rows = table.split("<tr>")[2:]
    assert len(rows) == 4 and html.unescape(table).count("verdict (gpu)") == 5  # heading + 4 phone labels
    assert [row.count(">not run<") for row in rows] == [2, 2, 2, 2]  # x, y, z lack gpu runs, w a cpu one


def test_table_renders_numbers_right_aligned_and_text_as_aligned_columns():
    table = report.Table(["network", "error %", "source"], [["CNN <9>", 26.01234, "26.0"], ["SphereNet", None, True]],
                         caption="mean over seeds 0, 1", digits=3)
    assert report.Table(["energy"], [[33320]])._text(33320) == "33320"  # integers whole, not 3.33e+04
    page = table._repr_html_()
    tags = _parse(page)
    assert not tags.stack and "CNN &lt;9&gt;" in page and '<td class="num">26</td>' in page
    assert "<td class=\"\">–</td>" in page and "mean over seeds 0, 1" in page
    assert repr(table).splitlines() == ["network    error %  source",
                                        "CNN <9>         26    26.0",
                                        "SphereNet        –     yes",
                                        "mean over seeds 0, 1"]


def test_table_rejects_a_row_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"rows \[1\] do not have 2 cells"):
        report.Table(["a", "b"], [[1, 2], [3]])


def test_a_claim_names_the_scale_of_its_numbers_in_its_card_and_the_ledger():
    record = _record("e", ours={"gs": 21.67, "baseline": 18.13, "difference": -3.53, "noise": 2.06, "seeds": 1})
    record["unit"] = "test error %; the difference in accuracy points"
    assert report.ours_text(record) == ("(test error %; the difference in accuracy points) gs 21.67; baseline 18.13; "
                                        "difference -3.53 (noise level 2.06), 1 seed")
    assert "ours: (test error %; the difference in accuracy points) gs" in report.ClaimCard(record)._repr_html_()
    table = report.ledger_table({"chapters": {"09_opt": {"cpu": {"claims": [record]}}}})
    assert "(test error %; the difference in accuracy points) gs 21.67" in table
    assert report.ours_text(_record()) == "A 0.1; B 0.2"  # no unit, no prefix
