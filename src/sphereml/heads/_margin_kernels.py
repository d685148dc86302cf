"""The Triton kernels of :mod:`sphereml.heads.margin_ce` (imported on first use, like the energy's kernels).

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted
(``TRITON_INTERPRET=1``), hence a module of its own, imported only once a kernel is needed.

Layout: RAW (Tensor[B, C], the product x W^T in any float dtype, rows of ``stride`` elements), INV
(Tensor[C], float32, 1 / max(||W_j||, eps), read only when ``HAS_INV``), LABELS (Tensor[B], int64).
The logit is z_bj = RAW_bj * INV_j.  The label column is left out of the log-sum-exp (the caller adds the
target logit, an O(B) term) and its raw value is returned instead.  All arithmetic is float32 but the norms'.

* ``norm_kernel``: ||W_j||, 1 / max(||W_j||, eps) and its derivative's factor for BR rows of W (Tensor[C, d], or
  the features) in one pass, the squares summed in float64 (no overflow or underflow for any float32 or bfloat16
  row).
* ``lse_kernel``: program (i, k) owns rows i * BM.. and the k-th chunk of ``chunk`` columns; it streams
  BN-wide tiles with the online max / sum of exponentials and writes one (max, sum) pair per row and
  chunk, the raw label value of the rows whose label lies in its chunk (NaN for a label outside [0, C), from the
  first chunk: a GPU's labels are not read on the host, so the loss and its gradients turn NaN instead) and, with
  ``WRITE_LOGITS``, the logits themselves (so returning them costs one write, not another pass).  Splitting the
  columns keeps every SM busy when B is small and C large (B = 512, C = 100,000).
* ``combine_kernel``: the chunks' (max, sum) pairs of BM rows into each row's log-sum-exp.
* ``grad_kernel``: program (i, j) owns one (BM, BN) tile: p = exp(z - lse) times the row's ``ROW_SCALE``
  (dL/dlse, read from device memory: no host copy), on the label column ``LABEL_GRAD`` (dL/dz_by) instead,
  written as g' = p * INV (the gradient of RAW), times the loss's incoming gradient SCALE with ``HAS_SCALE``; with
  ``HAS_INV`` also the tile's column sums of g' * z (the norm term of dL/dW), one row of partial sums per row
  block (no atomics: deterministic).
* ``tail_kernel``: one program over the B rows: each row's target logit (a margin head's O(B) part, Note [tail
  derivatives] in :mod:`sphereml.heads.margin_tail`), the mean loss and its derivatives, in one launch.
"""

import triton
import triton.language as tl

from ..energy.triton_backend import interpreting
from ..layers._patch_kernels import arccos

__all__ = ["NORM_BLOCKS", "LSE_BLOCKS", "COMBINE_BLOCKS", "GRAD_BLOCKS", "TAIL_BLOCKS", "norm_kernel", "lse_kernel",
           "combine_kernel", "grad_kernel", "tail_kernel"]

# (rows, columns, warps): small under the interpreter (each tile is numpy work there), Hopper-sized on a GPU, chosen
# by registers compiled for sm_90a (benchmarks.bench_margins.compile_check; norm 56, lse 91-122, grad 77-123,
# combine 113, tail 56-96, no spills), not yet timed on one
NORM_BLOCKS = (4, 32, 4) if interpreting() else (8, 128, 4)
LSE_BLOCKS = (16, 32, 4) if interpreting() else (8, 256, 4)
COMBINE_BLOCKS = (16, 16, 4) if interpreting() else (64, 32, 4)
GRAD_BLOCKS = (16, 32, 4) if interpreting() else (32, 128, 8)
TAIL_BLOCKS = (16, 1) if interpreting() else (1024, 4)  # (rows per iteration, warps) of the one tail program


@triton.jit
def norm_kernel(W, NORM_OUT, INV_OUT, DINV_OUT, C, d, stride, eps, BR: tl.constexpr, BD: tl.constexpr):
    """For rows j = program * BR..: ||W_j|| (squares summed in float64), inv_j = 1 / max(||W_j||, eps) (0 for a
    zero row when eps = 0) and dinv_j = -inv_j where ||W_j|| >= eps (0 elsewhere), written as float32."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < C
    acc = tl.zeros((BR,), tl.float64)
    for k0 in range(0, d, BD):
        cols = k0 + tl.arange(0, BD)
        w = tl.load(W + rows[:, None].to(tl.int64) * stride + cols[None, :],
                    mask=rmask[:, None] & (cols[None, :] < d), other=0.0).to(tl.float64)
        acc += tl.sum(w * w, axis=1)
    norm = tl.sqrt(acc)
    floor = tl.maximum(norm, eps)
    inv = tl.minimum(tl.where(floor > 0, 1.0 / tl.where(floor > 0, floor, 1.0), 0.0), 3.0e38)  # finite in float32
    tl.store(NORM_OUT + rows, norm.to(tl.float32), mask=rmask)
    tl.store(INV_OUT + rows, inv.to(tl.float32), mask=rmask)
    tl.store(DINV_OUT + rows, tl.where((norm >= eps) & (norm > 0), -inv, 0.0).to(tl.float32), mask=rmask)


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
    unknown = (labels < 0) | (labels >= C)  # no column of its own: NaN, so the loss says so (no host read)
    owner = ((labels >= start) & (labels < start + chunk)) | (unknown & (rows * 0 + start == 0))
    tl.store(RAWY_OUT + rows, tl.where(unknown, float("nan"), raw_y), mask=rmask & owner)


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
def grad_kernel(RAW, INV, LABELS, LSE, ROW_SCALE, LABEL_GRAD, SCALE, GRAD_OUT, COLSUM_OUT, B, C, stride,
                HAS_INV: tl.constexpr, HAS_LABEL_GRAD: tl.constexpr, HAS_SCALE: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr):
    """g' = (softmax(z) * ROW_SCALE, LABEL_GRAD on the label column) * INV on one tile (all times SCALE[0] with
    ``HAS_SCALE``), and its column sums of g' * z."""
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
    if HAS_SCALE:
        p = p * tl.load(SCALE)
    if HAS_INV:
        inv = tl.load(INV + cols, mask=cols < C, other=0.0)
        g = p * inv[None, :]
        colsum = tl.sum(g * z, axis=0)
        tl.store(COLSUM_OUT + tl.program_id(0).to(tl.int64) * C + cols, colsum, mask=cols < C)
    else:
        g = p
    offsets = rows[:, None].to(tl.int64) * C + cols[None, :]
    tl.store(GRAD_OUT + offsets, g.to(GRAD_OUT.dtype.element_ty), mask=inside)


@triton.jit
def _psi_slope(c, M: tl.constexpr):
    """psi_m(c) = (-1)^k T_m(c) - 2k and (-1)^k T_m'(c), k = floor(m theta / pi) (eq. 2.8; T by the recurrence)."""
    k = tl.minimum(tl.maximum(tl.floor(arccos(c) * M / 3.141592653589793), 0.0), M - 1.0)
    sign = 1.0 - 2.0 * (k - 2.0 * tl.floor(k * 0.5))
    prev, cur = tl.full(c.shape, 1.0, tl.float32), c
    dprev, dcur = tl.zeros(c.shape, tl.float32), tl.full(c.shape, 1.0, tl.float32)
    for _ in tl.static_range(M - 1):
        nxt, dnxt = 2.0 * c * cur - prev, 2.0 * cur + 2.0 * c * dcur - dprev
        prev, cur, dprev, dcur = cur, nxt, dcur, dnxt
    return sign * cur - 2.0 * k, sign * dcur


@triton.jit
def _tail_target(z, n, s_floor, KIND: tl.constexpr, M: tl.constexpr, a, b, p0, p1):
    """(t, dt/dz, dt/dn) of Note [tail derivatives] (:mod:`sphereml.heads.margin_tail`) for a block of rows."""
    n_floor = tl.maximum(n, s_floor)
    q = z / n_floor
    c = tl.minimum(tl.maximum(q, -1.0), 1.0)
    inside = ((q >= -1.0) & (q <= 1.0)).to(tl.float32)
    dc_dz = inside / n_floor
    dc_dn = -inside * (n >= s_floor).to(tl.float32) * q / n_floor
    direct_z = tl.zeros(z.shape, tl.float32)
    if KIND == 0:  # plain
        t, dt_dc, direct_n, direct_z = z, tl.zeros(z.shape, tl.float32), tl.zeros(z.shape, tl.float32), direct_z + 1.0
    elif KIND == 1:  # cosface, p0 = m
        t, dt_dc, direct_n = n * (c - p0), n, c - p0
    elif KIND == 2:  # arcface, p0 = cos m, p1 = sin m
        sin2 = 1.0 - c * c
        sin_theta = tl.sqrt(tl.maximum(sin2, 1e-6))
        tail = c < -p0
        value = tl.where(tail, c - (1.0 - p0), c * p0 - sin_theta * p1)
        slope = tl.where(tail, 1.0, p0 + p1 * c / sin_theta * (sin2 >= 1e-6).to(tl.float32))
        t, dt_dc, direct_n = n * value, n * slope, value
    elif KIND == 3:  # multiplicative
        value, slope = _psi_slope(c, M)
        t, dt_dc, direct_n = n * (a * c + b * value), n * (a + b * slope), a * c + b * value
    elif KIND == 4:  # detached, p0 = m, p1 = ceil(m) - 1
        theta = arccos(tl.minimum(tl.maximum(c, -1.0 + 1e-7), 1.0 - 1e-7))
        k = tl.minimum(tl.maximum(tl.floor(theta * p0 / 3.141592653589793), 0.0), p1)
        value = (1.0 - 2.0 * (k - 2.0 * tl.floor(k * 0.5))) * tl.cos(p0 * theta) - 2.0 * k
        target = a * c + b * value
        t, dt_dc, direct_n = n * target, n * (a + b), target
    else:  # lsoftmax
        value, slope = _psi_slope(c, M)
        t, dt_dc, direct_n, direct_z = a * z + b * n * value, b * n * slope, b * value, direct_z + a
    return t, direct_z + dt_dc * dc_dz, direct_n + dt_dc * dc_dn


@triton.jit
def tail_kernel(REST, RAWY, INV, XNORM, WNORM, LABELS, LOSS_OUT, ROW_GRAD, LABEL_GRAD, XNORM_GRAD, WNORM_GRAD, B,
                C, s, a, b, p0, p1, KIND: tl.constexpr, M: tl.constexpr, HAS_INV: tl.constexpr, SCALE: tl.constexpr,
                BLOCK: tl.constexpr):
    """One program over all B rows (a deterministic mean): the target t_b, the loss mean_b [logaddexp(t_b, rest_b)
    - t_b] and dL/drest_b, dL/dz_b, dL/d||x_b|| (SCALE 1, 2), dL/d||W_y_b|| (SCALE 2).  SCALE: 0 n = s, 1 n = ||x_b||,
    2 n = ||x_b|| ||W_y_b||."""
    total = tl.zeros((BLOCK,), tl.float32)
    for r0 in range(0, B, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        rmask = rows < B
        rest = tl.load(REST + rows, mask=rmask, other=0.0)
        raw_y = tl.load(RAWY + rows, mask=rmask, other=0.0)
        z = raw_y
        labels = tl.load(LABELS + rows, mask=rmask, other=0)
        known = rmask & (labels >= 0) & (labels < C)  # a label out of range reads nothing; its RAWY is NaN
        if HAS_INV:
            z = z * tl.load(INV + labels, mask=known, other=0.0)
        if SCALE == 0:
            n = tl.zeros((BLOCK,), tl.float32) + s
        elif KIND == 0:
            n = tl.zeros((BLOCK,), tl.float32)  # the plain target does not use it
        else:
            x_norm = tl.load(XNORM + rows, mask=rmask, other=0.0)
            n = x_norm
            if SCALE == 2:
                w_norm = tl.load(WNORM + labels, mask=known, other=0.0)
                n = x_norm * w_norm
        t, dt_dz, dt_dn = _tail_target(z, n, 1e-12, KIND, M, a, b, p0, p1)
        big = tl.maximum(t, rest)
        lae = big + tl.log(1.0 + tl.exp(-tl.abs(t - rest)))  # logaddexp; rest = -inf (one class) gives t
        lae = tl.where(raw_y != raw_y, float("nan"), lae)  # NaN through the clamps (tl.maximum drops it)
        total += tl.where(rmask, lae - t, 0.0)
        p = tl.exp(rest - lae) / B
        tl.store(ROW_GRAD + rows, p, mask=rmask)
        tl.store(LABEL_GRAD + rows, -p * dt_dz, mask=rmask)
        if SCALE == 1:
            tl.store(XNORM_GRAD + rows, -p * dt_dn, mask=rmask)
        if SCALE == 2:
            tl.store(XNORM_GRAD + rows, -p * dt_dn * w_norm, mask=rmask)
            tl.store(WNORM_GRAD + rows, -p * dt_dn * x_norm, mask=rmask)
    tl.store(LOSS_OUT, tl.sum(total, axis=0) / B)
