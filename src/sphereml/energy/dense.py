"""The readable O(N^2)-memory energy: the reference every other backend is tested against."""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import pair_values, squared_distances

__all__ = ["dense_energy"]


def dense_energy(points: Tensor, s: float, metric: str, eps: float) -> Tensor:
    """Mean over ordered pairs i != j of f(q_i, q_j) (autograd does the backward pass).

    Close pairs get their squared distance, and through it their gradient, from explicit
    differences (Note [close pairs] in :mod:`~sphereml.energy.kernels`).

    Args:
        points (Tensor[M, d]): the point set (unit, virtual-negative or weighted neurons).

    Returns:
        0-dim Tensor.
    """
    m = len(points)
    off_diagonal = ~torch.eye(m, dtype=torch.bool, device=points.device)
    gram = points @ points.T  # (M, M)
    r2, close = squared_distances(points, points, gram, skip=~off_diagonal)  # (M, M) each
    values, _ = pair_values(r2, gram, close, s, metric, eps)
    return values[off_diagonal].mean()
