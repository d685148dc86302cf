"""Pair kernels of the hyperspherical energy, shared by every backend (thesis eqs. 5.1, 5.5).

Every backend reduces the energy to a matrix of point coordinates Q (one row per point:
a unit neuron, its virtual negative, or a weighted neuron beta_i w_hat_i) and evaluates,
for each ordered pair, a value f and its derivative D = df / dg with respect to the Gram
entry g_ij = q_i . q_j:

* ``euclidean``: r^2 = ||q_i - q_j||^2 floored at ``eps``; f = (r^2)^(-s/2), or
  -log(r^2) / 2 = log(1 / r) for s = 0;
* ``angular`` (unit rows): theta = arccos(g) with g clamped to [-1 + eps/2, 1 - eps/2]
  (for close pairs theta = 2 arcsin(r / 2), the same angle on the sphere);
  f = theta^(-s), or log(1 / theta) for s = 0.

r^2 comes from the Gram matrix, r^2 = ||q_i||^2 + ||q_j||^2 - 2 g_ij, except for close pairs
(Note [close pairs]).

Note [energy floor]
    Two coincident neurons have r = 0 and infinite energy.  The floor r^2 >= eps (for the
    angular metric: ``abs(cos) <= 1 - eps/2``, i.e. theta >= about sqrt(eps)) caps each pair's
    value at eps^(-s/2) and gives a zero derivative below the floor, so duplicated neurons
    produce finite values and finite gradients.  The floor acts on the *exact* r^2 of
    Note [close pairs], so only (near-)exact duplicates are floored, with the same semantics in
    every backend and dtype; above the floor the values are exact.

Note [close pairs]
    The Gram estimate r^2 = ||q_i||^2 + ||q_j||^2 - 2 q_i . q_j costs one matrix product for
    all pairs, but it subtracts numbers of size ||q||^2 and so carries an absolute error
    Delta of a few units in the last place of ||q||^2, whatever r is.  For unit rows in
    float32: up to 5e-7 (CPU, random rows, d = 3 ... 512), 7e-7 for duplicated rows, 2.4e-7
    on an H200 -- more than the floor eps = 1e-7 and half the squared chord 1e-6 of two
    neurons at chord 1e-3.  With TF32 products (10-bit mantissa, unit roundoff u = 2^-11)
    abs(Delta) <= 4 u (||q_i||^2 + ||q_j||^2) / 2 = 2e-3; emulated on the CPU: up to 1.3e-3 at
    d = 3, 3.9e-4 at d = 64, 1.1e-4 at d = 512 (TF32x3 behaves like float32; all numbers in
    ``gram_error_emulated`` of benchmarks/results/energy_fwd_bwd-cpu.json).  Every backend
    therefore (1) estimates r^2 from the Gram matrix for all pairs; (2) calls a pair *close*
    when the estimate is below ``CLOSE_R2 (||q_i||^2 + ||q_j||^2) / 2`` (r^2 < 0.05, an angle
    below 12.8 degrees, for unit points) and recomputes its r^2 as ||q_i - q_j||^2 from the
    coordinate differences, which are exact for nearby floats (Sterbenz), so its relative
    error is a few float32 roundings in every matmul precision; (3) forms a close pair's
    gradient D_ij (q_j - q_i) from that explicit difference, never as
    (D Q)_i - rowsum(D)_i q_i, which cancels catastrophically (relative error ~ u / r) when
    one huge D_ij dominates the row.

    Why 0.05: it is 25 times the TF32 error bound and 1e5 times the float32 error, so no pair
    with r^2 < 0.048 escapes detection in any precision, and a pair left to the Gram
    estimate has a relative error of r^2 below Delta / 0.05 (float32: 1e-5, emulated 4e-6;
    TF32: 4 % bound, emulated 1.6 % at d = 3 for r^2 in [0.05, 0.1), much less in higher d)
    and a gradient cancellation factor ||q|| / ||q_j - q_i|| below 1 / sqrt(0.05) = 4.5.
    Close pairs are rare (random unit vectors in d >= 30 essentially never come within 12.8
    degrees; on S^2 about 1.25 % of pairs do), so recomputing them costs little.  ``dense``
    and ``tiled`` gather the close pairs with ``nonzero`` (one device synchronisation per
    call, or per block, on CUDA); the Triton kernels take a slow path only in tiles that
    contain one, without leaving the device.  ``gemm`` (:mod:`~sphereml.energy.gemm_backend`) flags the
    tiles whose Gram estimate has a pair below twice the threshold and there decides by the exact r^2,
    which two of its kernels must agree on.  For the angular metric the close pair's angle
    is theta = 2 arcsin(r / 2) (equal to arccos(g) on the sphere) and its floor is
    r^2 >= eps, the same as abs(cos) <= 1 - eps/2.  Antipodal pairs (cos near -1, e.g. w and
    -w in the half-space angular energy) are not treated: the symmetric clamp caps their angle
    at arccos(-1 + eps/2) = pi - sqrt(eps) (pi - 3.2e-4 for eps = 1e-7), which moves each such
    pair's value by about s sqrt(eps) / pi relative (2e-5 of the half-space angular energy of
    two orthogonal neurons, s = 1), and their float32 gradient error is about 1e-4 relative.
    Exact values there would need the explicit-sum treatment of close pairs mirrored at -1:
    arccos has an infinite slope at -1, so rounding in g alone moves theta by 1e-8.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["METRICS", "CLOSE_R2", "close_mask", "squared_distances", "pair_values"]

METRICS = ("euclidean", "angular")
CLOSE_R2 = 0.05  # Note [close pairs]: r^2 below this (for unit points) is recomputed from differences


def close_mask(raw: Tensor, sq_rows: Tensor, sq_cols: Tensor) -> Tensor:
    """The close pairs of Note [close pairs]: Gram estimate ``raw`` < CLOSE_R2 (||q_i||^2 + ||q_j||^2) / 2."""
    return 2 * raw < CLOSE_R2 * (sq_rows + sq_cols)


def squared_distances(a: Tensor, b: Tensor, gram: Tensor, skip: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """||a_i - b_j||^2 for all pairs: the Gram estimate, with close pairs recomputed from differences.

    Args:
        a (Tensor[B, d]), b (Tensor[M, d]): the points; ``gram`` (Tensor[B, M]) is ``a @ b.T``.
        skip (Tensor[B, M] of bool, optional): pairs never to recompute (e.g. i == j).

    Returns:
        (r2 Tensor[B, M], close Tensor[B, M] of bool), differentiable with respect to ``a``, ``b``
        and ``gram``: through the explicit differences for the close pairs (Note [close pairs]).
    """
    sq_a, sq_b = (a * a).sum(1, keepdim=True), (b * b).sum(1)[None, :]
    raw = sq_a + sq_b - 2 * gram  # (B, M)
    close = close_mask(raw, sq_a, sq_b)
    if skip is not None:
        close = close & ~skip
    rows, cols = close.nonzero(as_tuple=True)
    return raw.index_put_((rows, cols), (a[rows] - b[cols]).square().sum(1)), close  # in place: no second (B, M)


def pair_values(r2: Tensor, gram: Tensor | None, close: Tensor | None, s: float, metric: str, eps: float,
                with_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """f for every pair of a block, and (optionally) D = df / d gram.

    Args:
        r2 (Tensor[B, M]): squared distances, exact for the close pairs (:func:`squared_distances`).
        gram (Tensor[B, M]): q_i . q_j (angular only; may be None for euclidean).
        close (Tensor[B, M] of bool): the close pairs (angular only).
        s (float): the Riesz exponent, >= 0.
        metric (str): ``"euclidean"`` or ``"angular"``.
        eps (float): the floor of Note [energy floor].

    Returns:
        (values Tensor[B, M], D Tensor[B, M] or None).  Diagonal entries are not masked here;
        callers exclude i == j.  Both metrics give dE/dq_i = sum_j D_ij (q_j - q_i) for close
        pairs; far pairs give D_ij (q_j - q_i) (euclidean) or D_ij q_j (angular, unit rows).
    """
    if metric == "euclidean":
        above = r2 > eps
        r2 = torch.where(above, r2, eps)
        if s == 0:
            values = -0.5 * torch.log(r2)
            deriv_r2 = -0.5 / r2
        else:
            values = r2.pow(-0.5 * s)
            deriv_r2 = -0.5 * s * values / r2
        return values, (torch.where(above, -2 * deriv_r2, torch.zeros_like(r2)) if with_grad else None)
    bound = 1 - 0.5 * eps
    cos = gram.clamp(-bound, bound)
    chord2 = r2.clamp(eps, 2.0)  # close pairs: r^2 < 0.05; the clamp keeps the unused branch finite
    theta = torch.where(close, 2 * torch.asin(0.5 * chord2.sqrt()), torch.arccos(cos))
    if s == 0:
        values = -torch.log(theta)
        deriv_theta = -1.0 / theta
    else:
        values = theta.pow(-s)
        deriv_theta = -s * values / theta
    if not with_grad:
        return values, None
    inside = torch.where(close, r2 > eps, gram.abs() < bound)
    sin_theta = torch.where(close, (chord2 * (1 - 0.25 * chord2)).sqrt(), (1 - cos * cos).sqrt())
    return values, torch.where(inside, -deriv_theta / sin_theta, torch.zeros_like(gram))
