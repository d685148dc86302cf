"""Hyperspherical convolution: SphereConv, SphereNet's layers and SphereNorm (thesis Ch. 3, App. B).

A convolution scores a patch x against a kernel w by w . x = ||w|| ||x|| cos(theta).
SphereConv (eq. 3.1) keeps only the angle:

    F_s(w, x) = g(theta_(w, x)),   theta in [0, pi],

where x is the *whole* receptive field (C_in / groups x k_h x k_w values at one output
position, zero padding included) and g is one of the decreasing angular activations of
:mod:`sphereml.angular` (linear, cosine, sigmoid; eqs. 3.2-3.4).
The readable definition, patch by patch with ``unfold``, is :func:`sphere_conv2d_reference`; the
layers compute the same values with one ordinary convolution (Note [patch norm by convolution] in
:mod:`sphereml.layers.patches`).  A zero patch outputs g(pi/2) = 0 with finite gradients (Note [zero patch]
there); this sensitivity of SphereConv to tiny patches is the one the decoupled-networks chapter
criticises.

Note [SphereConv on a GPU]
    Eager, the layer is one cuDNN convolution plus about ten small elementwise and reduction
    kernels.  ``torch.compile`` fuses those passes around the convolution (the layers compile without
    graph breaks, tested with ``fullgraph=True``), so on a GPU compile the network
    (``torch.compile(model)``).  The times against ``nn.Conv2d``, eager and compiled, float32 and bf16, are
    in ``benchmarks/results/sphereconv_fwd_bwd*-cuda.json`` and ``book/measurements.md``; in the run of
    2026-11-26 compiling took the cosine layer from 1.61x to 1.17x of ``nn.Conv2d``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .._checks import integer, real_number
from ..angular import angular_activation, check_angular
from ..geometry import normalize
from .patches import conv_arguments, patch_cosine2d, patchwise_reference

__all__ = [
    "sphere_cosine2d", "sphere_conv2d", "sphere_conv2d_reference", "sphere_linear", "SphereConv2d", "SphereLinear",
    "SphereNorm", "K_FLOOR", "Positive",
]


def sphere_cosine2d(x: Tensor, weight: Tensor, stride=1, padding=0, dilation=1, groups: int = 1,
                    eps: float = 1e-6) -> Tensor:
    """cos(theta) between every kernel and every receptive-field patch (eq. 3.1, cosine g).

    See :func:`~sphereml.layers.patches.patch_cosine2d` (with q = 0), and Note [zero patch] there.

    Returns:
        Tensor[B, C_out, H', W'] in [-1, 1].
    """
    return patch_cosine2d(x, weight, stride, padding, dilation, groups, eps)


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
    out = patch_cosine2d(x, weight, stride, padding, dilation, groups, eps, angular=angular, k=k)
    return _add_bias(out, bias, 2)


def _printed_angular(cos: Tensor, angular: str, k: float) -> Tensor:
    """g(theta) from cos(theta) exactly as printed (eqs. 3.2-3.4; sigmoid as its ratio of exponentials)."""
    if angular == "cosine":
        return cos
    theta = torch.arccos(cos.clamp(-1.0, 1.0))
    if angular == "linear":
        return 1.0 - 2.0 * theta / math.pi
    a = math.exp(-math.pi / (2.0 * k))
    e = torch.exp(theta / k - math.pi / (2.0 * k))
    return (1.0 + a) / (1.0 - a) * (1.0 - e) / (1.0 + e)


def sphere_conv2d_reference(x: Tensor, weight: Tensor, stride=1, padding=0, dilation=1, groups: int = 1,
                            angular: str = "cosine", k: float = 0.5) -> Tensor:
    """SphereConv by its definition (eq. 3.1), patch by patch: the readable reference of :func:`sphere_conv2d`.

    Every receptive field is unfolded into a column (as public ports do), its cosine to each flattened
    kernel is taken, and g is evaluated as printed (the sigmoid as the ratio of exponentials of
    eq. 3.4, which overflows for k below about 0.02 in float32).  It materialises a
    Tensor[B, C_in / groups * k_h * k_w, L] per group, so it is slow and memory-hungry: for tests,
    chapters and benchmarks, not for training.  No eps: a zero patch gives NaN here.

    Args:
        x (Tensor[B, C_in, H, W]), weight (Tensor[C_out, C_in / groups, k_h, k_w]): input and kernels.
        stride, padding, dilation, groups: as in :func:`torch.nn.functional.conv2d` (integer padding).
        angular (str), k (float): g and the sigmoid curvature.

    Returns:
        Tensor[B, C_out, H', W'].
    """
    angular = check_angular(angular)

    def group(ws: Tensor, patches: Tensor, rows: slice) -> Tensor:
        cos = torch.einsum("od,bdl->bol", ws, patches)
        cos = cos / (ws.norm(dim=1)[None, :, None] * patches.norm(dim=1)[:, None, :])
        return _printed_angular(cos, angular, k)  # (B, C_out/G, L)

    return patchwise_reference(x, weight, group, stride, padding, dilation, groups)


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


class Positive(nn.Module):
    """Parametrisation value = floor + softplus(raw) of a learned positive quantity (SphereConv's k, a
    decoupled operator's radius rho); ``right_inverse`` makes ``layer.k = value`` work."""

    def __init__(self, floor: float = K_FLOOR, name: str = "k"):
        super().__init__()
        self.floor, self.name = floor, name

    def forward(self, raw: Tensor) -> Tensor:
        return self.floor + F.softplus(raw)

    def right_inverse(self, value: Tensor) -> Tensor:
        if bool((value <= self.floor).any()):
            raise ValueError(f"a learned {self.name} must be > {self.floor}")
        excess = value - self.floor
        return excess + torch.log(-torch.expm1(-excess))  # softplus^{-1}(y) = log(e^y - 1), stable form


class _SphereMixin:
    """Shared set-up of the angular function and k (fixed number or learned per-filter parameter)."""

    def _init_angular(self, out_features: int, angular: str, k: float, learnable_k: bool, eps: float,
                      factory: dict) -> None:
        self.angular = check_angular(angular)
        self.eps = real_number("eps", eps, above=0.0)
        k = real_number("k", k, above=K_FLOOR if learnable_k else 0.0)
        self.learnable_k = bool(learnable_k)
        if self.learnable_k:
            if self.angular != "sigmoid":
                raise ValueError(f"learnable_k needs angular='sigmoid', got {self.angular!r}")
            self.k = nn.Parameter(torch.full((out_features,), k, **factory))
            parametrize.register_parametrization(self, "k", Positive())
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
        eps (float): patch-norm floor, see Note [zero patch] in :mod:`sphereml.layers.patches`. Default: 1e-6.

    The weight norm does not affect the output, so weight decay does not change what the layer computes, only the
    effective step size of its weights (§3.1);
    the layer is still an ``nn.Conv2d`` and the regularisers (orthonormality, MHE) find it.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = False, padding_mode: str = "zeros", angular: str = "cosine",
                 k: float = 0.5, learnable_k: bool = False, eps: float = 1e-6, device=None, dtype=None):
        kernel_size, stride, padding, dilation = conv_arguments(in_channels, out_channels, kernel_size, stride,
                                                                padding, dilation, groups)
        factory = {"device": device, "dtype": dtype}
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, **factory)
        self._init_angular(out_channels, angular, k, learnable_k, eps, factory)

    def _padded(self, x: Tensor) -> tuple[Tensor, object]:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"input must be Tensor[B, {self.in_channels}, H, W], got shape {tuple(x.shape)}")
        if self.padding_mode != "zeros":  # pad once, so both convolutions see the same patches
            return F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode), 0
        return x, self.padding

    def cosine(self, x: Tensor) -> Tensor:
        """cos(theta) of every kernel and patch, Tensor[B, C_out, H', W'] (before g and bias)."""
        x, padding = self._padded(x)
        return sphere_cosine2d(x, self.weight, self.stride, padding, self.dilation, self.groups, self.eps)

    def forward(self, x: Tensor) -> Tensor:
        x, padding = self._padded(x)
        out = patch_cosine2d(x, self.weight, self.stride, padding, self.dilation, self.groups, self.eps,
                             angular=self.angular, k=self._k(2))  # g(theta) in the fused epilogue on CUDA
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
            integer(name, value, at_least=1)
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
