"""Minimal-energy configurations: unit vectors that minimise the hyperspherical energy (eq. 5.1).

At s = 1 on the sphere in R^3 this is the Thomson problem; as s grows the minimiser moves toward the Tammes problem's
max-min arrangement (thesis §5.3.7).  The search is local, so it keeps the best of a few random starts.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .._checks import integer, one_of, real_number
from ..geometry import normalize
from .kernels import METRICS

WARM_LR = 0.05  # Adam's step on the unnormalised rows before L-BFGS


def minimal_energy_points(n: int, dim: int = 3, s: float = 1.0, *, metric: str = "euclidean",
                          half_space: bool = False, restarts: int = 3, warm_steps: int = 150, max_iter: int = 500,
                          generator: torch.Generator | None = None,
                          dtype: torch.dtype = torch.float64) -> tuple[float, Tensor]:
    """The lowest pair-mean energy found for ``n`` unit vectors in ``R^dim``, and those vectors.

    Each of ``restarts`` starts draws Gaussian rows from ``generator``, takes ``warm_steps`` Adam steps on the
    unnormalised rows (the energy normalises them itself, so no projection is needed), then runs L-BFGS with a
    strong-Wolfe line search for at most ``max_iter`` iterations; the start that ends lowest wins.  From three starts
    it finds the tabulated Thomson minima for ``n`` = 2..12 to 1e-7 relative (``tests/test_energy.py``).

    Args:
        n (int): number of points, at least 2.
        dim (int): dimension of the ambient space (the points lie on ``S^(dim-1)``), at least 2.
        s (float): the energy's power, ``s >= 0`` (0: the logarithmic energy).
        metric, half_space: as for :func:`~sphereml.energy.hyperspherical_energy`.
        restarts (int): random starts, at least 1.
        warm_steps (int): Adam steps (lr 0.05) before L-BFGS, at least 0.
        max_iter (int): L-BFGS iterations per start, at least 1 (PyTorch's L-BFGS also stops after 1.25 times as
            many energy evaluations).
        generator (torch.Generator, optional): draws the starts.
        dtype: a floating dtype, float64 by default (the tabulated minima above are checked in float64).

    Returns:
        (energy, points): the pair-mean energy as a Python float (times ``n (n - 1) / 2`` for a tabulated Thomson
        energy, which counts unordered pairs) and the ``(n, dim)`` unit rows that reach it.

    Raises:
        ValueError: for a bad argument, or when no start ends at a finite energy.
    """
    integer("n", n, at_least=2)
    integer("dim", dim, at_least=2)
    real_number("s", s, at_least=0.0)
    one_of("metric", metric, METRICS)
    integer("restarts", restarts, at_least=1)
    integer("warm_steps", warm_steps, at_least=0)
    integer("max_iter", max_iter, at_least=1)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
    from . import hyperspherical_energy  # the package imports this module

    best = (math.inf, None)
    for _ in range(restarts):
        w = torch.randn(n, dim, generator=generator, dtype=dtype).requires_grad_(True)

        def energy():
            return hyperspherical_energy(w, s=s, metric=metric, half_space=half_space)
        _descend(w, energy, warm_steps, max_iter)
        value = float(energy().detach())
        if value < best[0]:
            best = (value, normalize(w.detach()))
    if best[1] is None:
        raise ValueError(f"no start of {restarts} ended at a finite energy (n={n}, dim={dim}, s={s})")
    return best


def _descend(w: Tensor, energy, warm_steps: int, max_iter: int) -> None:
    """Adam for ``warm_steps`` steps, then L-BFGS, on the leaf ``w`` in place."""
    adam = torch.optim.Adam([w], lr=WARM_LR)
    for _ in range(warm_steps):
        adam.zero_grad()
        energy().backward()
        adam.step()
    lbfgs = torch.optim.LBFGS([w], max_iter=max_iter, tolerance_grad=1e-14, tolerance_change=1e-16,
                              line_search_fn="strong_wolfe")

    def closure():
        lbfgs.zero_grad()
        value = energy()
        value.backward()
        return value
    lbfgs.step(closure)
