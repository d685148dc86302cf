"""The functional core of compressive MHE (thesis Ch. 6, App. E): projected, group and bilateral energies, and
the angle distortion L_P with its closed-form gradient.  :class:`~sphereml.regularizers.comhe.CoMHE` computes the same
numbers for all layers at once; these functions are its readable references and the chapter's tools.

Note [projection scale]
    g(w) = P w / ||P w|| is invariant to the scale of P, so unscaled N(0, 1) entries are used.  Lemma 3's mean
    preservation E<P w1, P w2> = <w1, w2> needs entries of variance 1/k, where k is the number of rows of P;
    the thesis writes 1/n.  Chapter 7 checks both.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import integer
from ..energy import BATCHED_MAX, hyperspherical_energy
from ..energy.batched import PointSets, SetEnergies
from ..geometry import normalize

__all__ = ["projected_energies", "angle_distortion", "angle_distortion_grad", "group_energy", "bilateral_energy",
           "project"]

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


def _unit(x: Tensor) -> tuple[Tensor, Tensor]:
    """(x / max(||x||, 1e-12) along the last axis, that scale): normalize, keeping the inverse norm."""
    inverse = (x * x).sum(-1, keepdim=True).clamp_min(_FLOOR_SQ).rsqrt()
    return x * inverse, inverse


def project(x: Tensor, p: Tensor) -> Tensor:
    """Tensor[L, N, d] by P (Tensor[C, k, d], shared; or Tensor[L, C, k, d], per layer) -> Tensor[L, C, N, k]."""
    if p.dim() == 3:
        c, k, d = p.shape
        return (x @ p.reshape(c * k, d).mT).unflatten(-1, (c, k)).transpose(1, 2)
    return torch.einsum("lnd,lckd->lcnk", x, p)


def angle_distortion_grad(x: Tensor, p: Tensor, share: Tensor) -> Tensor:
    """grad_P of each layer's L_P (eq. 6.6, as :func:`angle_distortion`), in closed form, batched.

    With v_i = P w_i / ||P w_i||, c_ij the cosines of the neurons and A_ij = 2 share_ij (v_i . v_j - c_ij):
    dL/dv_i = 2 sum_j A_ij v_j, dL/d(P w_i) = (dL/dv_i - (dL/dv_i . v_i) v_i) / ||P w_i|| and
    dL/dP = sum_i dL/d(P w_i) w_i^T.  An explicit expression of W and P, so autograd differentiates it
    with respect to W in one ordinary backward pass (the unrolled AP-CoMHE, eq. 6.7).

    Args:
        x (Tensor[L, N, d]): the neurons of L layers (zero rows pad short layers).
        p (Tensor[C, k, d] or Tensor[L, C, k, d]): the projections, shared by the layers or one set each.
        share (Tensor[L, N, N]): each pair's weight in the mean (1 / (C n (n - 1)) for real pairs i != j, else 0).

    Returns:
        Tensor[L, C, k, d]: the gradient of layer l's L_P with respect to its P.
    """
    unit, _ = _unit(x)
    cos = unit @ unit.mT  # (L, N, N)
    z = project(x, p)  # (L, C, N, k)
    v, inverse = _unit(z)
    a = 2 * share.unsqueeze(1) * (v @ v.mT - cos.unsqueeze(1))  # (L, C, N, N), symmetric
    grad_v = 2 * a @ v  # (L, C, N, k)
    radial = torch.where(inverse.square() < 1 / _FLOOR_SQ, (grad_v * v).sum(-1, keepdim=True), 0.0)
    grad_z = inverse * (grad_v - radial * v)
    return grad_z.mT @ x.unsqueeze(1)  # (L, C, k, d)


def group_energy(w: Tensor, group_size: int, s: float = 2.0, half_space: bool = True, backend: str = "auto") -> Tensor:
    """Group CoMHE (eq. 6.9): the mean over channel groups of the energy of the neurons restricted to a group.

    P_c keeps the coordinates of ``group_size`` consecutive input channels (a 0/1 diagonal matrix; the groups
    partition the channels).  For a conv weight Tensor[N, C_in, k, k] a channel is C_in's axis; for a linear
    weight Tensor[N, d], one input coordinate.

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
