"""The readable O(N^2)-memory energy: the reference every other backend is tested against."""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import pair_values


def dense_energy(points: Tensor, s: float, metric: str, eps: float) -> Tensor:
    """Mean over ordered pairs i != j of f(q_i, q_j) (autograd does the backward pass).

    Args:
        points (Tensor[M, d]): the point set (unit, virtual-negative or weighted neurons).

    Returns:
        0-dim Tensor.
    """
    m = len(points)
    gram = points @ points.T  # (M, M)
    sq = (points * points).sum(1)
    values, _ = pair_values(gram, sq[:, None], sq[None, :], s, metric, eps)
    off_diagonal = ~torch.eye(m, dtype=torch.bool, device=points.device)
    return values[off_diagonal].mean()
