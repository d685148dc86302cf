"""Energies of point sets from their Gram matrices (Note [batched energy] in :mod:`~sphereml.energy.batched`).

:func:`gram_energies_reference` is the formula written plainly and differentiated by autograd;
:func:`gram_energies` computes the same numbers with a hand-written backward that recomputes from the Gram
matrices (saving nothing N x N) and, on a CPU, goes through the sets in cache-sized chunks.  Its pair chain is some
twenty element-wise operations forward and forty backward per bucket, each a launch on a GPU; with
:data:`PAIRS_BACKEND` choosing them (:func:`pairs_fused`), the euclidean chain runs instead as one Triton kernel
each way (:mod:`~sphereml.energy._pair_kernels`, custom operators ``sphereml::gram_pair_energies`` and
``sphereml::gram_pair_gradient``), with the same float64 arithmetic.

Note [the gradient of the batched energy]
    With d_i = g_ii, v_i = 1 / sqrt(max(d_i, 1e-24)), c_ij = g_ij v_i v_j, ||w_hat_i||^2 = u_i = d_i v_i^2 and
    E = sum_ij M_ij f(r^2_-) + P_ij f(r^2_+), r^2_-+ = u_i + u_j -+ 2 c_ij (euclidean) or
    E = sum_ij M_ij h(theta) + P_ij h(pi - theta), theta = arccos c_ij (angular):
    K_ij = dE/dc_ij is -2 M f'(r^2_-) + 2 P f'(r^2_+), or (M h'(theta) - P h'(pi - theta)) dtheta/dc;
    U_i = dE/du_i = 2 sum_j (M f'(r^2_-) + P f'(r^2_+))_ij (symmetric weights; zero for angular).
    Through c and u: dE/dg_ij = K_ij v_i v_j, plus on the diagonal -v_i^2 sum_j K_ij c_ij for a row
    above the norm floor (where u_i = 1 and its terms cancel), or U_i v_i^2 for a row below it (where v_i
    is constant).  Floors give zero slopes, as in every backend (Note [energy floor]).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor

from .._autograd import Function
from .._custom_ops import custom_op
from .triton_backend import cdiv, choose_backend, lazy_module, power_path, usable_on

__all__ = ["gram_energies", "gram_energies_reference", "CPU_CHUNK", "PAIRS_BACKEND", "pairs_fused"]

_NORM_FLOOR_SQ = 1e-24  # (1e-12)^2: normalize's floor on the norm, applied to the squared norm g_ii


def _values(r2: Tensor, s: float, eps: float) -> Tensor:
    """f_s of the chordal distance, r^2 floored at eps with a zero derivative below it (Note [energy floor])."""
    r2 = r2.clamp_min(eps)
    return -0.5 * torch.log(r2) if s == 0 else r2.pow(-0.5 * s)


def _angle_values(theta: Tensor, s: float) -> Tensor:
    """f_s of the geodesic distance theta (already floored through the clamp of the cosine)."""
    return -torch.log(theta) if s == 0 else theta.pow(-s)


def _angles(cos: Tensor, eps: float) -> Tensor:
    """theta = arccos(cos), the cosine clamped to ``|cos| <= 1 - eps/2`` (Note [energy floor]).  At the upper floor
    the other backends take the close pair's 2 arcsin(sqrt(eps) / 2), the same angle as arccos(1 - eps/2)
    without its rounding (Note [close pairs]), so that constant is used there."""
    bound = 1 - 0.5 * eps
    theta = torch.arccos(cos.clamp(-bound, bound))
    return torch.where(cos < bound, theta, 2 * math.asin(0.5 * math.sqrt(eps)))


def _cosines(gram: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(squared norms d_i = g_ii, v_i = 1 / max(||x_i||, 1e-12), cosines g_ij v_i v_j) of Gram matrices."""
    squared_norms = gram.diagonal(dim1=-2, dim2=-1)  # (B, N)
    inverse = squared_norms.clamp_min(_NORM_FLOOR_SQ).rsqrt()
    return squared_norms, inverse, gram * (inverse.unsqueeze(-1) * inverse.unsqueeze(-2))  # (B, N, N)


def gram_energies_reference(gram: Tensor, minus: Tensor, plus: Tensor | None, s: float, metric: str,
                            eps: float) -> Tensor:
    """:func:`gram_energies` written plainly, differentiated by autograd: the oracle of the fused version."""
    squared_norms, inverse, cos = _cosines(gram)
    if metric == "angular":  # theta of (w_i, -w_j) is pi - theta_ij
        theta = _angles(cos, eps)
        total = minus * _angle_values(theta, s)
        if plus is not None:
            total = total + plus * _angle_values(torch.pi - theta, s)
        return total.sum((-2, -1))
    unit_sq = squared_norms * inverse.square()  # ||w_hat||^2: 1, or 0 for a zero row
    base = unit_sq.unsqueeze(-1) + unit_sq.unsqueeze(-2)  # (B, N, N)
    total = minus * _values(base - 2 * cos, s, eps)
    if plus is not None:
        total = total + plus * _values(base + 2 * cos, s, eps)
    return total.sum((-2, -1))


def _slopes(r2: Tensor, weight: Tensor, s: float, eps: float) -> Tensor:
    """weight * df_s/d(r^2), zero below the floor (euclidean)."""
    clamped = r2.clamp_min(eps)
    slope = clamped.reciprocal().mul_(-0.5) if s == 0 else clamped.pow(-0.5 * s - 1).mul_(-0.5 * s)
    return torch.where(r2 > eps, slope.mul_(weight), 0.0)


def _angle_slopes(theta: Tensor, weight: Tensor, s: float) -> Tensor:
    """weight * df_s/d(theta)."""
    slope = theta.reciprocal().neg_() if s == 0 else theta.pow(-s - 1).mul_(-s)
    return slope.mul_(weight)


def _energy_chunk(gram: Tensor, minus: Tensor, plus: Tensor | None, s: float, metric: str, eps: float) -> Tensor:
    """Forward of :class:`_GramEnergies` on a chunk of sets (no graph)."""
    return gram_energies_reference(gram, minus, plus, s, metric, eps)


def _gradient_chunk(gram: Tensor, minus: Tensor, plus: Tensor | None, grad: Tensor, s: float, metric: str,
                    eps: float) -> Tensor:
    """dE/dgram of a chunk (Note [the gradient of the batched energy]), recomputed from the Gram matrices."""
    squared_norms, inverse, cos = _cosines(gram)
    scale = grad[:, None, None]
    if metric == "angular":
        bound = 1 - 0.5 * eps
        theta = _angles(cos, eps)
        per_cos = _angle_slopes(theta, minus, s)  # dE/dtheta_minus, then through theta_plus = pi - theta
        if plus is not None:
            per_cos.sub_(_angle_slopes(torch.pi - theta, plus, s))
        inside = cos.abs() < bound
        k = torch.where(inside, per_cos.mul_(scale).div_((1 - cos.square()).clamp_min(1e-300).sqrt_().neg_()), 0.0)
        per_unit_sq = None
    else:
        unit_sq = squared_norms * inverse.square()
        base = unit_sq.unsqueeze(-1) + unit_sq.unsqueeze(-2)
        a = _slopes(base - 2 * cos, minus, s, eps)  # dE/d(r^2) of the pairs (w_i, w_j)
        k = a.mul(-2.0)
        if plus is not None:
            b = _slopes(base + 2 * cos, plus, s, eps)  # ... of the pairs (w_i, -w_j)
            k.add_(b, alpha=2.0)
            a.add_(b)
        k.mul_(scale)
        per_unit_sq = a.sum(-1).mul_(2.0).mul_(grad[:, None])  # symmetric weights: row and column sums agree
    # Chain rule through cos_ij = g_ij v_i v_j and ||w_hat_i||^2 = g_ii v_i^2.
    diagonal = -(k * cos).sum(-1) * inverse.square()  # (B, N): through v_i, for rows above the norm floor
    floored = squared_norms <= _NORM_FLOOR_SQ
    if per_unit_sq is not None:
        diagonal = torch.where(floored, per_unit_sq * inverse.square(), diagonal)
    else:
        diagonal = torch.where(floored, 0.0, diagonal)
    out = k.mul_(inverse.unsqueeze(-1) * inverse.unsqueeze(-2))
    out.diagonal(dim1=-2, dim2=-1).add_(diagonal)
    return out


def _chunks(gram: Tensor) -> list[slice]:
    """Sets evaluated together: all at once on a GPU; on a CPU, chunks whose N x N temporaries stay in cache."""
    count, rows = gram.shape[0], gram.shape[-1]
    per = count if gram.device.type != "cpu" else max(1, CPU_CHUNK // (rows * rows))
    return [slice(i, min(i + per, count)) for i in range(0, count, per)]


PAIRS_BACKEND = "auto"  # the pair chain: "auto" (the kernels on CUDA with SPHEREML_FUSED=1), "fused", "reference"
_pair_kernels = lazy_module("sphereml.energy._pair_kernels")


def pairs_fused(gram: Tensor, metric: str) -> bool:
    """Whether a bucket's pair chain runs as the Triton kernels of :mod:`~sphereml.energy._pair_kernels`: the
    euclidean metric, :data:`PAIRS_BACKEND` choosing them (:func:`~sphereml.energy.triton_backend.choose_backend`),
    Triton usable on ``gram``, and no torch.func transform around it (the kernels have no batching rule)."""
    if metric != "euclidean" or choose_backend(PAIRS_BACKEND, gram) != "fused" or not usable_on(gram):
        return False
    return torch.compiler.is_compiling() or not is_functorch_wrapped_tensor(gram)


def _pair_launch(gram: Tensor, minus: Tensor, plus: Tensor | None, s: float, eps: float, grad: Tensor | None = None):
    """Run ``energy_kernel`` (``grad`` None: Tensor[B]) or ``gradient_kernel`` (Tensor[B, N, N])."""
    kernels = _pair_kernels()
    (count, rows, _), (bm, bn, warps) = gram.shape, kernels.PAIR_BLOCKS
    gram, minus = gram.contiguous(), minus.contiguous()
    plus_or_minus = minus if plus is None else plus.contiguous()
    params = _kernel_params(s, eps, gram.device)
    blocks = cdiv(rows, bm)
    options = {"HAS_PLUS": plus is not None, "POWER": power_path(s), "BM": bm, "BN": bn, "num_warps": warps}
    if grad is None:
        partial = gram.new_empty(count, blocks)
        kernels.energy_kernel[(count, blocks)](gram, minus, plus_or_minus, params, partial, rows, blocks, **options)
        return partial.sum(1)
    out = torch.empty_like(gram)
    kernels.gradient_kernel[(count, blocks)](gram, minus, plus_or_minus, params, grad.contiguous(), out, rows,
                                             **options)
    return out


_PARAMS: dict = {}  # (s, eps, device) -> Tensor[3] float64 on that device, made once (no copy per step)


def _kernel_params(s: float, eps: float, device: torch.device) -> Tensor:
    """(s, eps, the squared-norm floor) as float64 on ``device``: a float argument would reach the kernel as fp32."""
    key = (s, eps, device)
    if key not in _PARAMS:
        _PARAMS[key] = torch.tensor([s, eps, _NORM_FLOOR_SQ], dtype=torch.float64, device=device)
    return _PARAMS[key]


@custom_op("sphereml::gram_pair_energies", mutates_args=())
def gram_pair_energies(gram: Tensor, minus: Tensor, plus: Tensor | None, s: float, eps: float) -> Tensor:
    """The euclidean forward of :class:`_GramEnergies`: one kernel pass (and the partial sums' sum)."""
    if usable_on(gram):
        return _pair_launch(gram, minus, plus, s, eps)
    return _energy_chunk(gram, minus, plus, s, "euclidean", eps)


@gram_pair_energies.register_fake
def _(gram, minus, plus, s, eps):
    return gram.new_empty(gram.shape[0])


@custom_op("sphereml::gram_pair_gradient", mutates_args=())
def gram_pair_gradient(gram: Tensor, minus: Tensor, plus: Tensor | None, grad: Tensor, s: float, eps: float) -> Tensor:
    """The euclidean backward of :class:`_GramEnergies`: dE/dgram times ``grad``, one kernel pass."""
    if usable_on(gram):
        return _pair_launch(gram, minus, plus, s, eps, grad)
    return _gradient_chunk(gram, minus, plus, grad, s, "euclidean", eps)


@gram_pair_gradient.register_fake
def _(gram, minus, plus, grad, s, eps):
    return torch.empty_like(gram)


class _GramEnergies(Function):
    """:func:`gram_energies_reference` with a hand-written backward that recomputes from the Gram matrices
    (Note [the gradient of the batched energy]): nothing N x N is saved, and on a CPU the sets go through in
    cache-sized chunks.  Written in the form ``torch.func`` batches (``setup_context``, ``generate_vmap_rule``), so
    that :func:`~sphereml.multiseed.fit_seeds` can evaluate it for every seed at once."""

    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx, inputs, output):
        gram, minus, plus, s, metric, eps = inputs
        ctx.save_for_backward(gram, minus, plus)
        ctx.options = (s, metric, eps)

    @staticmethod
    def forward(gram, minus, plus, s, metric, eps):
        if pairs_fused(gram, metric):
            return gram_pair_energies(gram, minus, plus, s, eps)
        chunks = _chunks(gram)
        if len(chunks) == 1:  # a GPU's one chunk: no concatenation (a copy) of a single part
            return _energy_chunk(gram, minus, plus, s, metric, eps)
        return torch.cat([_energy_chunk(gram[c], minus[c], None if plus is None else plus[c], s, metric, eps)
                          for c in chunks])

    @staticmethod
    def backward(ctx, grad):
        gram, minus, plus = ctx.saved_tensors
        s, metric, eps = ctx.options
        if pairs_fused(gram, metric):
            return gram_pair_gradient(gram, minus, plus, grad, s, eps), None, None, None, None, None
        chunks = _chunks(gram)
        if len(chunks) == 1:
            return _gradient_chunk(gram, minus, plus, grad, *ctx.options), None, None, None, None, None
        out = torch.empty_like(gram)  # each chunk written once, from cache
        for c in chunks:
            out[c] = _gradient_chunk(gram[c], minus[c], None if plus is None else plus[c], grad[c], *ctx.options)
        return out, None, None, None, None, None


CPU_CHUNK = 2**16  # pairs per chunk of _GramEnergies on a CPU (512 KiB per float64 temporary)


def gram_energies(gram: Tensor, minus: Tensor, plus: Tensor | None, s: float, metric: str, eps: float) -> Tensor:
    """The weighted pair sums of Note [batched energy] from Gram matrices of unnormalised points.

    Args:
        gram (Tensor[B, N, N]): X X^T of each set (float64 for exact close pairs).
        minus, plus (Tensor[B, N, N]): each pair's share for (w_i, w_j) and for (w_i, -w_j), symmetric; ``plus``
            None when no set is half-space.
        s (float), metric (str), eps (float): as :func:`~sphereml.energy.hyperspherical_energy`.

    Returns:
        Tensor[B]: sum_ij minus_ij f(w_hat_i, w_hat_j) + plus_ij f(w_hat_i, -w_hat_j).
    """
    return _GramEnergies.apply(gram, minus, plus, s, metric, eps)
