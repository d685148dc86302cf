"""The functional core of compressive MHE (thesis Ch. 6, App. E): projected, group and bilateral energies, and
the angle distortion L_P with its closed-form gradient.  :class:`~sphereml.regularizers.comhe.CoMHE` computes the same
numbers for all layers at once; these functions are its readable references and the chapter's tools.

Note [projection scale]
    g(w) = P w / ||P w|| is invariant to the scale of P, so unscaled N(0, 1) entries are used.  Lemma 3's mean
    preservation E<P w1, P w2> = <w1, w2> needs entries of variance 1/k, where k is the number of rows of P;
    the thesis writes 1/n.  Chapter 7 checks both.

Note [the unrolled step's backward]
    The unrolled AP-CoMHE step P' = P - eta G(W) is a function of the neurons through G = grad_P L_P
    (:func:`angle_distortion_grad`), with eta a constant as in eq. 6.7 (the scale-free step sets
    eta = lr ||P|| / ||G|| afresh at each step from the values, and W's gradient does not pass through it).
    For one group of CNN-9's layers the step takes ~43 operations forward and autograd ~80 backward;
    :func:`unrolled_projection` writes the backward out (~45 operations), from the forward's terms
    (u, v the unit neurons and projections, r = 1/||P w||, S = share + share^T,
    M = 2 S (v v^T - u u^T) with grad_v = M v,
    rho = v . grad_v, grad_z = r (grad_v - rho v), G = grad_z^T W).  Given dL/dG = -eta dL/dP':

    * dL/dgrad_z = W dL/dG^T, and W's first term dL/dG's product with grad_z;
    * dL/dgrad_v = r dL/dgrad_z - a v with a = v . (r dL/dgrad_z), and v's terms -rho r dL/dgrad_z - a grad_v;
    * through M v: v gets M dL/dgrad_v + Q v with Q = 2 S (dL/dgrad_v v^T + v dL/dgrad_v^T), symmetric,
      and the unit neurons get -(sum over projections of Q) u;
    * each normalisation y = t / max(||t||, floor) passes dL/dt = (dL/dy - (y . dL/dy + c) y) / ||t|| (c the
      term through r, dL/dgrad_z . grad_z, for v; the radial part only above the floor, as clamp_min's
      gradient), and dL/dW gets the projection's sum over projections of dL/d(P w) P.

    This cut AP-CoMHE's CNN-9 step (four groups) from 816 operations to 670 (tests: autograd's gradient through
    the same forward to 1e-12 in float64, gradcheck with pad rows and a zero neuron, vmap over seeds).  Until
    2026-12-06 the scale-free eta was differentiated through ||G|| as well, a term eq. 6.7 does not have.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.autograd.function import once_differentiable

from .._autograd import Function
from .._checks import integer
from ..energy import BATCHED_MAX, hyperspherical_energy
from ..energy.batched import PointSets, SetEnergies
from ..geometry import normalize

__all__ = ["projected_energies", "angle_distortion", "angle_distortion_grad", "projection_step",
           "unrolled_projection", "unrolled_projection_reference", "group_energy", "bilateral_energy", "project"]

_FLOOR_SQ = 1e-24  # normalize's floor on the norm (1e-12), squared


def _rows(w: Tensor) -> Tensor:
    if not isinstance(w, Tensor) or w.dim() < 2:
        raise ValueError(f"w must be a Tensor[N, ...] with one neuron per row, got {getattr(w, 'shape', w)!r}")
    return w.flatten(1)  # (N, d)


def _check_projections(p: Tensor, d: int) -> Tensor:
    if not isinstance(p, Tensor) or p.dim() != 3 or p.shape[-1] != d:
        raise ValueError(f"p must be a Tensor[C, k, {d}] of projections, got {tuple(getattr(p, 'shape', ()))}")
    return p


def _set_energies(points: Tensor, s: float, half_space: bool, backend: str) -> Tensor:
    """The energy of each set of Tensor[B, N, d]: one batched call, or one call per set for other backends."""
    if backend in ("auto", "batched") and points.shape[1] <= BATCHED_MAX:
        engine = SetEnergies([PointSets(points.shape[1], (points.shape[1],) * len(points),
                                        (half_space,) * len(points))], s)
        return engine([points.to(torch.float64)])[0].to(points.dtype)
    return torch.stack([hyperspherical_energy(x, s, half_space=half_space, backend=backend) for x in points])


def projected_energies(w: Tensor, p: Tensor, s: float = 2.0, half_space: bool = True,
                       backend: str = "auto") -> Tensor:
    """The energy of the neurons projected by each P_c (thesis eqs. 6.3-6.5), as a Tensor[C].

    Args:
        w (Tensor[N, ...]): neurons, one per row (flattened).
        p (Tensor[C, k, d]): C projections to k dimensions.
        s, half_space, backend: as :func:`~sphereml.energy.hyperspherical_energy`, which normalises the
            projected rows: g(w) = P w / ||P w|| (half-space adds -g(w)).

    Returns:
        Tensor[C]: pair-mean energies; ``.mean()`` is RP-CoMHE (eq. 6.4), ``.amax()`` its max form (eq. 6.5).
    """
    flat = _rows(w)
    _check_projections(p, flat.shape[1])
    return _set_energies(flat @ p.mT, s, half_space, backend)  # (C, N, k) projected sets


def angle_distortion(w: Tensor, p: Tensor) -> Tensor:
    """L_P of eq. 6.6 with cosines for angles (as the authors' code does): the mean over pairs i != j and
    projections of (cos(P w_i, P w_j) - cos(w_i, w_j))^2.  Eq. 6.6 sums over pairs and the authors' code
    takes an unsquared Frobenius norm; the minimiser is the same, only the scale differs."""
    flat = _rows(w)
    _check_projections(p, flat.shape[1])
    if len(flat) < 2:
        raise ValueError(f"w must hold at least 2 neurons to have pairs, got {len(flat)}")
    unit = normalize(flat)
    cos = unit @ unit.mT  # (N, N)
    projected = normalize(flat @ p.mT)  # (C, N, k)
    cos_p = projected @ projected.mT  # (C, N, N)
    n = len(flat)
    off = 1.0 - torch.eye(n, dtype=flat.dtype, device=flat.device)
    return ((cos_p - cos) * off).pow(2).sum() / (len(p) * n * (n - 1))


def project(x: Tensor, p: Tensor) -> Tensor:
    """Tensor[L, N, d] by P (Tensor[C, k, d], shared; or Tensor[L, C, k, d], per layer) -> Tensor[L, C, N, k]."""
    if p.dim() == 3:
        c, k, d = p.shape
        return (x @ p.reshape(c * k, d).mT).unflatten(-1, (c, k)).transpose(1, 2)
    return torch.einsum("lnd,lckd->lcnk", x, p)


def angle_distortion_grad(x: Tensor, p: Tensor, share: Tensor) -> Tensor:
    """grad_P of each layer's L_P (eq. 6.6, as :func:`angle_distortion`), in closed form, batched.

    With v_i = P w_i / ||P w_i||, c_ij the cosines of the neurons, L = sum_ij share_ij (v_i . v_j - c_ij)^2 and
    A_ij = (share_ij + share_ji) (v_i . v_j - c_ij): dL/dv_i = 2 sum_j A_ij v_j,
    dL/d(P w_i) = (dL/dv_i - (dL/dv_i . v_i) v_i) / ||P w_i|| and
    dL/dP = sum_i dL/d(P w_i) w_i^T.  An explicit expression of W and P, so autograd differentiates it
    with respect to W in one ordinary backward pass (the unrolled AP-CoMHE, eq. 6.7; :func:`unrolled_projection`
    does it with fewer operations).

    Args:
        x (Tensor[L, N, d]): the neurons of L layers (zero rows pad short layers).
        p (Tensor[C, k, d] or Tensor[L, C, k, d]): the projections, shared by the layers or one set each.
        share (Tensor[L, N, N]): each ordered pair's weight in the sum, summed over the C projections (CoMHE's:
            1 / (C n (n - 1)) for real pairs i != j, else 0, so that L is the mean; any weights are allowed).

    Returns:
        Tensor[L, C, k, d]: the gradient of layer l's L_P with respect to its P.
    """
    return _distortion_terms(x, p, share)[0]


def projection_step(p: Tensor, grad: Tensor, rate: float, scale_free: bool = True) -> Tensor:
    """Each P_l (Tensor[L, ...]) moved along ``grad_l``: by ``rate * ||P_l|| / ||grad_l||`` (a scale-free step: P's
    scale is arbitrary, Note [projection scale]; the size is a constant to autograd, eq. 6.7's eta), or by ``rate``
    (``scale_free=False``, the authors' plain step)."""
    if not scale_free:
        return torch.add(p, grad, alpha=rate)
    return torch.addcmul(p, _step_size(p, grad, rate), grad)


_STEP_FLOOR = 1e-30  # the scale-free step: the least gradient norm it divides by


def _step_size(p: Tensor, grad: Tensor, rate: float) -> Tensor:
    """rate ||P_l|| / max(||grad_l||, floor) for each l of grad (Tensor[L, ...]), a constant to autograd (eq. 6.7's
    eta, set from the values); P is Tensor[L, ...] or one Tensor[...] for all l (Note [projection scale])."""
    norm = torch.linalg.vector_norm(grad.detach(), dim=tuple(range(1, grad.dim())), keepdim=True)
    p_dims = tuple(range(p.dim() - grad.dim() + 1, p.dim()))
    return torch.linalg.vector_norm(p.detach(), dim=p_dims, keepdim=True) * rate / norm.clamp_min(_STEP_FLOOR)


def unrolled_projection(x: Tensor, p: Tensor, share: Tensor, lr: float, scale_free: bool = True) -> Tensor:
    """P_l - lr (||P_l|| / ||G_l||) G_l for each layer l, with G = :func:`angle_distortion_grad` (x, p, share):
    one step of the projections against the angle distortion, as a function of the neurons through G, the step
    size a constant (the unrolled AP-CoMHE, eq. 6.7; ``scale_free=False``: P_l - lr G_l).  Differentiated in x
    by a backward written out (Note [the unrolled step's backward]) when P and the weights are constants, else
    (and in forward mode: ``torch.func.jvp``, ``forward_ad``) by autograd; the two give the same numbers
    (:func:`unrolled_projection_reference`).

    Returns:
        Tensor[L, C, k, d], in x's dtype.
    """
    if p.requires_grad or share.requires_grad or _has_tangent(x, p, share):
        return unrolled_projection_reference(x, p, share, lr, scale_free)
    with torch.autocast(x.device.type, enabled=False):  # the backward mixes saved terms with x: one dtype for all
        return _UnrolledProjection.apply(x, p, share, lr, scale_free)[0]


def _has_tangent(*tensors: Tensor) -> bool:
    """Whether forward mode (``torch.func.jvp``, ``forward_ad``) carries a tangent on any of ``tensors``."""
    return any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def unrolled_projection_reference(x: Tensor, p: Tensor, share: Tensor, lr: float, scale_free: bool = True) -> Tensor:
    """:func:`unrolled_projection` in autograd's operations: differentiable in x, P and the weights."""
    grad = angle_distortion_grad(x, p, share)
    return projection_step(p.expand_as(grad), grad, -lr, scale_free)


def _unit_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(x / max(||x||, 1e-12) along the last axis, the inverse of that norm, and 1.0 for the rows above the floor,
    0.0 for those below it, as :func:`_unit_backward` needs): normalize, keeping what its backward reads."""
    square = (x * x).sum(-1, keepdim=True)
    inverse = square.clamp_min(_FLOOR_SQ).rsqrt()
    return x * inverse, inverse, (square > _FLOOR_SQ).to(x.dtype)


def _distortion_terms(x: Tensor, p: Tensor, share: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    """(grad_P L_P, the intermediate terms its backward reads): :func:`angle_distortion_grad` step by step."""
    u, inverse_x, live_x = _unit_rows(x)
    v, inverse, live = _unit_rows(project(x, p))  # (L, C, N, k)
    share4 = (2 * (share + share.mT)).unsqueeze(1)  # (L, 1, N, N): 4 share for a symmetric one, as CoMHE's
    weights = share4 * (v @ v.mT - (u @ u.mT).unsqueeze(1))  # symmetric: grad_v = weights v
    grad_v = weights @ v
    radial = live * (grad_v * v).sum(-1, keepdim=True)
    grad_z = inverse * torch.addcmul(grad_v, radial, v, value=-1.0)
    return grad_z.mT @ x.unsqueeze(1), (u, inverse_x, live_x, v, inverse, live, share4, weights, grad_v, radial, grad_z)


def _unit_backward(grad_unit: Tensor, unit: Tensor, inverse: Tensor, live: Tensor, extra: Tensor | None = None):
    """dL/dx of unit = x * inverse (inverse = 1 / max(||x||, floor)), given dL/dunit and dL/dinverse * inverse
    (``extra``, none if inverse is used only through unit): inverse * (grad_unit - [||x|| > floor] (unit . grad_unit
    + extra) unit)."""
    along = (grad_unit * unit).sum(-1, keepdim=True)
    radial = live * (along if extra is None else along + extra)
    return inverse * torch.addcmul(grad_unit, radial, unit, value=-1.0)


def _bmm(a: Tensor, b: Tensor, out: Tensor | None = None, beta: float = 1.0) -> Tensor:
    """a @ b (+ beta * out) over the leading dimensions of Tensor[..., m, n] and Tensor[..., n, p] of one shape."""
    batch = a.shape[:-2]
    a, b = a.flatten(0, -3), b.flatten(0, -3)
    product = torch.bmm(a, b) if out is None else torch.baddbmm(out.flatten(0, -3), a, b, beta=beta)
    return product.unflatten(0, batch)


class _UnrolledProjection(Function):
    """:func:`unrolled_projection`, its backward in x written out (Note [the unrolled step's backward]).  Returns the
    stepped projections and, as outputs that carry no gradient, what the backward reads."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, p: Tensor, share: Tensor, lr: float, scale_free: bool) -> tuple[Tensor, ...]:
        grad, terms = _distortion_terms(x, p, share)
        size = _step_size(p, grad, -lr) if scale_free else torch.full((), -lr, dtype=x.dtype, device=x.device)
        return torch.addcmul(p, size, grad), grad, size, *terms

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, p, *_ = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # no zeros for the outputs that carry no gradient
        ctx.save_for_backward(x, p, *output[1:])

    @staticmethod
    @once_differentiable  # first order only: a second derivative raises rather than treat saved terms as constants
    def backward(ctx, grad_out: Tensor | None, *unused) -> tuple[Tensor | None, None, None, None, None]:
        if grad_out is None:  # the stepped projections unused
            return None, None, None, None, None
        x, p, _, size, *rest = ctx.saved_tensors  # out = p + size grad, size a constant
        return _distortion_backward(x, p, size * grad_out, *rest), None, None, None, None


def _distortion_backward(x: Tensor, p: Tensor, grad_grad: Tensor, u, inverse_x, live_x, v, inverse, live, share4,
                         weights, grad_v, radial, grad_z) -> Tensor:
    """dL/dx of G = :func:`angle_distortion_grad` (x, p, share), given dL/dG (Note [the unrolled step's backward])."""
    grad_grad_z = project(x, grad_grad)  # (L, C, N, k); G = grad_z^T x
    grad_x = torch.einsum("lcnk,lckd->lnd", grad_z, grad_grad)
    # grad_z = inverse * (grad_v - radial v), radial = [live] v . grad_v
    direct = inverse * grad_grad_z
    along = live * (direct * v).sum(-1, keepdim=True)
    grad_grad_v = torch.addcmul(direct, along, v, value=-1.0)
    # grad_v = weights v with weights = share4 (v v^T - cos): v as the factor, v in the weights, the cosines
    outer = _bmm(grad_grad_v, v.mT)
    pair = share4 * (outer + outer.mT)  # symmetric
    grad_unit_v = _bmm(pair, v, _bmm(weights, grad_grad_v, torch.addcmul(radial * direct, along, grad_v), beta=-1.0))
    # v = z * inverse(z): dL/dinverse * inverse = dL/dgrad_z . grad_z
    extra = (grad_grad_z * grad_z).sum(-1, keepdim=True)
    grad_z_of_x = _unit_backward(grad_unit_v, v, inverse, live, extra)
    through_p = torch.einsum("lcnk,ckd->lnd" if p.dim() == 3 else "lcnk,lckd->lnd", grad_z_of_x, p)
    cosines = pair.sum(1) if pair.shape[1] > 1 else pair.squeeze(1)
    return grad_x + through_p - _unit_backward(_bmm(cosines, u), u, inverse_x, live_x)


def group_energy(w: Tensor, group_size: int, s: float = 2.0, half_space: bool = True, backend: str = "auto") -> Tensor:
    """Group CoMHE (eq. 6.9): the mean over channel groups of the energy of the neurons restricted to a group.

    P_c keeps the coordinates of ``group_size`` consecutive input channels (a 0/1 diagonal matrix; the groups
    partition the channels).  For a conv weight Tensor[N, C_in, k, k] a channel is C_in's axis; for a linear
    weight Tensor[N, d], one input coordinate (:class:`~sphereml.regularizers.comhe.CoMHE` passes a linear layer
    that reads a conv layer's C maps as Tensor[N, C, d / C]: ``CoMHE.neuron_shape``).

    Args:
        w (Tensor[N, C_in, ...]): neurons.
        group_size (int): channels per group; must divide C_in (the thesis: 8).
    """
    if not isinstance(w, Tensor) or w.dim() < 2:
        raise ValueError(f"w must be a Tensor[N, C_in, ...], got {getattr(w, 'shape', w)!r}")
    integer("group_size", group_size, at_least=1)
    if w.shape[1] % group_size:
        raise ValueError(f"group_size must divide the {w.shape[1]} input channels, got {group_size}")
    groups = w.unflatten(1, (-1, group_size)).transpose(0, 1).flatten(2)  # (G, N, group_size * k * k)
    return _set_energies(groups, s, half_space, backend).mean()


def bilateral_energy(w: Tensor, p1: Tensor, p2: Tensor, s: float = 2.0, half_space: bool = True,
                     backend: str = "auto") -> Tensor:
    """Plain bilateral-projection CoMHE (eqs. E.20-E.22) in the rows-are-neurons layout:
    E(rows of W P1^T) + E(rows of P2 W) — the neurons projected to k dimensions, and r random
    combinations of the neurons in the original d dimensions.

    Args:
        w (Tensor[N, ...]): neurons.
        p1 (Tensor[k, d]): the projection of the neurons.
        p2 (Tensor[r, N]): the combinations, r >= 2.
    """
    flat = _rows(w)
    if p1.dim() != 2 or p1.shape[1] != flat.shape[1]:
        raise ValueError(f"p1 must be a Tensor[k, {flat.shape[1]}], got {tuple(p1.shape)}")
    if p2.dim() != 2 or p2.shape[1] != len(flat) or len(p2) < 2:
        raise ValueError(f"p2 must be a Tensor[r >= 2, {len(flat)}], got {tuple(p2.shape)}")
    projected = hyperspherical_energy(flat @ p1.mT, s, half_space=half_space, backend=backend)
    return projected + hyperspherical_energy(p2 @ flat, s, half_space=half_space, backend=backend)
