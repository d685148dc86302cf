"""Large-margin objectives on the hypersphere (thesis Part I introduction, Ch. 2, App. A).

Every head owns the classifier weight ``weight`` (Tensor[C, d], one row W_j per class,
no bias) and is used in two ways::

    head = ASoftmaxLoss(64, 10, m=4, lambda_=LambdaSchedule.sphereface())
    loss = head.loss(features, labels)   # training: mean cross-entropy with the margin
    logits = head(features)              # inference: the same logits without the margin

All of them are instances of the *generalised softmax* (Part I introduction): the
logit of class j is a scale times cos(theta_j), and only the target logit is replaced
by a scale times psi(theta_y) with psi <= cos and non-increasing,

=========================  ======================  =================  =====================
head                       scale                   psi(theta_y)       source
=========================  ======================  =================  =====================
``NormalizedSoftmaxLoss``  ||x|| or s              cos(theta)         eq. 2.18, L_s
``LSoftmaxLoss``           ||W_j|| ||x||           eq. 2.6            eq. 2.4
``ASoftmaxLoss``           ||x|| or s              eq. 2.6            eq. 2.20, L_m
``CosFaceLoss``            s                       cos(theta) - m     L_a1
``ArcFaceLoss``            s                       cos(theta + m)     L_a2
``GASoftmaxLoss``          ||x|| or s              g(m theta)         eq. 3.11 (3.10: m = 1)
=========================  ======================  =================  =====================

(``GASoftmaxLoss`` replaces cos by the SphereConv angular function g of Ch. 3 in every
logit, so its logits are a scale times g(theta_j) rather than times cos(theta_j).)

On the reference path (the default) :meth:`loss` is autograd over readable steps: the logits, the B target
logits written into them, ``cross_entropy``.  With ``head.backend = "fused"`` every head but GA- and W-Softmax
takes :func:`~sphereml.heads.fused_head.fused_margin_loss` instead, one autograd node whose forward and backward
are Triton passes from one product, with the B target logits and their derivatives from one operator
(:mod:`~sphereml.heads.margin_tail`; each head names its target in ``_tail_spec``).

Note [margin without arccos]
    The multiplicative psi needs the branch index k = floor(m theta / pi).  k is
    piecewise constant, so it is computed from the cosine under ``no_grad`` and the
    value (-1)^k T_m(c) - 2k is a polynomial in c (:func:`~sphereml.heads.targets.chebyshev_cos`).
    No gradient ever passes through arccos, so gradients stay finite at c = +-1 and
    at the branch points theta = k pi / m (where psi'(theta) = 0).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import integer, labels as check_labels, real_number
from ..angular import angular_activation, angular_function, check_angular, stable_arccos
from ..energy.triton_backend import FUSED_BACKENDS, choose_backend
from ..geometry import normalize, safe_norm
from .fused_head import fused_margin_loss
from .margin_ce import under_vmap, weight_normalized_linear
from .schedules import LambdaSchedule
from .targets import arcface_psi, integer_margin, multiplicative_psi, psi

__all__ = [
    "LambdaSchedule",
    "NormalizedSoftmaxLoss", "LSoftmaxLoss", "ASoftmaxLoss", "CosFaceLoss", "ArcFaceLoss",
    "GASoftmaxLoss", "WSoftmaxLoss",
]

_ACOS_EPS = 1e-7  # keeps arccos (no_grad only) away from +-1 in the detached margin


def _detached_psi(cos: Tensor, m: float) -> Tensor:
    """psi(theta) with the gradient of cos(theta): c + stopgrad(psi - c) (SphereFace-R style, real m)."""
    with torch.no_grad():
        target = psi(torch.arccos(cos.clamp(-1.0 + _ACOS_EPS, 1.0 - _ACOS_EPS)), m)
    return cos + (target - cos).detach()


def _check_scale(s: float | None, allow_none: bool) -> float | None:
    if s is None and allow_none:
        return None
    return real_number("scale s", s, above=0.0)


class _MarginHead(nn.Module):
    """Shared parts: the weight, input checks, the target-logit swap and the loss.

    ``backend`` chooses how the B x C part of :meth:`loss` runs
    (:func:`~sphereml.heads.margin_ce.margin_cross_entropy`): ``"auto"`` (default: the reference path; the fused
    kernels on CUDA with ``SPHEREML_FUSED=1``), ``"reference"`` or ``"fused"``.  Heads whose logits are not a
    product x W^T scaled per column (GA-Softmax) always take the reference path.
    """

    weight_normalized: bool | None = None  # logits (x . W_j) / ||W_j|| (True), x . W_j (False), other (None)

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.backend = "auto"
        self.schedule: LambdaSchedule | None = None
        for name, value in {"in_features": in_features, "num_classes": num_classes}.items():
            integer(name, value, at_least=1)
        self.in_features, self.num_classes = in_features, num_classes
        self.weight = nn.Parameter(torch.empty(num_classes, in_features))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # the nn.Linear initialisation

    def _check_features(self, features: Tensor) -> None:
        if features.dim() != 2 or features.shape[1] != self.in_features:
            raise ValueError(f"features must be Tensor[B, {self.in_features}], got shape {tuple(features.shape)}")

    def _check_labels(self, features: Tensor, labels: Tensor) -> None:
        check_labels("labels", labels, features.shape[0], self.num_classes)  # range: CPU tensors only

    def cosine(self, features: Tensor) -> Tensor:
        """cos(theta_j) between each feature and each class weight: Tensor[B, C]."""
        self._check_features(features)
        return (normalize(features) @ normalize(self.weight).T).clamp(-1.0, 1.0)

    def logits(self, features: Tensor) -> Tensor:
        """Inference logits (no margin): Tensor[B, C]; argmax gives the prediction."""
        raise NotImplementedError

    def _scale(self, features: Tensor, labels: Tensor) -> Tensor:
        """The logit scale of the target class, Tensor[B, 1]."""
        raise NotImplementedError

    def _target(self, cos_y: Tensor, logit_y: Tensor, scale_y: Tensor) -> Tensor:
        """The target logit with the margin, from its cosine, plain logit and scale (each Tensor[B, 1])."""
        raise NotImplementedError

    def forward(self, features: Tensor) -> Tensor:
        return self.logits(features)

    def margin_logits(self, features: Tensor, labels: Tensor) -> Tensor:
        """Training logits: the target column replaced by its margin form. Tensor[B, C]."""
        return self._with_margin(self.logits(features), features, labels)

    def _with_margin(self, logits: Tensor, features: Tensor, labels: Tensor) -> Tensor:
        """Only B values change, so the margin costs O(B) on top of the logits' matmul: the
        target cosine is the target logit divided by its scale (0 for a zero feature), and
        the new target logit is written back with ``scatter``."""
        self._check_labels(features, labels)
        idx = labels[:, None]
        logit_y, scale_y = logits.gather(1, idx), self._scale(features, labels)  # (B, 1) each
        cos_y = self._target_cosine(features, labels, logit_y, scale_y)
        target = self._target(cos_y, logit_y, scale_y)
        return logits.scatter(1, idx, target.to(logits.dtype))  # autocast may compute them in different dtypes

    def _target_cosine(self, features: Tensor, labels: Tensor, logit_y: Tensor, scale_y: Tensor) -> Tensor:
        """cos(theta_y), Tensor[B, 1]: here the target logit over its scale (logits are scale * cos)."""
        return (logit_y / scale_y.clamp_min(1e-12)).clamp(-1.0, 1.0)

    def __setattr__(self, name, value):
        if name == "backend" and value not in FUSED_BACKENDS:
            raise ValueError(f"backend must be one of {FUSED_BACKENDS}, got {value!r}")
        super().__setattr__(name, value)

    def _tail_spec(self) -> tuple[str, float, float | None] | None:
        """(kind, m, s) of :func:`~sphereml.heads.fused_head.fused_margin_loss` for this head's target, or None."""
        return None

    def _fused_loss(self, features: Tensor, labels: Tensor, want_logits: bool):
        """The whole loss as one node (:func:`~sphereml.heads.fused_head.fused_margin_loss`): one product, the
        passes over it, and the target logits with their derivatives from one operator."""
        self._check_features(features)
        self._check_labels(features, labels)
        kind, m, s = self._tail_spec()
        lam = _current_lambda(self) if kind in ("multiplicative", "detached", "lsoftmax") else 0.0
        return fused_margin_loss(features, self.weight, labels, kind, m, s, lam, bool(self.weight_normalized),
                                 want_logits)

    def _loss(self, features: Tensor, labels: Tensor, want_logits: bool):
        fused = (self._tail_spec() is not None and choose_backend(self.backend, features) == "fused"
                 and not under_vmap(features) and not under_vmap(self.weight))
        if fused:
            value, logits = self._fused_loss(features, labels, want_logits)
        else:
            logits = self.logits(features)
            value = F.cross_entropy(self._with_margin(logits, features, labels), labels)
        if self.training and self.schedule is not None:
            self.schedule.advance()
        return value, (logits.detach() if want_logits else None)

    def loss_and_logits(self, features: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """(:meth:`loss`, the margin-free logits detached) from one logits computation."""
        return self._loss(features, labels, want_logits=True)

    def loss(self, features: Tensor, labels: Tensor) -> Tensor:
        """Mean cross-entropy of :meth:`margin_logits`; advances the lambda schedule in training mode."""
        return self._loss(features, labels, want_logits=False)[0]


class NormalizedSoftmaxLoss(_MarginHead):
    """Softmax on normalised class weights, no margin (Part I introduction; eq. 2.18).

    ``s=None``: weight-normalised softmax, logit ||x|| cos(theta_j) (the "modified
    softmax" of SphereFace, eq. 2.18).  ``s`` a number: sphere-normalised softmax
    L_s, logit s cos(theta_j), features normalised too.
    """

    weight_normalized = True

    def __init__(self, in_features: int, num_classes: int, s: float | None = None):
        super().__init__(in_features, num_classes)
        self.s = _check_scale(s, allow_none=True)

    def product_input(self, features: Tensor) -> Tensor:
        """The features as they enter the product x W^T of the logits: x, or s x / ||x||."""
        return features if self.s is None else self.s * normalize(features)

    def logits(self, features: Tensor) -> Tensor:
        self._check_features(features)
        return weight_normalized_linear(self.product_input(features), self.weight, 1e-12)

    def _scale(self, features, labels):
        if self.s is None:
            return safe_norm(features, dim=1, keepdim=True)
        return features.new_full((features.shape[0], 1), self.s)

    def _target(self, cos_y, logit_y, scale_y):
        return logit_y

    def _tail_spec(self):
        return "plain", 0.0, self.s

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, s={self.s}"


def _init_lambda(head: _MarginHead, lambda_: float | LambdaSchedule) -> None:
    if isinstance(lambda_, LambdaSchedule):
        head.schedule = lambda_
        head.lambda_ = None
    elif isinstance(lambda_, (int, float)) and not isinstance(lambda_, bool):
        head.schedule = None
        head.lambda_ = math.inf if lambda_ == math.inf else real_number("lambda_", lambda_, at_least=0.0)
    else:
        raise ValueError(f"lambda_ must be a number >= 0 or a LambdaSchedule, got {lambda_!r}")


def _current_lambda(head) -> float:
    return head.schedule.value() if head.schedule is not None else head.lambda_


def _anneal(plain: Tensor, margin: Tensor, lam: float) -> Tensor:
    """(lambda * plain + margin) / (1 + lambda); lambda = inf gives ``plain``."""
    if math.isinf(lam):
        return plain
    return (lam * plain + margin) / (1.0 + lam)


class LSoftmaxLoss(_MarginHead):
    """Large-margin softmax, L-Softmax (thesis eqs. 2.4, 2.6, 2.8); weights are not normalised.

    Logits are W_j . x = ||W_j|| ||x|| cos(theta_j); the target logit becomes
    ||W_y|| ||x|| psi(theta_y), annealed with lambda (§2.2.7).  ``m = 1`` is bias-free softmax.

    Args:
        in_features (int), num_classes (int): d and C.
        m (int): integer margin >= 1. Default: 4.
        lambda_ (float or LambdaSchedule): annealing weight (0: full margin). Default: 0.
    """

    weight_normalized = False

    def __init__(self, in_features: int, num_classes: int, m: int = 4, lambda_: float | LambdaSchedule = 0.0):
        super().__init__(in_features, num_classes)
        self.m = integer_margin(m)
        _init_lambda(self, lambda_)

    def logits(self, features: Tensor) -> Tensor:
        self._check_features(features)
        return features @ self.weight.T

    def _scale(self, features, labels):
        """||x|| ||W_y||, Tensor[B, 1], from the B label rows of W gathered: with the norms of all C rows (and their
        backward) L-Softmax's reference step took 1.7x of ``nn.Linear`` + ``cross_entropy`` on our CPU, with the
        rows 1.3x (B = 256, d = 512, C = 10,000; medians of three runs, book/measurements.md)."""
        return safe_norm(features, dim=1, keepdim=True) * safe_norm(self.weight[labels], dim=1)[:, None]

    def _target(self, cos_y, logit_y, scale_y):
        return _anneal(logit_y, scale_y * multiplicative_psi(cos_y, self.m), _current_lambda(self))

    def _tail_spec(self):
        return "lsoftmax", float(self.m), None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, m={self.m}"


class ASoftmaxLoss(NormalizedSoftmaxLoss):
    """Angular softmax, A-Softmax / SphereFace (thesis eq. 2.20; L_m of the Part I introduction).

    Class weights are normalised in the forward pass (gradients flow through the
    normalisation); the logit scale is ||x|| (``s=None``, eq. 2.20) or a constant ``s``
    (L_m with s_i = s).  The target cosine is replaced by psi(theta_y) of eq. 2.6,
    annealed with lambda (App. A.7).  ``m = 1`` is the modified softmax (eq. 2.18).

    ``detach_margin=True`` applies the margin as c + stopgrad(psi(theta) - c): the
    forward value is the same psi, the gradient that of the plain cosine, and m may be
    real (e.g. 1.5).  This is the variant that trains without lambda annealing.

    Args:
        in_features (int), num_classes (int): d and C.
        m (int or float): margin >= 1; an integer unless ``detach_margin``. Default: 4.
        lambda_ (float or LambdaSchedule): annealing weight (0: full margin). Default: 0.
        s (float, optional): constant logit scale; None uses ||x||. Default: None.
        detach_margin (bool): see above. Default: False.
    """

    def __init__(self, in_features: int, num_classes: int, m: int | float = 4,
                 lambda_: float | LambdaSchedule = 0.0, s: float | None = None, detach_margin: bool = False):
        super().__init__(in_features, num_classes, s=s)
        if detach_margin:
            self.m = real_number("m", m, at_least=1.0)
        else:
            self.m = integer_margin(m)
        self.detach_margin = detach_margin
        _init_lambda(self, lambda_)

    def _target(self, cos_y, logit_y, scale_y):
        margin = _detached_psi(cos_y, self.m) if self.detach_margin else multiplicative_psi(cos_y, self.m)
        return scale_y * _anneal(cos_y, margin, _current_lambda(self))

    def _tail_spec(self):
        return "detached" if self.detach_margin else "multiplicative", float(self.m), self.s

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, m={self.m}, detach_margin={self.detach_margin}"


class CosFaceLoss(NormalizedSoftmaxLoss):
    """Additive cosine margin, CosFace / AM-Softmax (L_a1 of the Part I introduction): target s (cos(theta) - m).

    Args:
        s (float): logit scale > 0. Default: 30.
        m (float): margin >= 0. Default: 0.35.
    """

    def __init__(self, in_features: int, num_classes: int, s: float = 30.0, m: float = 0.35):
        super().__init__(in_features, num_classes, s=_check_scale(s, allow_none=False))
        self.m = real_number("margin m", m, at_least=0.0)

    def _target(self, cos_y, logit_y, scale_y):
        return scale_y * (cos_y - self.m)

    def _tail_spec(self):
        return "cosface", self.m, self.s

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, m={self.m}"


class ArcFaceLoss(NormalizedSoftmaxLoss):
    """Additive angular margin, ArcFace (L_a2 of the Part I introduction): target s cos(theta + m).

    Kept monotone near theta = pi by :func:`arcface_psi`.

    Args:
        s (float): logit scale > 0. Default: 64.
        m (float): angular margin in [0, pi). Default: 0.5.
    """

    def __init__(self, in_features: int, num_classes: int, s: float = 64.0, m: float = 0.5):
        super().__init__(in_features, num_classes, s=_check_scale(s, allow_none=False))
        self.m = real_number("angular margin m", m, at_least=0.0, below=math.pi)

    def _target(self, cos_y, logit_y, scale_y):
        return scale_y * arcface_psi(cos_y, self.m)

    def _tail_spec(self):
        return "arcface", self.m, self.s

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, m={self.m}"


class GASoftmaxLoss(_MarginHead):
    """Generalised angular softmax, GA-Softmax (thesis eq. 3.11), and W-Softmax (eq. 3.10, ``m = 1``).

    Class weights are normalised; the logit of class j is ||x|| g(theta_j) (or s g(theta_j)
    with a fixed scale ``s``: the S-Softmax of App. B.3, features normalised too), with g a
    SphereConv angular function (:func:`~sphereml.layers.sphereconv.angular_function`).  The target
    logit becomes ||x|| g(m theta_y):

    * linear: 1 - 2 m theta / pi, strictly decreasing on all of [0, pi] with slope -2m/pi,
      range [1 - 2m, 1] (the same range as psi) and no piecewise extension (§3.3);
    * sigmoid: the tanh form continued past pi (monotone, below -1 there);
    * cosine: cos(m theta) is not monotone, so the psi extension of eq. 2.6 is used, which
      makes cosine GA-Softmax exactly A-Softmax (integer m).

    Args:
        in_features (int), num_classes (int): d and C.
        m (int or float): angular multiple >= 1 (an integer for cosine). Default: 4.
        angular (str): ``"linear"``, ``"cosine"`` or ``"sigmoid"``. Default: ``"linear"``.
        k (float): sigmoid curvature > 0. Default: 0.3.
        s (float, optional): constant logit scale (S-Softmax); None uses ||x||. Default: None.
        lambda_ (float or LambdaSchedule): annealing weight as in :class:`ASoftmaxLoss`. Default: 0.
    """

    def __init__(self, in_features: int, num_classes: int, m: int | float = 4, angular: str = "linear",
                 k: float = 0.3, s: float | None = None, lambda_: float | LambdaSchedule = 0.0):
        super().__init__(in_features, num_classes)
        self.angular = check_angular(angular)
        self.m = integer_margin(m) if self.angular == "cosine" else real_number("m", m, at_least=1.0)
        self.k = real_number("k", k, above=0.0)
        self.s = _check_scale(s, allow_none=True)
        _init_lambda(self, lambda_)

    def logits(self, features: Tensor) -> Tensor:
        cos = self.cosine(features)  # (B, C)
        return self._scale_of(features) * angular_activation(cos, self.angular, self.k)

    def _scale_of(self, features: Tensor) -> Tensor:
        if self.s is None:
            return safe_norm(features, dim=1, keepdim=True)  # (B, 1)
        return features.new_full((features.shape[0], 1), self.s)

    def _scale(self, features, labels):
        return self._scale_of(features)

    def _target_cosine(self, features, labels, logit_y, scale_y):
        w_y = normalize(self.weight)[labels]  # (B, d)
        return (normalize(features) * w_y).sum(1, keepdim=True).clamp(-1.0, 1.0)

    def _target(self, cos_y, logit_y, scale_y):
        if self.angular == "cosine":
            margin = multiplicative_psi(cos_y, self.m)
        else:
            margin = angular_function(self.m * stable_arccos(cos_y), self.angular, self.k)
        return _anneal(logit_y, scale_y * margin, _current_lambda(self))

    def extra_repr(self) -> str:
        text = f"in_features={self.in_features}, num_classes={self.num_classes}, m={self.m}, angular={self.angular!r}"
        return text + (f", k={self.k}" if self.angular == "sigmoid" else "") + f", s={self.s}"


class WSoftmaxLoss(GASoftmaxLoss):
    """Weight-normalised softmax, W-Softmax (thesis eq. 3.10): :class:`GASoftmaxLoss` with ``m = 1``.

    Cosine W-Softmax is the modified softmax of eq. 2.18.
    """

    def __init__(self, in_features: int, num_classes: int, angular: str = "cosine", k: float = 0.3,
                 s: float | None = None):
        super().__init__(in_features, num_classes, m=1, angular=angular, k=k, s=s)
