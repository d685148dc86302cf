"""The patch layers' epilogue fused into one kernel each way: patch-norm division, clamp, g(theta) or sharpening.

After its convolution a patch layer (:mod:`~sphereml.layers.patches`: SphereConv, SCS) only works elementwise on the
B x C_out x H' x W' inner products: divide each by its patch norm (+ q), clamp to [-1, 1], and apply the
layer's function of the cosine (an angular activation of :mod:`~sphereml.angular`, or the SCS sharpening).
Here the squared patch norms come from one depthwise convolution
(:func:`~sphereml.layers.patch_norms.squared_patch_norms`, Note [patch norm by convolution] in
:mod:`~sphereml.layers.patches`; on a GPU from one Triton kernel, Note [box sums in a kernel] in
:mod:`~sphereml.layers.window_sums`), and then one Triton kernel reads the inner products once
and writes the output, and one backward kernel reads them and dL/dy once and writes dL/d(inner products),
dL/d(squared norms) per position (autograd carries it on to x through
:func:`~sphereml.layers.patch_norms.squared_patch_norms`), and the partial sums of dL/d(parameter) and of dL/dq or
dL/dr, each summed by one reduction (:mod:`sphereml.layers._patch_kernels`, with the formulas).  The kernels are the
custom operators ``sphereml::patch_epilogue`` and ``sphereml::patch_epilogue_backward``, so ``torch.compile``
traces the layer with ``fullgraph=True``.  They read the inner products in NCHW or channels-last where they lie and
write y and dL/d(inner products) in the same layout (Note [layouts in the kernels] in
:mod:`~sphereml.layers._layouts`), dL/dy too where it has that layout or is one value broadcast (a ``.sum()``'s).
They run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests); the reference nodes of
:mod:`~sphereml.layers.patches` and :mod:`~sphereml.angular` are the oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._custom_ops import custom_op
from ..energy.triton_backend import cdiv, choose_backend, lazy_module, usable_on
from ._layouts import check_tile_span, densified, position_strides, same_strides
from .magnitudes import Magnitude

__all__ = ["EPILOGUES", "resolve_backend", "fused_epilogue", "per_channel"]

EPILOGUES = ("cosine", "sharpen", "linear", "sigmoid", "sqcosine")  # the kernels' EPILOGUE numbers, in order
WITH_PARAMETER = ("sharpen", "sigmoid")  # the epilogues that take a parameter (p, k); the others ignore it


def resolve_backend(backend: str, x: Tensor) -> str:
    """``"reference"`` or ``"fused"``: ``"auto"`` fuses float32 and half CUDA tensors when Triton is installed
    and ``SPHEREML_FUSED=1`` (an opt-in: :func:`~sphereml.energy.triton_backend.choose_backend`)."""
    fusable = x.dtype != torch.float64 and usable_on(x)
    backend = choose_backend(backend, x, fusable)
    if backend == "fused" and not fusable:
        raise ValueError("backend='fused' needs Triton and float32 or half CUDA tensors (on the CPU, "
                         "TRITON_INTERPRET=1)")
    return backend


def _slot(tensor: Tensor | None, number: float | None, placeholder: Tensor, default: float):
    """(pointer, number, mode) of a kernel argument: mode 0 absent, 1 a number, 2 a tensor."""
    if tensor is not None:
        return tensor, default, 2
    return (placeholder, default, 0) if number is None else (placeholder, number, 1)


_kernels = lazy_module("sphereml.layers._patch_kernels")


def _launch(kind: str, inner: Tensor, sq: Tensor, q, q_value, a, a_value, mag, h: tuple, epilogue: int,
            groups: int, eps: float, grad: Tensor | None = None, scalar_grad: int = 0):
    """``h``: (the kernels' MAGNITUDE number, alpha, beta, radius tensor or None, radius number or None);
    ``scalar_grad``: the kernels' SCALAR_GRAD (1 dL/dq, 2 dL/dr, 0 neither)."""
    kernels = _kernels()
    (b, co, ho, wo), placeholder = inner.shape, sq.new_empty(1)
    inner = densified(inner)  # NCHW or channels-last, read where it lies; OUT and dL/dINNER take its strides
    code, alpha, beta, r, r_value = h
    if code and (mag is not None or q is not None or q_value is not None):
        raise ValueError("the kernels evaluate h (MAGNITUDE) without a magnitude tensor and without q")
    if a is not None and EPILOGUES[epilogue] not in WITH_PARAMETER:
        raise ValueError(f"a parameter tensor needs an epilogue of {WITH_PARAMETER}, got {EPILOGUES[epilogue]!r}")
    q_slot, a_slot = _slot(q, q_value, placeholder, 0.0), _slot(a, a_value, placeholder, 1.0)
    r_slot = _slot(r, r_value, placeholder, 1.0)
    modes = {"Q_MODE": q_slot[2], "EPILOGUE": epilogue, "PARAM": a_slot[2], "HAS_MAG": mag is not None,
             "MAGNITUDE": code, "R_MODE": r_slot[2]}
    numbers = (q_slot[1], a_slot[1], r_slot[1], alpha, beta)
    pointers = (inner, sq, q_slot[0], a_slot[0], placeholder if mag is None else mag.contiguous(), r_slot[0])
    sizes = (groups, co // groups, ho * wo)
    strides = position_strides(inner)
    if kind == "forward":
        bc, bp, warps = kernels.FORWARD_BLOCKS
        check_tile_span(strides, bc, bp)
        out = torch.empty_like(inner)
        grid = (b * groups * cdiv(co // groups, bc) * cdiv(ho * wo, bp),)
        kernels.forward_kernel[grid](*pointers, out, *numbers, *sizes, *strides, eps * eps, **modes, BC=bc, BP=bp,
                                     num_warps=warps)
        return out
    bc, bp, warps = kernels.BACKWARD_BLOCKS
    check_tile_span(strides, bc, bp)
    blocks = cdiv(ho * wo, bp)
    grad_inner, grad_sq = torch.empty_like(inner), torch.empty_like(sq)
    broadcast = not any(grad.stride())  # one value for all: the gradient of a .sum()
    if not (broadcast or same_strides(grad, inner)):  # dL/dy in another layout than y's: a copy in y's
        grad = torch.empty_like(inner).copy_(grad)
    # every row of the partial sums is written (no zeros: a fill is a launch of its own on a GPU)
    partial = sq.new_empty(b * blocks, co) if a is not None else placeholder
    grad_mag = torch.empty_like(sq) if mag is not None else placeholder
    grad_scalar = sq.new_empty(b * groups * blocks) if scalar_grad else placeholder
    kernels.backward_kernel[(b * groups * blocks,)](
        *pointers, grad, grad_inner, grad_sq, partial, grad_mag, grad_scalar, *numbers, *sizes, co, *strides,
        eps * eps, **modes, SCALAR_GRAD=scalar_grad, GRAD_BROADCAST=broadcast, BC=bc, BP=bp, num_warps=warps)
    return (grad_inner, grad_sq, partial.sum(0) if a is not None else sq.new_empty(0),
            grad_mag if mag is not None else sq.new_empty(0), grad_scalar.sum() if scalar_grad else sq.new_empty(0))


@custom_op("sphereml::patch_epilogue", mutates_args=())
def patch_epilogue(inner: Tensor, sq: Tensor, q: Tensor | None, q_value: float | None, a: Tensor | None,
                   a_value: float | None, mag: Tensor | None, h_code: int, h_alpha: float, h_beta: float,
                   r: Tensor | None, r_value: float | None, epilogue: int, groups: int, eps: float) -> Tensor:
    """y = mag h(n) f(clamp(inner / (n + q), -1, 1)), n = sqrt(max(sq, eps^2)), f the epilogue with parameter a,
    h the magnitude numbered ``h_code`` (1 when 0) with radius r: one kernel."""
    h = (h_code, h_alpha, h_beta, r, r_value)
    return _launch("forward", inner, sq, q, q_value, a, a_value, mag, h, epilogue, groups, eps)


@patch_epilogue.register_fake
def _(inner, sq, q, q_value, a, a_value, mag, h_code, h_alpha, h_beta, r, r_value, epilogue, groups, eps):
    return torch.empty_like(densified(inner))


@custom_op("sphereml::patch_epilogue_backward", mutates_args=())
def patch_epilogue_backward(grad: Tensor, inner: Tensor, sq: Tensor, q: Tensor | None, q_value: float | None,
                            a: Tensor | None, a_value: float | None, mag: Tensor | None, h_code: int,
                            h_alpha: float, h_beta: float, r: Tensor | None, r_value: float | None, epilogue: int,
                            groups: int, eps: float, scalar_grad: int
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dL/dinner, dL/dsq (h's share included): Tensor[B, G, H', W'], dL/da: Tensor[C_out], dL/dmag:
    Tensor[B, G, H', W'], dL/dq (``scalar_grad`` 1) or dL/dr (2): a 0-d tensor; the last three empty without a
    tensor a, mag or ``scalar_grad``): one kernel, and a sum for each of dL/da, dL/dq and dL/dr."""
    h = (h_code, h_alpha, h_beta, r, r_value)
    return _launch("backward", inner, sq, q, q_value, a, a_value, mag, h, epilogue, groups, eps, grad, scalar_grad)


@patch_epilogue_backward.register_fake
def _(grad, inner, sq, q, q_value, a, a_value, mag, h_code, h_alpha, h_beta, r, r_value, epilogue, groups, eps,
      scalar_grad):
    return (torch.empty_like(densified(inner)), sq.new_empty(sq.shape),
            sq.new_empty(inner.shape[1] if a is not None else 0), sq.new_empty(sq.shape if mag is not None else (0,)),
            sq.new_empty(() if scalar_grad else (0,)))


def _split(value: Tensor | float | None) -> tuple[Tensor | None, float | None]:
    return (value, None) if isinstance(value, Tensor) else (None, None if value is None else float(value))


class _FusedEpilogue(torch.autograd.Function):
    """y = mag h(n) f(c) from the inner products and the squared patch norms sq, with the two kernels above.

    a: None, a number or Tensor[C_out]; mag: None or Tensor[B, G, H', W']; r: h's radius as a 0-d tensor, or None;
    h: (MAGNITUDE number, alpha, beta, radius number or None), (0, 0, 0, None) for no h.  dL/dsq = (dL/dn) / 2n
    where n = sqrt(sq) is above eps (zero under the floor), and dL/dq or dL/dr, from the backward kernel; autograd
    takes dL/dsq on to x."""

    @staticmethod
    def forward(ctx, inner, sq, q, a, mag, r, h, epilogue, groups, eps):
        sq = sq.float().contiguous()
        ctx.mag_dtype = None if mag is None else mag.dtype
        mag = None if mag is None else mag.float().contiguous()
        ctx.save_for_backward(inner, sq, *(_split(v)[0] for v in (q, a)), mag, r)
        ctx.numbers, ctx.settings = (_split(q)[1], _split(a)[1]), (h, epilogue, groups, eps)
        return patch_epilogue(inner, sq, *_split(q), *_split(a), mag, *h[:3], r, h[3], epilogue, groups, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        inner, sq, q, a, mag, r = ctx.saved_tensors
        h, epilogue, groups, eps = ctx.settings
        learned_q, learned_r = q is not None and ctx.needs_input_grad[2], r is not None and ctx.needs_input_grad[5]
        grad_inner, grad_sq, grad_a, grad_mag, grad_scalar = patch_epilogue_backward(
            grad, inner, sq, q, ctx.numbers[0], a, ctx.numbers[1], mag, *h[:3], r, h[3], epilogue, groups, eps,
            1 if learned_q else 2 if learned_r else 0)
        grad_q = grad_scalar.to(q.dtype) if learned_q else None
        grad_r = grad_scalar.to(r.dtype) if learned_r else None
        grad_a = grad_a.to(a.dtype) if a is not None and ctx.needs_input_grad[3] else None
        grad_mag = grad_mag.to(ctx.mag_dtype) if mag is not None and ctx.needs_input_grad[4] else None
        grad_sq = grad_sq if ctx.needs_input_grad[1] else None
        return grad_inner, grad_sq, grad_q, grad_a, grad_mag, grad_r, None, None, None, None


def _magnitude_arguments(h: Magnitude | None, q, device) -> tuple[Tensor | None, tuple]:
    """(r, h) of :class:`_FusedEpilogue` for a :class:`~sphereml.layers.magnitudes.Magnitude` or None."""
    if h is None:
        return None, (0, 0.0, 0.0, None)
    if q is not None:
        raise ValueError("the kernels' magnitude h(n) needs q=None (the decoupled operators have no q)")
    radius = h.radius
    if isinstance(radius, Tensor):
        if radius.numel() != 1:
            raise ValueError(f"the kernels take h's radius as a number or a one-value tensor, got shape "
                             f"{tuple(radius.shape)}")
        return radius.reshape(()).to(device), (h.code, float(h.alpha), float(h.beta), None)
    return None, (h.code, float(h.alpha), float(h.beta), float(radius))


def fused_epilogue(inner: Tensor, sq: Tensor, q: Tensor | float | None, epilogue: str, param, groups: int,
                   eps: float, magnitude: Tensor | Magnitude | None = None) -> Tensor:
    """The epilogue of a patch layer on its inner products ``inner`` (Tensor[B, C_out, H', W']).

    Args:
        sq (Tensor[B, G, H', W']): the squared patch norms
            (:func:`~sphereml.layers.patch_norms.squared_patch_norms`); the norm is
            n = sqrt(max(sq, eps^2)), and sq gets its gradient.
        q (float or 0-d Tensor, optional): added to the patch norm.
        epilogue (str): one of :data:`EPILOGUES`.
        param: p for ``"sharpen"``, k for ``"sigmoid"`` (a number or a Tensor of 1 or C_out values), else unused.
        groups (int), eps (float): the layer's groups and norm floor.
        magnitude (optional): the decoupled operators' h(||x||), as a factor per position and group
            (Tensor[B, G, H', W'], which gets its gradient), or as a
            :class:`~sphereml.layers.magnitudes.Magnitude` that the kernels evaluate at n (with q None; a tensor
            radius gets its gradient).
    """
    if isinstance(magnitude, Tensor) and magnitude.shape != sq.shape:
        raise ValueError(f"magnitude must have the patch norms' shape {tuple(sq.shape)} (one factor per group and "
                         f"position), got {tuple(magnitude.shape)}")
    r, h = _magnitude_arguments(magnitude if isinstance(magnitude, Magnitude) else None, q, inner.device)
    mag = magnitude if isinstance(magnitude, Tensor) else None
    if epilogue not in WITH_PARAMETER:
        param = None
    elif isinstance(param, Tensor):
        param = param.to(inner.device).reshape(-1).expand(inner.shape[1]).contiguous()  # one value per channel
    if isinstance(q, Tensor):
        q = q.to(inner.device)
    return _FusedEpilogue.apply(inner, sq, q, param, mag, r, h, EPILOGUES.index(epilogue), groups, eps)


def per_channel(param, channels: int) -> bool:
    """True for a number, a one-value tensor or Tensor[C_out, 1, 1]: the parameters the kernels take (any other
    shape broadcasts differently against Tensor[B, C_out, H', W'] and takes the reference path)."""
    return not isinstance(param, Tensor) or param.numel() == 1 or tuple(param.shape) == (channels, 1, 1)
