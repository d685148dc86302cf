"""Sharpened cosine similarity and max-abs pooling (Wu et al., *Exploring the Sharpened Cosine Similarity*).

The layer scores every receptive-field patch s against every kernel k by a cosine whose magnitude
is raised to a power p (the paper's Sec. 1, after Rohrer):

    SCS(s, k) = sign(c) abs(c)^p,    c = s . k / ((||s|| + q) ||k||),

with s the *whole* patch (C_in / groups x k_h x k_w values, zero padding included), p > 0 the
sharpening exponent (p > 1 sharpens: weak matches shrink faster than strong ones) and q >= 0 a
damping added to the patch norm only, which sends faint patches towards 0.  abs(SCS) <= 1, its
sign is that of s . k, and p = 1, q = 0 is the cosine of SphereConv (thesis eq. 3.3).  The layer is
invariant to the scale of each kernel, so the gradient of any loss is perpendicular to every
kernel, <dL/dk_j, k_j> = 0: under plain gradient descent kernel norms can only grow.  The readable
definition is :func:`scs_conv2d_reference` (unfold); the layer computes c with one convolution
(Note [patch norm by convolution] in :mod:`sphereml.layers.patches`).

Note [sharpening without NaN]
    d abs(c)^p / dc = p abs(c)^(p-1) is infinite at c = 0 for p < 1, and d abs(c)^p / dp =
    abs(c)^p ln abs(c) is 0 * inf there.  :func:`~sphereml.layers.patches.sharpen` computes the exact value
    sign(c) abs(c)^p (so abs(out) <= 1 holds exactly, unlike the upstream (abs(c) + 1e-6)^p) and
    takes the derivatives as p abs(c)^p / max(abs(c), 1e-6) and y ln max(abs(c), 1e-6): exact for
    abs(c) >= 1e-6, finite at c = 0, at zero patches and at abs(c) = 1 in every dtype.  Reusing
    abs(c)^p keeps the layer at one ``pow``: 1.26x (fixed p) and 1.43x (learned p and q) of
    ``nn.Conv2d`` forward + backward at B = 32, 64 channels, 32x32 on our 2-core CPU
    (``benchmarks/bench_scs.py``), against 1.48x and 1.85x with the derivatives recomputed.

Note [learnable p and q]
    The paper learns p per kernel and does not say how p is parameterised.  Rohrer's code changed
    it four times in 2022 (February: p = (theta / 10)^2 with q added to both norms; March and April:
    p = exp(theta / 5); May: theta itself, clamped at 0.1, with q = exp(theta_q) on the patch norm
    only).  We offer two, chosen by ``p_param``: ``"exp"`` (default, the April form without its
    scale): p = exp(theta), always positive with smooth gradients; ``"raw"`` (the May form):
    p = theta clamped at P_MIN = 0.1, whose gradient vanishes while the clamp is active.  q is one
    value per layer, q = exp(theta_q) (May 2022), so q > 0.  Initial values are the constructor's
    ``p`` and ``q`` (upstream draws p0 ~ U(1, 3)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .._checks import one_of, real_number
from .patches import conv_arguments, pair, patch_cosine2d, patchwise_reference, sharpen

__all__ = ["P_PARAMS", "P_MIN", "sharpen", "scs_conv2d", "scs_conv2d_reference", "SharpenedCosineSimilarity2d",
           "max_abs_pool2d", "MaxAbsPool2d"]

P_PARAMS = ("exp", "raw")
P_MIN = 0.1  # the floor of the "raw" parameterisation of p (upstream, May 2022)


def scs_conv2d(x: Tensor, weight: Tensor, p: float | Tensor = 2.0, q: float | Tensor = 1e-3, stride=1, padding=0,
               dilation=1, groups: int = 1, eps: float = 1e-6) -> Tensor:
    """Sharpened cosine similarity of every kernel and every patch (the paper's Sec. 1), by convolution.

    Args:
        x (Tensor[B, C_in, H, W]): input.
        weight (Tensor[C_out, C_in / groups, k_h, k_w]): kernels k (only their directions matter).
        p (float or Tensor[C_out, 1, 1]): sharpening exponent(s) > 0. Default: 2.
        q (float or 0-dim Tensor): damping >= 0 added to the patch norm. Default: 1e-3.
        stride, padding, dilation, groups: as in :func:`torch.nn.functional.conv2d`.
        eps (float): floor of the patch norm and of the kernel norms (zero patches give 0).

    Returns:
        Tensor[B, C_out, H', W'] in [-1, 1].
    """
    if not isinstance(q, Tensor):
        q = real_number("q", q, at_least=0.0)
    return patch_cosine2d(x, weight, stride, padding, dilation, groups, eps, q, power=p)


def scs_conv2d_reference(x: Tensor, weight: Tensor, p: float | Tensor = 2.0, q: float = 1e-3, stride=1, padding=0,
                         dilation=1, groups: int = 1) -> Tensor:
    """The readable definition of :func:`scs_conv2d`, patch by patch with ``unfold`` (as public ports compute it).

    Materialises a Tensor[B, C_in / groups * k_h * k_w, L] per group: for tests and benchmarks.  No
    floors: a zero patch with q = 0 gives NaN here.  ``p`` may be a number or Tensor[C_out, 1, 1].
    """
    p_flat = p.reshape(-1, 1) if isinstance(p, Tensor) else p  # (C_out, 1) or a number

    def group(ks: Tensor, patches: Tensor, rows: slice) -> Tensor:
        dots = torch.einsum("od,bdl->bol", ks, patches)
        cos = dots / ((patches.norm(dim=1)[:, None, :] + q) * ks.norm(dim=1)[None, :, None])
        exponent = p_flat[rows] if isinstance(p_flat, Tensor) else p_flat
        return torch.sign(cos) * cos.abs() ** exponent  # (B, C_out/G, L)

    return patchwise_reference(x, weight, group, stride, padding, dilation, groups)


class _ExpParam(nn.Module):
    """theta -> exp(theta); ``right_inverse`` makes ``layer.p = value`` (and ``layer.q``) assignable."""

    def forward(self, theta: Tensor) -> Tensor:
        return theta.exp()

    def right_inverse(self, value: Tensor) -> Tensor:
        return value.log()


class _ClampedParam(nn.Module):
    """theta -> max(theta, P_MIN): the "raw" parameterisation of p (Note [learnable p and q])."""

    def forward(self, theta: Tensor) -> Tensor:
        return theta.clamp_min(P_MIN)

    def right_inverse(self, value: Tensor) -> Tensor:
        return value


class SharpenedCosineSimilarity2d(nn.Conv2d):
    """Drop-in ``nn.Conv2d`` computing sharpened cosine similarity (see :func:`scs_conv2d`).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups: as in
            :class:`torch.nn.Conv2d`.
        bias (bool): add a learned bias after sharpening (the output is then no longer in [-1, 1]; the
            paper's layers have none). Default: False.
        p (float): sharpening exponent > 0 (the initial value when learned). Default: 2.
        q (float): damping >= 0 of the patch norm (initial value when learned; > 0 then). Default: 1e-3.
        learnable (bool): learn one p per output channel and one q per layer (Note [learnable p and q]).
            Default: False.
        p_param (str): ``"exp"`` or ``"raw"``, how a learned p is parameterised. Default: ``"exp"``.
        eps (float): floor of patch and kernel norms. Default: 1e-6.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = False, p: float = 2.0, q: float = 1e-3, learnable: bool = False,
                 p_param: str = "exp", eps: float = 1e-6, device=None, dtype=None):
        kernel_size, stride, padding, dilation = conv_arguments(in_channels, out_channels, kernel_size, stride,
                                                                padding, dilation, groups)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                         bias, "zeros", device=device, dtype=dtype)
        self.eps = real_number("eps", eps, above=0.0)
        self.learnable = bool(learnable)
        self.p_param = one_of("p_param", p_param, P_PARAMS)
        p = real_number("p", p, above=P_MIN if (learnable and p_param == "raw") else 0.0)
        q = real_number("q", q, above=0.0) if learnable else real_number("q", q, at_least=0.0)
        factory = {"device": device, "dtype": dtype}
        if self.learnable:
            self.p = nn.Parameter(torch.full((out_channels,), p, **factory))
            parametrize.register_parametrization(self, "p", _ExpParam() if p_param == "exp" else _ClampedParam())
            self.q = nn.Parameter(torch.tensor(q, **factory))
            parametrize.register_parametrization(self, "q", _ExpParam())
        else:
            self.p, self.q = p, q

    def _p(self) -> float | Tensor:
        return self.p.view(-1, 1, 1) if self.learnable else self.p  # (C_out, 1, 1) when learned

    def _check_input(self, x: Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"input must be Tensor[B, {self.in_channels}, H, W], got shape {tuple(x.shape)}")

    def cosine(self, x: Tensor) -> Tensor:
        """c = s . k / ((||s|| + q) ||k||) for every kernel and patch, Tensor[B, C_out, H', W'] (before sharpening)."""
        self._check_input(x)
        return patch_cosine2d(x, self.weight, self.stride, self.padding, self.dilation, self.groups, self.eps, self.q)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        out = patch_cosine2d(x, self.weight, self.stride, self.padding, self.dilation, self.groups, self.eps, self.q,
                             power=self._p())  # one fused epilogue on CUDA
        return out if self.bias is None else out + self.bias.view(-1, 1, 1)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.learnable:
            return text + f", learnable=True, p_param={self.p_param!r}"
        return text + f", p={self.p:g}, q={self.q:g}"


def max_abs_pool2d(x: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
    """The signed value of largest magnitude in every window (the paper's Sec. 2, after Pisoni).

    A feature and its negative are the same SCS evidence with opposite sign, so the pooling keeps
    whichever is larger in magnitude, with its sign; a tie between +a and -a gives +a, as upstream.
    The gradient reaches the selected element only.
    """
    positive = F.max_pool2d(x, kernel_size, stride, padding)
    negative = F.max_pool2d(-x, kernel_size, stride, padding)
    return torch.where(positive >= negative, positive, -negative)


class MaxAbsPool2d(nn.Module):
    """See :func:`max_abs_pool2d`; the arguments are those of :class:`torch.nn.MaxPool2d`."""

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        self.kernel_size = pair(kernel_size, "kernel_size", 1)
        self.stride = pair(stride, "stride", 1) if stride is not None else self.kernel_size
        self.padding = pair(padding, "padding", 0)
        if any(2 * p > k for p, k in zip(self.padding, self.kernel_size)):
            raise ValueError(f"padding must be at most half the kernel size, got {padding!r} for {kernel_size!r}")

    def forward(self, x: Tensor) -> Tensor:
        return max_abs_pool2d(x, self.kernel_size, self.stride, self.padding)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"
