"""How the patch layers' Triton kernels address a Tensor[B, C, H, W]: by a stride per sample, per channel and per
position, the H x W positions flattened into one axis.

Note [layouts in the kernels]
    The kernels of :mod:`~sphereml.layers.patch_epilogue` and :mod:`~sphereml.layers.window_sums` work on tiles of
    (channels, positions).  Element (b, c, p) of a tensor, p = h W + w, lies at b s_b + c s_c + p s_p wherever the
    positions flatten, that is where s_h = W s_w (or H or W is 1): in NCHW (s_c = H W, s_p = 1) and in
    channels-last NHWC (s_c = 1, s_p = C).  So the kernels take those three strides as arguments and read a
    channels-last network's tensors where they lie, with no copy (``model.to(memory_format=torch.channels_last)``,
    cuDNN's preferred layout for bf16 and fp16 convolutions on a GPU), and write their outputs in the layout of
    their input.  The epilogue's backward reads dL/dy at y's strides, or as one value where it is one value
    broadcast (the gradient of a ``.sum()``), and copies any other into y's layout (a third set of strides made one
    of its forms spill registers); the window gradient takes x's and dL/dx's strides apart.  Triton compiles a
    variant for each integer argument equal to 1, so the unit stride of either layout is known when the kernel is
    compiled.  A tile's first element is found in int64 (a sample may hold 2^31 values), its elements' offsets from
    there in int32 (int64 tiles made two forms spill registers), so a tile must span fewer than 2^31 elements
    (:func:`check_tile_span`).  Counted on the CPU with the GPU's forms (``tests/test_channels_last.py``), a fused
    SphereConv or decoupled layer makes the same 11 operations in channels-last as in NCHW, where it made 18 (the
    weight copied and reshaped each way for the unit kernels, and the box sums as convolutions) and copied the
    inner products inside its two epilogue operators.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["dense", "densified", "position_strides", "same_strides", "channels_last", "check_tile_span"]


def channels_last(t: Tensor) -> bool:
    """Whether ``t`` is laid out channels-last (NHWC) and not also NCHW (as a tensor with C = 1 or H = W = 1 is)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def dense(t: Tensor) -> bool:
    """Whether ``t`` is contiguous in NCHW or in channels-last NHWC."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def densified(t: Tensor) -> Tensor:
    """``t`` itself where :func:`dense`, else a contiguous (NCHW) copy."""
    return t if dense(t) else t.contiguous()


def position_strides(t: Tensor) -> tuple[int, int, int] | None:
    """(s_b, s_c, s_p) of a Tensor[B, C, H, W] whose positions flatten (Note [layouts in the kernels]), else None."""
    s_b, s_c, s_h, s_w = t.stride()
    h, w = t.shape[2:]
    if w == 1:
        return s_b, s_c, s_h
    return (s_b, s_c, s_w) if h == 1 or s_h == w * s_w else None


def same_strides(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one shape) step alike along every axis longer than 1: one layout."""
    return all(m == n or size == 1 for m, n, size in zip(a.stride(), b.stride(), a.shape))


def check_tile_span(strides: tuple[int, int, int], channels: int, positions: int) -> None:
    """A named error where a tile of ``channels`` x ``positions`` at ``strides`` (s_b, s_c, s_p) would span 2^31
    elements or more (its offsets are int32: Note [layouts in the kernels]), as an NCHW tile of 32 channels does
    over 6.9e7 positions (8,300 x 8,300)."""
    _, s_c, s_p = strides
    if (channels - 1) * abs(s_c) + (positions - 1) * abs(s_p) >= 2**31:
        raise ValueError(f"a tile of {channels} channels x {positions} positions at channel stride {s_c} and position "
                         f"stride {s_p} spans 2^31 elements or more; the kernels' offsets within a tile are int32")
