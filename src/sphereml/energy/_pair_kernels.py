"""Triton kernels of :mod:`sphereml.energy.gram` on CUDA: a bucket's pair chain forward and backward, one pass each.

The batched energy (Note [batched energy] in :mod:`~sphereml.energy.batched`) evaluates every pair of a bucket of
Gram matrices GRAM (Tensor[B, N, N], float64) with element-wise PyTorch operations: some twenty forward and forty
backward, one launch each on a GPU.  These two kernels do the same arithmetic, in float64, in one pass each
(euclidean metric; the angular metric keeps the PyTorch chain):

* ``energy_kernel``: program (b, i) owns rows i * BM.. of set b: from the diagonal, v_i = 1 / sqrt(max(g_ii,
  1e-24)) and u_i = g_ii v_i^2; over the column tiles, c_ij = g_ij v_i v_j, r^2 = u_i + u_j -+ 2 c_ij, and the
  weighted values MINUS_ij f(r^2_-) + PLUS_ij f(r^2_+); one partial sum per program (deterministic).
* ``gradient_kernel``: the same programs, two sweeps over the columns: the first sums, per row, K_ij c_ij and the
  slopes (Note [the gradient of the batched energy] in :mod:`~sphereml.energy.gram`), the second writes
  dE/dg_ij = K_ij v_i v_j with the diagonal term added where j = i; K carries the incoming gradient GRAD_b.

f is :func:`~sphereml.energy._triton_kernels.riesz` (its fast paths for s = 0, 1, 2), floored at r^2 = eps with a
zero slope below it, as in every backend.  s, eps and the norm floor 1e-24 are read from PARAMS (Tensor[3], float64):
a Python float argument would reach a compiled kernel as a float32.
"""

import triton
import triton.language as tl

from ._triton_kernels import riesz
from .triton_backend import interpreting

__all__ = ["PAIR_BLOCKS", "energy_kernel", "gradient_kernel"]

# (rows, columns, warps).  Four elements a thread, 146-148 registers, no spills under Triton 3.6 or 3.9 for sm_90a;
# (32, 32, 8) spilled 4 bytes under 3.6 (the energy without half-space weights at s = 0), found on an H100
PAIR_BLOCKS = (16, 16, 1) if interpreting() else (32, 16, 4)


@triton.jit
def _row_terms(GRAM, base, idx, mask, N, floor):
    """v = 1 / sqrt(max(g_ii, floor)) and u = g_ii v^2 for the indices ``idx`` of one set (floor = 1e-24)."""
    diag = tl.load(GRAM + base + idx.to(tl.int64) * (N + 1), mask=mask, other=0.0)
    v = 1.0 / tl.sqrt(tl.maximum(diag, floor))
    return diag, v, diag * v * v


@triton.jit
def _tile(GRAM, MINUS, PLUS, base, rows, cols, rmask, N, v_r, u_r, s, eps, floor, HAS_PLUS: tl.constexpr,
          POWER: tl.constexpr):
    """For one (BM, BN) tile: (weighted values, slopes a = MINUS f'(r^2_-), b = PLUS f'(r^2_+), cosines, v_j)."""
    cmask = cols < N
    inside = rmask[:, None] & cmask[None, :]
    offsets = base + rows[:, None].to(tl.int64) * N + cols[None, :]
    g = tl.load(GRAM + offsets, mask=inside, other=0.0)
    _, v_c, u_c = _row_terms(GRAM, base, cols, cmask, N, floor)
    cos = g * v_r[:, None] * v_c[None, :]
    pair_base = u_r[:, None] + u_c[None, :]
    minus = tl.load(MINUS + offsets, mask=inside, other=0.0)
    val, deriv = riesz(pair_base - 2.0 * cos, s, eps, POWER)  # deriv = -2 df/dr^2
    values, a = minus * val, -0.5 * minus * deriv
    b = tl.zeros_like(a)
    if HAS_PLUS:
        plus = tl.load(PLUS + offsets, mask=inside, other=0.0)
        val_p, deriv_p = riesz(pair_base + 2.0 * cos, s, eps, POWER)
        values += plus * val_p
        b = -0.5 * plus * deriv_p
    return values, a, b, cos, v_c, offsets, inside


@triton.jit
def _program(PARAMS, N, BM: tl.constexpr):
    """(s, eps, the norm floor; the program's set b, its row block, the set's offset, its rows and their mask)."""
    b, block = tl.program_id(0), tl.program_id(1)
    rows = block * BM + tl.arange(0, BM)
    return (tl.load(PARAMS), tl.load(PARAMS + 1), tl.load(PARAMS + 2), b, block, b.to(tl.int64) * N * N, rows,
            rows < N)


@triton.jit
def energy_kernel(GRAM, MINUS, PLUS, PARAMS, PARTIAL, N, n_blocks, HAS_PLUS: tl.constexpr, POWER: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
    """PARTIAL[b, i] = sum over rows i * BM.. and all columns of the weighted pair values of set b."""
    s, eps, floor, b, block, base, rows, rmask = _program(PARAMS, N, BM)
    _, v_r, u_r = _row_terms(GRAM, base, rows, rmask, N, floor)
    acc = tl.zeros((BM,), tl.float64)
    for col0 in range(0, N, BN):
        cols = col0 + tl.arange(0, BN)
        tile = _tile(GRAM, MINUS, PLUS, base, rows, cols, rmask, N, v_r, u_r, s, eps, floor, HAS_PLUS,
                     POWER)
        acc += tl.sum(tile[0], axis=1)
    tl.store(PARTIAL + b.to(tl.int64) * n_blocks + block, tl.sum(acc, axis=0))


@triton.jit
def gradient_kernel(GRAM, MINUS, PLUS, PARAMS, GRAD, OUT, N, HAS_PLUS: tl.constexpr, POWER: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
    """OUT[b] = dE_b/dGRAM[b] * GRAD[b] for rows i * BM.. (Note [the gradient of the batched energy])."""
    s, eps, floor, b, block, base, rows, rmask = _program(PARAMS, N, BM)
    grad = tl.load(GRAD + b)
    diag, v_r, u_r = _row_terms(GRAM, base, rows, rmask, N, floor)
    k_cos = tl.zeros((BM,), tl.float64)
    slopes = tl.zeros((BM,), tl.float64)
    for col0 in range(0, N, BN):  # first sweep: the row sums the diagonal needs
        cols = col0 + tl.arange(0, BN)
        tile = _tile(GRAM, MINUS, PLUS, base, rows, cols, rmask, N, v_r, u_r, s, eps, floor, HAS_PLUS,
                     POWER)
        a, bb, cos = tile[1], tile[2], tile[3]
        k = (2.0 * bb - 2.0 * a) * grad
        k_cos += tl.sum(k * cos, axis=1)
        slopes += tl.sum(a + bb, axis=1)
    floored = diag <= floor
    diagonal = tl.where(floored, 2.0 * slopes * grad * v_r * v_r, -k_cos * v_r * v_r)
    for col0 in range(0, N, BN):  # second sweep: dE/dg_ij, the diagonal term where j = i
        cols = col0 + tl.arange(0, BN)
        tile = _tile(GRAM, MINUS, PLUS, base, rows, cols, rmask, N, v_r, u_r, s, eps, floor, HAS_PLUS,
                     POWER)
        a, bb, v_c, offsets, inside = tile[1], tile[2], tile[4], tile[5], tile[6]
        out = (2.0 * bb - 2.0 * a) * grad * v_r[:, None] * v_c[None, :]
        out = tl.where(rows[:, None] == cols[None, :], out + diagonal[:, None], out)
        tl.store(OUT + offsets, out, mask=inside)
