"""The Triton kernels of :mod:`sphereml.layers.window_sums` (imported on first use, like the epilogue's).

Layout: NORMS (Tensor[B G, H, W], float32, contiguous) holds nu, the norm of each group's channels of x at every
position; SQ and GRAD_SQ (Tensor[B G, H', W'], float32) the squared patch norms s and their gradient; X and GRAD_X
(Tensor[B, C, H, W], float32 or half) the input and its gradient, each at its own strides per sample, channel and
position (XB, XC, XP and GB, GC, GP: NCHW or channels-last, Note [layouts in the kernels] in
:mod:`sphereml.layers._layouts`); channel g CG + c of sample b belongs to group g (b g = b G + g).  Output
position (i, j) covers the inputs (i s_h - p_h + a d_h, j s_w - p_w + b d_w) for a < KH, b < KW that lie inside
the image (zero padding).

* ``window_sums_kernel``: program (b g, output position block), a 1-D grid: s = sum over the window of nu^2.
* ``window_gradient_kernel``: program (b g, channel block, input position block), a 1-D grid: t = the sum of
  dL/ds over the windows that cover the position (the adjoint of the box sum: input (r, c) is covered by output
  i where r + p_h - a d_h = i s_h), then GRAD_X += 2 X t on the program's channels, in float32, rounded once.
  Each channel block gathers t again (KH KW loads of a tensor C / G times smaller than x) so that the grid has
  enough programs for a GPU's multiprocessors at small batches.
"""

import triton
import triton.language as tl

from ..energy.triton_backend import interpreting
from ._patch_kernels import tile_offsets

__all__ = ["BLOCKS", "CHANNELS_LAST_BLOCKS", "window_sums_kernel", "window_gradient_kernel"]

# (channel block, position block, warps): small under the interpreter; on a GPU a position block of 256 with 4
# warps (the sums kernel holds one float32 per position, the gradient kernel an 8 x 256 tile of x and of dL/dx).
# In channels-last x, whose channels lie next to each other, the gradient kernel's tile is 8 x 128 (each position's
# 8 channels one 32-byte sector in float32): compiled for sm_90a with the channels' unit stride it takes 40-56
# registers (3 x 3 and 5 x 5 windows); in a first version 8 x 256 took 90-95, and tiles of 16 or more channels
# 95-255, some with spills.
BLOCKS = (4, 16, 4) if interpreting() else (8, 256, 4)
CHANNELS_LAST_BLOCKS = (4, 16, 4) if interpreting() else (8, 128, 4)


@triton.jit
def _program(HW, BP: tl.constexpr):
    """(b g, positions, their mask) of this program in a 1-D grid over (b g, position blocks of HW)."""
    blocks = tl.cdiv(HW, BP)
    pid = tl.program_id(0)
    pos = pid % blocks * BP + tl.arange(0, BP)
    return pid // blocks, pos, pos < HW


@triton.jit
def window_sums_kernel(NORMS, SQ, H, W, HO, WO, SH, SW, PH, PW, DH, DW, KH: tl.constexpr, KW: tl.constexpr,
                       BP: tl.constexpr):
    """s = sum over each output position's window of NORMS^2 (see the module docstring)."""
    bg, pos, pmask = _program(HO * WO, BP)
    top, left = pos // WO * SH - PH, pos % WO * SW - PW
    base = NORMS + bg.to(tl.int64) * H * W
    acc = tl.zeros((BP,), tl.float32)
    for a in tl.static_range(KH):
        row = top + a * DH
        row_inside = pmask & (row >= 0) & (row < H)
        for b in tl.static_range(KW):
            col = left + b * DW
            nu = tl.load(base + row * W + col, mask=row_inside & (col >= 0) & (col < W), other=0.0)
            acc += nu * nu
    tl.store(SQ + bg.to(tl.int64) * HO * WO + pos, acc, mask=pmask)


@triton.jit
def window_gradient_kernel(GRAD_SQ, X, GRAD_X, G, CG, H, W, HO, WO, SH, SW, PH, PW, DH, DW, XB, XC, XP, GB, GC, GP,
                           KH: tl.constexpr, KW: tl.constexpr, SAME_LAYOUT: tl.constexpr, BC: tl.constexpr,
                           BP: tl.constexpr):
    """GRAD_X += 2 X t on one (channel block, position block) tile, t the box sum's adjoint of GRAD_SQ at each
    input position (see the module docstring); a 1-D grid over (b g, channel block, position block)."""
    channel_blocks, position_blocks = tl.cdiv(CG, BC), tl.cdiv(H * W, BP)
    pid = tl.program_id(0)
    bg = pid // (channel_blocks * position_blocks)
    c0, p0 = (pid // position_blocks) % channel_blocks * BC, pid % position_blocks * BP
    ch, pos = c0 + tl.arange(0, BC), p0 + tl.arange(0, BP)
    pmask = pos < H * W
    row0, col0 = pos // W + PH, pos % W + PW
    base = GRAD_SQ + bg.to(tl.int64) * HO * WO
    t = tl.zeros((BP,), tl.float32)
    for a in tl.static_range(KH):
        row = row0 - a * DH  # = i SH for the output row i whose window's a-th row this is
        i = tl.maximum(row, 0) // SH
        row_covered = pmask & (row >= 0) & (row == i * SH) & (i < HO)
        for b in tl.static_range(KW):
            col = col0 - b * DW
            j = tl.maximum(col, 0) // SW
            covered = row_covered & (col >= 0) & (col == j * SW) & (j < WO)
            t += tl.load(base + i * WO + j, mask=covered, other=0.0)
    x_first, x_offsets = tile_offsets(bg, G, CG, c0, p0, BC, BP, XB, XC, XP)
    grad_first, grad_offsets = x_first, x_offsets
    if not SAME_LAYOUT:  # one set of offsets where x and dL/dx share their strides (two spilled registers in fp16)
        grad_first, grad_offsets = tile_offsets(bg, G, CG, c0, p0, BC, BP, GB, GC, GP)
    mask = (ch < CG)[:, None] & pmask[None, :]
    x = tl.load(X + x_first + x_offsets, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(GRAD_X + grad_first + grad_offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(GRAD_X + grad_first + grad_offsets, (grad + x * (2.0 * t)[None, :]).to(GRAD_X.dtype.element_ty),
             mask=mask)
