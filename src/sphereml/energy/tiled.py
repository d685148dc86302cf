"""Blocked energy with a hand-written backward: O(M * block) memory, never the M x M matrix.

Forward: for each block of rows, form the Gram block q_r . q^T, evaluate the pair values and
add them up (in float64), skipping i == j.  Backward recomputes each block (as flash
attention does) and forms the gradient with one matmul per block:

    euclidean:  dE/dq_i = c * 2 * sum_j D_ij (q_j - q_i)
    angular:    dE/dq_i = c * 2 * sum_j D_ij q_j

with D_ij = df / dg_ij (from :func:`~sphereml.energy.kernels.pair_values`), the factor 2
from the two ordered pairs (i, j) and (j, i), and c = 1 / (M (M - 1)) times the incoming
gradient.  Close pairs (Note [close pairs] in :mod:`~sphereml.energy.kernels`) get their r^2
from explicit differences, are left out of the matmul and add D_ij (q_j - q_i) from the
gathered differences (``index_add_``), in both metrics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import CLOSE_R2, pair_values

__all__ = ["block_size", "block_sum", "block_gradient", "TiledEnergy", "tiled_energy"]


def block_size(m: int, budget: int = 2**22) -> int:
    """Rows per block so that one block of pair values holds about ``budget`` numbers."""
    return max(1, min(m, budget // max(m, 1)))


def _fix_close_pairs(points: Tensor, sq: Tensor, r2: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """Overwrite the close pairs of the Gram estimate ``r2`` (Tensor[b, M]) in place with ||q_i - q_j||^2.

    One comparison against a bound that holds for the whole block finds a few candidates
    (the diagonal among them); the exact rule of :func:`~sphereml.energy.kernels.close_mask`
    is applied to those only.  Returns the (block row, column) indices of the close pairs.
    """
    sq_rows = sq[start:stop]
    rows, cols = (r2 < 0.5 * CLOSE_R2 * (sq_rows.max() + sq.max())).nonzero(as_tuple=True)
    keep = (2 * r2[rows, cols] < CLOSE_R2 * (sq_rows[rows] + sq[cols])) & (rows + start != cols)
    rows, cols = rows[keep], cols[keep]
    r2[rows, cols] = (points[start + rows] - points[cols]).square().sum(1)
    return rows, cols


def _euclidean_values(r2: Tensor, s: float, eps: float, with_grad: bool) -> tuple[Tensor | None, Tensor | None]:
    """The kernel of :func:`~sphereml.energy.kernels.pair_values` in place on one (b, M) buffer (the hot path).

    Fast paths for s = 0, 1, 2; ``with_grad`` returns D = df/dg instead of the values.
    """
    below = r2 <= eps if with_grad else None
    r2.clamp_min_(eps)
    if not with_grad:
        if s == 0:
            return r2.log_().mul_(-0.5), None
        if s == 1:
            return r2.rsqrt_(), None
        if s == 2:
            return r2.reciprocal_(), None
        return r2.pow_(-0.5 * s), None
    # df/dg = -2 dh/dr2 with h(r2) = r2^(-s/2) (or -log(r2) / 2):  s r2^(-s/2 - 1)  (or 1 / r2)
    if s == 0:
        deriv = r2.reciprocal_()
    elif s == 2:
        deriv = r2.reciprocal_().square_().mul_(2.0)
    else:
        deriv = r2.pow_(-0.5 * s - 1.0).mul_(s)
    return None, deriv.masked_fill_(below, 0.0)


def _block(points: Tensor, sq: Tensor, start: int, stop: int, s, metric, eps, with_grad):
    """Values (or D) of rows start:stop against all points, zero on i == j, and the close pairs' indices."""
    rows_q = points[start:stop]
    if metric == "euclidean":
        gram = None  # r^2 = |q_i|^2 + |q_j|^2 - 2 g_ij straight out of one addmm
        r2 = torch.addmm(sq[None, :].expand(stop - start, -1), rows_q, points.T, beta=1.0, alpha=-2.0)  # (b, M)
        r2.add_(sq[start:stop, None])
    else:
        gram = rows_q @ points.T  # (b, M)
        r2 = sq[start:stop, None] + sq[None, :] - 2 * gram
    close_rows, close_cols = _fix_close_pairs(points, sq, r2, start, stop)
    if metric == "euclidean":
        values, deriv = _euclidean_values(r2, s, eps, with_grad)
    else:
        close = torch.zeros_like(r2, dtype=torch.bool)
        close[close_rows, close_cols] = True
        values, deriv = pair_values(r2, gram, close, s, metric, eps, with_grad)
    diag = torch.arange(stop - start, device=points.device)
    for t in (values, deriv):
        if t is not None:
            t[diag, diag + start] = 0
    return values, deriv, (close_rows, close_cols)


def block_sum(points: Tensor, sq: Tensor, start: int, stop: int, s: float, metric: str, eps: float) -> Tensor:
    """sum over j != i of f(q_i, q_j) for the rows i in start:stop, in float64 (``sq``: the squared norms)."""
    values, _, _ = _block(points, sq, start, stop, s, metric, eps, False)
    return values.sum(dtype=torch.float64)


def block_gradient(points: Tensor, sq: Tensor, start: int, stop: int, s: float, metric: str, eps: float) -> Tensor:
    """sum over j of D_ij (q_j - q_i) (euclidean) or D_ij q_j (angular) for the rows start:stop: the
    gradient of those rows up to the factor 2 c (module docstring), Tensor[stop - start, d]."""
    _, deriv, (rows, cols) = _block(points, sq, start, stop, s, metric, eps, True)
    d_close = deriv[rows, cols]  # Note [close pairs]: explicit differences, not the matmul
    deriv[rows, cols] = 0
    g = deriv @ points  # (b, d)
    if metric == "euclidean":
        g -= deriv.sum(1, keepdim=True) * points[start:stop]
    return g.index_add_(0, rows, d_close[:, None] * (points[cols] - points[start + rows]))


class TiledEnergy(torch.autograd.Function):
    """``TiledEnergy.apply(points, s, metric, eps, block)``: the pair-mean energy of ``points`` (Tensor[M, d])."""

    @staticmethod
    def forward(ctx, points: Tensor, s: float, metric: str, eps: float, block: int | None) -> Tensor:
        m = len(points)
        block = block or block_size(m)
        sq = (points * points).sum(1)
        total = torch.zeros((), dtype=torch.float64, device=points.device)
        for start in range(0, m, block):
            total += block_sum(points, sq, start, min(start + block, m), s, metric, eps)
        ctx.save_for_backward(points)
        ctx.params = (s, metric, eps, block)
        return (total / (m * (m - 1))).to(points.dtype)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        (points,) = ctx.saved_tensors
        s, metric, eps, block = ctx.params
        m = len(points)
        sq = (points * points).sum(1)
        # at least float32: in float16 the factor 2 / (M (M - 1)) underflows from M = 5,800 on
        scale = grad_output.to(torch.promote_types(grad_output.dtype, torch.float32)) * (2.0 / (m * (m - 1)))
        grad = torch.empty_like(points)
        for start in range(0, m, block):
            stop = min(start + block, m)
            grad[start:stop] = block_gradient(points, sq, start, stop, s, metric, eps).to(scale.dtype) * scale
        return grad, None, None, None, None


def tiled_energy(points: Tensor, s: float, metric: str, eps: float, block: int | None = None) -> Tensor:
    """Pair-mean energy of ``points`` without materialising the M x M matrix."""
    return TiledEnergy.apply(points, s, metric, eps, block)
