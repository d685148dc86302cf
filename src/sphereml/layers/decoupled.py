"""Decoupled operators (thesis Ch. 4, App. C): f(w, x) = h(||w||, ||x||) g(theta) (eq. 4.3).

A convolution scores a patch x against a kernel w by w . x = ||w|| ||x|| cos(theta).  A decoupled
operator keeps the two factors apart and replaces each: the *magnitude function* h of the norms
(intra-class variation) and the *angular activation* g of the angle (semantic difference).

=============  ================================================  =========  ===============
``magnitude``  h(||x||), radius r                                 thesis    bounded
=============  ================================================  =========  ===============
sphere         alpha                                              eq. 4.4   yes, by alpha
ball           alpha min(||x||, r) / r                            eq. 4.5   yes, by alpha
tanh           alpha tanh(||x|| / r)                              eq. 4.6   yes, by alpha
linear         alpha ||x||                                        eq. 4.7   no
seg            alpha ||x|| if ||x|| <= r, else                    eq. 4.8   no (beta > 0)
               beta ||x|| + (alpha - beta) r
log            alpha log(1 + ||x||)                               eq. 4.9   no
mix            alpha ||x|| + beta log(1 + ||x||)                  eq. 4.10  no
=============  ================================================  =========  ===============

``angular`` is any of :data:`~sphereml.angular.DECOUPLED_ANGULAR`: linear, cosine, sigmoid
(eqs. 4.11-4.13, the SphereConv functions) and square cosine sign(cos) cos^2 (eq. 4.14).  beta
defaults to App. C.2's values: 0.5 for SegConv, 1 for MixConv.

These *unweighted* operators drop ||w||: every kernel counts the same, and rescaling a kernel
leaves the output unchanged (which is why weight projection, :func:`project_weights`, is safe for
them; the optimisation aids of §4.4 are in :mod:`sphereml.layers.decoupled_training`).  ``weighted`` gives
the weighted forms of §4.3.5:

* ``"linear"`` (or True): ||w|| multiplies h.  Linearly weighted LinearConv with cosine g and
  alpha = 1 is ordinary convolution, ||w|| ||x|| cos(theta) = w . x.
* ``"tanh_joint"`` (eq. 4.15): alpha tanh(||x|| ||w|| / r) g(theta).
* ``"tanh_separate"`` (eq. 4.16): alpha tanh(||w|| / rho) tanh(||x|| / r) g(theta).

Note [radius normalisation]
    In the experiments (App. C.2, eqs. C.1-C.3) the radius of BallConv, TanhConv and SegConv is r = rho E{||x||},
    with rho learnable (initialised to 1) and E{||x||} a moving average of the layer's patch norms, "similar to BN":
    without it most radii in the middle layers never move. The seeds do not say whether training uses the batch mean
    or the average; we use the batch mean in training (as BatchNorm does) and the running average, a no-grad buffer,
    in evaluation. The average is cumulative over the first 1 / momentum batches and exponential (momentum 0.1)
    after, so it does not start from an arbitrary value; ``momentum=None`` keeps it cumulative, as BatchNorm's.  The
    seeds keep one mean per kernel; in a convolution every kernel sees the same patches, so one scalar per layer is
    the same thing.  With ``radius_norm=True`` a train-mode output is invariant to rescaling the input.  Before
    evaluating a network trained briefly, :func:`~sphereml.recalibration.recalibrate` re-estimates the average with
    the weights frozen.

Note [decoupled operator by convolution]
    Like SphereConv (:mod:`sphereml.layers.patches`), nothing is unfolded: u = conv(x, w_hat) is one convolution and
    the patch norms n a depthwise convolution of the summed x^2.  For cosine g the output is u h(n) / n, the factor
    one value per position (Tensor[B, G, H', W']): one convolution and one broadcast product.  Other g need the
    cosine u / n on the output.  n is floored at ``eps``: a zero patch gives u = 0, cos = 0 = g(pi/2) and output 0
    with finite gradients.  :func:`decoupled_conv2d_reference` computes the definition patch by patch.

Note [fused decoupled norms]
    On the fused path (``backend="fused"``) an unweighted operator takes SphereConv's squared patch norms s (one
    reduction of x and a box sum) and the epilogue's kernels evaluate h and its derivatives at n = sqrt(max(s, eps^2))
    themselves (:class:`~sphereml.layers.magnitudes.Magnitude`), radius included when it is one value, learned or
    not (a radius per channel, or a tensor alpha or beta, keeps h on autograd).  The scaled norms of Note [patch
    norm without overflow] would cost two more passes over x; s in float32 bounds n by 1.8e19, as it bounds
    SphereConv's cosines on either path.  Counted on the CPU with the GPU's forms (``tests/test_unit_kernels.py``,
    with Notes [convolution and norms in one node] and [box sums in a kernel]): 11 operations forward + backward, as
    SphereConv (42 with the scaled norms and autograd through h), and 4 passes over x-sized tensors (7).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .._checks import integer, one_of, real_number
from ..angular import DECOUPLED_ANGULAR, angular_activation, angular_function, check_angular, check_k
from ..geometry import safe_norm
from .magnitudes import (BOUNDED_MAGNITUDES, MAGNITUDES, RADIUS_MAGNITUDES, Magnitude, check_magnitude,
                         default_beta, magnitude_function, magnitude_over_norm)
from .patch_epilogue import fused_epilogue, per_channel, resolve_backend
from .patch_norms import conv_and_squared_norms
from .patches import conv_arguments, explicit_padding, pair, patch_norm2d, patchwise_reference
from .unit_kernels import fusable, unit_kernels
from .sphereconv import Positive

__all__ = [
    "MAGNITUDES", "RADIUS_MAGNITUDES", "BOUNDED_MAGNITUDES", "WEIGHTINGS", "default_beta", "magnitude_function",
    "decoupled_conv2d", "decoupled_conv2d_reference", "decoupled_linear", "DecoupledConv2d",
    "DecoupledLinear", "decoupled_layers", "decoupled_factory", "RHO_FLOOR",
]

WEIGHTINGS = ("linear", "tanh_joint", "tanh_separate")  # §4.3.5: ||w|| times h, eq. 4.15, eq. 4.16
RHO_FLOOR = 1e-3  # a learned rho stays above this (softplus parametrisation)


def _check_weighted(weighted, magnitude: str) -> str | None:
    """None (unweighted), "linear", "tanh_joint" or "tanh_separate" (the last two need TanhConv)."""
    if weighted is False or weighted is None:
        return None
    weighted = "linear" if weighted is True else one_of("weighted", weighted, WEIGHTINGS)
    if weighted != "linear" and magnitude != "tanh":
        raise ValueError(f"weighted={weighted!r} is a form of TanhConv (eqs. 4.15-4.16); got magnitude={magnitude!r}")
    return weighted


def _conv_parts(x: Tensor, weight: Tensor, stride, padding, dilation, groups: int, eps: float, backend="auto",
                weighted: str | None = None):
    """(u = conv(x, w_hat) Tensor[B, C_out, H', W'], patch norms Tensor[B, G, H', W'], ||w|| Tensor[C_out], fuse):
    what the operator needs from a convolution (Note [decoupled operator by convolution]).  ``fuse(angular, k, h)``:
    h g(theta) by :mod:`~sphereml.layers.patch_epilogue` for an unweighted operator where ``backend`` resolves to it
    (Note [fused decoupled norms]; w_hat from :mod:`~sphereml.layers.unit_kernels`, ||w|| None, and the norms a
    function that computes them when asked), else False."""
    kernel_size = tuple(weight.shape[2:])
    stride, dilation = pair(stride, "stride", 1), pair(dilation, "dilation", 1)
    x, padding = explicit_padding(x, padding, kernel_size, stride, dilation)
    fused = resolve_backend(backend, x) == "fused"
    unit = fused and weighted is None and fusable(weight)  # Note [unit kernels in one pass]
    w_norm = None if unit else weight.flatten(1).norm(dim=1).clamp_min(eps)
    w_hat = unit_kernels(weight, eps, True) if unit else weight / w_norm.view(-1, 1, 1, 1)
    if not (fused and weighted is None):
        inner = F.conv2d(x, w_hat, None, stride, padding, dilation, groups)
        return inner, patch_norm2d(x, kernel_size, stride, padding, dilation, groups, eps), w_norm, False
    inner, sq = conv_and_squared_norms(x, w_hat, stride, padding, dilation, groups)  # Note [fused decoupled norms]

    def norm():  # asked for only where the kernels do not take h, or for E{||x||}; in x's dtype, as patch_norm2d's
        return sq.clamp_min(eps * eps).sqrt().to(x.dtype)

    def fuse(angular, k, h):
        return fused_epilogue(inner, sq, None, angular, k, groups, eps, magnitude=h)
    return inner, norm, w_norm, fuse


def _linear_parts(x: Tensor, weight: Tensor, eps: float):
    """(u Tensor[N, out, 1] with the units on axis 1, ||x|| Tensor[N, 1, 1], ||w|| Tensor[out]) for x flattened
    to Tensor[N, in]: the fully connected counterpart of :func:`_conv_parts`."""
    w_norm = weight.norm(dim=1).clamp_min(eps)
    flat = x.reshape(-1, weight.shape[1])
    inner = F.linear(flat, weight / w_norm[:, None]).unsqueeze(-1)
    norm = safe_norm(flat, dim=-1).clamp_min(eps).view(-1, 1, 1)  # Note [patch norm without overflow]
    return inner, norm, w_norm


def _per_channel(norm: Tensor, channels: int) -> Tensor:
    """Patch norms Tensor[B, G, ...] repeated to Tensor[B, C, ...] (as is when G = 1, by broadcasting)."""
    groups = norm.shape[1]
    return norm if groups == 1 else norm.repeat_interleave(channels // groups, dim=1)


def _response(inner: Tensor, norm: Tensor | Callable[[], Tensor], w_norm: Tensor, magnitude: str, angular: str,
              alpha: float, beta: float, radius, rho, k, weighted: str | None, fuse=None) -> Tensor:
    """h g from u = w_hat . x (Tensor[B, C, ...]), the patch norms (Tensor[B, G, ...], or a function giving them)
    and ||w|| (Tensor[C]); unweighted operators through ``fuse`` (see :func:`_conv_parts`) where it is given."""
    if fuse and weighted is None and per_channel(k, inner.shape[1]):
        numbers = not isinstance(alpha, Tensor) and not isinstance(beta, Tensor)  # a tensor keeps its gradient
        if numbers and (not isinstance(radius, Tensor) or radius.numel() == 1):  # Note [fused decoupled norms]
            radius = radius if magnitude in RADIUS_MAGNITUDES else 1.0  # no gradient for an unused radius
            return fuse(angular, k, Magnitude(magnitude, alpha, beta, radius))
        norm = norm()
        h = magnitude_function(norm, magnitude, alpha, beta, radius)
        if h.shape == norm.shape:  # one factor per group and position (a radius per channel gives one per channel)
            return fuse(angular, k, h)
    norm = norm() if callable(norm) else norm
    w_norm = None if w_norm is None else w_norm.view((-1,) + (1,) * (inner.dim() - 2))  # over the channel axis
    if weighted == "tanh_joint":  # eq. 4.15: alpha tanh(||x|| ||w|| / r) g
        n = _per_channel(norm, inner.shape[1])
        h = alpha * torch.tanh(n * w_norm / radius)
        return h * angular_activation((inner / n).clamp(-1.0, 1.0), angular, k)
    if angular == "cosine":  # Note [decoupled operator by convolution]: u h(n) / n
        out = inner * _per_channel(magnitude_over_norm(norm, magnitude, alpha, beta, radius), inner.shape[1])
    else:
        n = _per_channel(norm, inner.shape[1])
        g = angular_activation((inner / n).clamp(-1.0, 1.0), angular, k)
        out = g * _per_channel(magnitude_function(norm, magnitude, alpha, beta, radius), inner.shape[1])
    if weighted == "linear":
        out = out * w_norm
    elif weighted == "tanh_separate":  # eq. 4.16: alpha tanh(||w|| / rho) tanh(||x|| / r) g
        out = out * torch.tanh(w_norm / rho)
    return out


def _radius(rho, norm_mean):
    return rho if norm_mean is None else rho * norm_mean


def decoupled_conv2d(x: Tensor, weight: Tensor, stride=1, padding=0, dilation=1, groups: int = 1,
                     magnitude: str = "tanh", angular: str = "cosine", alpha: float = 1.0, beta: float | None = None,
                     rho: float | Tensor = 1.0, k: float | Tensor = 0.5, weighted=False,
                     norm_mean: float | Tensor | None = None, eps: float = 1e-6, backend: str = "auto") -> Tensor:
    """The decoupled operator f = h(||w||, ||x||) g(theta) (eq. 4.3) for every kernel and patch.

    Args:
        x (Tensor[B, C_in, H, W]), weight (Tensor[C_out, C_in / groups, k_h, k_w]): input and kernels.
        stride, padding, dilation, groups: as in :func:`torch.nn.functional.conv2d` (padding may be
            ``"valid"`` or ``"same"``).
        magnitude (str), angular (str), alpha, beta: see the module table.
        rho (float or Tensor): the radius (ball, tanh, seg; also the ||w|| scale of eq. 4.16).
        k (float or Tensor): the sigmoid curvature.
        weighted: False, True / ``"linear"``, ``"tanh_joint"`` (eq. 4.15) or ``"tanh_separate"`` (eq. 4.16).
        norm_mean (float or Tensor, optional): E{||x||}; the radius becomes rho E{||x||}
            (Note [radius normalisation]).
        eps (float): patch-norm floor (a zero patch outputs 0).
        backend (str): ``"auto"``, ``"reference"`` or ``"fused"``: the unweighted operators' g and h in the fused
            epilogue of :mod:`~sphereml.layers.patch_epilogue` (``"auto"``: with ``SPHEREML_FUSED=1`` on CUDA).
            Default: ``"auto"``.

    Returns:
        Tensor[B, C_out, H', W'].
    """
    magnitude, weighted = check_magnitude(magnitude), _check_weighted(weighted, magnitude)
    angular = check_angular(angular, DECOUPLED_ANGULAR)
    beta = default_beta(magnitude, beta)
    inner, norm, w_norm, fuse = _conv_parts(x, weight, stride, padding, dilation, groups, eps, backend, weighted)
    return _response(inner, norm, w_norm, magnitude, angular, alpha, beta, _radius(rho, norm_mean), rho, k,
                     weighted, fuse)


def decoupled_linear(x: Tensor, weight: Tensor, magnitude: str = "tanh", angular: str = "cosine",
                     alpha: float = 1.0, beta: float | None = None, rho: float | Tensor = 1.0,
                     k: float | Tensor = 0.5, weighted=False, norm_mean: float | Tensor | None = None,
                     eps: float = 1e-6) -> Tensor:
    """The decoupled operator on a fully connected layer: x (Tensor[..., in]) against each row of
    ``weight`` (Tensor[out, in]); other arguments as in :func:`decoupled_conv2d`.  Returns Tensor[..., out]."""
    magnitude, weighted = check_magnitude(magnitude), _check_weighted(weighted, magnitude)
    angular = check_angular(angular, DECOUPLED_ANGULAR)
    inner, norm, w_norm = _linear_parts(x, weight, eps)
    out = _response(inner, norm, w_norm, magnitude, angular, alpha, default_beta(magnitude, beta),
                    _radius(rho, norm_mean), rho, k, weighted)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def decoupled_conv2d_reference(x: Tensor, weight: Tensor, stride=1, padding=0, dilation=1, groups: int = 1,
                               magnitude: str = "tanh", angular: str = "cosine", alpha: float = 1.0,
                               beta: float | None = None, radius: float = 1.0, rho: float = 1.0, k: float = 0.5,
                               weighted=False) -> Tensor:
    """The decoupled operator by its definition, patch by patch (``unfold``): the readable reference of
    :func:`decoupled_conv2d`, for tests and benchmarks.

    Every receptive field x and kernel w are flattened; ||x||, ||w|| and theta = arccos(w . x / (||w|| ||x||))
    are taken, and f = h g is evaluated from eq. 4.3 with h of eqs. 4.4-4.10
    (:func:`~sphereml.layers.magnitudes.magnitude_function`), g of eqs. 4.11-4.14 evaluated at the angle, and the
    weighted forms of §4.3.5.  ``radius`` is r (already
    rho E{||x||} for a radius-normalised layer); ``rho`` is the ||w|| scale of eq. 4.16.  Integer padding;
    no floor: a zero patch gives NaN here.

    Returns:
        Tensor[B, C_out, H', W'].
    """
    weighted = _check_weighted(weighted, check_magnitude(magnitude))

    def group(ws: Tensor, patches: Tensor, rows: slice) -> Tensor:
        x_norm = patches.norm(dim=1)[:, None, :]  # (B, 1, L)
        w_norm = ws.norm(dim=1)[None, :, None]  # (1, C_out/G, 1)
        cos = torch.einsum("od,bdl->bol", ws, patches) / (w_norm * x_norm)
        angle_part = angular_function(torch.arccos(cos.clamp(-1.0, 1.0)), angular, k)
        if weighted == "tanh_joint":
            return alpha * torch.tanh(x_norm * w_norm / radius) * angle_part
        size = magnitude_function(x_norm, magnitude, alpha, beta, radius)
        if weighted == "linear":
            size = size * w_norm
        elif weighted == "tanh_separate":
            size = size * torch.tanh(w_norm / rho)
        return size * angle_part  # (B, C_out/G, L)

    return patchwise_reference(x, weight, group, stride, padding, dilation, groups)


class _DecoupledMixin:
    """Set-up shared by the conv and linear layers: the operator's names, constants, rho and E{||x||}."""

    def _init_decoupled(self, magnitude: str, angular: str, alpha: float, beta: float | None, rho: float,
                        learnable_rho: bool, radius_norm: bool, weighted, k: float, momentum: float | None,
                        eps: float, factory: dict) -> None:
        self.magnitude = check_magnitude(magnitude)
        self.angular = check_angular(angular, DECOUPLED_ANGULAR)
        self.weighted = _check_weighted(weighted, self.magnitude)
        self.alpha = real_number("alpha", alpha, above=0.0)
        self.beta = default_beta(self.magnitude, beta)
        self.k = float(check_k(k))
        self.eps = real_number("eps", eps, above=0.0)
        self.momentum = None if momentum is None else real_number("momentum", momentum, above=0.0, at_most=1.0)
        has_radius = self.magnitude in RADIUS_MAGNITUDES or self.weighted in ("tanh_joint", "tanh_separate")
        for flag, value in {"radius_norm": radius_norm, "learnable_rho": learnable_rho}.items():
            if value and not has_radius:
                raise ValueError(f"{flag}=True needs a magnitude with a radius {RADIUS_MAGNITUDES}, "
                                 f"got magnitude={self.magnitude!r}")
        self.radius_norm, self.learnable_rho = bool(radius_norm), bool(learnable_rho)
        rho = real_number("rho", rho, above=RHO_FLOOR if learnable_rho else 0.0)
        if self.learnable_rho:
            self.rho = nn.Parameter(torch.tensor(rho, **factory))
            parametrize.register_parametrization(self, "rho", Positive(RHO_FLOOR, "rho"))
        else:
            self.rho = rho
        if self.radius_norm:
            self.register_buffer("norm_mean", torch.ones((), **factory))
            self.register_buffer("norm_mean_updates", torch.zeros((), dtype=torch.long, device=factory["device"]))

    def _norm_mean(self, norm: Tensor | Callable[[], Tensor]) -> Tensor | None:
        """E{||x||}: the batch mean in training (updating the running buffer), the buffer in evaluation."""
        if not self.radius_norm:
            return None
        if not self.training:
            return self.norm_mean
        batch_mean = (norm() if callable(norm) else norm).detach().mean()
        with torch.no_grad():
            weight = (self.norm_mean_updates.to(self.norm_mean.dtype) + 1.0).reciprocal()  # cumulative average ...
            if self.momentum is not None:
                weight = weight.clamp_min(self.momentum)  # ... until it is overtaken by the momentum
            self.norm_mean.copy_(self.norm_mean.lerp(batch_mean.to(self.norm_mean.dtype), weight))  # vmap: no lerp_
            self.norm_mean_updates.add_(1)
        return batch_mean

    def reset_running_stats(self) -> None:
        """Forget E{||x||} (as ``BatchNorm``'s method of the same name; see
        :func:`~sphereml.recalibration.recalibrate`)."""
        if self.radius_norm:
            self.norm_mean.fill_(1.0)
            self.norm_mean_updates.zero_()

    def _operator(self, inner: Tensor, norm: Tensor | Callable[[], Tensor], w_norm: Tensor, fuse=None) -> Tensor:
        return _response(inner, norm, w_norm, self.magnitude, self.angular, self.alpha, self.beta,
                         _radius(self.rho, self._norm_mean(norm)), self.rho, self.k, self.weighted, fuse)

    def _decoupled_repr(self) -> str:
        text = f", magnitude={self.magnitude!r}, angular={self.angular!r}, alpha={self.alpha:g}"
        if self.magnitude in ("seg", "mix"):
            text += f", beta={self.beta:g}"
        if self.angular == "sigmoid":
            text += f", k={self.k:g}"
        if self.magnitude in RADIUS_MAGNITUDES or self.weighted in ("tanh_joint", "tanh_separate"):
            text += ", learnable_rho=True" if self.learnable_rho else f", rho={self.rho:g}"
            text += ", radius_norm=True" if self.radius_norm else ""
        return text + (f", weighted={self.weighted!r}" if self.weighted else "")


class DecoupledConv2d(_DecoupledMixin, nn.Conv2d):
    """Drop-in ``nn.Conv2d`` computing the decoupled operator h(||w||, ||x||) g(theta) (thesis eq. 4.3).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode:
            as in :class:`torch.nn.Conv2d` (bias defaults to False).
        magnitude (str): one of :data:`MAGNITUDES` (eqs. 4.4-4.10). Default: ``"tanh"``.
        angular (str): ``"linear"``, ``"cosine"``, ``"sigmoid"`` or ``"sqcosine"`` (eqs. 4.11-4.14).
        alpha (float), beta (float, optional): h's constants (beta default: 0.5 seg, 1 mix; App. C.2).
        rho (float): the radius (the initial value when learned). Default: 1.
        learnable_rho (bool): learn rho, kept above 1e-3 by a softplus parametrisation. Default: False.
        radius_norm (bool): radius rho E{||x||} (eqs. C.1-C.3, Note [radius normalisation]). Default: False.
        weighted: False, True / ``"linear"``, ``"tanh_joint"`` (eq. 4.15), ``"tanh_separate"`` (eq. 4.16).
        k (float): sigmoid curvature. Default: 0.5.
        momentum (float or None): of the running E{||x||} (None: cumulative). Default: 0.1.
        eps (float): patch-norm floor. Default: 1e-6.

    With ``radius_norm=False`` and a fixed rho the output depends on the patch x only through ||x||
    and theta over the whole receptive field, as SphereConv does.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = False, padding_mode: str = "zeros", magnitude: str = "tanh",
                 angular: str = "cosine", alpha: float = 1.0, beta: float | None = None, rho: float = 1.0,
                 learnable_rho: bool = False, radius_norm: bool = False, weighted=False, k: float = 0.5,
                 momentum: float | None = 0.1, eps: float = 1e-6, device=None, dtype=None):
        kernel_size, stride, padding, dilation = conv_arguments(in_channels, out_channels, kernel_size, stride,
                                                                padding, dilation, groups)
        factory = {"device": device, "dtype": dtype}
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, **factory)
        self._init_decoupled(magnitude, angular, alpha, beta, rho, learnable_rho, radius_norm, weighted, k,
                             momentum, eps, factory)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"input must be Tensor[B, {self.in_channels}, H, W], got shape {tuple(x.shape)}")
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        out = self._operator(*_conv_parts(x, self.weight, self.stride, padding, self.dilation, self.groups,
                                          self.eps, weighted=self.weighted))
        return out if self.bias is None else out + self.bias.view(-1, 1, 1)

    def extra_repr(self) -> str:
        return super().extra_repr() + self._decoupled_repr()


class DecoupledLinear(_DecoupledMixin, nn.Linear):
    """The decoupled operator on a fully connected layer: each output unit is h(||w||, ||x||) g(theta)
    between the input vector and its weight row.  Arguments as :class:`DecoupledConv2d` (bias False)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, magnitude: str = "tanh",
                 angular: str = "cosine", alpha: float = 1.0, beta: float | None = None, rho: float = 1.0,
                 learnable_rho: bool = False, radius_norm: bool = False, weighted=False, k: float = 0.5,
                 momentum: float | None = 0.1, eps: float = 1e-6, device=None, dtype=None):
        for name, value in {"in_features": in_features, "out_features": out_features}.items():
            integer(name, value, at_least=1)
        factory = {"device": device, "dtype": dtype}
        super().__init__(in_features, out_features, bias, **factory)
        self._init_decoupled(magnitude, angular, alpha, beta, rho, learnable_rho, radius_norm, weighted, k,
                             momentum, eps, factory)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"input must be Tensor[..., {self.in_features}], got shape {tuple(x.shape)}")
        out = self._operator(*_linear_parts(x, self.weight, self.eps)).squeeze(-1)
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return super().extra_repr() + self._decoupled_repr()


def decoupled_layers(model: nn.Module) -> list[nn.Module]:
    """The :class:`DecoupledConv2d` and :class:`DecoupledLinear` layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, _DecoupledMixin)]


def decoupled_factory(**options) -> Callable[..., DecoupledConv2d]:
    """``conv_layer`` for the networks of :mod:`sphereml.models`: a :class:`DecoupledConv2d` with ``options``
    (checked now, so a bad option fails when the factory is made, not deep inside a network)."""
    DecoupledConv2d(1, 1, 1, **options)  # validates the options

    def make(in_channels: int, out_channels: int, kernel_size, **kwargs) -> DecoupledConv2d:
        return DecoupledConv2d(in_channels, out_channels, kernel_size, **kwargs, **options)

    return make

