"""The magnitude functions h(||x||) of the decoupled operators (thesis eqs. 4.4-4.10; the table of
:mod:`~sphereml.layers.decoupled`), and their description for the fused epilogue's kernels
(:mod:`~sphereml.layers.patch_epilogue`), which evaluate h and its derivative in the same pass."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import one_of, real_number

__all__ = ["MAGNITUDES", "RADIUS_MAGNITUDES", "BOUNDED_MAGNITUDES", "Magnitude", "check_magnitude", "default_beta",
           "magnitude_function", "magnitude_over_norm"]

MAGNITUDES = ("sphere", "ball", "tanh", "linear", "seg", "log", "mix")
RADIUS_MAGNITUDES = ("ball", "tanh", "seg")  # the operators with a radius rho (eqs. 4.5, 4.6, 4.8)
BOUNDED_MAGNITUDES = ("sphere", "ball", "tanh")
_DEFAULT_BETA = {"seg": 0.5, "mix": 1.0}  # App. C.2


class Magnitude(NamedTuple):
    """h of one operator for the fused epilogue: ``kind`` one of :data:`MAGNITUDES`, its constants, and the radius
    r (a number, or a one-value tensor, which gets its gradient)."""

    kind: str
    alpha: float
    beta: float
    radius: float | Tensor

    @property
    def code(self) -> int:
        """The kernels' ``MAGNITUDE`` number: 1 + the kind's place in :data:`MAGNITUDES` (0: no h)."""
        return 1 + MAGNITUDES.index(self.kind)


def default_beta(magnitude: str, beta: float | None = None) -> float:
    """beta of SegConv / MixConv: ``beta`` when given, else App. C.2's 0.5 (seg) or 1 (mix); 0 otherwise."""
    return _DEFAULT_BETA.get(magnitude, 0.0) if beta is None else real_number("beta", beta, at_least=0.0)


def check_magnitude(magnitude: str) -> str:
    return one_of("magnitude", magnitude, MAGNITUDES)


def magnitude_function(norm: Tensor, magnitude: str = "tanh", alpha: float = 1.0, beta: float | None = None,
                       radius: float | Tensor = 1.0) -> Tensor:
    """h(||x||) of eqs. 4.4-4.10 (the table of :mod:`~sphereml.layers.decoupled`) at the norms ``norm``.

    Args:
        norm (Tensor): patch (or input) norms >= 0.
        magnitude (str): one of :data:`MAGNITUDES`.
        alpha (float), beta (float, optional): the operator's constants (beta: SegConv's slope beyond the
            radius, MixConv's log weight; default :func:`default_beta`).
        radius (float or Tensor): r for ball, tanh and seg (rho, or rho E{||x||}); broadcast against ``norm``.

    Returns:
        Tensor shaped like ``norm`` (broadcast with ``radius``).
    """
    magnitude = check_magnitude(magnitude)
    beta = default_beta(magnitude, beta)
    if magnitude == "sphere":
        return torch.full_like(norm, alpha)
    if magnitude == "ball":
        return alpha * torch.clamp(norm / radius, max=1.0)
    if magnitude == "tanh":
        return alpha * torch.tanh(norm / radius)
    if magnitude == "linear":
        return alpha * norm
    if magnitude == "seg":
        return torch.where(norm <= radius, alpha * norm, beta * norm + (alpha - beta) * radius)
    if magnitude == "log":
        return alpha * torch.log1p(norm)
    return alpha * norm + beta * torch.log1p(norm)


def magnitude_over_norm(norm: Tensor, magnitude: str, alpha: float, beta: float, radius) -> Tensor:
    """h(n) / n for n >= eps > 0, in the forms that stay exact for small n (the cosine fast path)."""
    if magnitude == "linear":
        return torch.full_like(norm, alpha)
    if magnitude == "ball":
        return alpha / norm.clamp_min(radius)  # a float radius needs no copy to the device
    return magnitude_function(norm, magnitude, alpha, beta, radius) / norm
