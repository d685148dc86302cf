"""Hyperspherical energy (thesis Ch. 5, eqs. 5.1-5.5, D.10): one function, three interchangeable backends.

    E = mean over ordered pairs i != j of f_s(dist(w_hat_i, w_hat_j)),
    f_s(r) = r^(-s) for s > 0,  f_0(r) = log(1 / r),

with w_hat_i = w_i / ||w_i|| (rows of ``w`` are neurons; a conv kernel is flattened).  The
thesis's E_s of eq. 5.1 sums the same terms, so E_s = N (N - 1) E; the regulariser of eq. 5.4
uses exactly this pair mean.  Published Thomson energies count *unordered* pairs: for s = 1
on S^2, E_Thomson = N (N - 1) E / 2.

Backends (same values and gradients): ``dense`` (:mod:`~sphereml.energy.dense`, the reference),
``tiled`` (:mod:`~sphereml.energy.tiled`, O(N * block) memory, CPU or GPU) and ``triton``
(:mod:`~sphereml.energy.triton_backend`, fused kernels, Euclidean metric).  ``auto`` picks
triton on CUDA when it is importable, otherwise tiled above ``TILED_ABOVE`` points, else dense.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import real_number
from ..geometry import normalize
from .dense import dense_energy
from .kernels import METRICS, pair_values
from .tiled import tiled_energy
from .triton_backend import triton_energy, triton_importable, usable_on

__all__ = ["hyperspherical_energy", "minibatch_energy", "energy_metric", "output_energy", "BACKENDS", "METRICS"]

BACKENDS = ("auto", "dense", "tiled", "triton")
TILED_ABOVE = 2048


def _check_s(s: float) -> float:
    return real_number("s", s, at_least=0.0)


def _points(w: Tensor, metric: str, half_space: bool, weights: Tensor | None) -> Tensor:
    if not isinstance(w, Tensor) or w.dim() < 2:
        raise ValueError(f"w must be a Tensor[N, ...] with one neuron per row, got {getattr(w, 'shape', w)!r}")
    if len(w) < 2:
        raise ValueError(f"the energy needs at least 2 neurons, got {len(w)}")
    if not torch.is_floating_point(w) or not bool(torch.isfinite(w).all()):
        raise ValueError("w must be a floating-point tensor with finite entries")
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    points = normalize(w.flatten(1))  # (N, d)
    if weights is not None:
        if metric != "euclidean":
            raise ValueError("weights (weighted MHE, eq. D.10) are defined for the euclidean metric only")
        weights = torch.as_tensor(weights, dtype=points.dtype, device=points.device)
        if weights.shape != (len(w),) or not bool(torch.isfinite(weights).all()) or not bool((weights > 0).all()):
            raise ValueError(f"weights must be a positive finite Tensor[{len(w)}]")
        points = weights[:, None] * points
    if half_space:
        points = torch.cat([points, -points])  # the virtual neurons -w_hat_k (§5.3.4)
    return points


def _backend_for(points: Tensor, metric: str, backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        if metric != "euclidean":
            raise ValueError("the triton backend fuses the euclidean metric only; use backend='tiled' for angular")
        if not triton_importable():
            raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
        if not usable_on(points):
            raise RuntimeError("backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1)")
        return "triton"
    if backend != "auto":
        return backend
    if points.is_cuda and metric == "euclidean" and triton_importable():
        return "triton"
    return "tiled" if len(points) > TILED_ABOVE else "dense"


def hyperspherical_energy(w: Tensor, s: float = 2.0, metric: str = "euclidean", half_space: bool = False,
                          weights: Tensor | None = None, backend: str = "auto", eps: float = 1e-7) -> Tensor:
    """Pair-mean hyperspherical energy of the rows of ``w`` (eqs. 5.1-5.3; 5.5 angular; §5.3.4 half space; D.10).

    Args:
        w (Tensor[N, ...]): neurons, one per row (further axes are flattened); N >= 2.
        s (float): Riesz exponent >= 0; s = 0 is the logarithmic energy. Default: 2.
        metric (str): ``"euclidean"`` (chordal distance, eq. 5.1) or ``"angular"`` (geodesic, eq. 5.5).
        half_space (bool): add the virtual neurons -w_hat_i and average over the 2N (2N - 1)
            ordered pairs of the 2N points (eq. E.2). Default: False.
        weights (Tensor[N], optional): fixed beta_i > 0 of weighted MHE, points beta_i w_hat_i (eq. D.10).
        backend (str): ``"auto"``, ``"dense"``, ``"tiled"`` or ``"triton"``.
        eps (float): floor on squared distances, see Note [energy floor] in :mod:`~sphereml.energy.kernels`.

    Returns:
        0-dim Tensor, differentiable with respect to ``w`` (through the normalisation).
    """
    s = _check_s(s)
    if not 0 < eps < 1:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    points = _points(w, metric, half_space, weights)
    chosen = _backend_for(points, metric, backend)
    if chosen == "dense":
        return dense_energy(points, s, metric, eps)
    if chosen == "tiled":
        return tiled_energy(points, s, metric, eps)
    return triton_energy(points, s, eps)


def minibatch_energy(w: Tensor, batch: int, s: float = 2.0, metric: str = "euclidean",
                     generator: torch.Generator | None = None, **kwargs) -> Tensor:
    """The energy of ``batch`` neurons drawn uniformly without replacement (thesis §5.3.6).

    Every ordered pair of distinct neurons is equally likely to appear, so the pair mean of
    the subset is an unbiased estimate of the full pair mean (full-space and weighted
    energies; the half-space energy of a subset over-weights the constant pairs (w, -w)).
    """
    if not isinstance(batch, int) or not 2 <= batch <= len(w):
        raise ValueError(f"batch must be an integer in [2, {len(w)}], got {batch!r}")
    idx = torch.randperm(len(w), generator=generator)[:batch].to(w.device)
    weights = kwargs.pop("weights", None)
    if weights is not None:
        kwargs["weights"] = torch.as_tensor(weights, device=w.device)[idx]
    return hyperspherical_energy(w[idx], s=s, metric=metric, **kwargs)


@torch.no_grad()
def energy_metric(w: Tensor, s: float = 2.0, metric: str = "euclidean", half_space: bool = False) -> float:
    """The energy as a number for analysis (no graph; tiled or triton above a few thousand neurons)."""
    return float(hyperspherical_energy(w.detach(), s=s, metric=metric, half_space=half_space))


def output_energy(weight: Tensor, labels: Tensor, s: float = 2.0, eps: float = 1e-7) -> Tensor:
    """The data-dependent output-layer MHE of SphereFace+ (thesis eq. 5.8, second term).

    (1 / (m (N - 1))) sum_i sum_{j != y_i} f_s(||w_hat_{y_i} - w_hat_j||): each sample pushes its
    own class weight away from all other class weights, so only the classes present in the
    batch receive a repulsive gradient of their own.

    Args:
        weight (Tensor[N, d]): classifier weights, one row per class.
        labels (Tensor[m], int64): the batch labels.
    """
    s = _check_s(s)
    if weight.dim() != 2 or len(weight) < 2:
        raise ValueError(f"weight must be Tensor[N >= 2, d], got {tuple(weight.shape)}")
    if labels.dtype != torch.long or labels.dim() != 1 or (labels.numel() and (
            int(labels.min()) < 0 or int(labels.max()) >= len(weight))):
        raise ValueError(f"labels must be an int64 Tensor[m] with values in [0, {len(weight)})")
    unit = normalize(weight)
    gram = unit[labels] @ unit.T  # (m, N)
    ones = torch.ones(1, 1, dtype=unit.dtype, device=unit.device)
    values, _ = pair_values(gram, ones, ones.T, s, "euclidean", eps)
    others = torch.ones_like(values, dtype=torch.bool).scatter(1, labels[:, None], False)
    return values[others].mean()
