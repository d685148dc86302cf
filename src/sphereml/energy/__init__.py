"""Hyperspherical energy (thesis Ch. 5, eqs. 5.1-5.5, D.10): one function, three interchangeable backends.

    E = mean over ordered pairs i != j of f_s(dist(w_hat_i, w_hat_j)),
    f_s(r) = r^(-s) for s > 0,  f_0(r) = log(1 / r),

with w_hat_i = w_i / ||w_i|| (rows of ``w`` are neurons; a conv kernel is flattened).  The
thesis's E_s of eq. 5.1 sums the same terms, so E_s = N (N - 1) E; the regulariser of eq. 5.4
uses exactly this pair mean.  Published Thomson energies count *unordered* pairs: for s = 1
on S^2, E_Thomson = N (N - 1) E / 2.

Backends (same values and gradients): ``dense`` (:mod:`~sphereml.energy.dense`, the reference),
``tiled`` (:mod:`~sphereml.energy.tiled`, O(N * block) memory, CPU or GPU), ``triton``
(:mod:`~sphereml.energy.triton_backend`, fused kernels, Euclidean metric, float32 arithmetic) and ``gemm``
(:mod:`~sphereml.energy.gemm_backend`: cuBLAS products with one Triton kernel between them, Euclidean, float32,
no host synchronisation).
``auto`` decides from the tensor: float32 or half CUDA tensors go to triton when the matmul
precision allows TF32 ("high" or "medium") and there are more than ``TRITON_ABOVE`` points (the
kernel's exact-float32 path is slower than dense; see :mod:`~sphereml.energy.triton_backend`);
CUDA sets of at most ``TILED_ABOVE_CUDA`` points go to batched; larger float32 or half Euclidean ones that
triton does not take go to gemm, which does the work of tiled with fewer products and passes and without its
host synchronisations (chosen by that count; not yet timed on a GPU); everything else, float64 included, goes to
tiled above ``TILED_ABOVE`` points (``TILED_ABOVE_CUDA`` on CUDA), else dense.  ``auto`` never computes float64
input in float32, and an explicit ``backend="triton"`` or ``"gemm"`` with float64 input raises.  Without triton,
``auto`` on CUDA warns once and uses batched / tiled.

Precision: every backend computes close pairs of neurons exactly (Note [close pairs] in
:mod:`~sphereml.energy.kernels`).  Other pairs come from Gram matrix products at the precision
of ``torch.get_float32_matmul_precision()`` for float32 input: ``"highest"`` (the default)
is exact float32, ``"high"`` and ``"medium"`` allow TF32 (cuBLAS in dense / tiled, ``tf32`` in
the triton kernels).  Value checks that would read a GPU tensor (finite entries, positive
weights, label range) run on CPU tensors only, so a training step never synchronises the
device for them.
"""

from __future__ import annotations

import functools
import warnings
from typing import Sequence

import torch
from torch import Tensor, nn

from .._checks import integer, labels as _check_labels, one_of, real_number, values_readable
from ..geometry import normalize
from .batched import REDUCTIONS, LayerEnergies, PointSets, pair_weights
from .gram import gram_energies
from .dense import dense_energy
from .gemm_backend import gemm_energy
from .kernels import METRICS, pair_values
from .minimise import minimal_energy_points
from .sharded import sharded_energy
from .tiled import tiled_energy
from .triton_backend import TRITON_DTYPES, matmul_precision, triton_energy, triton_importable, usable_on

__all__ = ["hyperspherical_energy", "minibatch_energy", "sharded_energy", "energy_metric", "layer_energy",
           "output_energy", "minimal_energy_points", "BACKENDS", "BATCHED_MAX", "METRICS", "REDUCTIONS"]

BACKENDS = ("auto", "dense", "tiled", "triton", "gemm", "batched")
# Layers of at most this many neurons go to the batched, sync-free evaluation (Note [batched energy]) in the
# regularisers, and single sets of at most this many points to backend "batched" under "auto" on CUDA: its
# float64 Gram matrices and pair weights hold 8 N^2 bytes each (32 MiB at 2048).
BATCHED_MAX = 2048
# Above this many points (2N for half_space) ``auto`` leaves dense for tiled on the CPU.  Set from
# benchmarks/results/energy_fwd_bwd-cpu.json, "crossover" (d = 256, s = 2, fwd + bwd, one thread): the
# largest N at which dense is still faster ("fast_above").
TILED_ABOVE = 64
# The same switch for CUDA tensors: the float64 "crossover" of benchmarks/results/energy_fwd_bwd-cuda.json.
TILED_ABOVE_CUDA = 1024
# Float32 / half CUDA tensors at TF32 precision: triton above this many points, from the float32 dense vs
# triton "crossover" of the same file (measured at "highest", the kernel's slowest setting, where small sizes
# are noisy: triton wins some sizes below it and every size from 8192 on).
TRITON_ABOVE = 2048
_warned_no_triton = False


def _check_s(s: float) -> float:
    return real_number("s", s, at_least=0.0)


def _check_w(w: Tensor) -> Tensor:
    """Neurons ``Tensor[N >= 2, ...]`` of a floating dtype; finite entries checked on the CPU only (no sync)."""
    if not isinstance(w, Tensor) or w.dim() < 2:
        raise ValueError(f"w must be a Tensor[N, ...] with one neuron per row, got {getattr(w, 'shape', w)!r}")
    if len(w) < 2:
        raise ValueError(f"the energy needs at least 2 neurons, got {len(w)}")
    if not torch.is_floating_point(w):
        raise ValueError(f"w must be a floating-point tensor, got {w.dtype}")
    if values_readable(w) and not bool(torch.isfinite(w).all()):
        raise ValueError("w must have finite entries")
    return w


def _points(w: Tensor, metric: str, half_space: bool, weights: Tensor | None) -> Tensor:
    _check_w(w)
    one_of("metric", metric, METRICS)
    if not isinstance(half_space, bool):
        raise ValueError(f"half_space must be True or False, got {half_space!r}")
    points = normalize(w.flatten(1))  # (N, d)
    if weights is not None:
        if metric != "euclidean":
            raise ValueError("weights (weighted MHE, eq. D.10) are defined for the euclidean metric only")
        weights = torch.as_tensor(weights, dtype=points.dtype, device=points.device)
        if weights.shape != (len(w),):
            raise ValueError(f"weights must be a Tensor[{len(w)}], got shape {tuple(weights.shape)}")
        if values_readable(weights) and not bool((torch.isfinite(weights) & (weights > 0)).all()):
            raise ValueError("weights must be positive and finite")
        points = weights[:, None] * points
    if half_space:
        points = torch.cat([points, -points])  # the virtual neurons -w_hat_k (§5.3.4)
    return points


def _backend_for(points: Tensor, m: int, metric: str, backend: str) -> str:
    """The backend for ``m`` points like ``points`` (its device and dtype): explicit ones fail loudly, ``auto``
    never drops float64."""
    global _warned_no_triton
    one_of("backend", backend, BACKENDS)
    if backend in ("triton", "gemm"):
        if metric != "euclidean":
            raise ValueError(f"the {backend} backend fuses the euclidean metric only; use backend='tiled' for "
                             "angular")
        if points.dtype not in TRITON_DTYPES:
            raise ValueError(f"backend={backend!r} computes in float32 and would silently lose the precision of "
                             f"{points.dtype} input; use backend='tiled' (or 'dense') for float64, or pass w.float()")
        if not triton_importable():
            raise RuntimeError(f"backend={backend!r} needs the triton package (pip install triton)")
        if not usable_on(points):
            raise RuntimeError(f"backend={backend!r} needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1)")
        return backend
    if backend != "auto":
        return backend
    if points.is_cuda and metric == "euclidean" and points.dtype in TRITON_DTYPES:
        if triton_importable():
            if m > TRITON_ABOVE and matmul_precision() != "ieee":
                return "triton"
        elif not _warned_no_triton:
            _warned_no_triton = True
            warnings.warn("backend='auto' on CUDA falls back to dense/tiled: the triton package is not importable",
                          stacklevel=3)
    if points.is_cuda and m <= TILED_ABOVE_CUDA:
        return "batched"  # dense's nonzero and boolean masks would synchronise the device (Note [batched energy])
    if points.is_cuda and metric == "euclidean" and points.dtype in TRITON_DTYPES and triton_importable():
        return "gemm"  # tiled gathers close pairs with nonzero, one synchronisation per block of rows
    return "tiled" if m > (TILED_ABOVE_CUDA if points.is_cuda else TILED_ABOVE) else "dense"


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
        backend (str): ``"auto"``, ``"dense"``, ``"tiled"``, ``"triton"`` or ``"gemm"`` (float32 / half only,
            Euclidean) or ``"batched"`` (float64 Gram, no device synchronisation, Note [batched energy] in
            :mod:`~sphereml.energy.batched`; not with ``weights``). Default: ``"auto"``.
        eps (float): floor on squared distances, in (0, 1), see Note [energy floor] in
            :mod:`~sphereml.energy.kernels`. Default: 1e-7.

    Returns:
        0-dim Tensor of ``w``'s dtype, differentiable with respect to ``w`` (through the normalisation).
    """
    s = _check_s(s)
    eps = real_number("eps", eps, above=0.0, below=1.0)
    _check_w(w)
    chosen = _backend_for(w, len(w) * (2 if half_space is True else 1), metric, backend)
    if chosen == "batched" and weights is not None:
        if backend == "batched":
            raise ValueError("backend='batched' has no weights (weighted MHE, eq. D.10); use 'dense' or 'tiled'")
        chosen = "dense"
    if chosen == "batched":
        one_of("metric", metric, METRICS)
        if not isinstance(half_space, bool):
            raise ValueError(f"half_space must be True or False, got {half_space!r}")
        return _batched_energy(w.flatten(1), s, metric, half_space, eps).to(w.dtype)
    points = _points(w, metric, half_space, weights)
    if chosen == "dense":
        return dense_energy(points, s, metric, eps)
    if chosen == "tiled":
        return tiled_energy(points, s, metric, eps)
    if chosen == "gemm":
        return gemm_energy(points, s, eps)
    return triton_energy(points, s, eps)


def _batched_energy(rows: Tensor, s: float, metric: str, half_space: bool, eps: float) -> Tensor:
    """One set through the batched engine (Note [batched energy]): float64 Gram, no device synchronisation."""
    minus, plus = pair_weights(PointSets(len(rows), (len(rows),), (half_space,)), "pair_mean", rows.device)
    x = rows.to(torch.float64)  # (N, d)
    return gram_energies((x @ x.T)[None], minus, plus if half_space else None, s, metric, eps)[0]


def minibatch_energy(w: Tensor, batch: int, s: float = 2.0, metric: str = "euclidean",
                     generator: torch.Generator | None = None, **kwargs) -> Tensor:
    """The energy of ``batch`` neurons drawn uniformly without replacement (thesis §5.3.6).

    Every ordered pair of distinct neurons is equally likely to appear, so the pair mean of
    the subset is an unbiased estimate of the full pair mean (full-space and weighted
    energies; the half-space energy of a subset over-weights the constant pairs (w, -w)).

    Args:
        w (Tensor[N, ...]): neurons, one per row.
        batch (int): neurons drawn, in [2, N].
        generator (torch.Generator, optional): the generator of the draw (on its own device); without
            one the draw uses the default generator of ``w``'s device.
        **kwargs: further arguments of :func:`hyperspherical_energy` (``weights`` is subset alike).
    """
    _check_w(w)
    batch = integer("batch", batch, at_least=2, at_most=len(w))
    if generator is None:
        idx = torch.randperm(len(w), device=w.device)[:batch]  # drawn where w lives: no host round trip
    else:
        idx = torch.randperm(len(w), generator=generator, device=generator.device)[:batch].to(w.device)
    weights = kwargs.pop("weights", None)
    if weights is not None:
        kwargs["weights"] = torch.as_tensor(weights, device=w.device)[idx]
    return hyperspherical_energy(w[idx], s=s, metric=metric, **kwargs)


@torch.no_grad()
def energy_metric(w: Tensor, s: float = 2.0, metric: str = "euclidean", half_space: bool = False) -> float:
    """The energy as a number for analysis (no graph; tiled or triton above a few thousand neurons)."""
    return float(hyperspherical_energy(w.detach(), s=s, metric=metric, half_space=half_space))


@functools.lru_cache(maxsize=32)
def _layer_energies(shapes: tuple, s: float, metric: str, half_space: bool, reduction: str) -> LayerEnergies:
    """One :class:`~sphereml.energy.batched.LayerEnergies` per network and measure: its packing indices and pair
    weights are made once, not at every measurement (trackers measure at every few steps)."""
    return LayerEnergies(list(shapes), s, metric, half_space, reduction=reduction)


@torch.no_grad()
def layer_energy(layers: Sequence[Tensor | nn.Module], s: float = 2.0, half_space: bool = False,
                 reduction: str = "pair_mean", metric: str = "euclidean") -> float:
    """The energy of a network's layers as one number: the sum over layers of each layer's energy.

    The one measure every chapter reports on trained networks.  The defaults are those of
    :func:`hyperspherical_energy` (full space, pair mean); the thesis's measures are
    ``half_space=True`` with s = 2 (Table 7.2) or s = 1 (Figs. 6.1 and E.2), and
    ``reduction="pair_sum"``, s = 2 for E_2 of eq. 6.1 (Fig. 6.2).

    Args:
        layers: modules with a ``weight`` Tensor[n, ...] or the weights themselves, one neuron per row.
        s (float): Riesz exponent >= 0. Default: 2.
        half_space (bool): each layer with its virtual neurons -w_i (§5.3.4). Default: False.
        reduction (str): ``"pair_mean"`` (each layer's mean over ordered pairs, as eq. 5.4) or
            ``"pair_sum"`` (its sum over ordered pairs, E_s of eq. 5.1). Default: ``"pair_mean"``.
        metric (str): ``"euclidean"`` or ``"angular"``. Default: ``"euclidean"``.

    Returns:
        float.  Layers of at most ``BATCHED_MAX`` neurons go through the batched engine in one evaluation,
        in float64 whatever their dtype (Note [batched energy] in :mod:`~sphereml.energy.batched`); larger
        ones through :func:`hyperspherical_energy` one by one, in their own dtype (``auto`` backend).
    """
    s = _check_s(s)
    one_of("reduction", reduction, REDUCTIONS)
    one_of("metric", metric, METRICS)
    if not isinstance(half_space, bool):
        raise ValueError(f"half_space must be True or False, got {half_space!r}")
    weights = [getattr(layer, "weight", layer) for layer in layers]
    if not weights:
        raise ValueError("layers must hold at least one layer, got none")
    for w in weights:
        _check_w(w)
    small = [w.detach() for w in weights if len(w) <= BATCHED_MAX]
    large = [w.detach() for w in weights if len(w) > BATCHED_MAX]
    total = 0.0
    if small:
        engine = _layer_energies(tuple(w.shape for w in small), s, metric, half_space, reduction)
        total += float(engine.total(small))
    for w in large:
        points = 2 * len(w) if half_space else len(w)
        pairs = points * (points - 1) if reduction == "pair_sum" else 1
        total += pairs * float(hyperspherical_energy(w, s, metric, half_space))
    return total


def output_energy(weight: Tensor, labels: Tensor, s: float = 2.0, eps: float = 1e-7) -> Tensor:
    r"""The data-dependent output-layer MHE of SphereFace+ (thesis eq. 5.8, second term),

    .. math::

        \frac{1}{m (N - 1)} \sum_{i=1}^{m} \sum_{j \ne y_i} f_s\big(\lVert \hat w_{y_i} - \hat w_j \rVert\big):

    each sample pushes its own class weight away from all other class weights, so only the classes
    present in the batch receive a repulsive gradient of their own.  Close classes are exact as in
    :func:`hyperspherical_energy` (Note [close pairs] in :mod:`~sphereml.energy.kernels`).

    Args:
        weight (Tensor[N, d]): classifier weights, one row per class; N >= 2.
        labels (Tensor[m], int64): the batch labels, in [0, N) (range checked for CPU tensors).
        s (float): Riesz exponent >= 0. Default: 2.
        eps (float): the floor of Note [energy floor], in (0, 1). Default: 1e-7.

    Returns:
        0-dim Tensor.
    """
    s = _check_s(s)
    eps = real_number("eps", eps, above=0.0, below=1.0)
    if not isinstance(weight, Tensor) or weight.dim() != 2 or len(weight) < 2:
        raise ValueError(f"weight must be Tensor[N >= 2, d], got {getattr(weight, 'shape', weight)!r}")
    if isinstance(labels, Tensor) and labels.dim() != 1:
        raise ValueError(f"labels must be a Tensor[m], got shape {tuple(labels.shape)}")
    _check_labels("labels", labels, len(labels) if isinstance(labels, Tensor) else 0, num_classes=len(weight))
    unit = normalize(weight).to(torch.float64)  # a float64 Gram: close classes exact without a host read
    squared = unit.square().sum(1)
    r2 = squared[labels, None] + squared[None, :] - 2 * (unit[labels] @ unit.T)  # (m, N)
    own = labels[:, None] == torch.arange(len(weight), device=labels.device)  # the pairs (y_i, y_i)
    values, _ = pair_values(r2, None, None, s, "euclidean", eps)
    return (values.masked_fill(own, 0.0).sum() / (len(labels) * (len(weight) - 1))).to(weight.dtype)
