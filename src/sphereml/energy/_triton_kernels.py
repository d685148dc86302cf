"""The Triton kernels of :mod:`sphereml.energy.triton_backend` (imported on first use).

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted
(``TRITON_INTERPRET=1``), and jitted helpers must be module globals, hence this module.
"""

import triton
import triton.language as tl


@triton.jit
def gram_tile(Q, rows, cols, rmask, cmask, D, stride, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, D, BD):
        ks = k + tl.arange(0, BD)
        kmask = ks < D
        a = tl.load(Q + rows[:, None] * stride + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(Q + cols[:, None] * stride + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(b), input_precision="ieee")
    return acc


@triton.jit
def riesz(g, sq_r, sq_c, s, eps, LOG: tl.constexpr):
    raw = sq_r[:, None] + sq_c[None, :] - 2.0 * g
    above = raw > eps
    r2 = tl.where(above, raw, eps)
    if LOG:
        val = -0.5 * tl.log(r2)
        d_r2 = -0.5 / r2
    else:
        val = tl.exp(-0.5 * s * tl.log(r2))
        d_r2 = -0.5 * s * val / r2
    return val, tl.where(above, -2.0 * d_r2, 0.0)


@triton.jit
def pair_tile(Q, SQ, rows, rmask, sq_r, start, M, D, stride, s, eps, LOG: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """Values and derivatives of one (BM, BN) tile of pairs, zero on i == j and outside the matrix."""
    cols = start + tl.arange(0, BN)
    cmask = cols < M
    sq_c = tl.load(SQ + cols, mask=cmask, other=0.0)
    val, deriv = riesz(gram_tile(Q, rows, cols, rmask, cmask, D, stride, BM, BN, BD), sq_r, sq_c, s, eps, LOG)
    keep = rmask[:, None] & cmask[None, :] & (rows[:, None] != cols[None, :])
    return tl.where(keep, val, 0.0), tl.where(keep, deriv, 0.0), cols, cmask


@triton.jit
def forward_kernel(Q, SQ, OUT, M, D, stride, s, eps, LOG: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    sq_r = tl.load(SQ + rows, mask=rmask, other=0.0)
    total = tl.zeros((BM,), dtype=tl.float32)
    for start in range(0, M, BN):
        val, _, _, _ = pair_tile(Q, SQ, rows, rmask, sq_r, start, M, D, stride, s, eps, LOG, BM, BN, BD)
        total += tl.sum(val, axis=1)
    tl.store(OUT + rows, total, mask=rmask)


@triton.jit
def backward_kernel(Q, SQ, GRAD, M, D, stride, s, eps, LOG: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDO: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    dims = tl.program_id(1) * BDO + tl.arange(0, BDO)
    dmask = dims < D
    sq_r = tl.load(SQ + rows, mask=rmask, other=0.0)
    acc = tl.zeros((BM, BDO), dtype=tl.float32)
    rowsum = tl.zeros((BM,), dtype=tl.float32)
    for start in range(0, M, BN):
        _, deriv, cols, cmask = pair_tile(Q, SQ, rows, rmask, sq_r, start, M, D, stride, s, eps, LOG, BM, BN, BD)
        q_cols = tl.load(Q + cols[:, None] * stride + dims[None, :], mask=cmask[:, None] & dmask[None, :], other=0.0)
        acc += tl.dot(deriv, q_cols, input_precision="ieee")
        rowsum += tl.sum(deriv, axis=1)
    q_rows = tl.load(Q + rows[:, None] * stride + dims[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    grad = acc - rowsum[:, None] * q_rows
    tl.store(GRAD + rows[:, None] * stride + dims[None, :], grad, mask=rmask[:, None] & dmask[None, :])
