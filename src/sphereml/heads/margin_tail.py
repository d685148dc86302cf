"""The O(B) part of a fused margin head: each row's target logit, its cross-entropy, and their derivatives.

Once :func:`~sphereml.heads.margin_ce.label_split`'s passes have given, for every row b, rest_b = log sum_{j != y_b}
exp(z_bj) and the label logit z_b = z_b,y_b, the loss of a margin head is

    L = mean_b [ logaddexp(t_b, rest_b) - t_b ],    t_b = T(z_b, n_b),

with n_b the target's scale (s, ||x_b|| or ||x_b|| ||W_y_b||) and T the head's target (the table of
:mod:`~sphereml.heads.margins`).  Through autograd those B values cost tens of small operations forward and
backward (one kernel launch each on a GPU, where that, not the arithmetic, is their time).  Here one
operator, ``torch.ops.sphereml.margin_tail``, returns the loss together with its derivatives with respect to
rest_b, z_b and the norms (a closed form, Note [tail derivatives]), so the backward of a fused head needs no
operation for them at all: it scales them by the loss's incoming gradient inside its gradient pass.

Note [tail derivatives]
    With c = clamp(q, -1, 1), q = z / max(n, 1e-12) (the target cosine of ``_MarginHead._target_cosine``):
    dc/dz = [-1 <= q <= 1] / max(n, 1e-12) and dc/dn = -[-1 <= q <= 1] [n >= 1e-12] q / max(n, 1e-12), the
    clamps passing their gradient where PyTorch's do.  Each kind gives T and its partials in (c, z, n); a, b =
    lambda / (1 + lambda), 1 / (1 + lambda) are the annealing weights (§2.2.7; lambda = inf: a = 1, b = 0):

    ==================  ============================================  ======================================
    kind                T                                             head
    ==================  ============================================  ======================================
    ``plain``           z                                             normalised softmax (eq. 2.18, L_s)
    ``cosface``         n (c - m)                                     CosFace (L_a1)
    ``arcface``         n psi_arc(c)                                  ArcFace (L_a2, :func:`arcface_psi`)
    ``multiplicative``  n (a c + b psi_m(c))                          A-Softmax (eq. 2.20)
    ``detached``        n (a c + b (c + stopgrad(psi_m(theta) - c)))  A-Softmax, real m (SphereFace-R style)
    ``lsoftmax``        a z + b n psi_m(c)                            L-Softmax (eq. 2.4)
    ==================  ============================================  ======================================

    psi_m(c) = (-1)^k T_m(c) - 2k (eq. 2.8) has psi_m'(c) = (-1)^k T_m'(c), with T_m' from the recurrence
    T'_{n+1} = 2 T_n + 2 c T'_n - T'_{n-1}; k is piecewise constant, so it carries no gradient.  With
    p_b = sigmoid(rest_b - t_b): dL/drest_b = p_b / B and dL/dt_b = -p_b / B, and dL/dz_b, dL/dn_b follow by the
    chain rule.  The tests check every kind against autograd over the heads' own formulas in float64.

The closed form runs as PyTorch operations on CPU tensors (and in float64 always), and as one Triton program
(:func:`~sphereml.heads._margin_kernels.tail_kernel`) on CUDA tensors or under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._custom_ops import custom_op
from ..energy.triton_backend import launchable, lazy_module, usable_on
from .targets import arcface_psi, multiplicative_branch, psi

__all__ = ["TAIL_KINDS", "SCALE_FLOOR", "anneal_weights", "tail_terms", "margin_tail"]

TAIL_KINDS = ("plain", "cosface", "arcface", "multiplicative", "detached", "lsoftmax")
SCALE_FLOOR = 1e-12  # the floor on n in the target cosine z / max(n, floor), as in the heads
_ARC_EPS = 1e-6  # arcface_psi's floor on sin(theta)^2
_DETACHED_EPS = 1e-7  # the detached margin's clamp of c away from +-1 before arccos
_margin_kernels = lazy_module("sphereml.heads._margin_kernels")


def anneal_weights(lam: float) -> tuple[float, float]:
    """(lambda / (1 + lambda), 1 / (1 + lambda)): the weights of the plain and the margin target (inf: 1, 0)."""
    return (1.0, 0.0) if math.isinf(lam) else (lam / (1.0 + lam), 1.0 / (1.0 + lam))


def _psi_and_slope(c: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """psi_m(c) of eq. 2.8 and d psi_m / dc = (-1)^k T_m'(c), k = floor(m arccos(c) / pi) in 0..m-1."""
    k, sign = multiplicative_branch(c, m)
    prev, cur, dprev, dcur = torch.ones_like(c), c, torch.zeros_like(c), torch.ones_like(c)
    for _ in range(m - 1):
        prev, cur, dprev, dcur = cur, 2 * c * cur - prev, dcur, 2 * cur + 2 * c * dcur - dprev
    return sign * cur - 2 * k, sign * dcur


def _arcface_slope(c: Tensor, m: float) -> Tensor:
    """d psi_arc / dc: 1 on the tail, cos m + sin m c / sin(theta) on the rotated part (0 past the sin floor)."""
    sin2 = 1.0 - c * c
    sin_theta = torch.sqrt(sin2.clamp_min(_ARC_EPS))
    rotated = math.cos(m) + math.sin(m) * c / sin_theta * (sin2 >= _ARC_EPS)
    return torch.where(c < -math.cos(m), torch.ones_like(c), rotated)


def tail_terms(z: Tensor, n: Tensor, kind: str, m: float,
               weights: tuple[float, float]) -> tuple[Tensor, Tensor, Tensor]:
    """(t, dt/dz, dt/dn) for every row: the target logit of ``kind`` and its partials (Note [tail derivatives])."""
    if kind == "plain":
        return z, torch.ones_like(z), torch.zeros_like(z)
    a, b = weights
    n_floor = n.clamp_min(SCALE_FLOOR)
    q = z / n_floor
    c = q.clamp(-1.0, 1.0)
    inside = ((q >= -1.0) & (q <= 1.0)).to(z.dtype)
    dc_dz, dc_dn = inside / n_floor, -inside * (n >= SCALE_FLOOR) * q / n_floor
    direct_z = torch.zeros_like(z)
    if kind == "cosface":
        t, dt_dc, direct_n = n * (c - m), n, c - m
    elif kind == "arcface":
        value = arcface_psi(c, m)
        t, dt_dc, direct_n = n * value, n * _arcface_slope(c, m), value
    elif kind == "multiplicative":
        value, slope = _psi_and_slope(c, int(m))
        t, dt_dc, direct_n = n * (a * c + b * value), n * (a + b * slope), a * c + b * value
    elif kind == "detached":
        target = a * c + b * psi(torch.arccos(c.clamp(-1.0 + _DETACHED_EPS, 1.0 - _DETACHED_EPS)), m)
        t, dt_dc, direct_n = n * target, n * (a + b), target
    elif kind == "lsoftmax":
        value, slope = _psi_and_slope(c, int(m))
        t, dt_dc, direct_n, direct_z = a * z + b * n * value, b * n * slope, b * value, torch.full_like(z, a)
    else:
        raise ValueError(f"kind must be one of {TAIL_KINDS}, got {kind!r}")
    return t, direct_z + dt_dc * dc_dz, direct_n + dt_dc * dc_dn


def _scale(x_norm: Tensor, w_norm: Tensor, labels: Tensor, s: float, like: Tensor) -> Tensor:
    """n_b: s (s > 0), ||x_b|| (s = 0), or ||x_b|| ||W_y_b|| (s = 0 and the class norms given)."""
    if s > 0:
        return torch.full_like(like, s)
    return x_norm * w_norm[labels] if w_norm.numel() else x_norm


def _reference_tail(rest, raw_y, inv, x_norm, w_norm, labels, kind, m, s, a, b):
    z = raw_y * inv[labels] if inv.numel() else raw_y
    n = _scale(x_norm.to(z.dtype), w_norm.to(z.dtype), labels, s, z)
    t, dt_dz, dt_dn = tail_terms(z, n, kind, m, (a, b))
    total = torch.logaddexp(t, rest)
    p = torch.exp(rest - total) / rest.shape[0]  # dL/drest_b
    n_grad = -p * dt_dn
    x_grad = (n_grad * w_norm[labels] if w_norm.numel() else n_grad) if s <= 0 else rest.new_empty(0)
    w_grad = n_grad * x_norm if w_norm.numel() else rest.new_empty(0)
    return (total - t).mean(), p, -p * dt_dz, x_grad, w_grad


@custom_op("sphereml::margin_tail", mutates_args=())
def margin_tail_operator(rest: Tensor, raw_y: Tensor, inv: Tensor, x_norm: Tensor, w_norm: Tensor, labels: Tensor,
                         kind: str, m: float, s: float, a: float,
                         b: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(L, dL/drest: Tensor[B], dL/dz: Tensor[B], dL/d||x_b|| (empty when s > 0), dL/d||W_y_b|| (empty without
    ``w_norm``)), all in rest's dtype; z_b = raw_y_b inv_y_b (raw_y_b without ``inv``)."""
    if usable_on(rest) and rest.dtype != torch.float64:
        return _triton_tail(rest, raw_y, inv, x_norm, w_norm, labels, kind, m, s, a, b)
    return _reference_tail(rest, raw_y, inv, x_norm, w_norm, labels, kind, m, s, a, b)


@margin_tail_operator.register_fake
def _(rest, raw_y, inv, x_norm, w_norm, labels, kind, m, s, a, b):
    return (rest.new_empty(()), torch.empty_like(rest), torch.empty_like(rest),
            rest.new_empty(0 if s > 0 else rest.shape[0]), rest.new_empty(rest.shape[0] if w_norm.numel() else 0))


def _triton_tail(rest, raw_y, inv, x_norm, w_norm, labels, kind, m, s, a, b):
    kernels = _margin_kernels()
    bsz = rest.shape[0]
    if bsz == 0:  # no rows: the mean of nothing, as the reference's cross_entropy
        return _reference_tail(rest, raw_y, inv, x_norm, w_norm, labels, kind, m, s, a, b)
    rest, raw_y, inv, x_norm, w_norm = (t.contiguous() for t in (rest, raw_y, inv, x_norm, w_norm))
    params = {"cosface": (m, 0.0), "arcface": (math.cos(m), math.sin(m)), "detached": (m, math.ceil(m) - 1.0)}
    p0, p1 = params.get(kind, (0.0, 0.0))
    loss = rest.new_empty(1)
    row_grad, label_grad = torch.empty_like(rest), torch.empty_like(rest)
    x_grad = rest.new_empty(0 if s > 0 else bsz)
    w_grad = rest.new_empty(bsz if w_norm.numel() else 0)
    block, warps = kernels.TAIL_BLOCKS
    kernels.tail_kernel[(1,)](rest, raw_y, launchable(inv), launchable(x_norm), launchable(w_norm),
                              labels.contiguous(), loss, row_grad, label_grad, launchable(x_grad),
                              launchable(w_grad), bsz, max(inv.numel(), w_norm.numel(), 1), s, a, b, p0, p1,
                              KIND=TAIL_KINDS.index(kind),
                              M=int(m) if kind in ("multiplicative", "lsoftmax") else 1, HAS_INV=bool(inv.numel()),
                              SCALE=0 if s > 0 else (2 if w_norm.numel() else 1), BLOCK=block, num_warps=warps)
    return loss[0], row_grad, label_grad, x_grad, w_grad


def margin_tail(rest: Tensor, raw_y: Tensor, inv: Tensor, x_norm: Tensor, w_norm: Tensor, labels: Tensor, kind: str,
                m: float, s: float | None, lam: float):
    """The loss of a fused margin head and its derivatives from the B values of its passes (module notes).

    Args:
        rest (Tensor[B]): log sum_{j != y_b} exp(z_bj).
        raw_y (Tensor[B]): the label column of the product x W^T.
        inv (Tensor[C] or empty): 1 / max(||W_j||, eps) for weight-normalised heads (z_b = raw_y_b inv_y_b).
        x_norm (Tensor[B] or empty): ||x_b||, the scale when ``s`` is None.
        w_norm (Tensor[C] or empty): ||W_j||, a factor of the scale for L-Softmax.
        labels (Tensor[B], int64), kind (str, one of :data:`TAIL_KINDS`), m (float): the margin.
        s (float or None): a constant scale, or None for ||x_b|| (times ||W_y_b|| with ``w_norm``).
        lam (float): the annealing lambda (inf: no margin).

    Returns:
        (loss, dL/drest, dL/dz, dL/d||x_b||, dL/d||W_y_b||), as ``torch.ops.sphereml.margin_tail``.
    """
    if kind not in TAIL_KINDS:
        raise ValueError(f"kind must be one of {TAIL_KINDS}, got {kind!r}")
    if w_norm.numel() and (kind != "lsoftmax" or s is not None):
        raise ValueError(f"w_norm (the class norms in the scale) goes with kind 'lsoftmax' and s None, got {kind!r}")
    if s is None and kind != "plain" and x_norm.shape != rest.shape:
        raise ValueError(f"s None scales by ||x_b||: x_norm must be Tensor[{rest.shape[0]}], got "
                         f"{tuple(x_norm.shape)}")
    a, b = anneal_weights(lam)
    return margin_tail_operator(rest, raw_y, inv, x_norm, w_norm, labels, kind, float(m),
                                0.0 if s is None else float(s), a, b)
