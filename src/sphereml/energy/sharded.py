"""The hyperspherical energy of neurons spread over several processes (``torch.distributed``).

A face-recognition classifier with millions of classes does not fit one device; each rank then holds a
block of its rows.  :func:`sharded_energy` gives every rank the energy of *all* the rows and, in the
backward pass, the gradient of that energy with respect to *its own* rows, so a model-parallel classifier
is regularised exactly as a single process would regularise it.

Note [sharded energy]
    The pair-mean energy is E = c * sum over ordered pairs i != j of f(q_i, q_j), c = 1 / (M (M - 1)).
    Rank r owns the rows R_r.  It gathers every rank's (detached) points and sums f over the pairs whose
    first index lies in R_r: the blocks of rows of :mod:`~sphereml.energy.tiled`, limited to R_r.  One
    all-reduce adds the ranks' partial sums, so every rank holds E.  Since f is symmetric, dE/dq_i =
    2 c * sum_j df(q_i, q_j)/dq_i is a sum over the pairs whose first index is i: rank r computes the
    gradient of its rows from its own blocks, with no communication in the backward pass.  Memory per
    rank: the gathered points (M x d) and one block of pair values, never M x M.  With ``half_space`` the
    virtual neurons -q_i of a rank's rows are that rank's rows too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .._checks import one_of, real_number
from ..geometry import normalize
from .tiled import block_gradient, block_size, block_sum

__all__ = ["sharded_energy"]


def _gather_rows(local: Tensor, group) -> tuple[Tensor, int]:
    """Every rank's rows (detached), in rank order, and the offset of this rank's rows; ranks may hold
    different numbers of rows."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros((), dtype=torch.long, device=local.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor(len(local), device=local.device), group=group)
    sizes = [int(n) for n in sizes]
    padded = local.detach().new_zeros((max(sizes),) + local.shape[1:])
    padded[: len(local)] = local.detach()
    chunks = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(chunks, padded, group=group)
    rank = dist.get_rank(group)
    return torch.cat([c[:n] for c, n in zip(chunks, sizes)]), sum(sizes[:rank])


class _ShardedEnergy(torch.autograd.Function):
    """``apply(local, points, ranges, s, metric, eps, group)``: E of ``points`` (Tensor[M, d]); ``local`` is
    points[ranges] (this rank's rows, live), and the gradient flows to it only (Note [sharded energy])."""

    @staticmethod
    def forward(ctx, local, points, ranges, s, metric, eps, group):
        m = len(points)
        sq = (points * points).sum(1)
        block = block_size(m)
        total = torch.zeros((), dtype=torch.float64, device=points.device)
        for start, stop in _blocks(ranges, block):
            total += block_sum(points, sq, start, stop, s, metric, eps)
        dist.all_reduce(total, group=group)
        ctx.save_for_backward(points)
        ctx.params = (ranges, s, metric, eps, block)
        return (total / (m * (m - 1))).to(points.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        (points,) = ctx.saved_tensors
        ranges, s, metric, eps, block = ctx.params
        m = len(points)
        sq = (points * points).sum(1)
        # at least float32: in float16 the factor 2 / (M (M - 1)) underflows from M = 5,800 on
        scale = grad_output.to(torch.promote_types(grad_output.dtype, torch.float32)) * (2.0 / (m * (m - 1)))
        grads = [(block_gradient(points, sq, start, stop, s, metric, eps).to(scale.dtype) * scale).to(points.dtype)
                 for start, stop in _blocks(ranges, block)]
        grad = torch.cat(grads) if grads else points[:0].clone()  # a rank may hold no rows
        return grad, None, None, None, None, None, None


def _blocks(ranges, block):
    for first, last in ranges:
        for start in range(first, last, block):
            yield start, min(start + block, last)


def sharded_energy(w_local: Tensor, s: float = 2.0, metric: str = "euclidean", half_space: bool = False,
                   eps: float = 1e-7, group=None) -> Tensor:
    """Pair-mean hyperspherical energy of the rows of all ranks' ``w_local`` (Note [sharded energy]).

    Equal to :func:`~sphereml.energy.hyperspherical_energy` of the rows of every rank stacked in rank order;
    its gradient reaches this rank's rows.  Every rank of ``group`` must call it (a collective), with the same
    arguments and rows of the same width: a rank whose arguments are refused raises alone, before the
    collectives, and leaves the others waiting in them.

    Args:
        w_local (Tensor[n_r, ...]): this rank's neurons, one per row (ranks may hold different numbers).
        s (float): Riesz exponent >= 0 (0: logarithmic energy). Default: 2.
        metric (str): ``"euclidean"`` or ``"angular"``. Default: ``"euclidean"``.
        half_space (bool): add the virtual neurons -w_hat_i (§5.3.4). Default: False.
        eps (float): floor on squared distances, in (0, 1). Default: 1e-7.
        group: the process group (default: the world).

    Returns:
        0-dim Tensor, the same on every rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sharded_energy needs an initialised torch.distributed process group")
    if not isinstance(w_local, Tensor) or w_local.dim() < 2 or not torch.is_floating_point(w_local):
        raise ValueError(f"w_local must be a floating Tensor[n, ...] with one neuron per row, "
                         f"got {getattr(w_local, 'shape', w_local)!r}")
    s = real_number("s", s, at_least=0.0)
    eps = real_number("eps", eps, above=0.0, below=1.0)
    one_of("metric", metric, ("euclidean", "angular"))
    local = normalize(w_local.flatten(1))
    rows, offset = _gather_rows(local, group)
    n = len(rows)
    if n < 2:
        raise ValueError(f"the energy needs at least 2 neurons over all ranks, got {n}")
    ranges = [(offset, offset + len(local))]
    if half_space:
        rows = torch.cat([rows, -rows])
        ranges.append((n + offset, n + offset + len(local)))
        local = torch.cat([local, -local])
    return _ShardedEnergy.apply(local, rows, ranges, float(s), metric, float(eps), group)
