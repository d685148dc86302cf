"""Euclidean energy from two cuBLAS products per block of rows and one Triton kernel between them.

For a block of b rows of the points Q (Tensor[M, d]):

1. G = Q_b Q^T (cuBLAS, Tensor[b, M]), at the precision of ``torch.get_float32_matmul_precision()``;
2. one Triton kernel (:mod:`sphereml.energy._gemm_kernels`) reads G once: r^2 = ||q_i||^2 + ||q_j||^2 - 2 g_ij, the
   pair values f(r^2) summed per row, and, when a gradient is wanted, D_ij = df/dg_ij of the far pairs written
   over G, their row sums, and one flag per tile that holds a close pair;
3. the rows' gradient sum_j D_ij (q_j - q_i) = (D Q)_i - (sum_j D_ij) q_i (cuBLAS, Tensor[b, d]), to which a second
   small kernel adds the close pairs of the flagged tiles from explicit differences (Note [close pairs] in
   :mod:`~sphereml.energy.kernels`).

The gradient is computed in the forward pass, when autograd will ask for one, and kept (Tensor[M, d]) for the
backward, which only scales it: the work is two Gram-sized products, where a separate backward would form the
Gram matrix again.  Nothing reads the device on the host (no ``nonzero``, no data-dependent shapes): the blocks,
tiles and launches follow from the shapes alone.

Note [energy by cuBLAS products]
    The fused kernels of :mod:`~sphereml.energy.triton_backend` do every product themselves with ``tl.dot``.  At
    N = 32,768, d = 512 (TF32) they took 12x the time of three cuBLAS Gram products on an H200
    (``benchmarks/results/logs/gpu-check-3-h200.txt``), their backward (about 107 ms) far longer than their
    forward (6 ms).  Why has not been profiled; the kernel's own structure suggests causes: the backward forms
    the Gram tiles again d / BDO times (an accumulator of all d = 512 columns for a tile of rows would not fit in
    registers) on small tiles.  Here both products are cuBLAS's, each the size of one Gram product, and the pair
    kernel between them moves 8 bytes per ordered pair (it reads G and writes D over it; 4 bytes without a
    gradient), 8.6 GB at N = 32,768.  Expected time from these two facts alone: two thirds of three Gram
    products plus that traffic at the memory's bandwidth.  At N = 2^20 a block has only 256 rows, and the second
    product (256 x 2^20 by 2^20 x 512) is a shape cuBLAS runs less well.  Not yet measured on a GPU: ``python -m
    benchmarks energy`` times it beside the fused kernels and the three Gram products.  The price is memory:
    one (b, M) block, ``BLOCK_BUDGET`` numbers, besides O(M d).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import integer
from .._custom_ops import custom_op
from .kernels import CLOSE_R2
from .triton_backend import cdiv, lazy_module, next_power_of_2, power_path

__all__ = ["BLOCK_BUDGET", "block_rows", "GemmEnergy", "gemm_energy"]

#: Numbers in one (b, M) Gram block: 1 GiB of float32.
BLOCK_BUDGET = 2**28


def block_rows(m: int, budget: int = BLOCK_BUDGET) -> int:
    """Rows per block so that one (rows, m) block holds at most ``budget`` numbers (at least one row)."""
    return max(1, min(m, budget // max(m, 1)))


_kernels = lazy_module("sphereml.energy._gemm_kernels")


@custom_op("sphereml::energy_pair_sums", mutates_args=("gram",))
def energy_pair_sums(gram: Tensor, q: Tensor, sq: Tensor, start: int, s: float, eps: float,
                     with_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(values, dsum: Tensor[b, tiles], flags: Tensor[b / BM, tiles], int32) of the Gram block ``gram`` of rows
    start ... start + b - 1; with ``with_grad`` the far pairs' D written over ``gram`` (``pair_kernel``)."""
    kernels = _kernels()
    (m, d), b = q.shape, len(gram)
    bm, bn, warps = kernels.PAIR_BLOCKS
    row_tiles, tiles = cdiv(b, bm), cdiv(m, bn)
    values = q.new_empty(b, tiles)
    dsum = q.new_empty(b, tiles if with_grad else 0)
    flags = q.new_empty(row_tiles, tiles if with_grad else 0, dtype=torch.int32)
    kernels.pair_kernel[(row_tiles * tiles,)](
        gram, q, sq, values, dsum if with_grad else values, flags if with_grad else values, start, b, m, d,
        q.stride(0), gram.stride(0), tiles, s, eps, CLOSE_R2, POWER=power_path(s), WITH_GRAD=with_grad, BM=bm, BN=bn,
        num_warps=warps, num_stages=1)
    return values, dsum, flags


@energy_pair_sums.register_fake
def _(gram, q, sq, start, s, eps, with_grad):
    bm, bn, _ = _kernels().PAIR_BLOCKS
    b, tiles = len(gram), cdiv(len(q), bn)
    return (q.new_empty(b, tiles), q.new_empty(b, tiles if with_grad else 0),
            q.new_empty(cdiv(b, bm), tiles if with_grad else 0, dtype=torch.int32))


@custom_op("sphereml::energy_close_gradient", mutates_args=("rows",))
def energy_close_gradient(rows: Tensor, q: Tensor, sq: Tensor, flags: Tensor, start: int, s: float, eps: float) -> None:
    """Adds the close pairs of the flagged tiles to ``rows``, the gradient of rows start ... start + b - 1
    (``close_gradient_kernel``)."""
    kernels = _kernels()
    (m, d), b = q.shape, len(rows)
    bm, bn, _ = kernels.PAIR_BLOCKS
    largest, fb, warps = kernels.CLOSE_BLOCKS
    bdo = min(largest, max(16, next_power_of_2(d)))  # d-slices no wider than d needs
    kernels.close_gradient_kernel[(cdiv(b, bm), cdiv(d, bdo))](
        q, sq, flags, rows, start, b, m, d, q.stride(0), rows.stride(0), flags.shape[1], s, eps, CLOSE_R2,
        POWER=power_path(s), BM=bm, BN=bn, BDO=bdo, FB=fb, num_warps=warps, num_stages=1)


@energy_close_gradient.register_fake
def _(rows, q, sq, flags, start, s, eps):
    return None


def _block(q: Tensor, sq: Tensor, start: int, stop: int, buffer: Tensor, s: float, eps: float,
           grad: Tensor | None) -> Tensor:
    """The sum over the rows start:stop of f over their pairs (0-d float64); with ``grad``, those rows of the
    gradient sum_j D_ij (q_j - q_i) written into it.  Two cuBLAS products and the two kernels' custom operators."""
    gram = torch.mm(q[start:stop], q.T, out=buffer[:stop - start])  # (b, M)
    values, dsum, flags = energy_pair_sums(gram, q, sq, start, float(s), float(eps), grad is not None)
    if grad is not None:
        rows = torch.mm(gram, q, out=grad[start:stop])  # (D Q)_i of the far pairs: (b, d)
        rows.addcmul_(dsum.sum(1, keepdim=True), q[start:stop], value=-1.0)
        energy_close_gradient(rows, q, sq, flags, start, float(s), float(eps))
    return values.sum(dtype=torch.float64)


class GemmEnergy(torch.autograd.Function):
    """``GemmEnergy.apply(points, s, eps, block, with_grad)``: the Euclidean pair-mean energy of ``points``
    (Tensor[M, d]) by cuBLAS products and the Triton pair kernels (float32 arithmetic); ``block``: rows per Gram
    block; ``with_grad``: form the gradient in the forward pass (:func:`gemm_energy` decides)."""

    @staticmethod
    def forward(ctx, points: Tensor, s: float, eps: float, block: int, with_grad: bool) -> Tensor:
        q = points.detach().float().contiguous()  # (M, d)
        m = len(q)
        sq = (q * q).sum(1)  # (M,)
        buffer = q.new_empty(min(block, m), m)
        grad = torch.empty_like(q) if with_grad else None
        total = torch.zeros((), dtype=torch.float64, device=q.device)
        for start in range(0, m, block):
            total += _block(q, sq, start, min(start + block, m), buffer, s, eps, grad)
        if grad is not None:
            ctx.save_for_backward(grad)
        ctx.scale, ctx.dtype = 2.0 / (m * (m - 1)), points.dtype
        return (total / (m * (m - 1))).to(points.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: Tensor):
        (grad,) = ctx.saved_tensors
        # the factor in float32: 2 / (M (M - 1)) is below float16's smallest number from M = 5,800 on
        return (grad * (grad_output.float() * ctx.scale)).to(ctx.dtype), None, None, None, None


def gemm_energy(points: Tensor, s: float, eps: float, block: int | None = None) -> Tensor:
    """Pair-mean Euclidean energy of ``points`` (Tensor[M >= 2, d], float32 or half), two cuBLAS products per block
    of ``block`` rows (default :func:`block_rows`) with the Triton pair kernels between them.  The gradient is
    formed in the forward pass only when autograd will ask for it (``points`` requires it, grad mode on)."""
    if not isinstance(points, Tensor) or points.dim() != 2 or len(points) < 2:
        raise ValueError(f"points must be a Tensor[M >= 2, d], got {getattr(points, 'shape', points)!r}")
    block = block_rows(len(points)) if block is None else integer("block", block, at_least=1)
    with_grad = torch.is_grad_enabled() and points.requires_grad
    return GemmEnergy.apply(points, s, eps, block, with_grad)
