"""Pair kernels of the hyperspherical energy, shared by every backend (thesis eqs. 5.1, 5.5).

Every backend reduces the energy to a matrix of point coordinates Q (one row per point:
a unit neuron, its virtual negative, or a weighted neuron beta_i w_hat_i) and evaluates,
for each ordered pair, a value f and its derivative with respect to the Gram entry
g_ij = q_i . q_j:

* ``euclidean``: ``r^2 = ||q_i||^2 + ||q_j||^2 - 2 g_ij`` floored at ``eps``; f = (r^2)^(-s/2), or
  -log(r^2) / 2 = log(1 / r) for s = 0;
* ``angular`` (unit rows): theta = arccos(g) with g clamped to [-1 + eps/2, 1 - eps/2];
  f = theta^(-s), or log(1 / theta) for s = 0.

Note [energy floor]
    Two coincident neurons have r = 0 and infinite energy.  The floor r^2 >= eps (for the
    angular metric: ``abs(cos) <= 1 - eps/2``, i.e. theta >= about sqrt(eps)) caps each pair's
    value at eps^(-s/2) and gives a zero derivative below the floor, so duplicated
    neurons produce finite values and finite gradients.  Above the floor the values are
    exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

METRICS = ("euclidean", "angular")


def pair_values(gram: Tensor, sq_rows: Tensor, sq_cols: Tensor, s: float, metric: str, eps: float,
                with_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """f for every entry of a Gram block, and (optionally) df / d gram.

    Args:
        gram (Tensor[B, M]): q_i . q_j for a block of rows i and all columns j.
        sq_rows (Tensor[B, 1]), sq_cols (Tensor[1, M]): squared norms ``||q||^2`` (euclidean only).
        s (float): the Riesz exponent, >= 0.
        metric (str): ``"euclidean"`` or ``"angular"``.
        eps (float): the floor of Note [energy floor].

    Returns:
        (values Tensor[B, M], derivative Tensor[B, M] or None).  Diagonal entries are not
        masked here; callers exclude i == j.
    """
    if metric == "euclidean":
        raw = sq_rows + sq_cols - 2 * gram
        above = raw > eps
        r2 = torch.where(above, raw, torch.full_like(raw, eps))
        if s == 0:
            values = -0.5 * torch.log(r2)
            deriv_r2 = -0.5 / r2
        else:
            values = r2.pow(-0.5 * s)
            deriv_r2 = -0.5 * s * values / r2
        return values, (torch.where(above, -2 * deriv_r2, torch.zeros_like(raw)) if with_grad else None)
    bound = 1 - 0.5 * eps
    inside = gram.abs() < bound
    cos = gram.clamp(-bound, bound)
    theta = torch.arccos(cos)
    if s == 0:
        values = -torch.log(theta)
        deriv_theta = -1.0 / theta
    else:
        values = theta.pow(-s)
        deriv_theta = -s * values / theta
    if not with_grad:
        return values, None
    dtheta_dcos = -torch.rsqrt(1 - cos * cos)
    return values, torch.where(inside, deriv_theta * dtheta_dcos, torch.zeros_like(gram))
