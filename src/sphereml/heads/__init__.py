"""Margin heads: a classifier's last layer and its loss, with the margin on the angle (thesis Ch. 2).

* :mod:`~sphereml.heads.margins` — normalised, L-, A-, GA-, W-Softmax, CosFace, ArcFace.
* :mod:`~sphereml.heads.margin_ce` — the heads' B x C part: class logits and the cross-entropy with a margin
  target, fused into two passes (Triton on CUDA, an opt-in).
* :mod:`~sphereml.heads.margin_tail` — the fused heads' B target logits, loss and derivatives in one operator.
* :mod:`~sphereml.heads.fused_head` — a whole fused head, forward and backward, as one autograd node.
* :mod:`~sphereml.heads.targets` — the target functions psi: cos(m theta) by Chebyshev polynomials (eq. 2.7),
  the monotone psi of L- and A-Softmax (eqs. 2.6, 2.8), ArcFace's cos(theta + m).
* :mod:`~sphereml.heads.schedules` — the lambda schedule that phases a multiplicative margin in.

The heads themselves are importable from here (``from sphereml.heads import ArcFaceLoss``).
"""

from . import fused_head, margin_ce, margin_tail, margins, schedules, targets
from .margin_ce import margin_cross_entropy
from .margins import (ArcFaceLoss, ASoftmaxLoss, CosFaceLoss, GASoftmaxLoss, LSoftmaxLoss, NormalizedSoftmaxLoss,
                      WSoftmaxLoss)
from .schedules import LambdaSchedule

__all__ = [
    "margins", "margin_ce", "margin_tail", "fused_head", "schedules", "targets",
    "NormalizedSoftmaxLoss", "LSoftmaxLoss", "ASoftmaxLoss", "GASoftmaxLoss", "WSoftmaxLoss", "CosFaceLoss",
    "ArcFaceLoss", "LambdaSchedule", "margin_cross_entropy",
]
