"""The Triton kernels of the patch epilogue in :mod:`sphereml.layers.patches` (imported on first use).

Layout: INNER (Tensor[B, C_out, P], P = H' W' positions) holds w_hat . x for every kernel and patch, at strides
SB, SC, SP per sample, channel and position (NCHW or channels-last: Note [layouts in the kernels] in
:mod:`sphereml.layers._layouts`), which OUT, GRAD_Y and GRAD_INNER share (with ``GRAD_BROADCAST`` GRAD_Y is one
value for all, the gradient of a ``.sum()``).  The C_out channels form G groups of CG; SQ (Tensor[B, G, P],
float32, contiguous) the squared patch norms of each group.  With m = sqrt(max(SQ, eps^2)) + q (q a number or a 0-d
tensor) the cosine is c = clamp(INNER / m, -1, 1) and the epilogue y = f(c) is chosen by ``EPILOGUE`` (the numbers
of ``EPILOGUES``):

    0 cosine     y = c
    1 sharpen    y = sign(c) |c|^a            (SCS, the paper's Sec. 1; a = p)
    2 linear     y = 1 - 2 theta / pi         (thesis eq. 3.2; theta = arccos c)
    3 sigmoid    y = tanh(u) / tanh(pi / 4a), u = (pi/2 - theta) / 2a   (eq. 3.4 as a tanh ratio; a = k)
    4 sqcosine   y = c |c|                    (eq. 4.14)

with the parameter a a number (``PARAM`` 1) or one value per channel (``PARAM`` 2).  With ``HAS_MAG`` the
output is multiplied by a magnitude per position, MAG (Tensor[B, G, P], float32): the h(||x||) of the
decoupled operators (thesis eq. 4.3), whose gradient dL/dMAG = sum_j dL/dy_j f(c_j) the backward also writes.
With ``MAGNITUDE`` k > 0 (no q) the kernels evaluate that h themselves from n: the k-th of
``sphereml.layers.magnitudes.MAGNITUDES`` (sphere, ball, tanh, linear, seg, log, mix; eqs. 4.4-4.10) with the
numbers alpha and beta and the radius r (``R_MODE`` 1 a number, 2 a 0-d tensor), and the backward adds
dL/dh dh/dn to dL/dn and, with ``SCALAR_GRAD`` 2, writes each program's sum of dL/dh dh/dr.  Their derivatives are those
of :func:`~sphereml.layers.magnitudes.magnitude_function`'s operations: ball's clamp passes the gradient at n = r,
seg's branch n <= r takes alpha.
The derivatives follow the reference nodes exactly: d|c|^a/dc = a |c|^a / max(|c|, 1e-6) (Note [sharpening
without NaN] in :mod:`sphereml.layers.scs`) and d theta / dc = -1 / sqrt(max(1 - c^2, 1e-10)) (Note [angle for linear
and sigmoid] in :mod:`sphereml.angular`).  Triton has neither arccos nor tanh: theta comes from the minimax
polynomial of Abramowitz and Stegun 4.4.46 (|error| <= 2e-8 on [0, 1], theta(-c) = pi - theta(c)) and tanh
from its series near 0 and exponentials elsewhere (``_tanh_sech2``).  NaN inputs stay NaN.  All arithmetic is
float32; outputs take INNER's dtype.

* ``forward_kernel``: program (b g, channel block, position block), flattened into a 1-D grid: one read of
  INNER, one write of y.
* ``backward_kernel``: program (b g, position block), also a 1-D grid, walks over the group's channels: from
  dL/dy it writes dL/dINNER = dL/dc / m (the clamp passes the gradient, as in ``_DivideByPatchNorm``), and
  the squared norms' dL/dSQ = dL/dm / 2n per position (Tensor[B, G, P]; 0 where SQ < eps^2, as the floor passes
  no gradient), from dL/dm = -sum_j dL/dc_j INNER_j / m^2; with ``SCALAR_GRAD`` 1 (a learned q, dm/dq = 1) also
  each program's sum of dL/dm, so that dL/dq is one sum of those (Tensor[programs]); with ``PARAM`` 2 the partial
  sums over its positions of dL/da_j, one row per sample and position block (no atomics).
"""

import triton
import triton.language as tl

from ..energy.triton_backend import interpreting

__all__ = ["EPILOGUES", "FORWARD_BLOCKS", "BACKWARD_BLOCKS", "arccos", "tile_offsets", "forward_kernel",
           "backward_kernel"]

EPILOGUES = {"cosine": 0, "sharpen": 1, "linear": 2, "sigmoid": 3, "sqcosine": 4}

# (channel block, position block, warps): small under the interpreter, Hopper-sized on a GPU.  The backward
# keeps more tiles live: on sm_90a (ptxas -v) 32 x 128 with 4 warps spilled 276 bytes (sharpening), 32 x 64
# with 4 warps 16-20 bytes (sigmoid), 32 x 64 with 8 warps none under Triton 3.9 (64-141 registers) but 16 bytes
# under Triton 3.6 (sigmoid with a scalar k and a magnitude, capped at 80 registers); 16 x 64 with 8 warps none
# under either (62-64 registers).
FORWARD_BLOCKS = (8, 16, 4) if interpreting() else (32, 128, 4)
BACKWARD_BLOCKS = (8, 16, 4) if interpreting() else (16, 64, 8)


@triton.jit
def _denominator(SQ, Q, q_value, bg, pos, pmask, P, eps2, Q_MODE: tl.constexpr):
    """(m = n + q, n = sqrt(max(SQ, eps^2)), SQ); Q_MODE 0: no q, 1: the number ``q_value``, 2: the 0-d tensor at
    Q."""
    sq = tl.load(SQ + bg.to(tl.int64) * P + pos, mask=pmask, other=1.0)
    n = tl.sqrt(tl.maximum(sq, eps2, propagate_nan=tl.PropagateNan.ALL))
    m = n
    if Q_MODE == 1:
        m = n + q_value
    elif Q_MODE == 2:
        m = n + tl.load(Q).to(tl.float32)
    return m, n, sq


@triton.jit
def _parameter(A, a_value, g, ch, cmask, CG, PARAM: tl.constexpr):
    """The epilogue's parameter for each channel of the block: the number ``a_value`` or one per channel at A."""
    if PARAM == 2:
        return tl.load(A + g * CG + ch, mask=cmask, other=1.0).to(tl.float32)
    return tl.zeros(ch.shape, tl.float32) + a_value


@triton.jit
def arccos(c):
    """arccos on [-1, 1]: Abramowitz and Stegun 4.4.46 on |c|, reflected for c < 0."""
    x = tl.abs(c)
    poly = -0.0012624911
    poly = poly * x + 0.0066700901
    poly = poly * x - 0.0170881256
    poly = poly * x + 0.0308918810
    poly = poly * x - 0.0501743046
    poly = poly * x + 0.0889789874
    poly = poly * x - 0.2145988016
    poly = poly * x + 1.5707963050
    theta = tl.sqrt(tl.maximum(1.0 - x, 0.0)) * poly
    return tl.where(c < 0, 3.141592653589793 - theta, theta)


@triton.jit
def _tanh_sech2(u):
    """tanh(u) and sech^2(u) with small relative errors everywhere (a small k makes |u| large and sech^2 tiny,
    a large k makes u and tanh(pi / 4k) small): below |u| = 0.1 the odd series of tanh to u^7 (truncation
    2e-10 relative) and 1 - tanh^2; above, with e = exp(-2|u|), (1 - e) / (1 + e) and 4e / (1 + e)^2."""
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    u2 = u * u
    series = a * (1.0 + u2 * (-0.3333333333333333 + u2 * (0.13333333333333333 - u2 * 0.05396825396825397)))
    small = a < 0.1
    th = tl.where(small, series, (1.0 - e) / (1.0 + e))
    sech2 = tl.where(small, 1.0 - series * series, 4.0 * e / ((1.0 + e) * (1.0 + e)))
    return tl.where(u < 0, -th, th), sech2


@triton.jit
def _log1p(n):
    """log(1 + n) to float32's relative precision for small n >= 0 (log(u) n / (u - 1), u = 1 + n rounded)."""
    u = 1.0 + n
    return tl.where(u == 1.0, n, tl.log(u) * (n / (u - 1.0)))


@triton.jit
def _magnitude(n, R, r_value, alpha, beta, MAGNITUDE: tl.constexpr, R_MODE: tl.constexpr):
    """(h(n), dh/dn, dh/dr) of the decoupled operators' MAGNITUDE-th function (eqs. 4.4-4.10) for norms n > 0."""
    r = r_value
    if R_MODE == 2:
        r = tl.load(R).to(tl.float32)
    zero = tl.zeros(n.shape, tl.float32)
    if MAGNITUDE == 1:  # sphere
        return zero + alpha, zero, zero
    if MAGNITUDE == 2:  # ball: alpha min(n / r, 1)
        t = n / r
        inside = n <= r
        return alpha * tl.where(inside, t, 1.0), tl.where(inside, alpha / r, 0.0), tl.where(inside, -alpha * t / r, 0.0)
    if MAGNITUDE == 3:  # tanh: alpha tanh(n / r); dh/dr = -dh/dn n / r, no r^2 to underflow
        t = n / r
        th, sech2 = _tanh_sech2(t)
        return alpha * th, alpha * sech2 / r, -(alpha * sech2 / r) * t
    if MAGNITUDE == 4:  # linear
        return alpha * n, zero + alpha, zero
    if MAGNITUDE == 5:  # seg: alpha n up to r, then beta n + (alpha - beta) r
        inside = n <= r
        return (tl.where(inside, alpha * n, beta * n + (alpha - beta) * r), tl.where(inside, alpha, beta) + zero,
                tl.where(inside, 0.0, alpha - beta) + zero)
    if MAGNITUDE == 6:  # log
        return alpha * _log1p(n), alpha / (1.0 + n), zero
    return alpha * n + beta * _log1p(n), alpha + beta / (1.0 + n), zero  # mix


@triton.jit
def _epilogue(c, a, EPILOGUE: tl.constexpr):
    """(y, dy/dc, dy/da) for cosines c (BC, BP) and parameters a (BC, 1)."""
    zero = tl.zeros(c.shape, tl.float32)
    if EPILOGUE == 0:
        return c, zero + 1.0, zero
    if EPILOGUE == 4:
        return c * tl.abs(c), 2.0 * tl.abs(c), zero
    if EPILOGUE == 1:
        floored = tl.maximum(tl.abs(c), 1e-6, propagate_nan=tl.PropagateNan.ALL)
        powered = tl.exp2(a * tl.log2(tl.abs(c)))  # |c|^a; 0 at c = 0 (a > 0), NaN for NaN
        y = tl.where(c < 0, -powered, powered)
        return y, a * powered / floored, y * tl.log(floored)
    inverse_sine = tl.rsqrt(tl.maximum(1.0 - c * c, 1e-10, propagate_nan=tl.PropagateNan.ALL))
    theta = arccos(c)
    if EPILOGUE == 2:
        return 1.0 - theta * 0.6366197723675814, inverse_sine * 0.6366197723675814, zero
    u = (1.5707963267948966 - theta) / (2.0 * a)
    th, sech2 = _tanh_sech2(u)
    t, _ = _tanh_sech2(0.7853981633974483 / a)
    dk = -sech2 * u / (a * t) + th * (1.0 - t * t) * 0.7853981633974483 / (a * a * t * t)
    return th / t, sech2 * inverse_sine / (2.0 * a * t), dk


@triton.jit
def tile_offsets(bg, G, CG, c0, p0, BC: tl.constexpr, BP: tl.constexpr, SB, SC, SP):
    """(the offset of the tile's first element, in int64: a sample may hold 2^31 values or more; the offsets of its
    BC x BP elements from there, in int32) for the tile of channels c0.. and positions p0.. of sample b = bg // G and
    group g = bg % G (channel g CG + c0) in a Tensor[B, C, P] with strides SB, SC, SP."""
    first = (bg // G).to(tl.int64) * SB + ((bg % G) * CG + c0).to(tl.int64) * SC + p0.to(tl.int64) * SP
    return first, tl.arange(0, BC)[:, None] * SC + tl.arange(0, BP)[None, :] * SP


@triton.jit
def _clamp(c):
    """clamp to [-1, 1], NaN kept (tl.minimum / tl.maximum drop it by default)."""
    return tl.minimum(tl.maximum(c, -1.0, propagate_nan=tl.PropagateNan.ALL), 1.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def forward_kernel(INNER, SQ, Q, A, MAG, R, OUT, q_value, a_value, r_value, alpha, beta, G, CG, P, SB, SC, SP,
                   eps2, Q_MODE: tl.constexpr, EPILOGUE: tl.constexpr, PARAM: tl.constexpr, HAS_MAG: tl.constexpr,
                   MAGNITUDE: tl.constexpr, R_MODE: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr):
    """y = f(clamp(INNER / m, -1, 1)) on one (channels, positions) tile; a 1-D grid (no 65,535 limit)."""
    channel_blocks, position_blocks = tl.cdiv(CG, BC), tl.cdiv(P, BP)
    pid = tl.program_id(0)
    bg = pid // (channel_blocks * position_blocks)
    c0, p0 = (pid // position_blocks) % channel_blocks * BC, pid % position_blocks * BP
    ch, pos = c0 + tl.arange(0, BC), p0 + tl.arange(0, BP)
    cmask, pmask = ch < CG, pos < P
    m, n, _ = _denominator(SQ, Q, q_value, bg, pos, pmask, P, eps2, Q_MODE)
    first, offsets = tile_offsets(bg, G, CG, c0, p0, BC, BP, SB, SC, SP)
    mask = cmask[:, None] & pmask[None, :]
    c = _clamp(tl.load(INNER + first + offsets, mask=mask, other=0.0).to(tl.float32) / m[None, :])
    a = _parameter(A, a_value, bg % G, ch, cmask, CG, PARAM)
    y, _, _ = _epilogue(c, a[:, None], EPILOGUE)
    if HAS_MAG:
        y = y * tl.load(MAG + bg.to(tl.int64) * P + pos, mask=pmask, other=0.0)[None, :]
    if MAGNITUDE != 0:
        h, _, _ = _magnitude(n, R, r_value, alpha, beta, MAGNITUDE, R_MODE)
        y = y * h[None, :]
    tl.store(OUT + first + offsets, y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def backward_kernel(INNER, SQ, Q, A, MAG, R, GRAD_Y, GRAD_INNER, GRAD_SQ, GRAD_A, GRAD_MAG, GRAD_SCALAR, q_value,
                    a_value, r_value, alpha, beta, G, CG, P, C_OUT, SB, SC, SP, eps2, Q_MODE: tl.constexpr,
                    EPILOGUE: tl.constexpr, PARAM: tl.constexpr, HAS_MAG: tl.constexpr, MAGNITUDE: tl.constexpr,
                    R_MODE: tl.constexpr, SCALAR_GRAD: tl.constexpr, GRAD_BROADCAST: tl.constexpr, BC: tl.constexpr,
                    BP: tl.constexpr):
    """dL/dINNER on every channel of the group, dL/dSQ per position, dL/da partial sums and, with ``SCALAR_GRAD``
    1 or 2, this program's share of dL/dq or dL/dr, for BP positions.

    A 1-D grid over (b g, position block); the dL/da partial sums of sample b and position block go to row
    b * blocks + block (the groups write disjoint columns of it)."""
    position_blocks = tl.cdiv(P, BP)
    pid = tl.program_id(0)
    bg, block = pid // position_blocks, pid % position_blocks
    g = bg % G
    pos = block * BP + tl.arange(0, BP)
    pmask = pos < P
    m, n, sq = _denominator(SQ, Q, q_value, bg, pos, pmask, P, eps2, Q_MODE)
    acc = tl.zeros((BP,), tl.float32)
    acc_mag = tl.zeros((BP,), tl.float32)
    if HAS_MAG:
        mag = tl.load(MAG + bg.to(tl.int64) * P + pos, mask=pmask, other=0.0)
    if MAGNITUDE != 0:
        mag, dh_dn, dh_dr = _magnitude(n, R, r_value, alpha, beta, MAGNITUDE, R_MODE)
    partial_row = ((bg // G).to(tl.int64) * position_blocks + block) * C_OUT
    for c0 in range(0, CG, BC):
        ch = c0 + tl.arange(0, BC)
        cmask = ch < CG
        first, offsets = tile_offsets(bg, G, CG, c0, block * BP, BC, BP, SB, SC, SP)
        mask = cmask[:, None] & pmask[None, :]
        inner = tl.load(INNER + first + offsets, mask=mask, other=0.0).to(tl.float32)
        if GRAD_BROADCAST:
            grad = tl.where(mask, tl.load(GRAD_Y).to(tl.float32), 0.0)
        else:
            grad = tl.load(GRAD_Y + first + offsets, mask=mask, other=0.0).to(tl.float32)
        if EPILOGUE != 0 or HAS_MAG or MAGNITUDE != 0:
            c = _clamp(inner / m[None, :])
            a = _parameter(A, a_value, g, ch, cmask, CG, PARAM)
            y, dy_dc, dy_da = _epilogue(c, a[:, None], EPILOGUE)
            if HAS_MAG or MAGNITUDE != 0:
                acc_mag += tl.sum(grad * y, axis=0)
                grad = grad * mag[None, :]
            if PARAM == 2:
                tl.store(GRAD_A + partial_row + g * CG + ch, tl.sum(grad * dy_da, axis=1), mask=cmask)
            grad = grad * dy_dc
        tl.store(GRAD_INNER + first + offsets, (grad / m[None, :]).to(GRAD_INNER.dtype.element_ty), mask=mask)
        acc += tl.sum(grad * inner, axis=0)
    grad_m = -acc / (m * m)
    if MAGNITUDE != 0:  # m = n: h's share of dL/dn
        grad_m += acc_mag * dh_dn
    if SCALAR_GRAD == 1:  # this program's share of dL/dq = sum of dL/dm
        tl.store(GRAD_SCALAR + pid, tl.sum(tl.where(pmask, grad_m, 0.0), axis=0))
    elif SCALAR_GRAD == 2:  # of dL/dr
        tl.store(GRAD_SCALAR + pid, tl.sum(acc_mag * dh_dr, axis=0))
    grad_sq = grad_m * tl.where(sq >= eps2, 0.5 / n, 0.0)  # dn/dSQ = 1 / 2n above the floor, 0 under it
    tl.store(GRAD_SQ + bg.to(tl.int64) * P + pos, grad_sq, mask=pmask)
    if HAS_MAG:
        tl.store(GRAD_MAG + bg.to(tl.int64) * P + pos, acc_mag, mask=pmask)
