"""The Triton kernels of :mod:`sphereml.heads.margin_ce` (imported on first use, like the energy's kernels).

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted
(``TRITON_INTERPRET=1``), hence a module of its own, imported only once a kernel is needed.

Layout: RAW (Tensor[B, C], the product x W^T in any float dtype, rows of ``stride`` elements), INV
(Tensor[C], float32, 1 / max(||W_j||, eps), read only when ``HAS_INV``), LABELS (Tensor[B], int64).
The logit is z_bj = RAW_bj * INV_j; the label column is left out of both passes (the caller adds the
target logit, an O(B) term).  All arithmetic is float32.

* ``lse_kernel``: program (i, k) owns rows i * BM.. and the k-th chunk of ``chunk`` columns; it streams
  BN-wide tiles with the online max / sum of exponentials and writes one (max, sum) pair per row and
  chunk.  Splitting the columns keeps every SM busy when B is small and C large (B = 512, C = 100,000).
* ``grad_kernel``: program (i, j) owns one (BM, BN) tile: p = exp(z - lse) with the label column set to
  0, times the scalar ``SCALE`` (dL/dloss / B, read from device memory: no host copy), written as
  g' = p * scale * INV (the gradient of RAW); with ``HAS_INV`` also the tile's column sums of
  g' * RAW (the norm term of dL/dW), one row of partial sums per row block (no atomics: deterministic).
"""

import triton
import triton.language as tl

from ..energy.triton_backend import interpreting

__all__ = ["LSE_BLOCKS", "GRAD_BLOCKS", "lse_kernel", "grad_kernel"]

# (BM, BN, warps): small under the interpreter (each tile is numpy work there), Hopper-sized on a GPU
LSE_BLOCKS = (16, 32, 4) if interpreting() else (16, 256, 4)
GRAD_BLOCKS = (16, 32, 4) if interpreting() else (32, 128, 4)

@triton.jit
def _tile_logits(RAW, INV, LABELS, rows, cols, rmask, B, C, stride, HAS_INV: tl.constexpr):
    """z for a (BM, BN) tile, its labels' column flags, and the in-range mask."""
    inside = rmask[:, None] & (cols[None, :] < C)
    raw = tl.load(RAW + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    if HAS_INV:
        inv = tl.load(INV + cols, mask=cols < C, other=0.0)
        z = raw * inv[None, :]
    else:
        z = raw
    labels = tl.load(LABELS + rows, mask=rmask, other=-1)
    is_label = cols[None, :] == labels[:, None]
    return raw, z, is_label, inside


@triton.jit
def lse_kernel(RAW, INV, LABELS, MAX_OUT, SUM_OUT, B, C, stride, chunk, n_chunks,
               HAS_INV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Per row and column chunk: m = max_j z_bj and l = sum_j exp(z_bj - m) over the chunk, label left out."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < B
    start = tl.program_id(1) * chunk
    m = tl.full((BM,), -1.0e30, tl.float32)  # not -inf: exp(m_old - m_new) is never nan
    l = tl.zeros((BM,), tl.float32)
    for col0 in range(start, start + chunk, BN):
        cols = col0 + tl.arange(0, BN)
        _, z, is_label, inside = _tile_logits(RAW, INV, LABELS, rows, cols, rmask, B, C, stride, HAS_INV)
        z = tl.where(inside & ~is_label, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
    out = rows.to(tl.int64) * n_chunks + tl.program_id(1)
    tl.store(MAX_OUT + out, m, mask=rmask)
    tl.store(SUM_OUT + out, l, mask=rmask)


@triton.jit
def grad_kernel(RAW, INV, LABELS, LSE, SCALE, GRAD_OUT, COLSUM_OUT, B, C, stride,
                HAS_INV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """g' = softmax(z) * SCALE * INV on one tile (0 on the label column) and its column sums of g' * RAW."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < B
    raw, z, is_label, inside = _tile_logits(RAW, INV, LABELS, rows, cols, rmask, B, C, stride, HAS_INV)
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    scale = tl.load(SCALE)
    p = tl.where(inside & ~is_label, tl.exp(z - lse[:, None]), 0.0) * scale
    if HAS_INV:
        inv = tl.load(INV + cols, mask=cols < C, other=0.0)
        g = p * inv[None, :]
        colsum = tl.sum(g * raw, axis=0)
        tl.store(COLSUM_OUT + tl.program_id(0).to(tl.int64) * C + cols, colsum, mask=cols < C)
    else:
        g = p
    offsets = rows[:, None].to(tl.int64) * C + cols[None, :]
    tl.store(GRAD_OUT + offsets, g.to(GRAD_OUT.dtype.element_ty), mask=inside)
