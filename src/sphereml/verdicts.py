"""Verdicts that know their noise: compare two trained variants over several seeds.

A claim such as "MHE beats the baseline" compares numbers that move from seed to seed and from one
evaluation sample to another. :func:`compare_over_seeds` turns the per-seed values of two variants into a
verdict (``True`` / ``False`` / ``None`` for "not distinguishable", the values :meth:`Chapter.claim
<sphereml.chapter.Chapter.claim>` takes) by comparing the mean paired difference with a noise level.

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
from dataclasses import dataclass

from scipy import stats

__all__ = ["SeedComparison", "compare_over_seeds", "every"]


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
        """True when ``a`` exceeds ``b`` beyond the noise, False when it falls short beyond it, else None."""
        if self.difference > self.noise:
            return True
        if self.difference < -self.noise:
            return False
        return None

    def numbers(self, name_a: str, name_b: str, scale: float = 1.0, digits: int = 4) -> dict:
        """The values behind the verdict as a claim's ``ours`` dict: both means, seeds, noise, spread.

        ``scale`` multiplies every value (100 for percent); ``digits`` rounds them.
        """
        out = {name_b: round(scale * self.mean_b, digits), name_a: round(scale * self.mean_a, digits),
               "seeds": self.seeds, "noise": round(scale * self.noise, digits)}
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


def compare_over_seeds(a, b, *, floor: float, n_eval: int | None = None, confidence: float = 0.95
                       ) -> SeedComparison:
    """Compare variant ``a`` with variant ``b`` over paired seeds (Note [noise level of a paired comparison]).

    Args:
        a, b: one value per seed (sequences of equal length; ``a[i]`` and ``b[i]`` from the same seed).
        floor (float): the smallest difference the caller is willing to call (>= 0), in the values' units.
        n_eval (int, optional): the evaluation-set size when the values are accuracies in [0, 1]; adds the
            binomial evaluation noise.  Leave None for other quantities.
        confidence (float): the level of the seed-spread interval (0.95 by default).

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
        p = (mean_a + mean_b) / 2
        noise = max(noise, 2 * math.sqrt(2 * p * (1 - p) / size))
    spread = None
    if k > 1:
        spread = math.sqrt(sum((d - difference) ** 2 for d in diffs) / (k - 1))
        quantile = float(stats.t.ppf(0.5 + confidence / 2, k - 1))
        noise = max(noise, quantile * spread / math.sqrt(k))
    return SeedComparison(mean_a, mean_b, difference, noise, k, spread)


def every(verdicts) -> bool | None:
    """A claim made for every case: True if all hold, False if any fails, else None (not distinguishable)."""
    verdicts = list(verdicts)
    if any(v not in (True, False, None) for v in verdicts):
        raise ValueError(f"verdicts must be True, False or None, got {verdicts}")
    return False if False in verdicts else True if all(v is True for v in verdicts) else None
