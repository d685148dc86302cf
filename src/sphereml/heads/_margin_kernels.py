"""The Triton kernels of :mod:`sphereml.heads.margin_ce` (imported on first use, like the energy's kernels).

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted
(``TRITON_INTERPRET=1``), hence a module of its own, imported only once a kernel is needed.

Layout: RAW (Tensor[B, C], the product x W^T in any float dtype, rows of ``stride`` elements), INV
(Tensor[C], float32, 1 / max(||W_j||, eps), read only when ``HAS_INV``), LABELS (Tensor[B], int64).
The logit is z_bj = RAW_bj * INV_j.  The label column is left out of the log-sum-exp (the caller adds the
target logit, an O(B) term) and its raw value is returned instead.  All arithmetic is float32 but the norms'.

* ``norm_kernel``: ||W_j|| for BR rows of W (Tensor[C, d]) in one pass, the squares summed in float64 (no
  overflow or underflow for any float32 or bfloat16 row).
* ``lse_kernel``: program (i, k) owns rows i * BM.. and the k-th chunk of ``chunk`` columns; it streams
  BN-wide tiles with the online max / sum of exponentials and writes one (max, sum) pair per row and
  chunk, the raw label value of the rows whose label lies in its chunk and, with ``WRITE_LOGITS``, the
  logits themselves (so returning them costs one write, not another pass).  Splitting the columns keeps
  every SM busy when B is small and C large (B = 512, C = 100,000).
* ``combine_kernel``: the chunks' (max, sum) pairs of BM rows into each row's log-sum-exp.
* ``grad_kernel``: program (i, j) owns one (BM, BN) tile: p = exp(z - lse) times the row's ``ROW_SCALE``
  (dL/dlse, read from device memory: no host copy), on the label column ``LABEL_GRAD`` (dL/dz_by) instead,
  written as g' = p * INV (the gradient of RAW); with ``HAS_INV`` also the tile's column sums of
  g' * RAW (the norm term of dL/dW), one row of partial sums per row block (no atomics: deterministic).
"""

import triton
import triton.language as tl

from ..energy.triton_backend import interpreting

__all__ = ["NORM_BLOCKS", "LSE_BLOCKS", "COMBINE_BLOCKS", "GRAD_BLOCKS", "norm_kernel", "lse_kernel",
           "combine_kernel", "grad_kernel"]

# (rows, columns, warps): small under the interpreter (each tile is numpy work there), Hopper-sized on a GPU, chosen
# by registers compiled for sm_90a (benchmarks.bench_margins.compile_check; lse 72-122, grad 92-102, no spills),
# not yet timed on one
NORM_BLOCKS = (4, 32, 4) if interpreting() else (8, 128, 4)
LSE_BLOCKS = (16, 32, 4) if interpreting() else (8, 256, 4)
COMBINE_BLOCKS = (16, 16, 4) if interpreting() else (64, 32, 4)
GRAD_BLOCKS = (16, 32, 4) if interpreting() else (32, 128, 8)


@triton.jit
def norm_kernel(W, NORM_OUT, C, d, stride, BR: tl.constexpr, BD: tl.constexpr):
    """||W_j|| for rows j = program * BR.., squares summed in float64, written as float32."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < C
    acc = tl.zeros((BR,), tl.float64)
    for k0 in range(0, d, BD):
        cols = k0 + tl.arange(0, BD)
        w = tl.load(W + rows[:, None].to(tl.int64) * stride + cols[None, :],
                    mask=rmask[:, None] & (cols[None, :] < d), other=0.0).to(tl.float64)
        acc += tl.sum(w * w, axis=1)
    tl.store(NORM_OUT + rows, tl.sqrt(acc).to(tl.float32), mask=rmask)


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
def lse_kernel(RAW, INV, LABELS, MAX_OUT, SUM_OUT, RAWY_OUT, LOGITS_OUT, B, C, stride, chunk, n_chunks,
               HAS_INV: tl.constexpr, WRITE_LOGITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Per row and column chunk: m = max_j z_bj and l = sum_j exp(z_bj - m) over the chunk, label left out;
    the label's raw value where it lies in the chunk; the logits with ``WRITE_LOGITS``."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < B
    start = tl.program_id(1) * chunk
    m = tl.full((BM,), -1.0e30, tl.float32)  # not -inf: exp(m_old - m_new) is never nan
    l = tl.zeros((BM,), tl.float32)
    raw_y = tl.zeros((BM,), tl.float32)
    for col0 in range(start, start + chunk, BN):
        cols = col0 + tl.arange(0, BN)
        raw, z, is_label, inside = _tile_logits(RAW, INV, LABELS, rows, cols, rmask, B, C, stride, HAS_INV)
        if WRITE_LOGITS:
            tl.store(LOGITS_OUT + rows[:, None].to(tl.int64) * C + cols[None, :],
                     z.to(LOGITS_OUT.dtype.element_ty), mask=inside)
        raw_y += tl.sum(tl.where(is_label & inside, raw, 0.0), axis=1)
        z = tl.where(inside & ~is_label, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
    out = rows.to(tl.int64) * n_chunks + tl.program_id(1)
    tl.store(MAX_OUT + out, m, mask=rmask)
    tl.store(SUM_OUT + out, l, mask=rmask)
    labels = tl.load(LABELS + rows, mask=rmask, other=-1)
    tl.store(RAWY_OUT + rows, raw_y, mask=rmask & (labels >= start) & (labels < start + chunk))


@triton.jit
def combine_kernel(MAX_IN, SUM_IN, LSE_OUT, B, n_chunks, BM: tl.constexpr, BK: tl.constexpr):
    """lse_b = M + log(sum_k l_bk exp(m_bk - M)) over the chunks k of each row (M the largest m_bk)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < B
    m = tl.full((BM,), -1.0e30, tl.float32)
    total = tl.zeros((BM,), tl.float32)
    for k0 in range(0, n_chunks, BK):
        ks = k0 + tl.arange(0, BK)
        inside = rmask[:, None] & (ks[None, :] < n_chunks)
        offsets = rows[:, None].to(tl.int64) * n_chunks + ks[None, :]
        mk = tl.load(MAX_IN + offsets, mask=inside, other=-1.0e30)
        lk = tl.load(SUM_IN + offsets, mask=inside, other=0.0)
        m_new = tl.maximum(m, tl.max(mk, axis=1))
        total = total * tl.exp(m - m_new) + tl.sum(lk * tl.exp(mk - m_new[:, None]), axis=1)
        m = m_new
    total = tl.where(rmask, total, 1.0)  # padding rows: no log(0) warnings under the interpreter
    tl.store(LSE_OUT + rows, m + tl.log(total), mask=rmask)  # log(0) = -inf: a row with no other column


@triton.jit
def grad_kernel(RAW, INV, LABELS, LSE, ROW_SCALE, LABEL_GRAD, GRAD_OUT, COLSUM_OUT, B, C, stride,
                HAS_INV: tl.constexpr, HAS_LABEL_GRAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """g' = (softmax(z) * ROW_SCALE, LABEL_GRAD on the label column) * INV on one tile, and its column sums of
    g' * RAW."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < B
    raw, z, is_label, inside = _tile_logits(RAW, INV, LABELS, rows, cols, rmask, B, C, stride, HAS_INV)
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    scale = tl.load(ROW_SCALE + rows, mask=rmask, other=0.0)
    p = tl.where(inside & ~is_label, tl.exp(z - lse[:, None]), 0.0) * scale[:, None]
    if HAS_LABEL_GRAD:
        label_grad = tl.load(LABEL_GRAD + rows, mask=rmask, other=0.0)
        p = tl.where(is_label & inside, label_grad[:, None], p)
    if HAS_INV:
        inv = tl.load(INV + cols, mask=cols < C, other=0.0)
        g = p * inv[None, :]
        colsum = tl.sum(g * raw, axis=0)
        tl.store(COLSUM_OUT + tl.program_id(0).to(tl.int64) * C + cols, colsum, mask=cols < C)
    else:
        g = p
    offsets = rows[:, None].to(tl.int64) * C + cols[None, :]
    tl.store(GRAD_OUT + offsets, g.to(GRAD_OUT.dtype.element_ty), mask=inside)
