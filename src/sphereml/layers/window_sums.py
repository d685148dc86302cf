"""The patch norms' box sum and its adjoint as one Triton kernel each way (a GPU's form of
:func:`~sphereml.layers.patch_norms.conv_and_squared_norms`).

Note [box sums in a kernel]
    A patch's squared norm is the sum over its window of e = the sum of x^2 over the group's channels (Note [patch
    norm by convolution] in :mod:`~sphereml.layers.patches`).  On a GPU e is nu^2, nu the channel norm from one
    reduction (Note [one pass over the input] in :mod:`~sphereml.layers.patch_norms`), and the window sum was a
    depthwise convolution with a kernel of ones: three operations forward (the square, the kernel of ones, the
    convolution) and two backward (the convolution's adjoint, then dL/dx += 2 x dL/de by ``addcmul_``).  All five
    work on tensors of 1 / C of x's size, or pass once over x, so on a GPU their cost is launches.  Here
    :func:`squared_norms_by_window` squares nu and sums each window in one kernel, and :func:`add_window_gradient_`
    forms the adjoint, dL/de at each input position as the sum of dL/ds over the windows that cover it, and adds
    2 x dL/de into the convolution's input gradient in the same kernel (:mod:`sphereml.layers._window_kernels`):
    one pass over x-sized tensors, as ``addcmul_`` made, and three operations fewer a step.  Both are custom
    operators (``torch.compile(fullgraph=True)`` holds), for float32 and half x laid out contiguously in NCHW or
    channels-last (Note [layouts in the kernels] in :mod:`sphereml.layers._layouts`); they run on CUDA tensors, and
    on CPU tensors under ``TRITON_INTERPRET=1`` (the tests, against the convolutions).  The sums are float32; the
    gradient's sum is formed in float32 and rounded once to x's dtype.  The node keeps the convolutions for other
    inputs, under ``torch.func`` transforms (the operators have no batching rules), and in a backward that is itself
    differentiated (``create_graph=True``: the gradient's kernel has no derivative); under ``torch.func.grad`` the
    forward, which sees plain tensors, takes the sums' kernel and the backward the convolutions, and under ``vmap``
    both take the convolutions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._autograd import transformed
from .._custom_ops import custom_op
from ..energy.triton_backend import cdiv, lazy_module, usable_on
from ._layouts import channels_last, check_tile_span, dense, position_strides

__all__ = ["takes", "squared_norms_by_window", "add_window_gradient_"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def takes(x: Tensor) -> bool:
    """Whether the kernels take the patch norms of ``x``: Triton usable on it, float32 or half, contiguous in NCHW
    or channels-last, not under a ``torch.func`` transform."""
    return usable_on(x) and x.dtype in _DTYPES and dense(x) and not transformed(x)


def _output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _geometry(kernel_size, stride, padding, dilation) -> tuple[int, ...]:
    """(kh, kw, sh, sw, ph, pw, dh, dw): the window as the operators take it (plain numbers, for direct calls)."""
    return (*kernel_size, *stride, *padding, *dilation)


_kernels = lazy_module("sphereml.layers._window_kernels")


@custom_op("sphereml::window_sums", mutates_args=())
def window_sums(norms: Tensor, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int, dh: int, dw: int) -> Tensor:
    """s = the sum over each window of norms^2 (``norms``: Tensor[B, G, H, W] float32; s: Tensor[B, G, H', W']
    float32): one kernel."""
    kernels = _kernels()
    b, g, h, w = norms.shape
    ho, wo = _output_size(h, kh, sh, ph, dh), _output_size(w, kw, sw, pw, dw)
    out = norms.new_empty(b, g, ho, wo)
    _, bp, warps = kernels.BLOCKS
    kernels.window_sums_kernel[(b * g * cdiv(ho * wo, bp),)](
        norms.contiguous(), out, h, w, ho, wo, sh, sw, ph, pw, dh, dw, KH=kh, KW=kw, BP=bp, num_warps=warps)
    return out


@window_sums.register_fake
def _(norms, kh, kw, sh, sw, ph, pw, dh, dw):
    b, g, h, w = norms.shape
    return norms.new_empty(b, g, _output_size(h, kh, sh, ph, dh), _output_size(w, kw, sw, pw, dw))


@custom_op("sphereml::add_window_gradient_", mutates_args=("grad_x",))
def add_window_gradient(grad_x: Tensor, x: Tensor, grad_sq: Tensor, kh: int, kw: int, sh: int, sw: int, ph: int,
                        pw: int, dh: int, dw: int) -> None:
    """grad_x += 2 x t, t the box sum's adjoint of ``grad_sq`` (Tensor[B, G, H', W']), in place on ``grad_x`` (x's
    shape; each NCHW or channels-last): one kernel."""
    kernels = _kernels()
    b, c, h, w = x.shape
    g, ho, wo = grad_sq.shape[1:]
    bc, bp, warps = kernels.CHANNELS_LAST_BLOCKS if channels_last(x) else kernels.BLOCKS
    strides = position_strides(x), position_strides(grad_x)
    for layout in strides:
        check_tile_span(layout, bc, bp)
    kernels.window_gradient_kernel[(b * g * cdiv(c // g, bc) * cdiv(h * w, bp),)](
        grad_sq.contiguous(), x, grad_x, g, c // g, h, w, ho, wo, sh, sw, ph, pw, dh, dw, *strides[0], *strides[1],
        KH=kh, KW=kw, SAME_LAYOUT=strides[0] == strides[1], BC=bc, BP=bp, num_warps=warps)


@add_window_gradient.register_fake
def _(grad_x, x, grad_sq, kh, kw, sh, sw, ph, pw, dh, dw):
    return None


def squared_norms_by_window(norms: Tensor, kernel_size, stride, padding, dilation) -> Tensor:
    """The squared patch norms (Tensor[B, G, H', W'], float32) from the channel norms ``norms`` (Tensor[B, G, H, W],
    float32) for the window given by pairs (Note [box sums in a kernel]); no gradient."""
    if norms.dtype != torch.float32 or norms.dim() != 4:
        raise ValueError(f"squared_norms_by_window takes float32 channel norms Tensor[B, G, H, W], got {norms.dtype} "
                         f"of shape {tuple(norms.shape)}")
    return window_sums(norms, *_geometry(kernel_size, stride, padding, dilation))


def add_window_gradient_(grad_x: Tensor, x: Tensor, grad_sq: Tensor, kernel_size, stride, padding, dilation) -> None:
    """dL/dx += 2 x dL/de in place, dL/de the box sum's adjoint of ``grad_sq`` = dL/ds (Note [box sums in a kernel]);
    ``grad_x`` and ``x`` of one shape, each contiguous in NCHW or channels-last."""
    if not (dense(grad_x) and dense(x) and grad_x.shape == x.shape and x.dim() == 4):
        raise ValueError(f"add_window_gradient_ needs x and dL/dx of one shape Tensor[B, C, H, W], each contiguous in "
                         f"NCHW or channels-last, got {tuple(x.shape)} and {tuple(grad_x.shape)}")
    geometry = _geometry(kernel_size, stride, padding, dilation)
    (b, c, h, w), groups = x.shape, grad_sq.shape[1]
    want = (b, groups, *(_output_size(n, *geometry[i::2]) for i, n in enumerate((h, w))))  # each axis's numbers
    if tuple(grad_sq.shape) != want or c % groups:
        raise ValueError(f"add_window_gradient_ needs dL/ds of shape {want} for this window, got "
                         f"{tuple(grad_sq.shape)} (groups must divide the {c} channels)")
    add_window_gradient(grad_x, x, grad_sq.float(), *geometry)
