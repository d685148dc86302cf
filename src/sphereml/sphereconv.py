"""Hyperspherical convolution: SphereConv, SphereNet's layers and SphereNorm (thesis Ch. 3, App. B).

A convolution scores a patch x against a kernel w by w . x = ||w|| ||x|| cos(theta).
SphereConv (eq. 3.1) keeps only the angle:

    F_s(w, x) = g(theta_(w, x)),   theta in [0, pi],

where x is the *whole* receptive field (C_in / groups x k_h x k_w values at one output
position, zero padding included) and g is a decreasing "angular activation":

===========  ======================================================  =========
``angular``  g(theta)                                                thesis
===========  ======================================================  =========
linear       1 - 2 theta / pi                                         eq. 3.2
cosine       cos(theta)                                               eq. 3.3
sigmoid      tanh((pi/2 - theta) / (2k)) / tanh(pi / (4k)),  k > 0    eq. 3.4
===========  ======================================================  =========

All three map [0, pi] onto [1, -1] with g(pi/2) = 0 and g(pi - theta) = -g(theta).  The
sigmoid row is eq. 3.4 rewritten: the printed ratio of exponentials equals this tanh ratio
exactly, and the tanh form cannot overflow (the printed form needs exp(pi / 2k), which is
inf in float32 for k < 0.018).

Note [patch norm by convolution]
    ||x|| for every output position is a convolution of x^2 with a kernel of ones over
    the same window (same stride, padding, dilation and groups).  We sum x^2 over the
    channels of each group first and then convolve with a ones *spatial* kernel, one
    output channel per group (a depthwise convolution): the same sums, at 1 / C_out of
    the main convolution's cost.  The cosine is then conv(x, w / ||w||) / ||x||, so the
    layer costs one ordinary convolution plus a few elementwise passes; nothing is
    unfolded.

Note [zero patch]
    A patch with ||x|| < eps (zero padding on a blank background, a dead ReLU region)
    has its norm floored at eps.  Its inner product is 0, so cos = 0, theta = pi/2 and
    every g gives 0, with finite gradients (d/dx is w_hat / eps; the floor is applied
    to ||x||^2 before the square root, whose derivative at 0 would be infinite).
    Above eps the layer is exactly invariant to rescaling the patch.  This sensitivity
    of SphereConv to tiny patches is the one the decoupled-networks chapter criticises.

Note [angle for linear and sigmoid]
    Linear and sigmoid g need theta = arccos(c), whose derivative -1 / sqrt(1 - c^2) is
    infinite at c = +-1 (a patch parallel to its kernel).  :class:`_Arccos` keeps the exact
    value arccos(c) but floors 1 - c^2 at 1e-10 in the backward pass, so d theta / d c is
    at most 1e5 in magnitude (and it is multiplied by dc/dx, which vanishes there).  Clamping c away
    from +-1 instead (as :func:`~sphereml.geometry.safe_angle` does) would shift the output
    by up to sqrt(2 eps) radians at the poles.  Cosine g is computed from c directly and
    never touches arccos.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ._checks import real_number
from .geometry import normalize

__all__ = [
    "ANGULAR", "stable_arccos", "angular_function", "angular_activation", "sphere_cosine2d", "sphere_conv2d",
    "sphere_linear", "SphereConv2d", "SphereLinear", "SphereNorm",
]

ANGULAR = ("linear", "cosine", "sigmoid")


def _check_angular(angular: str) -> str:
    if angular not in ANGULAR:
        raise ValueError(f"angular must be one of {ANGULAR}, got {angular!r}")
    return angular


def _check_k(k) -> float | Tensor:
    """A positive number; a tensor (a learned per-filter k) is passed through unchecked, as a
    check would synchronise the device on every forward; :class:`_Positive` keeps it > 0."""
    if isinstance(k, Tensor):
        return k
    return real_number("k", k, above=0.0)


def angular_function(theta: Tensor, angular: str = "cosine", k: float | Tensor = 0.5) -> Tensor:
    """g(theta) of eqs. 3.2-3.4 evaluated at angles ``theta`` (any real values, for g(m theta) too).

    Args:
        theta (Tensor): angles; [0, pi] for the SphereConv output range [-1, 1].
        angular (str): ``"linear"``, ``"cosine"`` or ``"sigmoid"``.
        k (float or Tensor): sigmoid curvature > 0 (broadcast against ``theta``).

    Returns:
        Tensor shaped like ``theta`` (broadcast with ``k``).
    """
    angular = _check_angular(angular)
    if angular == "linear":
        return 1.0 - theta * (2.0 / math.pi)
    if angular == "cosine":
        return torch.cos(theta)
    k = _check_k(k)
    scale = math.tanh(math.pi / (4.0 * k)) if not isinstance(k, Tensor) else torch.tanh(math.pi / (4.0 * k))
    return torch.tanh((math.pi / 2.0 - theta) / (2.0 * k)) / scale


_POLE_FLOOR = 1e-10  # floor on 1 - c^2 in d arccos / dc, Note [angle for linear and sigmoid]


def _inverse_sine(cos: Tensor) -> Tensor:
    """1 / sin(theta) = 1 / sqrt(1 - c^2), with 1 - c^2 floored (Note [angle for linear and sigmoid])."""
    return (cos * cos).neg_().add_(1.0).clamp_min_(_POLE_FLOOR).rsqrt_()


class _Arccos(torch.autograd.Function):
    """arccos(c) on [-1, 1] with the derivative floored at the poles: Note [angle for linear and sigmoid]."""

    @staticmethod
    def forward(ctx, cos: Tensor) -> Tensor:
        cos = cos.clamp(-1.0, 1.0)
        ctx.save_for_backward(cos)
        return torch.arccos(cos)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (cos,) = ctx.saved_tensors
        return _inverse_sine(cos).mul_(grad).neg_()


def stable_arccos(cos: Tensor) -> Tensor:
    """theta = arccos(c), exact on [-1, 1] (c clamped), with a finite gradient at c = +-1.

    See Note [angle for linear and sigmoid].
    """
    return _Arccos.apply(cos)


class _LinearFromCos(torch.autograd.Function):
    """Linear g(arccos(c)) = 1 - 2 arccos(c) / pi in one autograd node: dg/dc = (2 / pi) / sin(theta).

    One node instead of a chain of autograd nodes: from about 1.6x to 1.35-1.45x of
    ``nn.Conv2d`` forward + backward at 64 channels, 32x32, batch 32 on our 2-core CPU
    (``benchmarks/bench_sphereconv.py``).
    """

    @staticmethod
    def forward(ctx, cos: Tensor) -> Tensor:
        cos = cos.clamp(-1.0, 1.0)
        ctx.save_for_backward(cos)
        return torch.arccos(cos).mul_(-2.0 / math.pi).add_(1.0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (cos,) = ctx.saved_tensors
        return _inverse_sine(cos).mul_(grad).mul_(2.0 / math.pi)


class _SigmoidFromCos(torch.autograd.Function):
    """Sigmoid g(arccos(c)) = tanh(u) / T in one autograd node, u = (pi/2 - theta) / 2k, T = tanh(pi / 4k).

    k is a tensor broadcast against c (a number k arrives as a 0-d tensor).  With sech^2 = 1 - tanh^2
    from the saved tanh(u),

        dg/dc = sech^2(u) / (2k T sin(theta)),
        dg/dk = -sech^2(u) u / (k T) + tanh(u) (1 - T^2) pi / (4 k^2 T^2)   (summed over the broadcast axes).

    u is saved only when k needs a gradient.  Against autograd through :func:`angular_function`:
    1.6x -> 1.35-1.55x of ``nn.Conv2d`` for a fixed k, 1.8-2.0x -> about 1.6x for a learned one
    (``benchmarks/bench_sphereconv.py``).  The output itself is not saved: a following in-place
    ReLU may modify it.
    """

    @staticmethod
    def forward(ctx, cos: Tensor, k: Tensor) -> Tensor:
        cos = cos.clamp(-1.0, 1.0)
        u = torch.arccos(cos).sub_(math.pi / 2.0).neg_().div_(2.0 * k)  # (pi/2 - theta) / 2k
        keep_u = ctx.needs_input_grad[1]
        th = torch.tanh(u) if keep_u else u.tanh_()
        t = torch.tanh(math.pi / (4.0 * k))
        ctx.save_for_backward(cos, th, u if keep_u else None, k, t)
        return th / t

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, th, u, k, t = ctx.saved_tensors
        sech2 = th.square().neg_().add_(1.0)
        grad_cos = grad_k = None
        if ctx.needs_input_grad[0]:
            grad_cos = _inverse_sine(cos).mul_(sech2).mul_(grad).div_(2.0 * k * t)
        if ctx.needs_input_grad[1]:
            dg_dk = sech2.mul_(u).div_(-k * t).add_(th * ((1.0 - t * t) * math.pi / (4.0 * k * k * t * t)))
            grad_k = dg_dk.mul_(grad).sum_to_size(k.shape)
        return grad_cos, grad_k


def angular_activation(cos: Tensor, angular: str = "cosine", k: float | Tensor = 0.5) -> Tensor:
    """g(theta) from c = cos(theta); see Note [angle for linear and sigmoid].

    Args:
        cos (Tensor): cosines in [-1, 1].
        angular (str), k (float or Tensor): as in :func:`angular_function`; linear and sigmoid
            are one fused autograd node each (a tensor k, e.g. a learned one, gets its gradient too).

    Returns:
        Tensor shaped like ``cos`` with values in [-1, 1].
    """
    angular = _check_angular(angular)
    if angular == "cosine":
        return cos
    if angular == "linear":
        return _LinearFromCos.apply(cos)
    k = _check_k(k)
    return _SigmoidFromCos.apply(cos, k if isinstance(k, Tensor) else cos.new_tensor(k))


def _pair(value, name: str, minimum: int) -> tuple[int, int]:
    if isinstance(value, int):
        pair = (value, value)
    else:
        pair = tuple(value) if isinstance(value, (tuple, list)) else ()
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in pair):
        raise ValueError(f"{name} must be an integer >= {minimum} or a pair of them, got {value!r}")
    return pair


def _check_padding(padding) -> str | tuple[int, int]:
    if isinstance(padding, str):
        if padding not in ("valid", "same"):
            raise ValueError(f"padding must be 'valid', 'same', an integer >= 0 or a pair, got {padding!r}")
        return padding
    return _pair(padding, "padding", 0)


def _explicit_padding(x: Tensor, padding, kernel_size, stride, dilation) -> tuple[Tensor, tuple[int, int]]:
    """Turn ``'valid'`` / ``'same'`` into numbers (padding x first when 'same' is asymmetric)."""
    padding = _check_padding(padding)
    if not isinstance(padding, str):
        return x, padding
    if padding == "valid":
        return x, (0, 0)
    if stride != (1, 1):
        raise ValueError(f"padding='same' needs stride 1, got stride {stride}")
    total = [d * (k - 1) for d, k in zip(dilation, kernel_size)]  # (H, W); PyTorch puts the odd pixel last
    pads = [total[1] // 2, total[1] - total[1] // 2, total[0] // 2, total[0] - total[0] // 2]
    return F.pad(x, pads), (0, 0)


class _DivideByPatchNorm(torch.autograd.Function):
    """cos = clamp(inner / ||x_patch||, -1, 1) with the patch norm of Note [patch norm by convolution].

    Forward: e = sum over each group's channels of x^2 (Tensor[B, G, H, W]), s = conv(e, ones)
    over the layer's window, n = sqrt(max(s, eps^2)).  Backward, by hand, with g the incoming
    gradient and j the output channels of a group:

        d/d inner = g / n,    d/dn = -sum_j g_j inner_j / n^2,    d/ds = (d/dn) / 2n  (0 where s < eps^2),
        d/dx = 2 x * conv_transpose(d/ds, ones).

    The clamp only removes rounding (the inner product never exceeds the norm product) and
    passes the gradient through.  Four elementwise passes over the B x C x H x W tensors
    instead of autograd's eight: 1.46x -> 1.17x of ``nn.Conv2d`` forward + backward at 64
    channels, 32x32, batch 32, in one A/B run on our 2-core CPU.  The norms are summed in float32 (x^2
    overflows float16 above 256).
    """

    @staticmethod
    def forward(ctx, inner: Tensor, x: Tensor, kernel_size, stride, padding, dilation, groups: int,
                eps: float) -> Tensor:
        b, c, h, w = x.shape
        with torch.autocast(x.device.type, enabled=False):
            xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
            energy = xf.square().reshape(b, groups, c // groups, h, w).sum(2)  # (B, G, H, W)
            ones = energy.new_ones(groups, 1, *kernel_size)
            sq = F.conv2d(energy, ones, None, stride, padding, dilation, groups)  # (B, G, H', W')
        norm = sq.clamp_min(eps * eps).sqrt_()
        bo, co, ho, wo = inner.shape
        cos = torch.empty_like(inner)  # written through a grouped view, returned as a fresh tensor (not a view)
        grouped = (bo, groups, co // groups, ho, wo)
        torch.div(inner.view(grouped), norm.unsqueeze(2), out=cos.view(grouped))
        ctx.save_for_backward(inner, x, norm, sq)
        ctx.conv = (kernel_size, stride, padding, dilation, groups, eps, energy.shape)
        return cos.clamp_(-1.0, 1.0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        inner, x, norm, sq = ctx.saved_tensors
        kernel_size, stride, padding, dilation, groups, eps, energy_shape = ctx.conv
        bo, co, ho, wo = inner.shape
        g = grad.reshape(bo, groups, co // groups, ho, wo)
        inv = norm.reciprocal()  # (B, G, H', W')
        grad_inner = (g * inv.unsqueeze(2)).reshape(bo, co, ho, wo).to(inner.dtype)
        grad_x = None
        if ctx.needs_input_grad[1]:
            # d/ds = (d/dn) / 2n = -sum_j g_j inner_j / (2 n^3), zero where the floor is active
            grad_sq = (g * inner.reshape(g.shape)).sum(2).mul_(inv.pow(3)).mul_(-0.5).mul_(sq >= eps * eps)
            ones = grad_sq.new_ones(groups, 1, *kernel_size)
            grad_energy = torch.nn.grad.conv2d_input(energy_shape, ones, grad_sq, stride, padding, dilation, groups)
            b, c, h, w = x.shape
            grad_x = (x.reshape(b, groups, c // groups, h, w) * grad_energy.unsqueeze(2)).mul_(2.0)
            grad_x = grad_x.reshape(b, c, h, w).to(x.dtype)
        return grad_inner, grad_x, None, None, None, None, None, None


def sphere_cosine2d(x: Tensor, weight: Tensor, stride=1, padding=0, dilation=1, groups: int = 1,
                    eps: float = 1e-6) -> Tensor:
    """cos(theta) between every kernel and every receptive-field patch (eq. 3.1, cosine g).

    Args:
        x (Tensor[B, C_in, H, W]): input.
        weight (Tensor[C_out, C_in / groups, k_h, k_w]): kernels (any norm; only directions matter).
        stride, padding, dilation, groups: as in :func:`torch.nn.functional.conv2d`.
        eps (float): patch-norm floor, Note [zero patch]. Default: 1e-6.

    Returns:
        Tensor[B, C_out, H', W'] in [-1, 1].
    """
    kernel_size = tuple(weight.shape[2:])
    stride, dilation = _pair(stride, "stride", 1), _pair(dilation, "dilation", 1)
    x, padding = _explicit_padding(x, padding, kernel_size, stride, dilation)
    w_hat = normalize(weight.flatten(1), eps=eps).view_as(weight)
    inner = F.conv2d(x, w_hat, None, stride, padding, dilation, groups)  # (B, C_out, H', W')
    return _DivideByPatchNorm.apply(inner, x, kernel_size, stride, padding, dilation, groups, eps)


def _add_bias(out: Tensor, bias: Tensor | None, dims: int) -> Tensor:
    return out if bias is None else out + bias.view(-1, *([1] * dims))


def sphere_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
                  groups: int = 1, angular: str = "cosine", k: float | Tensor = 0.5, eps: float = 1e-6) -> Tensor:
    """SphereConv, F_s(w, x) = g(theta_(w, x)) + b (thesis eq. 3.1), for a batch of images.

    Args:
        x, weight, stride, padding, dilation, groups, eps: as in :func:`sphere_cosine2d`.
        bias (Tensor[C_out], optional): b_(F_s); the thesis usually leaves it out.
        angular (str), k (float or Tensor[C_out, 1, 1]): g, see :func:`angular_function`.

    Returns:
        Tensor[B, C_out, H', W']; in [-1, 1] without bias.
    """
    cos = sphere_cosine2d(x, weight, stride, padding, dilation, groups, eps)
    return _add_bias(angular_activation(cos, angular, k), bias, 2)


def sphere_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, angular: str = "cosine",
                  k: float | Tensor = 0.5, eps: float = 1e-6) -> Tensor:
    """SphereConv on a fully connected layer (thesis §3.2.4): g(theta) between x and each row of ``weight``.

    Args:
        x (Tensor[..., in_features]), weight (Tensor[out_features, in_features]), bias (Tensor[out_features]).
        angular, k, eps: as in :func:`sphere_conv2d`.

    Returns:
        Tensor[..., out_features].
    """
    cos = F.linear(normalize(x, eps=eps), normalize(weight, eps=eps)).clamp(-1.0, 1.0)
    return _add_bias(angular_activation(cos, angular, k), bias, 0)


K_FLOOR = 1e-3  # learned k never goes below this: g is already a step there (and softplus underflows)


class _Positive(nn.Module):
    """Parametrisation k = K_FLOOR + softplus(r); ``right_inverse`` makes ``layer.k = value`` work."""

    def forward(self, raw: Tensor) -> Tensor:
        return K_FLOOR + F.softplus(raw)

    def right_inverse(self, k: Tensor) -> Tensor:
        if bool((k <= K_FLOOR).any()):
            raise ValueError(f"a learned k must be > {K_FLOOR}")
        excess = k - K_FLOOR
        return excess + torch.log(-torch.expm1(-excess))  # softplus^{-1}(y) = log(e^y - 1), stable form


class _SphereMixin:
    """Shared set-up of the angular function and k (fixed number or learned per-filter parameter)."""

    def _init_angular(self, out_features: int, angular: str, k: float, learnable_k: bool, eps: float,
                      factory: dict) -> None:
        self.angular = _check_angular(angular)
        self.eps = real_number("eps", eps, above=0.0)
        k = real_number("k", k, above=K_FLOOR if learnable_k else 0.0)
        self.learnable_k = bool(learnable_k)
        if self.learnable_k:
            if self.angular != "sigmoid":
                raise ValueError(f"learnable_k needs angular='sigmoid', got {self.angular!r}")
            self.k = nn.Parameter(torch.full((out_features,), k, **factory))
            parametrize.register_parametrization(self, "k", _Positive())
        else:
            self.k = k

    def _k(self, dims: int) -> float | Tensor:
        """k shaped to broadcast over the output channels: Tensor[C_out, 1, ...] when learned."""
        return self.k.view(-1, *([1] * dims)) if self.learnable_k else self.k

    def _angular_repr(self) -> str:
        text = f", angular={self.angular!r}"
        if self.angular == "sigmoid":
            text += ", learnable_k=True" if self.learnable_k else f", k={self.k}"
        return text


class SphereConv2d(_SphereMixin, nn.Conv2d):
    """Drop-in hyperspherical ``nn.Conv2d``: output g(theta) per kernel and patch (thesis eq. 3.1, §3.2).

    Same signature as :class:`torch.nn.Conv2d` (bias defaults to False: the thesis leaves it out), plus:

    Args:
        angular (str): ``"linear"`` (eq. 3.2), ``"cosine"`` (eq. 3.3) or ``"sigmoid"`` (eq. 3.4).
            Default: ``"cosine"``.
        k (float): sigmoid curvature > 0 (the initial value when learned). Default: 0.5.
        learnable_k (bool): learn one k per filter, kept above ``K_FLOOR`` = 1e-3 by a softplus
            parametrisation (learnable SphereConv, §3.2.5; needs ``angular="sigmoid"``). Default: False.
        eps (float): patch-norm floor, see Note [zero patch]. Default: 1e-6.

    The weight norm does not affect the output, so weight decay has no effect on it (§3.1);
    the layer is still an ``nn.Conv2d`` and the regularisers (orthonormality, MHE) find it.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = False, padding_mode: str = "zeros", angular: str = "cosine",
                 k: float = 0.5, learnable_k: bool = False, eps: float = 1e-6, device=None, dtype=None):
        for name, value in {"in_channels": in_channels, "out_channels": out_channels, "groups": groups}.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"in_channels ({in_channels}) and out_channels ({out_channels}) must be divisible "
                             f"by groups ({groups})")
        kernel_size, stride, dilation = _pair(kernel_size, "kernel_size", 1), _pair(stride, "stride", 1), \
            _pair(dilation, "dilation", 1)
        padding = _check_padding(padding)
        factory = {"device": device, "dtype": dtype}
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, **factory)
        self._init_angular(out_channels, angular, k, learnable_k, eps, factory)

    def cosine(self, x: Tensor) -> Tensor:
        """cos(theta) of every kernel and patch, Tensor[B, C_out, H', W'] (before g and bias)."""
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"input must be Tensor[B, {self.in_channels}, H, W], got shape {tuple(x.shape)}")
        padding = self.padding
        if self.padding_mode != "zeros":  # pad once, so both convolutions see the same patches
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        return sphere_cosine2d(x, self.weight, self.stride, padding, self.dilation, self.groups, self.eps)

    def forward(self, x: Tensor) -> Tensor:
        out = angular_activation(self.cosine(x), self.angular, self._k(2))
        return _add_bias(out, self.bias, 2)

    def extra_repr(self) -> str:
        return super().extra_repr() + self._angular_repr()


class SphereLinear(_SphereMixin, nn.Linear):
    """Drop-in hyperspherical ``nn.Linear`` (SphereConv on a fully connected layer, §3.2.4).

    Same arguments as :class:`torch.nn.Linear` (bias defaults to False) plus ``angular``, ``k``,
    ``learnable_k`` and ``eps`` as in :class:`SphereConv2d`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, angular: str = "cosine",
                 k: float = 0.5, learnable_k: bool = False, eps: float = 1e-6, device=None, dtype=None):
        for name, value in {"in_features": in_features, "out_features": out_features}.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        factory = {"device": device, "dtype": dtype}
        super().__init__(in_features, out_features, bias, **factory)
        self._init_angular(out_features, angular, k, learnable_k, eps, factory)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input must be Tensor[..., {self.in_features}], got shape {tuple(x.shape)}")
        return sphere_linear(x, self.weight, self.bias, self.angular, self._k(0), self.eps)

    def extra_repr(self) -> str:
        return super().extra_repr() + self._angular_repr()


class SphereNorm(SphereConv2d):
    """SphereNorm (thesis §3.2.5): cosine SphereConv used as a normalisation layer.

    It normalises each output by its own patch and kernel, so a sample's output does not
    depend on the rest of the batch (unlike BatchNorm).  With ``rescale=True`` the output is
    beta * F_s(w, x) + gamma with per-channel beta and gamma (initialised to 1 and 0), learned
    unless ``learn_rescale=False`` (the "prefixed" variant).  Put it in a network's conv slot;
    a following BatchNorm gives the "SphereNorm + BatchNorm" combination.

    Args:
        in_channels, out_channels, kernel_size, ...: as in :class:`SphereConv2d` (angular is cosine).
        rescale (bool): apply beta * F_s + gamma. Default: False.
        beta, gamma (float): initial (or fixed) rescale values. Default: 1 and 0.
        learn_rescale (bool): make beta and gamma parameters. Default: True.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = False, padding_mode: str = "zeros", rescale: bool = False,
                 beta: float = 1.0, gamma: float = 0.0, learn_rescale: bool = True, eps: float = 1e-6,
                 device=None, dtype=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, angular="cosine", eps=eps, device=device, dtype=dtype)
        self.rescale = bool(rescale)
        if self.rescale:
            beta, gamma = real_number("beta", beta), real_number("gamma", gamma)
            values = {"beta": torch.full((out_channels,), beta, device=device, dtype=dtype),
                      "gamma": torch.full((out_channels,), gamma, device=device, dtype=dtype)}
            for name, value in values.items():
                if learn_rescale:
                    self.register_parameter(name, nn.Parameter(value))
                else:
                    self.register_buffer(name, value)

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        if self.rescale:
            out = torch.addcmul(self.gamma.view(-1, 1, 1), out, self.beta.view(-1, 1, 1))
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rescale={self.rescale}"
