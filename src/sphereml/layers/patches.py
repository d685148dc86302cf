"""Patches of a convolution: the norm of every receptive field and its cosine to every kernel, by convolution.

SphereConv (thesis Ch. 3), the decoupled operators (Ch. 4) and sharpened cosine similarity all score
a receptive-field patch x against a kernel w through cos(theta) = w . x / (||w|| ||x||), x being the
*whole* patch (C_in / groups x k_h x k_w values at one output position, zero padding included).
This module computes it without ``unfold``, for all positions at once, and holds the argument
checks those layers share.

Note [patch norm by convolution]
    ||x|| for every output position is a convolution of x^2 with a kernel of ones over
    the same window (same stride, padding, dilation and groups).  We sum x^2 over the
    channels of each group first and then convolve with a ones *spatial* kernel, one
    output channel per group (a depthwise convolution): the same sums, at 1 / C_out of
    the main convolution's cost.  The cosine is then conv(x, w / ||w||) / ||x||, so the
    layer costs one ordinary convolution plus a few elementwise passes; nothing is
    unfolded.  The sums over channels and their gradient take one pass over x each way
    (Note [one pass over the input] in :mod:`~sphereml.layers.patch_norms`).

Note [zero patch]
    A patch with ||x|| < eps (zero padding on a blank background, a dead ReLU region)
    has its norm floored at eps.  Its inner product is 0, so cos = 0, theta = pi/2 and
    every angular g (and every sharpened cosine) gives 0, with finite gradients (d/dx is
    w_hat / eps; the square root sees ||x||^2 floored at the smallest normal number of the dtype
    it is summed in, float32 for half inputs, where its derivative at 0 would be infinite, and
    the floor at eps after it passes no gradient).  Above eps a layer with q = 0 is exactly
    invariant to rescaling the patch.

Note [fused epilogue]
    After the convolution the layer's work is elementwise: divide each inner product by its patch norm (+ q),
    clamp, and for SCS sharpen.  Eagerly that is a pass over the B x C_out x H' x W' output per operation:
    forward + backward, 8 such operations for the cosine, 19 for linear g, 26 for sigmoid g (32 with a learned
    k), 17 for SCS (23 with learned p and q), against 3 for ``nn.Conv2d``.  With ``backend="fused"`` one
    Triton kernel does it all forward and one backward, for every angular activation and for the sharpening
    (:mod:`sphereml.layers.patch_epilogue`): 5 in every case (the convolution, its backward, the two kernels, and a
    loss's sum), reading the inner products once; the patch norms still come from the depthwise convolution
    above.  Counted on the CPU by ``tests/test_patch_epilogue.py``.  The fused output keeps the input's dtype
    (bf16 stays bf16, as a convolution's); the reference path promotes half inputs to float32.  Fewer passes
    did not make it faster: on a GPU the fused layer took longer than the reference nodes in every shape
    timed (``benchmarks/results/sphereconv_*-cuda.json``, ``scs_*-cuda.json``), and under ``torch.compile`` the
    opaque kernel keeps inductor from fusing the epilogue itself, so ``"auto"`` takes the reference path unless
    ``SPHEREML_FUSED=1`` (:func:`~sphereml.energy.triton_backend.choose_backend`).

Note [patch norm without overflow]
    In float32 and bfloat16 the square of 1e19 is inf and that of 1e-20 is 0.  Each sample is
    divided by its largest absolute value before squaring and the norms are multiplied back after the
    root, so patch norms are right from the dtype's smallest to its largest number.  The scale
    is detached: the gradient of the norm is still exactly x / ||x||.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._autograd import Function
from .._checks import integer, real_number
from ..angular import DECOUPLED_ANGULAR, angular_activation, check_angular, check_k
from .patch_epilogue import fused_epilogue, per_channel, resolve_backend
from .patch_norms import box_sum_transpose, conv_and_squared_norms, patch_norm, squared_patch_norms, times_channels
from .unit_kernels import unit_kernels

__all__ = ["pair", "check_padding", "conv_arguments", "explicit_padding", "output_size", "patch_cosine2d",
           "patch_norm2d", "patchwise_reference", "sharpen"]

_GRAD_FLOOR = 1e-6  # Note [sharpening without NaN] in sphereml.layers.scs


def pair(value, name: str, minimum: int) -> tuple[int, int]:
    """``value`` as an (H, W) pair of integers >= ``minimum`` (an int is used for both)."""
    if isinstance(value, int):
        pair = (value, value)
    else:
        pair = tuple(value) if isinstance(value, (tuple, list)) else ()
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in pair):
        raise ValueError(f"{name} must be an integer >= {minimum} or a pair of them, got {value!r}")
    return pair


def check_padding(padding) -> str | tuple[int, int]:
    """``"valid"``, ``"same"`` or an (H, W) pair of integers >= 0."""
    if isinstance(padding, str):
        if padding not in ("valid", "same"):
            raise ValueError(f"padding must be 'valid', 'same', an integer >= 0 or a pair, got {padding!r}")
        return padding
    return pair(padding, "padding", 0)


def conv_arguments(in_channels: int, out_channels: int, kernel_size, stride, padding, dilation, groups: int):
    """The checked ``nn.Conv2d`` geometry of a patch layer: (kernel_size, stride, padding, dilation) as pairs
    (padding may stay ``"valid"`` / ``"same"``); channel counts >= 1 and divisible by ``groups``."""
    for name, value in {"in_channels": in_channels, "out_channels": out_channels, "groups": groups}.items():
        integer(name, value, at_least=1)
    if in_channels % groups or out_channels % groups:
        raise ValueError(f"in_channels ({in_channels}) and out_channels ({out_channels}) must be divisible "
                         f"by groups ({groups})")
    return (pair(kernel_size, "kernel_size", 1), pair(stride, "stride", 1), check_padding(padding),
            pair(dilation, "dilation", 1))


def explicit_padding(x: Tensor, padding, kernel_size, stride, dilation) -> tuple[Tensor, tuple[int, int]]:
    """Turn ``'valid'`` / ``'same'`` into numbers (padding x first when 'same' is asymmetric)."""
    padding = check_padding(padding)
    if not isinstance(padding, str):
        return x, padding
    if padding == "valid":
        return x, (0, 0)
    if stride != (1, 1):
        raise ValueError(f"padding='same' needs stride 1, got stride {stride}")
    total = [d * (k - 1) for d, k in zip(dilation, kernel_size)]  # (H, W); PyTorch puts the odd pixel last
    pads = [total[1] // 2, total[1] - total[1] // 2, total[0] // 2, total[0] - total[0] // 2]
    return F.pad(x, pads), (0, 0)


def output_size(size: tuple[int, int], kernel_size, stride, padding, dilation) -> list[int]:
    """(H', W') of a convolution with integer ``padding`` (the formula of :class:`torch.nn.Conv2d`)."""
    return [(n + 2 * p - d * (k - 1) - 1) // s + 1
            for n, p, d, k, s in zip(size, padding, dilation, kernel_size, stride)]


def patch_norm2d(x: Tensor, kernel_size, stride=1, padding=0, dilation=1, groups: int = 1,
                 eps: float = 1e-6) -> Tensor:
    """||x|| of every receptive-field patch of each channel group, floored at ``eps`` (Note [patch norm by
    convolution] in :mod:`sphereml.layers.patches`; ``padding`` as for the layers), with no overflow or underflow
    (Note [patch norm without overflow]) and one pass over x each way (:func:`~sphereml.layers.patch_norms.patch_norm`).

    Returns:
        Tensor[B, groups, H', W'].
    """
    kernel_size, stride = pair(kernel_size, "kernel_size", 1), pair(stride, "stride", 1)
    dilation = pair(dilation, "dilation", 1)
    x, padding = explicit_padding(x, padding, kernel_size, stride, dilation)
    return patch_norm(x, kernel_size, stride, padding, dilation, groups, eps)


def patchwise_reference(x: Tensor, weight: Tensor, fn, stride=1, padding=0, dilation=1, groups: int = 1) -> Tensor:
    """A patch operator evaluated by its definition with ``unfold``: the loop the readable references share.

    For each channel group, ``fn(kernels, patches, rows)`` receives the group's flattened kernels
    Tensor[C_out / G, D], its unfolded receptive fields Tensor[B, D, L] (D = C_in / G * k_h * k_w, zero padding
    included) and the slice of output channels it produces, and returns Tensor[B, C_out / G, L].  The whole
    Tensor[B, D, L] is materialised, so this is for tests and benchmarks.  Integer padding.

    Returns:
        Tensor[B, C_out, H', W'].
    """
    b, c_in, c_out, kernel = x.shape[0], x.shape[1], weight.shape[0], tuple(weight.shape[2:])
    outs = []
    for g in range(groups):
        rows = slice(g * c_out // groups, (g + 1) * c_out // groups)
        xs = x[:, g * c_in // groups:(g + 1) * c_in // groups]
        patches = F.unfold(xs, kernel, dilation=dilation, padding=padding, stride=stride)  # (B, D, L)
        outs.append(fn(weight[rows].flatten(1), patches, rows))  # (B, C_out/G, L)
    shape = output_size(x.shape[2:], kernel, pair(stride, "stride", 1), pair(padding, "padding", 0),
                        pair(dilation, "dilation", 1))
    return torch.cat(outs, 1).view(b, c_out, *shape)


def _grad_x_through_norms(grad_m: Tensor, x: Tensor, norm: Tensor, sq: Tensor, energy_shape, conv) -> Tensor:
    """dL/dx through the patch norms: x * 2 conv_transpose(d/ds, ones) with d/ds = (dL/dm) / 2n, zero where the
    norm floor is active (the factors on the small tensors, one pass over x).  ``conv``: (kernel_size, stride,
    padding, dilation, groups, eps)."""
    *window, groups, eps = conv
    grad_sq = grad_m.div_(norm).mul_(sq >= eps * eps)  # 2 d/ds
    return times_channels(x, box_sum_transpose(grad_sq, energy_shape, *window, groups), groups)


class _DivideByPatchNorm(Function):
    """cos = clamp(inner / (||x_patch|| + q), -1, 1) with the patch norm of Note [patch norm by convolution].

    Forward: e = sum over each group's channels of x^2 (Tensor[B, G, H, W]), s = conv(e, ones)
    over the layer's window, n = sqrt(max(s, eps^2)), m = n + q (q = 0 when None).  Backward, by
    hand, with g the incoming gradient and j the output channels of a group:

        d/d inner = g / m,    d/dm = -sum_j g_j inner_j / m^2,    d/dq = sum over positions of d/dm,
        d/ds = (d/dm) / 2n  (0 where s < eps^2),    d/dx = 2 x * conv_transpose(d/ds, ones).

    The clamp only removes rounding (the inner product never exceeds the norm product) and
    passes the gradient through.  The backward passes over the B x C_out x H' x W' tensors
    three times (d/d inner, the product with inner and its sum over channels) and over x once
    (Note [one pass over the input] in :mod:`~sphereml.layers.patch_norms`); autograd through
    the composite made eight such passes (1.46x -> 1.17x of ``nn.Conv2d`` forward + backward
    at 64 channels, 32x32, batch 32, in one A/B run on our 2-core CPU when this node was written).
    """

    generate_vmap_rule = True  # several seeds at once (sphereml.multiseed)

    @staticmethod
    def forward(inner: Tensor, x: Tensor, q: Tensor | float | None, kernel_size, stride, padding, dilation,
                groups: int, eps: float) -> tuple[Tensor, ...]:
        """(cos, n, s), and m = n + q after them when q is given: the norms are outputs so that the context
        may save them (the form ``torch.func`` needs), never differentiated."""
        sq = squared_patch_norms(x, kernel_size, stride, padding, dilation, groups)
        norm = sq.clamp_min(eps * eps).sqrt_()
        denominator = norm if q is None else norm + q
        bo, co, ho, wo = inner.shape
        grouped = (bo, groups, co // groups, ho, wo)
        cos = (inner.view(grouped) / denominator.unsqueeze(2)).view(bo, co, ho, wo)
        # Out of place: torch.compile (2.11) drops the backward of a Function whose output is changed in place.
        return (cos.clamp(-1.0, 1.0), norm, sq) + (() if q is None else (denominator,))

    @staticmethod
    def setup_context(ctx, inputs, output):
        inner, x, q, kernel_size, stride, padding, dilation, groups, eps = inputs
        norm, sq = output[1], output[2]
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(inner, x, norm, output[-1] if q is not None else norm, sq)
        ctx.conv = (kernel_size, stride, padding, dilation, groups, eps)
        b, c, h, w = x.shape
        ctx.energy_shape, ctx.has_q = (b, groups, h, w), q is not None

    @staticmethod
    def backward(ctx, grad: Tensor | None, *_):
        if grad is None:
            return (None,) * 9
        inner, x, norm, denominator, sq = ctx.saved_tensors
        groups = ctx.conv[4]
        bo, co, ho, wo = inner.shape
        g = grad.reshape(bo, groups, co // groups, ho, wo)
        inv = denominator.reciprocal()  # (B, G, H', W')
        grad_inner = (g * inv.unsqueeze(2)).reshape(bo, co, ho, wo).to(inner.dtype)
        grad_x = grad_q = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_m = (g * inner.reshape(g.shape)).sum(2).mul_(inv.square()).neg_()  # d/dm, (B, G, H', W')
            if ctx.has_q and ctx.needs_input_grad[2]:
                grad_q = grad_m.sum()
            if ctx.needs_input_grad[1]:
                grad_x = _grad_x_through_norms(grad_m, x, norm, sq, ctx.energy_shape, ctx.conv)
        return grad_inner, grad_x, grad_q, None, None, None, None, None, None


class _Sharpen(Function):
    """sign(c) abs(c)^p with p a number or a tensor broadcast against c, in one autograd node.

    Forward computes y = sign(c) abs(c)^p exactly.  Backward (Note [sharpening without NaN]) reuses
    abs(c)^p: dy/dc = p abs(c)^p / max(abs(c), 1e-6) and dy/dp = y ln max(abs(c), 1e-6) (summed over the broadcast
    axes), exact for abs(c) >= 1e-6 and finite below; one ``pow`` in all, as for plain autograd's forward.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(c: Tensor, p: float | Tensor) -> tuple[Tensor, Tensor]:
        powered = c.abs().pow(p)  # abs(c)^p
        return powered * torch.sign(c), powered

    @staticmethod
    def setup_context(ctx, inputs, output):
        c, p = inputs
        ctx.save_for_backward(c, output[1], p if isinstance(p, Tensor) else None)
        ctx.p = p if not isinstance(p, Tensor) else None
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # no zeros for the second output, which is never differentiated

    @staticmethod
    def backward(ctx, grad: Tensor | None, _):
        if grad is None:
            return None, None
        c, powered, p_tensor = ctx.saved_tensors
        p = p_tensor if p_tensor is not None else ctx.p
        floored = c.abs().clamp_min_(_GRAD_FLOOR)
        grad_c = grad_p = None
        if ctx.needs_input_grad[0]:
            grad_c = (powered / floored).mul_(grad).mul_(p)
        if p_tensor is not None and ctx.needs_input_grad[1]:
            grad_p = floored.log_().mul_(powered).mul_(torch.sign(c)).mul_(grad).sum_to_size(p_tensor.shape)
        return grad_c, grad_p


def sharpen(c: Tensor, p: float | Tensor) -> Tensor:
    """sign(c) abs(c)^p: the sharpening of the paper's Sec. 1, finite gradients at c = 0.

    Args:
        c (Tensor): cosines (any shape).
        p (float or Tensor): exponent > 0, broadcast against ``c`` (a tensor gets a gradient).
    """
    if not isinstance(p, Tensor):
        p = real_number("p", p, above=0.0)
    return _Sharpen.apply(c, p)[0]


def patch_cosine2d(x: Tensor, weight: Tensor, stride=1, padding=0, dilation=1, groups: int = 1, eps: float = 1e-6,
                   q: float | Tensor | None = None, angular: str = "cosine", k: float | Tensor = 0.5,
                   power: float | Tensor | None = None, backend: str = "auto") -> Tensor:
    """w . x / (||w|| (||x|| + q)) between every kernel w and every receptive-field patch x, and its epilogue.

    With ``q`` None (or 0) this is cos(theta) (thesis eq. 3.1); a q > 0 damps weak patches, as the
    denominator of sharpened cosine similarity does.  ||x|| is floored at ``eps`` (Note [zero patch]).
    The result c is returned as it is, or as an angular activation g (``angular``, with curvature ``k``
    for sigmoid: :func:`~sphereml.angular.angular_activation`), or sharpened (``power`` p: :func:`sharpen`),
    which on CUDA all run in one fused kernel each way (Note [fused epilogue]).

    Args:
        x (Tensor[B, C_in, H, W]): input.
        weight (Tensor[C_out, C_in / groups, k_h, k_w]): kernels (any norm; only directions matter).
        stride, padding, dilation, groups: as in :func:`torch.nn.functional.conv2d` (``padding`` may be
            ``"valid"`` or ``"same"``).
        eps (float): patch-norm floor. Default: 1e-6.
        q (float or 0-dim Tensor, optional): offset added to the patch norm (a tensor gets a gradient; a number
            is never copied to the device).
        angular (str): ``"cosine"`` (c itself), ``"linear"``, ``"sigmoid"`` or ``"sqcosine"``. Default: cosine.
        k (float or Tensor): sigmoid curvature > 0 (one value, or Tensor[C_out, 1, 1] on the fused path; other
            shapes broadcast as in :func:`~sphereml.angular.angular_activation`, on the reference path). Default: 0.5.
        power (float or Tensor, optional): sharpening exponent p > 0 (cosine only), shaped as ``k``.
        backend (str): ``"auto"`` (the reference unless ``SPHEREML_FUSED=1``), ``"reference"`` or ``"fused"``
            (Triton, float32 or half: the epilogue and the kernels' normalisation, Note [unit kernels in one pass]
            in :mod:`~sphereml.layers.unit_kernels`). Default: ``"auto"``.

    Returns:
        Tensor[B, C_out, H', W'] in [-1, 1].
    """
    angular = check_angular(angular, DECOUPLED_ANGULAR)
    eps = real_number("eps", eps, above=0.0)
    if angular == "sigmoid":
        k = check_k(k)
    if power is not None and angular != "cosine":
        raise ValueError(f"power sharpens the cosine: it needs angular='cosine', got {angular!r}")
    if power is not None and not isinstance(power, Tensor):
        power = real_number("power", power, above=0.0)
    kernel_size = tuple(weight.shape[2:])
    stride, dilation = pair(stride, "stride", 1), pair(dilation, "dilation", 1)
    x, padding = explicit_padding(x, padding, kernel_size, stride, dilation)
    if q is not None and not isinstance(q, Tensor):
        q = None if q == 0 else float(q)  # a number stays on the host: no copy to the device per call
    epilogue, param = ("sharpen", power) if power is not None else (angular, k)
    fused = resolve_backend(backend, x) == "fused"
    if fused and not per_channel(param, weight.shape[0]):
        if backend == "fused":
            raise ValueError(f"the fused epilogue takes k or p as a number, one value or Tensor[C_out, 1, 1], "
                             f"got shape {tuple(param.shape)}")
        fused = False
    w_hat = unit_kernels(weight, eps, fused)  # Note [unit kernels in one pass]
    if fused:  # Note [convolution and norms in one node]
        inner, sq = conv_and_squared_norms(x, w_hat, stride, padding, dilation, groups)
        return fused_epilogue(inner, sq, q, epilogue, param, groups, eps)
    inner = F.conv2d(x, w_hat, None, stride, padding, dilation, groups)  # (B, C_out, H', W')
    cos = _DivideByPatchNorm.apply(inner, x, q, kernel_size, stride, padding, dilation, groups, eps)[0]
    if power is not None:
        return sharpen(cos, power)
    return angular_activation(cos, angular, k)
