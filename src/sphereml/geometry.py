"""Geometry on the unit hypersphere :math:`S^{d-1}`.

Thesis Ch. 1 (eq. 1.1) motivates measuring similarity by angle rather than by
Euclidean distance or inner product; every later chapter uses the helpers here.

Note [no arccos at ``|cos| = 1``]
    d/dc arccos(c) = -1/sqrt(1 - c^2) is infinite at c = +-1, which is exactly
    where a feature and a classifier weight agree (or oppose) perfectly.  We
    therefore never call ``torch.arccos`` on an unclamped cosine:
    :func:`safe_angle` clamps to [-1 + eps, 1 - eps] first, so the gradient is
    bounded by 1/sqrt(2 eps - eps^2) inside the interval and is zero outside it.
    Norms get an ``eps`` floor so that zero vectors give finite values and
    gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import integer

__all__ = [
    "max_abs_scale", "safe_norm", "normalize", "cosine_matrix", "safe_angle", "angle_matrix", "pair_cosines",
    "pair_angles", "min_pair_angle", "most_collinear_pair", "sample_sphere",
]


def _check_eps(eps: float) -> None:
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")


def max_abs_scale(x: Tensor, dim) -> Tensor:
    """The largest absolute entry over ``dim`` (an int or a tuple, kept as size-1 axes), detached and floored
    at the dtype's smallest normal number: what to divide by before squaring, so that the squares neither
    overflow nor underflow."""
    return x.detach().abs().amax(dim=dim, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


def safe_norm(x: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor:
    """||x|| along ``dim`` with no overflow or underflow of the squares: s ||x / s|| with s = max_i abs(x_i).

    ``torch.linalg.vector_norm`` squares the entries, so in float32 (and bfloat16) a vector longer than
    about 1.8e19 has norm inf and one shorter than about 1e-19 has norm 0.  The scale s is detached, so the
    gradient is exactly x / ||x||; a zero vector has norm 0.
    """
    scale = max_abs_scale(x, dim)
    norm = torch.linalg.vector_norm(x / scale, dim=dim, keepdim=True) * scale
    return norm if keepdim else norm.squeeze(dim)


def normalize(x: Tensor, dim: int = -1, eps: float = 1e-12) -> Tensor:
    """Project ``x`` onto the unit sphere along ``dim``: x / max(||x||, eps).

    Args:
        x (Tensor[..., d, ...]): vectors to normalise.
        dim (int): the dimension that holds the vector coordinates. Default: -1.
        eps (float): floor on the norm, so a zero vector maps to zero with a
            finite gradient. Default: 1e-12.

    Returns:
        Tensor of the same shape, unit norm along ``dim`` (zero vectors stay zero).
    """
    _check_eps(eps)
    return x / safe_norm(x, dim=dim, keepdim=True).clamp_min(eps)


def cosine_matrix(a: Tensor, b: Tensor | None = None, eps: float = 1e-12) -> Tensor:
    """Pairwise cosines cos(theta_ij) = a_i . b_j / (||a_i|| ||b_j||) (thesis Sec. 1.1, d_C).

    Args:
        a (Tensor[N, d]): first set of vectors.
        b (Tensor[M, d], optional): second set; ``a`` itself when omitted.
        eps (float): norm floor, see :func:`normalize`. Default: 1e-12.

    Returns:
        Tensor[N, M] with entries in [-1, 1] (0 for any zero vector).
    """
    if a.dim() != 2:
        raise ValueError(f"a must be Tensor[N, d], got shape {tuple(a.shape)}")
    if b is None:
        b = a
    if b.dim() != 2 or b.shape[1] != a.shape[1]:
        raise ValueError(f"b must be Tensor[M, {a.shape[1]}], got shape {tuple(b.shape)}")
    return (normalize(a, eps=eps) @ normalize(b, eps=eps).T).clamp(-1.0, 1.0)  # (N, M)


def safe_angle(cos: Tensor, eps: float = 1e-7) -> Tensor:
    """theta = arccos(cos) with a finite gradient everywhere (Note [no arccos at ``|cos| = 1``]).

    Args:
        cos (Tensor): cosines, any shape; values outside [-1, 1] are clamped.
        eps (float): distance kept from +-1 before arccos. Default: 1e-7, which
            bounds the magnitude of d theta / d cos by about 2.2e3 (float32 resolves it).

    Returns:
        Tensor of angles in [0, pi], same shape as ``cos``; off by at most
        sqrt(2 eps) radians at the poles.
    """
    _check_eps(eps)
    if eps >= 1:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    return torch.arccos(cos.clamp(-1.0 + eps, 1.0 - eps))


def angle_matrix(a: Tensor, b: Tensor | None = None, eps: float = 1e-7) -> Tensor:
    """Pairwise angles theta_ij in [0, pi] between rows of ``a`` and ``b``.

    Args:
        a (Tensor[N, d]), b (Tensor[M, d], optional): as in :func:`cosine_matrix`.
        eps (float): see :func:`safe_angle`.

    Returns:
        Tensor[N, M].
    """
    return safe_angle(cosine_matrix(a, b), eps=eps)


def pair_cosines(w: Tensor) -> Tensor:
    """The cosines of the N (N - 1) / 2 unordered pairs of distinct neurons (rows of ``w``, flattened).

    Args:
        w (Tensor[N, ...]): neurons, one per row; N >= 2.

    Returns:
        Tensor[N (N - 1) / 2], pair (i, j), i < j, in the order of ``torch.triu_indices(N, N, 1)``.
    """
    if not isinstance(w, Tensor) or w.dim() < 2 or len(w) < 2:
        raise ValueError(f"w must be a Tensor[N >= 2, ...] with one neuron per row, got {getattr(w, 'shape', w)!r}")
    i, j = torch.triu_indices(len(w), len(w), 1, device=w.device)
    return cosine_matrix(w.flatten(1))[i, j]


def pair_angles(w: Tensor, lines: bool = False, eps: float = 1e-7) -> Tensor:
    """The angles (radians) of the unordered pairs of distinct neurons, in the order of :func:`pair_cosines`.

    With ``lines=True`` a neuron and its negative count as one direction (the half-space view of
    thesis §5.3.4): the angle between the lines the two neurons span, min(theta, pi - theta), in [0, pi / 2].
    Angles come from :func:`safe_angle` (finite gradients; ``eps`` as there).
    """
    cos = pair_cosines(w)
    return safe_angle(cos.abs() if lines else cos, eps=eps)


def min_pair_angle(w: Tensor, lines: bool = False, eps: float = 1e-7) -> Tensor:
    """The smallest angle (radians, 0-dim Tensor) between two distinct neurons, or between the lines they span
    (``lines=True``): how close the most redundant pair of a layer is (:func:`pair_angles`)."""
    return pair_angles(w, lines, eps).min()


def most_collinear_pair(weights) -> tuple[int, float]:
    """Over several layers' neurons (Tensors with one neuron per row), the index of the layer holding the most
    collinear pair of distinct neurons and that pair's signed cosine (the largest absolute cosine; a host read, not
    per step)."""
    extremes = [c[c.abs().argmax()] for c in (pair_cosines(w.detach()) for w in weights)]
    if not extremes:
        raise ValueError("most_collinear_pair needs at least one layer")
    layer = int(torch.stack(extremes).abs().argmax())
    return layer, float(extremes[layer])


def sample_sphere(
    n: int,
    d: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Draw ``n`` points uniformly from :math:`S^{d-1}` (normalised standard Gaussians).

    The Gaussian is rotation invariant, so its direction is uniform on the sphere.

    Args:
        n (int): number of points, >= 0.
        d (int): ambient dimension, >= 1.
        generator (torch.Generator, optional): source of randomness.

    Returns:
        Tensor[n, d] of unit rows.
    """
    integer("n", n, at_least=0)
    integer("d", d, at_least=1)
    z = torch.randn(n, d, generator=generator, dtype=dtype, device=device)  # (n, d)
    # A Gaussian draw of exactly zero has probability zero; redraw it anyway.
    while n and bool((torch.linalg.vector_norm(z, dim=1) == 0).any()):
        bad = torch.linalg.vector_norm(z, dim=1) == 0
        z[bad] = torch.randn(int(bad.sum()), d, generator=generator, dtype=z.dtype, device=z.device)
    return normalize(z)
