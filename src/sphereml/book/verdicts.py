"""Verdicts that know their noise: one rule for every claim of the book.

A claim such as "MHE beats the baseline" compares numbers that move from seed to seed and from one
evaluation sample to another.  Every chapter decides its claims here, with four possible verdicts (the
vocabulary of the whole book, defined once in the preface and on the claims ledger):

* **holds** — the effect has the claimed sign and its size clears the noise level; for a claim of *no
  difference*, the whole interval of the difference (± the noise level) lies inside a stated margin;
* **does not hold** — the effect clears the noise the other way (for a claim of no difference: the whole
  interval lies outside the margin);
* **not distinguishable** — neither: at this scale the data cannot decide;
* **not testable** — the comparison cannot speak to the claim: an arm never trained (stays at chance), the
  source says the measure is unreliable at our scale, or the control the claim depends on failed.

:class:`SeedTable` collects results by variant and seed; :func:`compare_over_seeds` (or
:meth:`SeedTable.compare`) pairs two variants seed by seed and compares the mean paired difference with a
noise level; :meth:`SeedComparison.holds`, :meth:`SeedComparison.equivalent` and :meth:`SeedComparison.at_most`
are the verdicts of "a is larger than b", "a and b do not differ" and "a is not larger than b by more than a
margin"; :func:`trains`, :func:`given` and :func:`every` handle untrained arms, conditional claims and claims
made for several cases; :func:`within` decides exact claims at a stated tolerance; :func:`bootstrap_noise`
gives the floor of a measure with no binomial formula.  A verdict is ``True`` (holds), ``False`` (does not
hold), ``None`` (not distinguishable) or :data:`NOT_TESTABLE`, the values :meth:`Chapter.claim
<sphereml.book.chapter.Chapter.claim>` takes.

Note [noise level of a paired comparison]
-----------------------------------------
With ``k`` seeds, variant ``a`` and ``b`` give values ``a_i`` and ``b_i`` from the same seed ``i`` (same
data order and, where the variants allow, the same initial weights), so the differences ``d_i = a_i - b_i``
are paired.  The claim "``a`` is larger than ``b``" holds when ``mean(d) > noise``, does not hold when
``mean(d) < -noise`` and is not distinguishable otherwise.  The noise level is the largest of

* ``floor`` — a resolution the chapter chooses and states, below which no difference is called
  (for accuracies we use half a point);
* the evaluation noise, twice the standard error that the finite evaluation set alone puts on a
  difference of two accuracies on ``n_eval`` items: ``2 sqrt(2 p (1 - p) / n_eval)`` with ``p`` the mean
  accuracy (two independent binomial errors; pairing on the same items usually makes it smaller).  Every
  seed is evaluated on the same items, so this error is shared by the seeds and does not shrink with ``k``;
* with ``k > 1``, the half-width of the 95 % confidence interval of ``mean(d)`` from the seed-to-seed
  spread, ``t_{0.975, k-1} s / sqrt(k)`` with ``s`` the standard deviation of the ``d_i``.

Taking the largest of the three is a rule of thumb, not a test at a stated level: each term guards against
one source of noise, and a difference must clear all of them.  With one seed the last term is absent, so a
verdict that rests on one seed is only as strong as the floor and the evaluation noise allow; with two, the
t quantile is 12.7, so a difference is called only when both seeds agree closely.
"""

from __future__ import annotations

import math
import operator
import statistics
from dataclasses import dataclass
from typing import Callable

import torch
from scipy import stats

from .._checks import integer

__all__ = ["VERDICTS", "NOT_TESTABLE", "verdict_name", "SeedComparison", "evaluation_noise", "compare_over_seeds",
           "SeedTable", "GroupComparison", "trains", "given", "every", "within", "bootstrap_noise"]

NOT_TESTABLE = "not testable"  # the fourth verdict (True, False and None are the other three)
VERDICTS = {True: "holds", False: "does not hold", None: "not distinguishable", NOT_TESTABLE: NOT_TESTABLE}


def verdict_name(verdict) -> str:
    """The word for a verdict (:data:`VERDICTS`): "holds", "does not hold", "not distinguishable", "not testable"."""
    if isinstance(verdict, bool) or verdict is None or verdict == NOT_TESTABLE:
        return VERDICTS[verdict]
    raise ValueError(f"a verdict must be True, False, None or {NOT_TESTABLE!r}, got {verdict!r}")


@dataclass(frozen=True)
class SeedComparison:
    """The outcome of :func:`compare_over_seeds`: means, mean paired difference, noise level, verdict."""

    mean_a: float
    mean_b: float
    difference: float  # mean of a_i - b_i
    noise: float
    seeds: int
    spread: float | None  # standard deviation of the paired differences (None with one seed)

    @property
    def holds(self) -> bool | None:
        """The verdict of "``a`` is larger than ``b``": True when the difference clears the noise, False when
        it clears it the other way, else None."""
        if self.difference > self.noise:
            return True
        if self.difference < -self.noise:
            return False
        return None

    def equivalent(self, margin: float) -> bool | None:
        """The verdict of "``a`` and ``b`` do not differ by more than ``margin``" (an equivalence test).

        True when the whole interval difference ± noise lies inside [-margin, margin]; False when it lies
        wholly outside; None otherwise.  A difference inside the noise is *not* evidence of no difference:
        with a noise level wider than the margin, the verdict can never be True.
        """
        if not (math.isfinite(margin) and margin > 0):
            raise ValueError(f"margin must be a finite number > 0, got {margin}")
        low, high = self.difference - self.noise, self.difference + self.noise
        if -margin <= low and high <= margin:
            return True
        if low > margin or high < -margin:
            return False
        return None

    def at_most(self, margin: float) -> bool | None:
        """The verdict of "``a`` exceeds ``b`` by no more than ``margin``" (a one-sided, non-superiority test).

        True when the whole interval lies at or below ``margin`` (difference + noise <= margin); False when
        it lies wholly above (difference - noise > margin); None otherwise.  ``a`` far *below* ``b`` holds:
        the claim says only that ``a`` is not better.
        """
        if not (math.isfinite(margin) and margin >= 0):
            raise ValueError(f"margin must be a finite number >= 0, got {margin}")
        if self.difference + self.noise <= margin:
            return True
        if self.difference - self.noise > margin:
            return False
        return None

    def numbers(self, name_a: str, name_b: str, scale: float = 1.0, digits: int = 4) -> dict:
        """The values behind the verdict as a claim's ``ours`` dict: both means, their difference (a - b,
        signed as the claim reads), seeds, noise, spread.

        ``scale`` multiplies every value (100 for percent); ``digits`` rounds them.
        """
        out = {name_b: round(scale * self.mean_b, digits), name_a: round(scale * self.mean_a, digits),
               "difference": round(scale * self.difference, digits), "seeds": self.seeds,
               "noise": round(scale * self.noise, digits)}
        if self.spread is not None:
            out["seed s.d."] = round(scale * self.spread, digits)
        return out


def _values(name: str, values) -> list[float]:
    values = [float(v) for v in values]
    if not values:
        raise ValueError(f"{name} must hold one value per seed, got none")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name} must be finite, got {values}")
    return values


def evaluation_noise(accuracy: float, n_eval: int, terms: int = 2) -> float:
    """Twice the binomial standard error of a sum or difference of ``terms`` accuracies near ``accuracy``, each
    measured on ``n_eval`` items: two for a difference of accuracies, four for a difference of two gains."""
    return 2 * math.sqrt(terms * accuracy * (1 - accuracy) / n_eval)


def compare_over_seeds(a, b, *, floor: float, n_eval: int | None = None, confidence: float = 0.95,
                       eval_terms: int = 2) -> SeedComparison:
    """Compare variant ``a`` with variant ``b`` over paired seeds (Note [noise level of a paired comparison]).

    Args:
        a, b: one value per seed (sequences of equal length; ``a[i]`` and ``b[i]`` from the same seed).
        floor (float): the smallest difference the caller is willing to call (>= 0), in the values' units.
        n_eval (int, optional): the evaluation-set size when the values are accuracies in [0, 1]; adds the
            binomial evaluation noise.  Leave None for other quantities.
        confidence (float): the level of the seed-spread interval (0.95 by default).
        eval_terms (int): how many of the two sides were measured on the ``n_eval`` items: 2 (two accuracies),
            or 1 when one side is exact (a stated probability or bound), which halves the binomial variance.

    Returns:
        :class:`SeedComparison`; its ``holds`` is the verdict for "``a`` is larger than ``b``".
    """
    a, b = _values("a", a), _values("b", b)
    if len(a) != len(b):
        raise ValueError(f"a and b need one value per seed each, got {len(a)} and {len(b)}")
    if not (math.isfinite(floor) and floor >= 0):
        raise ValueError(f"floor must be a finite number >= 0, got {floor}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    k = len(a)
    diffs = [x - y for x, y in zip(a, b)]
    mean_a, mean_b, difference = sum(a) / k, sum(b) / k, sum(diffs) / k
    noise = floor
    if n_eval is not None:
        try:
            size = operator.index(n_eval)
        except TypeError:
            size = 0
        if isinstance(n_eval, bool) or size < 1:
            raise ValueError(f"n_eval must be a positive int, got {n_eval!r}")
        if not all(0 <= v <= 1 for v in a + b):
            raise ValueError("with n_eval the values must be accuracies in [0, 1]")
        if eval_terms not in (1, 2):
            raise ValueError(f"eval_terms must be 1 or 2, got {eval_terms!r}")
        noise = max(noise, evaluation_noise((mean_a + mean_b) / 2, size, eval_terms))
    spread = None
    if k > 1:
        spread = math.sqrt(sum((d - difference) ** 2 for d in diffs) / (k - 1))
        quantile = float(stats.t.ppf(0.5 + confidence / 2, k - 1))
        noise = max(noise, quantile * spread / math.sqrt(k))
    return SeedComparison(mean_a, mean_b, difference, noise, k, spread)


class SeedTable:
    """Results by variant and seed: the one collector of every chapter's trained comparisons.

    ``table.add("MHE", seed, accuracy=0.81, energy=3.2)`` records a run; ``table.values("MHE", "accuracy")``
    lists a key over the variant's seeds (in seed order), :meth:`mean` averages it, and :meth:`compare`
    pairs two variants on their common seeds (:func:`compare_over_seeds`).  A chapter states its rule once,
    when it makes the table: ``SeedTable(floor=0.005, n_eval=len(test), chance=0.1)``.  Then
    ``table.compare(a, b)`` compares accuracies with that floor and evaluation noise, :meth:`trains` says whether
    variants cleared chance, :meth:`beats` is the verdict of "a is more accurate than b" (not testable when
    either arm stays at chance) and :meth:`evidence` is what a claim rests on."""

    def __init__(self, *, floor: float | None = None, n_eval: int | None = None, chance: float | None = None,
                 key: str = "accuracy"):
        self.rows: dict[str, dict[int, dict[str, float]]] = {}
        self.floor, self.n_eval, self.chance, self.key = floor, n_eval, chance, key

    def add(self, variant: str, seed: int, **values) -> None:
        """Record (or extend) the values of one run."""
        self.rows.setdefault(variant, {}).setdefault(seed, {}).update(values)

    @property
    def variants(self) -> list[str]:
        return list(self.rows)

    def seeds(self, variant: str) -> list[int]:
        if variant not in self.rows:
            raise KeyError(f"no results for variant {variant!r}; have {sorted(self.rows)}")
        return sorted(self.rows[variant])

    def values(self, variant: str, key: str | None = None, seeds=None) -> list[float]:
        """``key`` (default: the table's key) of ``variant`` over ``seeds`` (default: all of its seeds, in order)."""
        key = key or self.key
        return [self.rows[variant][s][key] for s in (self.seeds(variant) if seeds is None else seeds)]

    def mean(self, variant: str, key: str | None = None) -> float:
        values = self.values(variant, key)
        return sum(values) / len(values)

    def error(self, variant: str) -> float:
        """Mean error in percent (``100 (1 - mean accuracy)``), rounded to 0.01, as the sources print errors."""
        return round(100 * (1 - self.mean(variant)), 2)

    def error_numbers(self, a: str, b: str) -> dict:
        """A claim's ``ours`` for "``a`` is more accurate than ``b``", in the units the sources print: both errors
        (%), the accuracy difference ``a - b``, its noise level and seed s.d. (points), and the seeds."""
        return self.compare(a, b).numbers(a, b, scale=100, digits=2) | {b: self.error(b), a: self.error(a)}

    def compare(self, a: str, b: str, key: str | None = None, *, floor: float | None = None,
                n_eval: int | None = None, confidence: float = 0.95) -> "SeedComparison":
        """``a`` against ``b`` on ``key``, paired on the seeds both have (see :func:`compare_over_seeds`).

        The floor defaults to the table's; so does the evaluation size, but only for the table's own key (an
        accuracy): the binomial term does not apply to other measures, which pass ``n_eval`` when they are
        accuracies too."""
        floor, seeds = self._paired(a, b, floor, "compare")
        if n_eval is None and key in (None, self.key):
            n_eval = self.n_eval
        return compare_over_seeds(self.values(a, key, seeds), self.values(b, key, seeds), floor=floor,
                                  n_eval=n_eval, confidence=confidence)

    def compare_changes(self, a: str, b: str, start: str, end: str, *, floor: float | None = None,
                        n_eval: int | None = None, confidence: float = 0.95) -> SeedComparison:
        """``a``'s change from key ``start`` to key ``end`` (``end - start``, per seed) against ``b``'s, paired
        on the seeds both have: ``holds`` reads "``a`` changes more than ``b``" (loses less, when both fall).
        With ``n_eval`` (accuracies on ``n_eval`` items) the noise counts four binomial terms, two per side."""
        floor, seeds = self._paired(a, b, floor, "compare_changes")
        changes = {v: [e - s for s, e in zip(self.values(v, start, seeds), self.values(v, end, seeds))] for v in (a, b)}
        if n_eval is not None:
            accuracies = [x for v in (a, b) for key in (start, end) for x in self.values(v, key, seeds)]
            if not all(0 <= x <= 1 for x in accuracies):
                raise ValueError("with n_eval the values must be accuracies in [0, 1]")
            size = integer("n_eval", n_eval, at_least=1)
            floor = max(floor, evaluation_noise(sum(accuracies) / len(accuracies), size, terms=4))
        return compare_over_seeds(changes[a], changes[b], floor=floor, confidence=confidence)

    def _paired(self, a: str, b: str, floor: float | None, caller: str) -> tuple[float, list[int]]:
        """The floor (the table's unless given) and the seeds ``a`` and ``b`` share."""
        floor = self.floor if floor is None else floor
        if floor is None:
            raise ValueError(f"{caller} needs a floor: give one here or when making the SeedTable")
        seeds = sorted(set(self.seeds(a)) & set(self.seeds(b)))
        if not seeds:
            raise ValueError(f"{a!r} and {b!r} share no seed")
        return floor, seeds

    def trains(self, *variants: str, every_seed: bool = False) -> bool:
        """Whether every variant named learned anything (:func:`trains` on the table's key, chance and evaluation
        size): its mean over the seeds, or with ``every_seed`` each seed's value on its own."""
        if self.chance is None or self.n_eval is None:
            raise ValueError("trains needs the SeedTable's chance and n_eval")
        runs = [[value] for v in variants for value in self.values(v)] if every_seed else map(self.values, variants)
        return all(trains(values, chance=self.chance, n_eval=self.n_eval) for values in runs)

    def beats(self, a: str, b: str) -> bool | None | str:
        """The verdict of "``a`` is larger than ``b``" on the table's key, :data:`NOT_TESTABLE` when either
        arm stays at chance."""
        return given(self.trains(a), self.trains(b), verdict=self.compare(a, b).holds)

    def beats_each(self, variants, baseline: str | None = None, key: str | None = None, *,
                   floor: float | None = None, n_eval: int | None = None) -> "GroupComparison":
        """The claim "each of ``variants`` is larger than ``baseline`` on ``key``", one verdict for all.

        With ``baseline=None``, ``variants`` are pairs ``(a, b)``, each read "a is larger than b" (a claim
        made for several operators, each against its own reference).  Every pair is compared as
        :meth:`compare` does (``floor`` and ``n_eval`` as there); a pair is :data:`NOT_TESTABLE` when either
        arm stays at chance on the table's own key (an accuracy, :meth:`trains`, where the table knows its
        chance level), whichever ``key`` is compared; the verdicts of the pairs are joined by :func:`every`.
        """
        if isinstance(variants, str):
            raise ValueError(f"beats_each needs a list of variants, got the string {variants!r}")
        variants = list(variants)
        if baseline is None:
            bad = [p for p in variants if not (isinstance(p, (tuple, list)) and len(p) == 2)]
            if bad or not variants:
                raise ValueError(f"beats_each needs variants with a baseline, or (a, b) pairs; got {variants!r}")
        pairs = [tuple(p) for p in variants] if baseline is None else [(v, baseline) for v in variants]
        if not pairs:
            raise ValueError("beats_each needs at least one variant")
        comparisons = [self.compare(a, b, key, floor=floor, n_eval=n_eval) for a, b in pairs]
        verdicts = [c.holds if self.chance is None else given(self.trains(a), self.trains(b), verdict=c.holds)
                    for (a, b), c in zip(pairs, comparisons)]
        return GroupComparison(self, key, pairs, comparisons, verdicts)

    @staticmethod
    def evidence(comparisons, scale: float = 1.0, digits: int = 4, labels=None) -> dict:
        """What a claim over several comparisons rests on: the seeds and the noise level (times ``scale``: 100
        for points), one number when the comparisons share it or no ``labels`` name them (then the largest),
        else ``{label: noise}``, since each comparison is decided against its own."""
        comparisons = list(comparisons)
        if not comparisons or (labels is not None and len(labels) != len(comparisons)):
            raise ValueError(f"evidence needs at least one comparison and one label per comparison, got "
                             f"{len(comparisons)} comparisons and labels {labels!r}")
        noises = [round(scale * c.noise, digits) for c in comparisons]
        noise = max(noises) if labels is None or len(set(noises)) == 1 else dict(zip(labels, noises))
        return {"seeds": max(c.seeds for c in comparisons), "noise": noise}

    def to_dict(self) -> dict:
        """``{variant: {seed: values}}`` (seeds as strings), for a chapter's metrics."""
        return {variant: {str(s): dict(v) for s, v in runs.items()} for variant, runs in self.rows.items()}


@dataclass(frozen=True)
class GroupComparison:
    """One claim made for several pairs of variants (:meth:`SeedTable.beats_each`): the pairs, their
    comparisons and verdicts; :attr:`holds` joins the verdicts, :meth:`numbers` is the claim's ``ours``."""

    table: SeedTable
    key: str | None
    pairs: list[tuple[str, str]]
    comparisons: list[SeedComparison]
    verdicts: list

    @property
    def holds(self):
        """:func:`every` verdict of the pairs: True if all hold, False if any fails, and so on."""
        return every(self.verdicts)

    def numbers(self, names: dict[str, str] | None = None, scale: float = 1.0, digits: int = 4) -> dict:
        """Each variant's mean on the key (references first), then :meth:`evidence` (seeds, noise).  A variant
        is shown under ``names[variant]`` if given, else, when two or more are not named, without the words all
        of those share at their start and end ("no BN TanhConv cosine" against "no BN CNN cosine" reads
        "TanhConv" and "CNN")."""
        names = self._names(names)
        means = {names[v]: round(scale * self.table.mean(v, self.key), digits) for v in names}
        return means | self.evidence(names, scale, digits)

    def evidence(self, names: dict[str, str] | None = None, scale: float = 1.0, digits: int = 4) -> dict:
        """:meth:`SeedTable.evidence` of the pairs, a noise level per pair where they differ, each pair named
        by its first variant (against one baseline) or as "a vs b"; ``names`` as in :meth:`numbers`."""
        names = self._names(names)
        one_baseline = len({b for _, b in self.pairs}) == 1
        labels = [names[a] if one_baseline else f"{names[a]} vs {names[b]}" for a, b in self.pairs]
        return self.table.evidence(self.comparisons, scale, digits, labels)

    def _names(self, names: dict[str, str] | None) -> dict[str, str]:
        """Every variant of the pairs (references first) -> the name it is shown under."""
        names = dict(names or {})
        variants = list(dict.fromkeys([b for _, b in self.pairs] + [a for a, _ in self.pairs]))
        unnamed = [v for v in variants if v not in names]
        names |= _distinct_words(unnamed) if len(unnamed) > 1 else {v: v for v in unnamed}
        return {v: names[v] for v in variants}


def _distinct_words(variants: list[str]) -> dict[str, str]:
    """Each name without the words all of them share at the start and at the end (at least one word kept)."""
    words = [v.split() for v in variants]
    shortest, start, end = min(len(w) for w in words), 0, 0
    while start < shortest - 1 and len({w[start] for w in words}) == 1:
        start += 1
    while end < shortest - 1 - start and len({w[-1 - end] for w in words}) == 1:
        end += 1
    return {v: " ".join(w[start:len(w) - end]) for v, w in zip(variants, words)}


def trains(accuracies, chance: float, n_eval: int, floor: float = 0.01) -> bool:
    """Whether a variant learned anything: its mean accuracy exceeds ``chance`` by more than the larger of
    ``floor`` and twice the binomial standard error of an accuracy at chance on ``n_eval`` items.  A claim
    with an arm that does not train is :data:`NOT_TESTABLE` (see :func:`given`)."""
    values = _values("accuracies", accuracies)
    if not 0 < chance < 1:
        raise ValueError(f"chance must lie in (0, 1), got {chance}")
    noise = max(floor, 2 * math.sqrt(chance * (1 - chance) / n_eval))
    return sum(values) / len(values) > chance + noise


def given(*conditions, verdict):
    """``verdict`` if every condition holds (``True``), else :data:`NOT_TESTABLE`: a claim that rests on a control
    (the arms train, the control comparison itself holds) is tested only where the control stands."""
    for condition in conditions:
        if condition is not True and condition not in (False, None, NOT_TESTABLE):
            raise ValueError(f"conditions must be verdicts or booleans, got {condition!r}")
    verdict_name(verdict)
    return verdict if all(c is True for c in conditions) else NOT_TESTABLE


def bootstrap_noise(statistic: Callable[[torch.Tensor], float], n: int, resamples: int = 100, seed: int = 0) -> float:
    """A noise level for a measure with no binomial formula (a Fisher score, a mean distance): twice the
    standard deviation of ``statistic(idx)`` over ``resamples`` bootstrap draws ``idx`` of ``n`` item indices
    (with replacement, from a generator seeded by ``seed``).  For a paired comparison, let ``statistic``
    compute the *difference* of the two variants on the same drawn items, as the paired rule above does."""
    integer("n", n, at_least=1)
    integer("resamples", resamples, at_least=2)
    generator = torch.Generator().manual_seed(seed)
    values = [float(statistic(torch.randint(0, n, (n,), generator=generator))) for _ in range(resamples)]
    return 2 * statistics.pstdev(values)


def within(value, expected, tolerance: float) -> bool:
    """An exact claim (a closed form, an identity of a proof, a known optimum): it holds when every computed
    value lies within ``tolerance`` of the expected one, and does not hold otherwise.  There is no noise to
    speak of, only rounding, so the tolerance is stated where the claim is made."""
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance}")
    pairs = zip(value, expected) if isinstance(value, (list, tuple)) else [(value, expected)]
    return all(abs(float(v) - float(e)) <= tolerance for v, e in pairs)


def every(verdicts):
    """A claim made for every case: True if all hold, False if any fails, :data:`NOT_TESTABLE` if any cannot be
    tested (and none fails), else None (not distinguishable)."""
    verdicts = list(verdicts)
    for v in verdicts:
        if not (isinstance(v, bool) or v is None or v == NOT_TESTABLE):
            raise ValueError(f"verdicts must be True, False, None or {NOT_TESTABLE!r}, got {verdicts}")
    if False in verdicts:
        return False
    if NOT_TESTABLE in verdicts:
        return NOT_TESTABLE
    return True if all(v is True for v in verdicts) else None
