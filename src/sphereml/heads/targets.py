"""The target functions psi of the margin heads: what replaces cos(theta) at a sample's own class.

* :func:`chebyshev_cos` — cos(m theta) as the Chebyshev polynomial T_m(cos theta) (thesis eq. 2.7);
* :func:`psi` — the monotone multiplicative target of L- and A-Softmax, from the angle (eq. 2.6), for plots
  and tests;
* :func:`multiplicative_psi` — the same from the cosine, with no arccos in the gradient (eq. 2.8; Note
  [margin without arccos] in :mod:`sphereml.heads.margins`), its branch index from :func:`multiplicative_branch`;
* :func:`arcface_psi` — the additive angular margin cos(theta + m), made monotone on [0, pi];
* :func:`integer_margin` — the check that m is an integer >= 1, for the multiple-angle formula.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._checks import real_number

__all__ = ["integer_margin", "chebyshev_cos", "psi", "multiplicative_branch", "multiplicative_psi", "arcface_psi"]


def integer_margin(m) -> int:
    """``m`` as an int if it is an integer (or an integral float) >= 1: the margin of eqs. 2.6-2.8."""
    if isinstance(m, bool) or not isinstance(m, int) and not (isinstance(m, float) and m.is_integer()):
        raise ValueError(f"m must be an integer >= 1 for the multiple-angle formula, got {m!r}")
    if m < 1:
        raise ValueError(f"m must be an integer >= 1, got {m!r}")
    return int(m)


def chebyshev_cos(cos: Tensor, m: int) -> Tensor:
    r""":math:`\cos(m\theta)` as a polynomial in :math:`c = \cos\theta`: the multiple-angle formula (thesis eq. 2.7).

    .. math::

        \cos(m\theta) = \sum_{n=0}^{\lfloor m/2 \rfloor} (-1)^n \binom{m}{2n} c^{m-2n} (1 - c^2)^n = T_m(c),

    the Chebyshev polynomial of degree :math:`m`.  It is evaluated by the three-term recurrence
    :math:`T_0 = 1`, :math:`T_1 = c`, :math:`T_{n+1} = 2 c T_n - T_{n-1}`, which is the same polynomial and
    stable on :math:`[-1, 1]`; no arccos is involved, so the gradient :math:`T_m'(c)` is finite
    everywhere (at most :math:`m^2` in magnitude on :math:`[-1, 1]`).

    Args:
        cos (Tensor): cosines, any shape.
        m (int): the multiple, an integer >= 1.

    Returns:
        Tensor of the same shape.
    """
    m = integer_margin(m)
    prev, cur = torch.ones_like(cos), cos
    for _ in range(m - 1):
        prev, cur = cur, 2 * cos * cur - prev
    return cur


def psi(theta: Tensor, m: int | float) -> Tensor:
    """The monotone multiplicative-margin target function of L-Softmax and A-Softmax (thesis eq. 2.6).

    psi(theta) = (-1)^k cos(m theta) - 2k on [k pi / m, (k + 1) pi / m], k = 0, ..., ceil(m) - 1.

    It equals cos(m theta) on [0, pi / m], is continuous and non-increasing on [0, pi],
    psi(0) = 1 and, for integer m, psi(pi) = 1 - 2m.  This reference form takes the angle
    and is used for plots and tests; the loss heads evaluate it from the cosine through
    :func:`chebyshev_cos` (see :mod:`sphereml.heads.margins`).

    Args:
        theta (Tensor): angles in [0, pi].
        m (int or float): the margin multiple, >= 1 (real values give the continuous
            extension used by the detached SphereFace variant).

    Returns:
        Tensor of the same shape as ``theta``.
    """
    m = real_number("m", m, at_least=1.0)
    k = torch.floor(theta.detach() * m / math.pi).clamp(0, math.ceil(m) - 1)
    sign = 1 - 2 * torch.remainder(k, 2)  # (-1)^k
    return sign * torch.cos(m * theta) - 2 * k


def multiplicative_psi(cos: Tensor, m: int) -> Tensor:
    """psi(theta) of eq. 2.6 evaluated from c = cos(theta) (eq. 2.8), see Note [margin without arccos] in
    :mod:`sphereml.heads.margins`.

    Args:
        cos (Tensor): cosines in [-1, 1].
        m (int): integer margin >= 1.

    Returns:
        Tensor of the same shape, (-1)^k T_m(c) - 2k with k = floor(m arccos(c) / pi) in 0..m-1.
    """
    m = integer_margin(m)
    k, sign = multiplicative_branch(cos, m)
    return sign * chebyshev_cos(cos, m) - 2 * k


def multiplicative_branch(cos: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(k, (-1)^k) of eq. 2.6 for cosines: k = floor(m arccos(c) / pi) in 0..m-1, piecewise constant (no gradient)."""
    with torch.no_grad():
        theta = torch.arccos(cos.clamp(-1.0, 1.0))
        k = torch.floor(theta * m / math.pi).clamp(0, m - 1)
        return k, 1 - 2 * torch.remainder(k, 2)


def arcface_psi(cos: Tensor, m: float, eps: float = 1e-6) -> Tensor:
    """The additive angular margin cos(theta + m) (L_a2), made monotone on the whole of [0, pi].

    cos(theta + m) rises again once theta + m > pi, so for theta > pi - m it would
    reward moving *away* from the class.  There we continue with the CosFace-type
    line psi = cos(theta) - (1 - cos m): it meets cos(theta + m) = -1 at theta = pi - m
    (continuous), decreases, and stays below cos(theta).  (InsightFace's tail
    cos(theta) - m sin(m) is monotone too but jumps down at pi - m.)

    sin(theta) = sqrt(max(1 - c^2, eps)), so the gradient stays finite at c = +-1 (the
    exact d psi / dc = cos m + sin m cos(theta) / sin(theta) is infinite at theta = 0); the
    value is exact for theta above about sqrt(eps) = 1e-3 rad.
    """
    sin_theta = torch.sqrt((1.0 - cos * cos).clamp_min(eps))
    rotated = cos * math.cos(m) - sin_theta * math.sin(m)
    tail = cos - (1.0 - math.cos(m))
    return torch.where(cos < -math.cos(m), tail, rotated)
