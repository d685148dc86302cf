"""The norm of every receptive-field patch, with one pass over the input each way.

Note [patch norm by convolution] in :mod:`~sphereml.layers.patches` gives the patch norms as a box sum over the
window of e = the sum of x^2 over each group's channels (Tensor[B, G, H, W], 1 / C of the input's size).  What
costs time on a GPU is not that small convolution but the passes over the B x C x H x W input around it.

Note [one pass over the input]
    Autograd through ``x.square().sum(channels)`` passes over input-sized tensors twice forward (the squares are
    written, then read by the sum) and three times backward (``pow`` writes x, a product doubles it, another
    multiplies by dL/de).  Here dL/dx = 2 x dL/de is one product, the factor 2 applied to the small dL/de
    (:class:`_ChannelEnergy`, :func:`times_channels`; for float16 x, whose range the factor may exceed, a float32
    product and a cast), and off the CPU e is one reduction, :func:`torch.linalg.vector_norm` over the channels,
    squared on the small result.  Half inputs accumulate in float32 inside that reduction: PyTorch's CUDA
    reductions read half inputs for a float32 result without a float32 copy (the mixed-precision case of its
    ``make_reduction``; other accelerators may copy), and autocast, which could make that copy, is switched off
    around it.  On the CPU the reduction takes 14 times as long as squaring and summing (7.5 against 0.5 ms for
    32 x 64 x 32 x 32 floats here), so the CPU keeps the two passes.  The norms with Note [patch norm without
    overflow]'s scale (:func:`patch_norm`, the decoupled operators') find the scale off the CPU with one reduction
    too (the infinity norm, no ``abs`` copy of x; float16 needs no scale, its squares fit float32) and get dL/dx =
    x conv_transpose(dL/dn / n), each patch norm's exact gradient x / ||x||, in one product.  On the CPU these
    norms keep autograd's gradients, which the node's equal only to rounding: in float32 that rounding moved 84
    of chapter 4's 129 recorded numbers and one of its 15 verdicts (a claim at its noise floor) in a rerun on one
    machine, so the CPU's chapters keep their numbers bit for bit.  Counted on the CPU
    with the GPU's forms (``tests/test_patch_norms.py``, ``tests/test_patch_epilogue.py``), forward + backward
    touch input-sized tensors 5 times for a SphereConv or SCS layer (7 before, the fused epilogue's path 8), 7
    times for a decoupled operator (12 before) and twice for ``nn.Conv2d``.

Note [convolution and norms in one node]
    x reaches a patch layer's output along two paths, the convolution and the patch norms, and autograd adds their
    input gradients: the norms' product 2 x dL/de writes an x-sized tensor and the sum reads two and writes one.
    :func:`conv_and_squared_norms` makes the convolution and the squared norms one node whose backward adds
    2 x dL/de into the convolution's input gradient in place (``addcmul_``): one pass over x-sized tensors where
    there were two, and two operations fewer.  The fused paths (:mod:`~sphereml.layers.patch_epilogue`) use it on
    a GPU; on the CPU (the chapters' numbers) the two stay apart.  Under autocast the node does what autocast does
    to a convolution of float32 or half x and w: it casts each that is not in autocast's dtype to it, convolves
    and keeps the copies for the backward, whose gradients it casts back (the norms stay float32, as apart; a
    backward that is itself differentiated casts again, so that autograd sees the casts); float64 stays apart.
    Where Triton runs and x is float32 or half in NCHW or channels-last, the node's box sum is one kernel and its
    adjoint and that addition another (Note [box sums in a kernel] in :mod:`~sphereml.layers.window_sums`): three
    operations fewer.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import forward_ad

from .._autograd import Function, transformed
from ..launches import on_accelerator  # the GPU forms; tests make it say True
from . import window_sums
from ._layouts import densified

__all__ = ["channel_energy", "times_channels", "box_sum", "box_sum_transpose", "squared_patch_norms",
           "conv_and_squared_norms", "patch_norm"]

_HALF = (torch.float16, torch.bfloat16)


_AUTOCAST_AVAILABLE: dict[str, bool] = {}  # per device type: asked afresh, about 1 µs a call, five a fused step


def _autocast_on(device: torch.device) -> bool:
    """Whether autocast is on for ``device`` (meta tensors have none)."""
    kind = device.type
    if torch.compiler.is_compiling():  # TorchDynamo traces the question itself, not a cache
        return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
    available = _AUTOCAST_AVAILABLE.get(kind)
    if available is None:
        available = _AUTOCAST_AVAILABLE.setdefault(kind, torch.amp.is_autocast_available(kind))
    return available and torch.is_autocast_enabled(kind)


def _autocast_off(device: torch.device):
    """Autocast switched off on ``device`` where it is on: it would run the box sums of squares in half precision
    and copy x to float32 for a norm.  Nothing to enter otherwise (meta tensors have no autocast)."""
    if _autocast_on(device):
        return torch.autocast(device.type, enabled=False)
    return nullcontext()


def _grouped(x: Tensor, groups: int) -> Tensor:
    b, c, h, w = x.shape
    return x.reshape(b, groups, c // groups, h, w)


def _channel_norms(x: Tensor, groups: int) -> Tensor:
    """nu = the norm of each group's channels, Tensor[B, G, H, W], float32 for half inputs: one reduction."""
    with _autocast_off(x.device):
        accumulate = torch.float32 if x.dtype in _HALF else None
        return torch.linalg.vector_norm(_grouped(x, groups), dim=2, dtype=accumulate)


def _energy(x: Tensor, groups: int) -> Tensor:
    """e = sum over each group's channels of x^2, Tensor[B, G, H, W], float32 for half inputs: one reduction off
    the CPU (Note [one pass over the input]); on the CPU the squares, then their sum."""
    if not on_accelerator(x.device):
        return _grouped(x.float() if x.dtype in _HALF else x, groups).square().sum(2)
    return _channel_norms(x, groups).square()


def _largest_magnitude(x: Tensor) -> Tensor:
    """Each sample's largest absolute value, Tensor[B, 1, 1, 1]: one reduction off the CPU, abs then max on it."""
    if not on_accelerator(x.device):
        return x.abs().amax(dim=(1, 2, 3), keepdim=True)
    with _autocast_off(x.device):
        return torch.linalg.vector_norm(x, float("inf"), dim=(1, 2, 3), keepdim=True)


def times_channels(x: Tensor, per_position: Tensor, groups: int) -> Tensor:
    """x times a factor per group and position (Tensor[B, G, H, W]) broadcast over the group's channels, in x's
    dtype: one pass over x (for float16 x, whose range a float32 factor may exceed, a float32 product and a cast)."""
    if x.dtype == torch.bfloat16:  # float32's range: the factor rounded once, the product written once
        per_position = per_position.to(x.dtype)
    return (_grouped(x, groups) * per_position.unsqueeze(2)).reshape(x.shape).to(x.dtype)


def _plain(x: Tensor) -> bool:
    """Whether x needs no gradient, or forward mode is on (``torch.func.jvp``, ``jacfwd``, ``hessian``,
    ``forward_ad``): then the nodes' forwards run as they are, in autograd's own operations, which forward mode
    differentiates (TorchDynamo cannot trace a node with a ``jvp`` rule, so the nodes have none)."""
    return not (torch.is_grad_enabled() and x.requires_grad) or forward_ad._current_level >= 0


class _ChannelEnergy(Function):
    """e = sum over each group's channels of x^2 (Note [one pass over the input]); dL/dx = x * 2 dL/de."""

    generate_vmap_rule = True  # several seeds at once (sphereml.multiseed)

    @staticmethod
    def forward(x: Tensor, groups: int) -> Tensor:
        return _energy(x, groups)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.groups = inputs[1]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        return times_channels(x, grad * 2.0, ctx.groups), None


def channel_energy(x: Tensor, groups: int = 1) -> Tensor:
    """The sum of x^2 over each group's channels, Tensor[B, G, H, W] (float32 for half x), differentiable."""
    if _plain(x):  # inside another node's forward, or in forward mode: no node of its own
        return _energy(x, groups)
    return _ChannelEnergy.apply(x, groups)


def box_sum(energy: Tensor, kernel_size, stride, padding, dilation, groups: int) -> Tensor:
    """The sum of ``energy`` (Tensor[B, G, H, W]) over each window of the layer: one depthwise convolution with a
    kernel of ones (Note [patch norm by convolution]); Tensor[B, G, H', W'], in float32 under autocast too."""
    ones = energy.new_ones(groups, 1, *kernel_size)
    with _autocast_off(energy.device):
        return F.conv2d(energy, ones, None, stride, padding, dilation, groups)


def box_sum_transpose(grad: Tensor, energy_shape, kernel_size, stride, padding, dilation, groups: int) -> Tensor:
    """The adjoint of :func:`box_sum`: each window's value added back to every position it covers (autocast does
    not touch a convolution's backward)."""
    ones = grad.new_ones(groups, 1, *kernel_size)
    return torch.nn.grad.conv2d_input(energy_shape, ones, grad, stride, padding, dilation, groups)


def squared_patch_norms(x: Tensor, kernel_size, stride, padding, dilation, groups: int) -> Tensor:
    """s = the box sum of :func:`channel_energy`: every patch's squared norm, Tensor[B, G, H', W'] (float32 for
    half x; x^2 overflows float16 above 256), differentiable."""
    return box_sum(channel_energy(x, groups), kernel_size, stride, padding, dilation, groups)


class _ConvAndSquaredNorms(Function):
    """(u = conv(x, w), s = :func:`squared_patch_norms`) in one node (Note [convolution and norms in one node])."""

    generate_vmap_rule = True  # torch.func's per-sample gradients

    @staticmethod
    def forward(x: Tensor, weight: Tensor, stride, padding, dilation, groups: int) -> tuple[Tensor, ...]:
        """(u, s, and for the backward, never differentiated: the energy e and the box sum's kernel of ones unless
        the kernels of Note [box sums in a kernel] take x, then autocast's copies of x and w, where it casts them)."""
        casts = _autocast_casts(x, weight)
        conv = [t if dtype is None else t.to(dtype) for t, dtype in zip((x, weight), casts)]
        with _autocast_off(x.device):
            inner = F.conv2d(*conv, None, stride, padding, dilation, groups)
        copies = [t for t, dtype in zip(conv, casts) if dtype is not None]
        return inner, *_squared_norms(x, weight.shape[2:], stride, padding, dilation, groups), *copies

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, *conv = inputs
        ctx.casts = _autocast_casts(x, weight)
        ctx.mark_non_differentiable(*output[2:])
        ctx.save_for_backward(x, weight, *output[2:])
        ctx.conv = tuple(conv)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_inner: Tensor | None, grad_sq: Tensor | None, *_):
        x, weight, *rest = ctx.saved_tensors
        count = sum(dtype is not None for dtype in ctx.casts)
        box, copies = rest[:len(rest) - count], iter(rest[len(rest) - count:])
        differentiated = torch.is_grad_enabled()  # create_graph=True: autograd must see the casts
        conv_x, conv_w = (t if dtype is None else (t.to(dtype) if differentiated else next(copies))
                          for t, dtype in zip((x, weight), ctx.casts))
        stride, padding, dilation, groups = ctx.conv
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        if grad_inner is not None and (need_x or need_w):
            grad_x, grad_w, _ = torch.ops.aten.convolution_backward(
                grad_inner, conv_x, conv_w, None, stride, padding, dilation, False, (0, 0), groups,
                (need_x, need_w, False))
            grad_x, grad_w = (g if g is None or g.dtype == t.dtype else g.to(t.dtype)
                              for g, t in ((grad_x, x), (grad_w, weight)))
        return _add_norms_gradient(ctx, x, weight, box, grad_x, grad_sq), grad_w, None, None, None, None


def _autocast_casts(x: Tensor, weight: Tensor) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The dtype autocast would cast x and w to for their convolution, or None for each it leaves alone."""
    if not _autocast_on(x.device):
        return None, None
    low = torch.get_autocast_dtype(x.device.type)
    return tuple(None if t.dtype == low else low for t in (x, weight))


def _squared_norms(x: Tensor, kernel_size, stride, padding, dilation, groups: int) -> tuple[Tensor, ...]:
    """(s, and for the backward the energy e and the box sum's kernel of ones unless the kernels take x)."""
    if window_sums.takes(x):
        return (window_sums.squared_norms_by_window(_channel_norms(x, groups), kernel_size, stride, padding, dilation),)
    energy = _energy(x, groups)
    ones = energy.new_ones(groups, 1, *kernel_size)
    with _autocast_off(x.device):
        return F.conv2d(energy, ones, None, stride, padding, dilation, groups), energy, ones


def _add_norms_gradient(ctx, x: Tensor, weight: Tensor, box, grad_x: Tensor | None, grad_sq: Tensor | None):
    """dL/dx with the norms' share 2 x dL/de added, dL/de the box sum's adjoint of dL/ds (in place where there is
    a dL/dx)."""
    stride, padding, dilation, groups = ctx.conv
    if grad_sq is None or not ctx.needs_input_grad[0]:
        return grad_x
    differentiated = torch.is_grad_enabled()  # create_graph=True: the kernel has no derivative
    if not (box or differentiated or transformed(x, grad_sq, grad_x)):  # Note [box sums in a kernel]
        grad_x = torch.zeros_like(x) if grad_x is None else densified(grad_x)  # NCHW or channels-last, either
        window_sums.add_window_gradient_(grad_x, x, grad_sq, weight.shape[2:], stride, padding, dilation)
        return grad_x
    b, _, h, w = x.shape
    if box:  # dL/de: the box sum's adjoint, with the forward's energy and kernel of ones
        per_position = torch.ops.aten.convolution_backward(
            grad_sq, *box, None, stride, padding, dilation, False, (0, 0), groups, (True, False, False))[0]
    else:  # the forward took the kernels; this backward is differentiated, or under a torch.func transform
        per_position = box_sum_transpose(grad_sq, (b, groups, h, w), weight.shape[2:], stride, padding, dilation,
                                         groups)
    if grad_x is None:
        return times_channels(x, per_position * 2.0, groups)
    # dL/dx += 2 x dL/de, in place: a view of each group's channels (a split channel axis is a view)
    grad_x.view(b, groups, -1, h, w).addcmul_(_grouped(x, groups), per_position.unsqueeze(2), value=2.0)
    return grad_x


def _pair(value) -> tuple[int, int]:
    """A number, or a sequence of one or two, as a pair (as ``F.conv2d`` takes them)."""
    value = (value,) if isinstance(value, int) else tuple(value)
    return value * 2 if len(value) == 1 else value


def conv_and_squared_norms(x: Tensor, weight: Tensor, stride, padding, dilation, groups: int) -> tuple[Tensor, Tensor]:
    """(conv2d(x, weight) Tensor[B, C_out, H', W'], the squared patch norms Tensor[B, G, H', W']) with one pass over x
    in the backward for both (Note [convolution and norms in one node]); stride, integer padding and dilation as
    numbers or pairs.  One node off the CPU where x needs a gradient, outside forward mode (under autocast, for
    float32 or half x and w); else the two apart."""
    stride, padding, dilation = (_pair(v) for v in (stride, padding, dilation))
    autocast_float64 = _autocast_on(x.device) and torch.float64 in (x.dtype, weight.dtype)  # which it leaves alone
    if _plain(x) or not on_accelerator(x.device) or autocast_float64:
        kernel_size = tuple(weight.shape[2:])
        return (F.conv2d(x, weight, None, stride, padding, dilation, groups),
                squared_patch_norms(x, kernel_size, stride, padding, dilation, groups))
    return _ConvAndSquaredNorms.apply(x, weight, stride, padding, dilation, groups)[:2]


def _norms(x: Tensor, window, groups: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(max(||x_patch||, eps) in x's dtype, the box sums of squares, the norms before the floor at eps): float16
    squares summed in float32 neither overflow nor underflow, other dtypes are scaled by each sample's largest
    magnitude first (a constant of the gradient: detached)."""
    scale = None if x.dtype == torch.float16 else _largest_magnitude(x.detach()).clamp_min(torch.finfo(x.dtype).tiny)
    squares = box_sum(_energy(x if scale is None else x / scale, groups), *window, groups)
    norm = squares.clamp_min(torch.finfo(squares.dtype).tiny).sqrt()  # the floor keeps the root's gradient finite
    if scale is not None:
        norm = norm * scale.to(squares.dtype)  # out of place: autograd differentiates these where no node does
    return norm.clamp_min(eps).to(x.dtype), squares, norm


class _PatchNorm(Function):
    """n = max(||x_patch||, eps) with Note [patch norm without overflow]'s scale; dL/dx = x conv_T(dL/dn / n).

    The scale s (each sample's largest absolute value) is a constant of the gradient, so d n / d x = x / n exactly
    for every patch above the floors; below them (the root's at the smallest normal number, the norm's at eps) the
    gradient is zero, as autograd gives through the clamps.  Returns (n in x's dtype, where it is above the floors).
    """

    generate_vmap_rule = True  # several seeds at once (sphereml.multiseed)

    @staticmethod
    def forward(x: Tensor, kernel_size, stride, padding, dilation, groups: int, eps: float):
        floored, squares, norm = _norms(x, (kernel_size, stride, padding, dilation), groups, eps)
        return floored, (squares >= torch.finfo(squares.dtype).tiny) & (norm >= eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, kernel_size, stride, padding, dilation, groups, _ = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, *output)
        ctx.conv = (kernel_size, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad: Tensor | None, _):
        if grad is None:
            return (None,) * 7
        x, norm, active = ctx.saved_tensors
        groups = ctx.conv[-1]
        wide = torch.promote_types(grad.dtype, torch.float32)
        per_patch = torch.where(active, grad.to(wide) / norm, 0.0)  # 0, not 0 * inf, where a floor rounds to 0
        b, _, h, w = x.shape
        per_position = box_sum_transpose(per_patch, (b, groups, h, w), *ctx.conv)
        return (times_channels(x, per_position, groups),) + (None,) * 6


def patch_norm(x: Tensor, kernel_size, stride, padding, dilation, groups: int, eps: float) -> Tensor:
    """max(||x_patch||, eps) for every patch, Tensor[B, G, H', W'] in x's dtype, right from the dtype's smallest to
    its largest numbers (Note [patch norm without overflow]); tuples for the window's sizes, integer padding.  Off
    the CPU one autograd node where x needs a gradient (Note [one pass over the input]); on the CPU, and where x
    needs none or forward mode is on, autograd through the forward, whose gradients on the CPU are bit for bit the
    library's before the node (the chapters' recorded ``cpu`` runs)."""
    if _plain(x) or not on_accelerator(x.device):
        return _norms(x, (kernel_size, stride, padding, dilation), groups, eps)[0]
    return _PatchNorm.apply(x, kernel_size, stride, padding, dilation, groups, eps)[0]
