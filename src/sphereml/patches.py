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
    unfolded.

Note [zero patch]
    A patch with ||x|| < eps (zero padding on a blank background, a dead ReLU region)
    has its norm floored at eps.  Its inner product is 0, so cos = 0, theta = pi/2 and
    every angular g (and every sharpened cosine) gives 0, with finite gradients (d/dx is
    w_hat / eps; the square root sees ||x||^2 floored at the dtype's smallest normal number, where
    its derivative at 0 would be infinite, and the floor at eps after it passes no gradient).  Above
    eps a layer with q = 0 is exactly invariant to rescaling the patch.

Note [fused epilogue]
    After the convolution the layer's work is elementwise: divide each inner product by its patch norm
    (+ q), clamp, and for SCS sharpen.  Eagerly that is a pass over the B x C_out x H' x W' output per
    operation (8 forward + backward for the cosine, 17 with sharpening).  On CUDA (``backend="auto"``) one
    Triton kernel does it all forward and one backward (:mod:`sphereml._patch_kernels`, registered as the
    custom operators ``sphereml::patch_epilogue`` and ``patch_epilogue_backward`` so ``torch.compile``
    traces them), reading the inner products once; the patch norms still come from the depthwise
    convolution above.  The fused output keeps the input's dtype (bf16 stays bf16, as a convolution's);
    the reference path promotes half inputs to float32.  The CPU keeps the reference path.

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

from ._checks import integer, real_number
from .energy.triton_backend import usable_on
from .geometry import max_abs_scale, safe_norm

__all__ = ["pair", "check_padding", "conv_arguments", "explicit_padding", "output_size", "patch_cosine2d",
           "patch_norm2d", "patchwise_reference", "sharpen", "EPILOGUE_BACKENDS"]

EPILOGUE_BACKENDS = ("auto", "reference", "fused")
_GRAD_FLOOR = 1e-6  # Note [sharpening without NaN] in sphereml.scs


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
    """||x|| of every receptive-field patch of each channel group, floored at ``eps``
    (Note [patch norm by convolution] in :mod:`sphereml.patches`; integer padding).

    Returns:
        Tensor[B, groups, H', W'].
    """
    b, c, h, w = x.shape
    # Note [patch norm without overflow]
    scale = max_abs_scale(x, (1, 2, 3))
    energy = (x / scale).square().reshape(b, groups, c // groups, h, w).sum(2)  # (B, G, H, W)
    ones = energy.new_ones(groups, 1, *pair(kernel_size, "kernel_size", 1))
    squares = F.conv2d(energy, ones, None, stride, padding, dilation, groups)  # (B, G, H', W')
    tiny = torch.finfo(squares.dtype).tiny  # keeps the root's gradient finite where a patch is zero
    return (squares.clamp_min(tiny).sqrt() * scale.to(squares.dtype)).clamp_min(eps)


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


def _squared_patch_norms(x: Tensor, kernel_size, stride, padding, dilation, groups: int):
    """s = conv(e, ones) with e the sum over each group's channels of x^2: (e's shape, Tensor[B, G, H', W']).

    Summed in float32 (x^2 overflows float16 above 256)."""
    b, c, h, w = x.shape
    with torch.autocast(x.device.type, enabled=False):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        energy = xf.square().reshape(b, groups, c // groups, h, w).sum(2)  # (B, G, H, W)
        ones = energy.new_ones(groups, 1, *kernel_size)
        return energy.shape, F.conv2d(energy, ones, None, stride, padding, dilation, groups)


def _grad_x_from_grad_m(grad_m: Tensor, x: Tensor, norm: Tensor, sq: Tensor, energy_shape, conv) -> Tensor:
    """d/dx = 2 x conv_transpose(d/ds, ones) with d/ds = (d/dm) / 2n, zero where the floor is active."""
    kernel_size, stride, padding, dilation, groups, eps = conv
    grad_sq = grad_m.div_(norm).mul_(0.5).mul_(sq >= eps * eps)
    ones = grad_sq.new_ones(groups, 1, *kernel_size)
    grad_energy = torch.nn.grad.conv2d_input(energy_shape, ones, grad_sq, stride, padding, dilation, groups)
    b, c, h, w = x.shape
    grad_x = (x.reshape(b, groups, c // groups, h, w) * grad_energy.unsqueeze(2)).mul_(2.0)
    return grad_x.reshape(b, c, h, w).to(x.dtype)


class _DivideByPatchNorm(torch.autograd.Function):
    """cos = clamp(inner / (||x_patch|| + q), -1, 1) with the patch norm of Note [patch norm by convolution].

    Forward: e = sum over each group's channels of x^2 (Tensor[B, G, H, W]), s = conv(e, ones)
    over the layer's window, n = sqrt(max(s, eps^2)), m = n + q (q = 0 when None).  Backward, by
    hand, with g the incoming gradient and j the output channels of a group:

        d/d inner = g / m,    d/dm = -sum_j g_j inner_j / m^2,    d/dq = sum over positions of d/dm,
        d/ds = (d/dm) / 2n  (0 where s < eps^2),    d/dx = 2 x * conv_transpose(d/ds, ones).

    The clamp only removes rounding (the inner product never exceeds the norm product) and
    passes the gradient through.  Four elementwise passes over the B x C x H x W tensors
    instead of autograd's eight: 1.46x -> 1.17x of ``nn.Conv2d`` forward + backward at 64
    channels, 32x32, batch 32, in one A/B run on our 2-core CPU.
    """

    @staticmethod
    def forward(ctx, inner: Tensor, x: Tensor, q: Tensor | float | None, kernel_size, stride, padding, dilation,
                groups: int, eps: float) -> Tensor:
        energy_shape, sq = _squared_patch_norms(x, kernel_size, stride, padding, dilation, groups)
        norm = sq.clamp_min(eps * eps).sqrt_()
        denominator = norm if q is None else norm + q
        bo, co, ho, wo = inner.shape
        grouped = (bo, groups, co // groups, ho, wo)
        cos = (inner.view(grouped) / denominator.unsqueeze(2)).view(bo, co, ho, wo)
        ctx.save_for_backward(inner, x, norm, denominator, sq)
        ctx.conv = (kernel_size, stride, padding, dilation, groups, eps)
        ctx.energy_shape, ctx.has_q = energy_shape, q is not None
        # Out of place: torch.compile (2.11) drops the backward of a Function whose output is changed in place.
        return cos.clamp(-1.0, 1.0)

    @staticmethod
    def backward(ctx, grad: Tensor):
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
                grad_x = _grad_x_from_grad_m(grad_m, x, norm, sq, ctx.energy_shape, ctx.conv)
        return grad_inner, grad_x, grad_q, None, None, None, None, None, None


def _kernels():
    import triton

    from . import _patch_kernels

    return triton, _patch_kernels


def _scalar(value: Tensor | float | None, placeholder: Tensor, default: float):
    """(pointer, number, mode) for the kernels: mode 0 none, 1 the number, 2 the tensor."""
    if value is None:
        return placeholder, default, 0
    return (placeholder, value, 1) if isinstance(value, float) else (value, default, 2)


@torch.library.custom_op("sphereml::patch_epilogue", mutates_args=())
def _epilogue_forward(inner: Tensor, sq: Tensor, q: Tensor | None, q_value: float | None, p: Tensor | None,
                      p_value: float | None, groups: int, eps: float) -> Tensor:
    """y = sign(c) abs(c)^p (or c), c = clamp(inner / (sqrt(max(sq, eps^2)) + q), -1, 1): one kernel."""
    triton, kernels = _kernels()
    bc, bp, warps = kernels.FORWARD_BLOCKS
    (b, co, ho, wo), placeholder = inner.shape, sq.new_empty(1)
    q_ptr, q_num, q_mode = _scalar(q if q is not None else q_value, placeholder, 0.0)
    p_ptr, p_num, p_mode = _scalar(p if p is not None else p_value, placeholder, 1.0)
    inner, out = inner.contiguous(), torch.empty(inner.shape, dtype=inner.dtype, device=inner.device)
    grid = (b * groups, triton.cdiv(co // groups, bc), triton.cdiv(ho * wo, bp))
    kernels.forward_kernel[grid](inner, sq, q_ptr, p_ptr, out, q_num, p_num, groups, co // groups, ho * wo, eps * eps,
                                 Q_MODE=q_mode, POWER=p_mode, BC=bc, BP=bp, num_warps=warps)
    return out


@_epilogue_forward.register_fake
def _(inner, sq, q, q_value, p, p_value, groups, eps):
    return inner.new_empty(inner.shape)


@torch.library.custom_op("sphereml::patch_epilogue_backward", mutates_args=())
def _epilogue_backward(grad: Tensor, inner: Tensor, sq: Tensor, q: Tensor | None, q_value: float | None,
                       p: Tensor | None, p_value: float | None, groups: int,
                       eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dL/dinner, dL/dm: Tensor[B, G, H', W'], dL/dp: Tensor[C_out], empty without a tensor p): one kernel."""
    triton, kernels = _kernels()
    bc, bp, warps = kernels.BACKWARD_BLOCKS
    (b, co, ho, wo), placeholder = inner.shape, sq.new_empty(1)
    q_ptr, q_num, q_mode = _scalar(q if q is not None else q_value, placeholder, 0.0)
    p_ptr, p_num, p_mode = _scalar(p if p is not None else p_value, placeholder, 1.0)
    blocks = triton.cdiv(ho * wo, bp)
    inner, grad_inner, grad_m = inner.contiguous(), torch.empty_like(inner, memory_format=torch.contiguous_format), \
        torch.empty_like(sq)
    partial = torch.zeros(b * groups * blocks if p is not None else 1, co, device=sq.device)
    kernels.backward_kernel[(b * groups, blocks)](
        inner, sq, q_ptr, p_ptr, grad.contiguous(), grad_inner, grad_m, partial, q_num, p_num, groups, co // groups,
        ho * wo, co, eps * eps, Q_MODE=q_mode, POWER=p_mode, BC=bc, BP=bp, num_warps=warps)
    return grad_inner, grad_m, partial.sum(0) if p is not None else partial.new_empty(0)


@_epilogue_backward.register_fake
def _(grad, inner, sq, q, q_value, p, p_value, groups, eps):
    return inner.new_empty(inner.shape), sq.new_empty(sq.shape), sq.new_empty(inner.shape[1] if p is not None else 0)


def _split(value: Tensor | float | None) -> tuple[Tensor | None, float | None]:
    return (value, None) if isinstance(value, Tensor) else (None, value)


class _FusedEpilogue(torch.autograd.Function):
    """:class:`_DivideByPatchNorm` and, with p, :func:`sharpen` in one Triton kernel each way.

    The squared patch norms s come from the same depthwise convolution; then one kernel reads the
    inner products once and writes y = sign(c) abs(c)^p (or c), and the backward kernel reads the
    inner products and dL/dy once and writes dL/dinner, dL/dm per position and the dL/dp partial sums
    (:mod:`sphereml._patch_kernels`).  p: a number or one value per channel (Tensor[C_out]).
    """

    @staticmethod
    def forward(ctx, inner, x, q, p, kernel_size, stride, padding, dilation, groups, eps):
        energy_shape, sq = _squared_patch_norms(x, kernel_size, stride, padding, dilation, groups)
        sq = sq.contiguous()
        ctx.save_for_backward(inner, x, sq, q if isinstance(q, Tensor) else None, p if isinstance(p, Tensor) else None)
        ctx.numbers = (q if not isinstance(q, Tensor) else None, p if not isinstance(p, Tensor) else None)
        ctx.conv, ctx.energy_shape = (kernel_size, stride, padding, dilation, groups, eps), energy_shape
        return torch.ops.sphereml.patch_epilogue(inner, sq, *_split(q), *_split(p), groups, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        inner, x, sq, q_tensor, p_tensor = ctx.saved_tensors
        q = q_tensor if q_tensor is not None else ctx.numbers[0]
        p = p_tensor if p_tensor is not None else ctx.numbers[1]
        groups, eps = ctx.conv[4], ctx.conv[5]
        grad_inner, grad_m, grad_p = torch.ops.sphereml.patch_epilogue_backward(grad, inner, sq, *_split(q), *_split(p),
                                                                                 groups, eps)
        grad_q = grad_m.sum().to(q.dtype) if q_tensor is not None and ctx.needs_input_grad[2] else None
        grad_p = grad_p.to(p.dtype) if p_tensor is not None and ctx.needs_input_grad[3] else None
        grad_x = None
        if ctx.needs_input_grad[1]:
            norm = sq.clamp_min(eps * eps).sqrt_()
            grad_x = _grad_x_from_grad_m(grad_m, x, norm, sq, ctx.energy_shape, ctx.conv)
        return grad_inner, grad_x, grad_q, grad_p, None, None, None, None, None, None


def _epilogue_backend(backend: str, x: Tensor) -> str:
    if backend not in EPILOGUE_BACKENDS:
        raise ValueError(f"backend must be one of {EPILOGUE_BACKENDS}, got {backend!r}")
    fusable = usable_on(x) and x.dtype != torch.float64
    if backend == "auto":
        return "fused" if fusable and x.is_cuda else "reference"
    if backend == "fused" and not fusable:
        raise ValueError("backend='fused' needs Triton and float32 or half CUDA tensors (on the CPU, TRITON_INTERPRET=1)")
    return backend


class _Sharpen(torch.autograd.Function):
    """sign(c) abs(c)^p with p a number or a tensor broadcast against c, in one autograd node.

    Forward computes y = sign(c) abs(c)^p exactly.  Backward (Note [sharpening without NaN]) reuses
    abs(c)^p: dy/dc = p abs(c)^p / max(abs(c), 1e-6) and dy/dp = y ln max(abs(c), 1e-6) (summed over the broadcast
    axes), exact for abs(c) >= 1e-6 and finite below; one ``pow`` in all, as for plain autograd's forward.
    """

    @staticmethod
    def forward(ctx, c: Tensor, p: float | Tensor) -> Tensor:
        powered = c.abs().pow(p)  # abs(c)^p
        ctx.save_for_backward(c, powered, p if isinstance(p, Tensor) else None)
        ctx.p = p if not isinstance(p, Tensor) else None
        return powered * torch.sign(c)

    @staticmethod
    def backward(ctx, grad: Tensor):
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
    return _Sharpen.apply(c, p)


class _UnitKernels(torch.autograd.Function):
    """w_hat = w / max(||w||, eps) for each flattened kernel (the w_hat of thesis eq. 3.1), by hand.

    Backward: dw = (g - w_hat (g . w_hat)) / max(||w||, eps), without the projection where the norm is
    floored (there w_hat = w / eps is linear in w).  15 operations forward + backward where autograd
    through :func:`~sphereml.geometry.normalize` dispatches 26, once per layer and step.  Once
    differentiable, as the patch-norm division that follows it.
    """

    @staticmethod
    def forward(ctx, weight: Tensor, eps: float) -> Tensor:
        flat = weight.flatten(1)
        norm = safe_norm(flat, dim=1, keepdim=True)
        denominator = norm.clamp_min(eps)
        unit = flat / denominator
        ctx.save_for_backward(unit, denominator, norm >= eps)
        return unit.view_as(weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        unit, denominator, active = ctx.saved_tensors
        g = grad.reshape(unit.shape)
        along = (g * unit).sum(1, keepdim=True) * active
        return ((g - unit * along) / denominator).view_as(grad), None


def patch_cosine2d(x: Tensor, weight: Tensor, stride=1, padding=0, dilation=1, groups: int = 1, eps: float = 1e-6,
                   q: float | Tensor | None = None, power: float | Tensor | None = None,
                   backend: str = "auto") -> Tensor:
    """w . x / (||w|| (||x|| + q)) between every kernel w and every receptive-field patch x, optionally sharpened.

    With ``q`` None (or 0) this is cos(theta) (thesis eq. 3.1); a q > 0 damps weak patches, as the
    denominator of sharpened cosine similarity does.  ||x|| is floored at ``eps`` (Note [zero patch]).
    With ``power`` p the result is :func:`sharpen`'s sign(c) abs(c)^p (SCS, the paper's Sec. 1).

    Args:
        x (Tensor[B, C_in, H, W]): input.
        weight (Tensor[C_out, C_in / groups, k_h, k_w]): kernels (any norm; only directions matter).
        stride, padding, dilation, groups: as in :func:`torch.nn.functional.conv2d` (``padding`` may be
            ``"valid"`` or ``"same"``).
        eps (float): patch-norm floor. Default: 1e-6.
        q (float or 0-dim Tensor, optional): offset added to the patch norm (a tensor gets a gradient; a number
            is never copied to the device).
        power (float, or a Tensor of 1 or C_out values, e.g. Tensor[C_out, 1, 1], optional): sharpening
            exponent p > 0 (a tensor gets a gradient).
        backend (str): ``"auto"`` (fused on CUDA), ``"reference"`` (:class:`_DivideByPatchNorm` then
            :func:`sharpen`) or ``"fused"`` (one Triton kernel each way; float32 or half). Default: ``"auto"``.

    Returns:
        Tensor[B, C_out, H', W'] in [-1, 1].
    """
    kernel_size = tuple(weight.shape[2:])
    stride, dilation = pair(stride, "stride", 1), pair(dilation, "dilation", 1)
    x, padding = explicit_padding(x, padding, kernel_size, stride, dilation)
    w_hat = _UnitKernels.apply(weight, eps)
    inner = F.conv2d(x, w_hat, None, stride, padding, dilation, groups)  # (B, C_out, H', W')
    if q is not None and not isinstance(q, Tensor):
        q = None if q == 0 else float(q)  # a number stays on the host: no copy to the device per call
    if power is not None and not isinstance(power, Tensor):
        power = real_number("power", power, above=0.0)
    conv = (kernel_size, stride, padding, dilation, groups, eps)
    if _epilogue_backend(backend, x) == "fused":
        per_channel = power.reshape(-1).expand(weight.shape[0]).contiguous() if isinstance(power, Tensor) else power
        return _FusedEpilogue.apply(inner, x, q, per_channel, *conv)
    cos = _DivideByPatchNorm.apply(inner, x, q, *conv)
    return cos if power is None else sharpen(cos, power)
