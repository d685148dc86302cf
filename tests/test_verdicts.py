"""compare_over_seeds: each term of the noise level, the verdict's three outcomes, and bad arguments."""

import math

import numpy as np
import pytest
from scipy import stats

from sphereml.book.verdicts import (NOT_TESTABLE, VERDICTS, SeedComparison, SeedTable, compare_over_seeds,
                                    evaluation_noise, every, given, trains, verdict_name, within)


def test_one_seed_uses_the_floor_and_the_binomial_noise():
    result = compare_over_seeds([0.80], [0.79], floor=0.005, n_eval=10_000)
    binomial = 2 * math.sqrt(2 * 0.795 * 0.205 / 10_000)  # about 0.0114: larger than the floor
    assert result.noise == pytest.approx(binomial)
    assert result.spread is None and result.seeds == 1
    assert result.difference == pytest.approx(0.01) and result.holds is None
    assert compare_over_seeds([0.80], [0.78], floor=0.005, n_eval=10_000).holds is True
    assert compare_over_seeds([0.78], [0.80], floor=0.005, n_eval=10_000).holds is False
    assert evaluation_noise(0.795, 10_000) == pytest.approx(binomial)
    assert evaluation_noise(0.795, 10_000, terms=4) == pytest.approx(math.sqrt(2) * binomial)  # a difference of gains


def test_one_exact_side_counts_one_binomial_term():
    """A measured frequency against a stated probability: only the measured side carries binomial noise."""
    result = compare_over_seeds([0.70], [0.80], floor=0.0, n_eval=2_000, eval_terms=1)
    assert result.noise == pytest.approx(2 * math.sqrt(0.75 * 0.25 / 2_000))
    assert result.noise == pytest.approx(compare_over_seeds([0.70], [0.80], floor=0.0, n_eval=2_000).noise
                                         / math.sqrt(2))


def test_without_n_eval_only_the_floor_and_the_seeds_count():
    assert compare_over_seeds([3.0], [1.0], floor=1.5).noise == 1.5
    assert compare_over_seeds([3.0], [1.0], floor=2.5).holds is None


def test_the_seed_spread_gives_the_t_half_width_of_the_mean_paired_difference():
    a, b = [0.90, 0.80, 0.70], [0.85, 0.78, 0.60]  # differences 0.05, 0.02, 0.10
    result = compare_over_seeds(a, b, floor=0.0)
    diffs = [0.05, 0.02, 0.10]
    s = math.sqrt(sum((d - sum(diffs) / 3) ** 2 for d in diffs) / 2)
    assert result.spread == pytest.approx(s)
    assert result.noise == pytest.approx(stats.t.ppf(0.975, 2) * s / math.sqrt(3))
    assert result.difference == pytest.approx(sum(diffs) / 3)
    assert result.holds is None  # mean 0.057 against a half-width of 0.10: the seeds disagree too much


def test_pairing_removes_the_shared_seed_effect():
    """A seed that lifts both variants alike does not widen the noise: only the differences count."""
    a = [0.60, 0.90, 0.75]
    b = [x - 0.02 for x in a]
    result = compare_over_seeds(a, b, floor=0.005)
    assert result.spread == pytest.approx(0.0, abs=1e-12) and result.holds is True


def test_the_largest_term_wins():
    loose = compare_over_seeds([0.5, 0.5], [0.49, 0.49], floor=0.2, n_eval=100)
    assert loose.noise == 0.2 and loose.holds is None
    binomial = compare_over_seeds([0.5, 0.5], [0.49, 0.49], floor=0.0, n_eval=100)
    # the seeds share the evaluation set, so its error does not shrink with the number of seeds
    assert binomial.noise == pytest.approx(2 * math.sqrt(2 * 0.495 * 0.505 / 100))
    assert compare_over_seeds([0.5], [0.49], floor=0.0, n_eval=np.int64(100)).noise == pytest.approx(binomial.noise)


def test_numbers_are_a_claims_ours_dict():
    result = compare_over_seeds([0.8123, 0.8234], [0.8011, 0.8001], floor=0.005)
    numbers = result.numbers("MHE", "baseline", scale=100, digits=2)
    assert list(numbers) == ["baseline", "MHE", "difference", "seeds", "noise", "seed s.d."]
    assert numbers["difference"] == pytest.approx(100 * result.difference, abs=0.01) and numbers["difference"] > 0
    assert numbers["MHE"] == pytest.approx(81.78) and numbers["seeds"] == 2
    assert "seed s.d." not in compare_over_seeds([1.0], [0.0], floor=0.1).numbers("a", "b")


def test_is_a_frozen_record():
    result = compare_over_seeds([1.0], [0.0], floor=0.1)
    assert isinstance(result, SeedComparison)
    with pytest.raises(AttributeError):
        result.noise = 0.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(a=[], b=[], floor=0.1), "one value per seed"),
    (dict(a=[0.1, 0.2], b=[0.1], floor=0.1), "one value per seed each"),
    (dict(a=[float("nan")], b=[0.1], floor=0.1), "finite"),
    (dict(a=[0.1], b=[0.1], floor=-1.0), "floor"),
    (dict(a=[0.1], b=[0.1], floor=0.1, n_eval=0), "n_eval"),
    (dict(a=[0.1], b=[0.1], floor=0.1, n_eval=True), "n_eval"),
    (dict(a=[1.5], b=[0.1], floor=0.1, n_eval=10), "accuracies"),
    (dict(a=[0.1], b=[0.1], floor=0.1, confidence=1.0), "confidence"),
    (dict(a=[0.1], b=[0.1], floor=0.1, n_eval=10, eval_terms=3), "eval_terms"),
])
def test_bad_arguments_raise_clear_errors(kwargs, message):
    a, b = kwargs.pop("a"), kwargs.pop("b")
    with pytest.raises(ValueError, match=message):
        compare_over_seeds(a, b, **kwargs)


def test_every_holds_only_when_all_hold_and_fails_when_any_fails():
    assert every([True, True]) is True
    assert every([True, None]) is None
    assert every([None, False, True]) is False
    assert every([True, NOT_TESTABLE, None]) == NOT_TESTABLE
    assert every([NOT_TESTABLE, False]) is False
    assert every(c for c in (True,)) is True  # any iterable
    with pytest.raises(ValueError, match="True, False, None or 'not testable'"):
        every([True, "yes"])


def test_equivalence_holds_only_when_the_whole_interval_is_inside_the_margin():
    tight = compare_over_seeds([0.801, 0.802, 0.800], [0.800, 0.800, 0.799], floor=0.0)  # d ~ 0.0013
    assert tight.equivalent(margin=0.01) is True
    assert tight.holds is None or tight.holds is True  # a "larger" verdict is a different question
    # inside the noise is not the same as equivalent: a wide noise leaves it undecided
    wide = compare_over_seeds([0.80], [0.80], floor=0.02)
    assert wide.holds is None and wide.equivalent(margin=0.01) is None
    far = compare_over_seeds([0.90], [0.80], floor=0.02)  # interval [0.08, 0.12], margin 0.05
    assert far.equivalent(margin=0.05) is False
    with pytest.raises(ValueError, match="margin must be a finite number > 0"):
        tight.equivalent(margin=0.0)


def test_at_most_is_one_sided():
    much_worse = compare_over_seeds([0.60], [0.80], floor=0.02)  # a far below b: "a is not better" holds
    assert much_worse.at_most(0.01) is True and much_worse.equivalent(0.01) is False
    better = compare_over_seeds([0.90], [0.80], floor=0.02)  # interval [0.08, 0.12] above the margin
    assert better.at_most(0.05) is False
    close = compare_over_seeds([0.81], [0.80], floor=0.02)  # interval [-0.01, 0.03] straddles 0.02
    assert close.at_most(0.02) is None and close.at_most(0.035) is True
    with pytest.raises(ValueError, match="margin must be a finite number >= 0"):
        close.at_most(float("nan"))


def test_seed_table_collects_and_pairs_on_common_seeds():
    table = SeedTable()
    for seed, (a, b) in enumerate([(0.80, 0.78), (0.82, 0.79), (0.81, 0.80)]):
        table.add("MHE", seed, accuracy=a, energy=1.0 + seed)
        table.add("baseline", seed, accuracy=b)
    table.add("MHE", 3, accuracy=0.5)  # a seed the baseline lacks is left out of the pairing
    assert table.variants == ["MHE", "baseline"] and table.seeds("MHE") == [0, 1, 2, 3]
    assert table.values("MHE", "energy", seeds=[0, 1, 2]) == [1.0, 2.0, 3.0]
    assert table.mean("baseline", "accuracy") == pytest.approx(0.79)
    paired = table.compare("MHE", "baseline", "accuracy", floor=0.005)
    direct = compare_over_seeds([0.80, 0.82, 0.81], [0.78, 0.79, 0.80], floor=0.005)
    assert paired == direct
    assert table.to_dict()["MHE"]["3"] == {"accuracy": 0.5}
    with pytest.raises(KeyError, match="no results for variant 'OPT'"):
        table.seeds("OPT")


def test_a_seed_table_states_its_rule_once():
    table = SeedTable(floor=0.005, n_eval=2000, chance=0.1)
    for seed, (a, b, stuck) in enumerate([(0.80, 0.70, 0.10), (0.82, 0.71, 0.11)]):
        table.add("MHE", seed, accuracy=a)
        table.add("baseline", seed, accuracy=b)
        table.add("stuck", seed, accuracy=stuck)
    assert table.compare("MHE", "baseline") == compare_over_seeds([0.80, 0.82], [0.70, 0.71], floor=0.005,
                                                                    n_eval=2000)
    assert table.compare("MHE", "baseline", floor=0.5).holds is None  # an explicit floor overrides the table's
    for seed in (0, 1):
        table.add("MHE", seed, energy=1.0), table.add("baseline", seed, energy=2.0)
    assert table.compare("MHE", "baseline", "energy").noise == 0.005  # no binomial term outside the table's key
    assert table.trains("MHE", "baseline") is True and table.trains("MHE", "stuck") is False
    table.add("one seed stuck", 0, accuracy=0.80), table.add("one seed stuck", 1, accuracy=0.10)
    assert table.trains("one seed stuck") is True  # its mean, 0.45, clears chance
    assert table.trains("one seed stuck", every_seed=True) is False  # its second seed does not
    assert table.trains("MHE", "baseline", every_seed=True) is True
    assert table.beats("MHE", "baseline") is True and table.beats("baseline", "MHE") is False
    assert table.beats("MHE", "stuck") == NOT_TESTABLE  # an arm at chance: the comparison says nothing
    assert table.error("baseline") == 29.5
    assert table.error_numbers("MHE", "baseline") == table.compare("MHE", "baseline").numbers(
        "MHE", "baseline", scale=100, digits=2) | {"MHE": 19.0, "baseline": 29.5}  # errors; difference in accuracy
    comparisons = [table.compare("MHE", "baseline"), table.compare("MHE", "stuck")]
    assert table.evidence(comparisons, scale=100, digits=2) == {
        "seeds": 2, "noise": round(100 * max(c.noise for c in comparisons), 2)}
    with pytest.raises(ValueError, match="at least one comparison"):
        table.evidence([])
    bare = SeedTable()
    bare.add("a", 0, accuracy=0.5)
    bare.add("b", 0, accuracy=0.4)
    with pytest.raises(ValueError, match="needs a floor"):
        bare.compare("a", "b")
    with pytest.raises(ValueError, match="chance and n_eval"):
        bare.trains("a")


def _grid_table():
    table = SeedTable(floor=0.005, n_eval=2000, chance=0.1)
    runs = {"no BN CNN cosine": (0.70, 0.71), "no BN TanhConv cosine": (0.80, 0.82),
            "no BN SegConv cosine": (0.60, 0.62), "no BN LogConv cosine": (0.10, 0.11)}
    for variant, accuracies in runs.items():
        for seed, accuracy in enumerate(accuracies):
            table.add(variant, seed, accuracy=accuracy, halfway=accuracy / 2)
    return table


def test_compare_changes_pairs_each_seeds_drop_and_counts_four_binomial_terms():
    table = SeedTable(floor=0.005, n_eval=1000, chance=0.1)
    for seed, (clean_a, end_a, clean_b, end_b) in enumerate([(0.90, 0.60, 0.80, 0.30), (0.88, 0.60, 0.82, 0.30),
                                                                (0.89, 0.60, 0.81, 0.30)]):
        table.add("SCS", seed, clean=clean_a, attacked=end_a)
        table.add("Conv", seed, clean=clean_b, attacked=end_b)
    result = table.compare_changes("SCS", "Conv", "clean", "attacked", n_eval=1000)
    assert result.mean_a == pytest.approx(-0.29) and result.mean_b == pytest.approx(-0.51)
    assert result.difference == pytest.approx(0.22)  # SCS loses 22 points less
    expected = compare_over_seeds([-0.30, -0.28, -0.29], [-0.50, -0.52, -0.51], floor=evaluation_noise(0.65, 1000, 4))
    assert result.noise == pytest.approx(expected.noise) == pytest.approx(evaluation_noise(0.65, 1000, 4))
    assert result.seeds == 3
    assert result.holds is True and table.compare_changes("Conv", "SCS", "clean", "attacked").holds is False
    assert table.compare_changes("SCS", "Conv", "clean", "attacked").noise < result.noise  # no binomial term
    table.add("odd", 0, clean=2.0, attacked=1.0)
    with pytest.raises(ValueError, match="accuracies"):
        table.compare_changes("odd", "Conv", "clean", "attacked", n_eval=1000)
    with pytest.raises(ValueError, match="needs a floor"):
        SeedTable().compare_changes("SCS", "Conv", "clean", "attacked")


def test_group_evidence_gives_each_comparison_its_own_noise():
    table = SeedTable(floor=0.005)
    for seed, (cnn, tanh, seg) in enumerate([(0.70, 0.80, 0.60), (0.70, 0.90, 0.61)]):
        table.add("no BN CNN", seed, accuracy=cnn), table.add("no BN TanhConv", seed, accuracy=tanh)
        table.add("no BN SegConv", seed, accuracy=seg)
    group = table.beats_each(["no BN TanhConv", "no BN SegConv"], "no BN CNN")
    noises = [round(c.noise, 4) for c in group.comparisons]
    assert noises[0] > 10 * noises[1]  # the TanhConv pair's seeds disagree, the SegConv pair's hardly
    assert group.evidence() == {"seeds": 2, "noise": {"TanhConv": noises[0], "SegConv": noises[1]}}
    assert group.numbers()["noise"] == {"TanhConv": noises[0], "SegConv": noises[1]}
    assert SeedTable.evidence(group.comparisons) == {"seeds": 2, "noise": noises[0]}  # unlabelled: the largest
    same = table.beats_each(["no BN TanhConv"], "no BN CNN")
    assert same.evidence() == {"seeds": 2, "noise": noises[0]}  # one comparison: one number
    with pytest.raises(ValueError, match="one label per comparison"):
        SeedTable.evidence(group.comparisons, labels=["a"])


def test_beats_each_joins_one_verdict_per_pair_and_names_the_arms_by_what_differs():
    table = _grid_table()
    ops = ["no BN TanhConv cosine", "no BN SegConv cosine"]
    group = table.beats_each(ops, "no BN CNN cosine")
    assert group.pairs == [(op, "no BN CNN cosine") for op in ops]
    assert group.comparisons == [table.compare(op, "no BN CNN cosine") for op in ops]
    assert group.verdicts == [True, False] and group.holds is False
    assert table.beats_each(ops[:1], "no BN CNN cosine").holds is True
    numbers = group.numbers()
    assert list(numbers) == ["CNN", "TanhConv", "SegConv", "seeds", "noise"]
    assert numbers["TanhConv"] == 0.81 and numbers | table.evidence(group.comparisons) == numbers
    named = group.numbers(names={"no BN CNN cosine": "plain CNN"}, scale=100, digits=1)
    assert list(named)[:3] == ["plain CNN", "TanhConv", "SegConv"] and named["plain CNN"] == 70.5
    one = table.beats_each(ops[:1], "no BN CNN cosine").numbers({"no BN CNN cosine": "CNN"})
    assert list(one)[:2] == ["CNN", "no BN TanhConv cosine"]  # one unnamed variant keeps its whole name
    # an arm at chance makes its pair not testable; a failed pair still decides the claim
    assert table.beats_each(["no BN LogConv cosine"], "no BN CNN cosine").holds == NOT_TESTABLE
    assert table.beats_each(["no BN LogConv cosine", "no BN SegConv cosine"], "no BN CNN cosine").holds is False
    # pairs with their own references, and another key with its own noise
    pairs = [("no BN TanhConv cosine", "no BN CNN cosine"), ("no BN CNN cosine", "no BN SegConv cosine")]
    assert table.beats_each(pairs).verdicts == [True, True]
    halfway = table.beats_each(ops[:1], "no BN CNN cosine", "halfway", n_eval=500)
    assert halfway.comparisons[0] == table.compare(ops[0], "no BN CNN cosine", "halfway", n_eval=500)
    assert halfway.numbers()["TanhConv"] == 0.405
    with pytest.raises(ValueError, match="pairs"):
        table.beats_each([])
    with pytest.raises(ValueError, match="pairs"):
        table.beats_each(["no BN CNN cosine"])  # a name, not a pair, and no baseline


def test_a_table_without_a_chance_level_compares_without_the_training_check():
    table = SeedTable(floor=0.0)
    table.add("refined", 0, energy=1.0)
    table.add("none", 0, energy=2.0)
    group = table.beats_each([("none", "refined")], key="energy")
    assert group.numbers() == {"refined": 1.0, "none": 2.0, "seeds": 1, "noise": 0.0}
    assert group.verdicts == [True] and group.holds is True
    assert table.beats_each([("refined", "none")], key="energy").holds is False
    with pytest.raises(ValueError, match="string"):
        table.beats_each("none", "refined")  # a name where a list was meant


def test_exact_claims_hold_within_their_tolerance():
    assert within(1.0000001, 1.0, tolerance=1e-6) is True
    assert within([0.5, 0.25], [0.5, 0.2500001], tolerance=1e-6) is True
    assert within(1.1, 1.0, tolerance=1e-6) is False
    with pytest.raises(ValueError, match="tolerance"):
        within(1.0, 1.0, tolerance=-1.0)


def test_an_arm_at_chance_makes_a_claim_not_testable():
    assert trains([0.10, 0.11], chance=0.1, n_eval=10_000) is False  # 0.105 against 0.1 + max(0.01, 0.006)
    assert trains([0.60, 0.62], chance=0.1, n_eval=10_000) is True
    assert given(True, True, verdict=False) is False
    assert given(True, False, verdict=True) == NOT_TESTABLE
    assert given(None, verdict=True) == NOT_TESTABLE  # a control that is not distinguishable does not stand
    assert [verdict_name(v) for v in (True, False, None, NOT_TESTABLE)] == list(VERDICTS.values())
    with pytest.raises(ValueError, match="a verdict must be"):
        verdict_name("maybe")


def test_bootstrap_noise_is_twice_the_spread_of_the_resampled_statistic():
    import statistics as stdlib

    import torch

    from sphereml.book.verdicts import bootstrap_noise

    values = torch.arange(10, dtype=torch.float64)
    noise = bootstrap_noise(lambda idx: values[idx].mean(), 10, resamples=2000, seed=1)
    standard_error = stdlib.pstdev(values.tolist()) / 10 ** 0.5  # of a mean of 10 draws with replacement
    assert noise == pytest.approx(2 * standard_error, rel=0.1)
    assert bootstrap_noise(lambda idx: values[idx].mean(), 10, seed=1) == bootstrap_noise(
        lambda idx: values[idx].mean(), 10, seed=1)  # seeded: the same draws
    assert bootstrap_noise(lambda idx: 3.0, 10) == 0.0
    with pytest.raises(ValueError, match="resamples must be an integer >= 2"):
        bootstrap_noise(lambda idx: 0.0, 10, resamples=1)
