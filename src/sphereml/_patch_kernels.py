"""The Triton kernels of the patch epilogue in :mod:`sphereml.patches` (imported on first use).

Layout: INNER (Tensor[B, C_out, P], P = H' W' positions, contiguous) holds w_hat . x for every kernel and
patch; the C_out channels form G groups of CG; SQ (Tensor[B, G, P], float32) the squared patch norms of each
group.  With m = sqrt(max(SQ, eps^2)) + q (q a number or a 0-d tensor) the epilogue is c = clamp(INNER / m, -1, 1) and, with a power
p (``POWER`` 1: a number, 2: a tensor, one value per channel), the sharpened cosine y = sign(c) |c|^p (the SCS
paper's Sec. 1).  All arithmetic is float32; outputs take INNER's dtype.

* ``forward_kernel``: program (b g, channel block, position block): one read of INNER, one write of y.
* ``backward_kernel``: program (b g, position block) walks over the group's channels: from dL/dy it writes
  dL/dINNER = dL/dc / m (the clamp passes the gradient, as in ``_DivideByPatchNorm``), and
  dL/dm = -sum_j dL/dc_j INNER_j / m^2 per position (Tensor[B, G, P]); with ``POWER`` 2 also the partial sums
  over its positions of dL/dp_j = dL/dy_j y_j ln max(|c_j|, 1e-6), one row per program (no atomics).
"""

import triton
import triton.language as tl

from .energy.triton_backend import interpreting

__all__ = ["FORWARD_BLOCKS", "BACKWARD_BLOCKS", "forward_kernel", "backward_kernel"]

# (channel block, position block, warps): small under the interpreter, Hopper-sized on a GPU.  The backward
# keeps six tiles live: 32 x 128 spilled 276 bytes with a per-channel p on sm_90a (ptxas -v), 32 x 64 none.
FORWARD_BLOCKS = (8, 16, 4) if interpreting() else (32, 128, 4)
BACKWARD_BLOCKS = (8, 16, 4) if interpreting() else (32, 64, 4)


@triton.jit
def _denominator(SQ, Q, q_value, bg, pos, pmask, P, eps2, Q_MODE: tl.constexpr):
    """m = sqrt(max(SQ, eps^2)) + q; Q_MODE 0: no q, 1: the number ``q_value``, 2: the 0-d tensor at Q."""
    sq = tl.load(SQ + bg.to(tl.int64) * P + pos, mask=pmask, other=1.0)
    m = tl.sqrt(tl.maximum(sq, eps2))
    if Q_MODE == 1:
        m = m + q_value
    elif Q_MODE == 2:
        m = m + tl.load(Q).to(tl.float32)
    return m


@triton.jit
def _exponent(P_EXP, p_value, g, ch, cmask, CG, POWER: tl.constexpr):
    """p for each channel of the block; POWER 1: the number ``p_value``, 2: one value per channel at P_EXP."""
    if POWER == 1:
        return tl.zeros(ch.shape, tl.float32) + p_value
    return tl.load(P_EXP + g * CG + ch, mask=cmask, other=1.0).to(tl.float32)


@triton.jit
def forward_kernel(INNER, SQ, Q, P_EXP, OUT, q_value, p_value, G, CG, P, eps2,
                   Q_MODE: tl.constexpr, POWER: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr):
    """y = sign(c) |c|^p (or c) with c = clamp(INNER / m, -1, 1) on one (channels, positions) tile."""
    bg = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    pos = tl.program_id(2) * BP + tl.arange(0, BP)
    cmask, pmask = ch < CG, pos < P
    m = _denominator(SQ, Q, q_value, bg, pos, pmask, P, eps2, Q_MODE)
    offsets = (bg.to(tl.int64) * CG + ch[:, None]) * P + pos[None, :]
    mask = cmask[:, None] & pmask[None, :]
    c = tl.load(INNER + offsets, mask=mask, other=0.0).to(tl.float32) / m[None, :]
    c = tl.minimum(tl.maximum(c, -1.0), 1.0)
    if POWER != 0:
        p = _exponent(P_EXP, p_value, bg % G, ch, cmask, CG, POWER)
        powered = tl.exp2(p[:, None] * tl.log2(tl.abs(c)))  # |c|^p; 0 at c = 0 (p > 0)
        c = tl.where(c < 0, -powered, tl.where(c > 0, powered, 0.0))
    tl.store(OUT + offsets, c.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def backward_kernel(INNER, SQ, Q, P_EXP, GRAD_Y, GRAD_INNER, GRAD_M, GRAD_P, q_value, p_value, G, CG, P, C_OUT,
                    eps2, Q_MODE: tl.constexpr, POWER: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr):
    """dL/dINNER on every channel of the group, dL/dm per position and dL/dp partial sums, for BP positions."""
    bg = tl.program_id(0)
    g = bg % G
    pos = tl.program_id(1) * BP + tl.arange(0, BP)
    pmask = pos < P
    m = _denominator(SQ, Q, q_value, bg, pos, pmask, P, eps2, Q_MODE)
    acc = tl.zeros((BP,), tl.float32)
    partial_row = (tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * C_OUT
    for c0 in range(0, CG, BC):
        ch = c0 + tl.arange(0, BC)
        cmask = ch < CG
        offsets = (bg.to(tl.int64) * CG + ch[:, None]) * P + pos[None, :]
        mask = cmask[:, None] & pmask[None, :]
        inner = tl.load(INNER + offsets, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(GRAD_Y + offsets, mask=mask, other=0.0).to(tl.float32)
        if POWER != 0:
            c = tl.minimum(tl.maximum(inner / m[None, :], -1.0), 1.0)
            p = _exponent(P_EXP, p_value, g, ch, cmask, CG, POWER)
            floored = tl.maximum(tl.abs(c), 1e-6)
            powered = tl.exp2(p[:, None] * tl.log2(tl.abs(c)))
            signed = tl.where(c < 0, -powered, tl.where(c > 0, powered, 0.0))
            grad_p = tl.sum(grad * signed * tl.log(floored), axis=1)
            if POWER == 2:
                tl.store(GRAD_P + partial_row + g * CG + ch, grad_p, mask=cmask)
            grad = grad * p[:, None] * powered / floored
        tl.store(GRAD_INNER + offsets, (grad / m[None, :]).to(GRAD_INNER.dtype.element_ty), mask=mask)
        acc += tl.sum(grad * inner, axis=0)
    tl.store(GRAD_M + bg.to(tl.int64) * P + pos, -acc / (m * m), mask=pmask)
