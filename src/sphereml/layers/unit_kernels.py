"""A patch layer's kernels on the unit sphere: w_hat = w / max(||w||, eps) per kernel (the w_hat of thesis eq. 3.1).

Note [unit kernels in one pass]
    Every forward of SphereConv, SCS and the unweighted decoupled operators divides each flattened kernel by its
    norm, and every backward projects the kernels' gradient onto the sphere's tangent space.  The work is tiny
    (C_out x C_in k^2 values), so on a GPU its cost is launches: :class:`_UnitKernels` takes 9 operations forward
    (the overflow-safe norm of :func:`~sphereml.geometry.safe_norm` alone takes 6: the largest entry by abs, amax
    and a floor, a division by it, the norm, a product) and 6 backward, once per layer and step, 15 of a fused patch
    layer's 35.  On the fused path (``backend="fused"``, or ``SPHEREML_FUSED=1`` on CUDA) two Triton kernels do the
    same, one each way (:mod:`sphereml.layers._unit_kernels`): the squares summed in float64, which neither
    overflows nor underflows for any float32 or half row, so the norm needs no scale.  For finite rows whose norm
    float32 holds, their results equal :class:`_UnitKernels`' to float32's rounding (the kernels multiply by 1 /
    max(||w||, eps) where the reference divides, and compare the float64 norm with eps; tested under
    ``TRITON_INTERPRET=1``, which runs the same kernels on the CPU).  The kernels read each kernel's values as a row
    in the order they lie in memory, so channels-last weights need no copy, and w_hat and dL/dw keep the weight's
    layout.  Elsewhere, and for float64 kernels, :class:`_UnitKernels` runs: the CPU's numbers are those of the
    book's runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._autograd import Function
from .._custom_ops import custom_op
from ..energy.triton_backend import cdiv, lazy_module
from ..geometry import safe_norm
from ._layouts import channels_last

__all__ = ["unit_kernels", "fusable"]


class _UnitKernels(Function):
    """w_hat = w / max(||w||, eps) for each flattened kernel, by hand.

    Backward: dw = (g - w_hat (g . w_hat)) / max(||w||, eps), without the projection where the norm is
    floored (there w_hat = w / eps is linear in w).  15 operations forward + backward where autograd
    through :func:`~sphereml.geometry.normalize` dispatches 26.  Once differentiable, as the patch-norm division
    that follows it.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
        """(w_hat, max(||w||, eps), ||w|| >= eps), the last two for the context only."""
        flat = weight.flatten(1)
        norm = safe_norm(flat, dim=1, keepdim=True)
        denominator = norm.clamp_min(eps)
        return (flat / denominator).view_as(weight), denominator, norm >= eps

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*output)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor | None, *_):
        if grad is None:
            return None, None
        unit, denominator, active = ctx.saved_tensors
        unit = unit.flatten(1)
        g = grad.reshape(unit.shape)
        along = (g * unit).sum(1, keepdim=True) * active
        return ((g - unit * along) / denominator).view_as(grad), None


_kernels = lazy_module("sphereml.layers._unit_kernels")


@custom_op("sphereml::unit_kernels", mutates_args=())
def unit_kernels_forward(rows: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(u = w / max(||w||, eps) for every row w of ``rows`` (Tensor[R, D], contiguous), inv = 1 / max(||w||, eps)
    and active = [||w|| >= eps]: Tensor[R], float32): one kernel."""
    kernels = _kernels()
    (r, d), (br, bd, warps) = rows.shape, kernels.BLOCKS
    rows = rows.contiguous()  # the kernels read and write whole rows
    unit, inv, active = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device), rows.new_empty(
        r, dtype=torch.float32), rows.new_empty(r, dtype=torch.float32)
    kernels.forward_kernel[(cdiv(r, br),)](rows, unit, inv, active, r, d, eps, BR=br, BD=bd, num_warps=warps)
    return unit, inv, active


@unit_kernels_forward.register_fake
def _(rows, eps):
    return rows.new_empty(rows.shape), rows.new_empty(rows.shape[0], dtype=torch.float32), rows.new_empty(
        rows.shape[0], dtype=torch.float32)


@custom_op("sphereml::unit_kernels_backward", mutates_args=())
def unit_kernels_backward(grad: Tensor, unit: Tensor, inv: Tensor, active: Tensor) -> Tensor:
    """dL/dw = inv (dL/du - active (dL/du . u) u) for every row (``grad``, ``unit``: Tensor[R, D]): one kernel."""
    kernels = _kernels()
    (r, d), (br, bd, warps) = unit.shape, kernels.BLOCKS
    unit, inv, active = unit.contiguous(), inv.contiguous(), active.contiguous()
    out = torch.empty(unit.shape, dtype=unit.dtype, device=unit.device)
    kernels.backward_kernel[(cdiv(r, br),)](grad.contiguous(), unit, inv, active, out, r, d, BR=br, BD=bd,
                                            num_warps=warps)
    return out


@unit_kernels_backward.register_fake
def _(grad, unit, inv, active):
    return unit.new_empty(unit.shape)


def _rows(t: Tensor, last: bool) -> Tensor:
    """Each kernel of ``t`` (Tensor[C_out, ...]) as a row, its values in NCHW order or, where ``last``, in
    channels-last order: a view where ``t`` lies in that layout (a kernel's norm and its tangent projection do not
    depend on the order)."""
    return (t.permute(0, 2, 3, 1) if last else t).flatten(1)


def _kernels_of(rows: Tensor, shape: torch.Size, last: bool) -> Tensor:
    """The inverse of :func:`_rows`: ``rows`` as kernels of ``shape``, channels-last where ``last`` (a view)."""
    if last:
        c_out, c_in, kh, kw = shape
        return rows.view(c_out, kh, kw, c_in).permute(0, 3, 1, 2)
    return rows.view(shape)


class _FusedUnitKernels(torch.autograd.Function):
    """w_hat by the two kernels above (Note [unit kernels in one pass]), in the weight's layout."""

    @staticmethod
    def forward(ctx, weight, eps):
        ctx.layout = (weight.shape, channels_last(weight))  # the gradient's too
        unit, inv, active = unit_kernels_forward(_rows(weight, ctx.layout[1]), eps)
        ctx.save_for_backward(unit, inv, active)
        return _kernels_of(unit, *ctx.layout)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        unit, inv, active = ctx.saved_tensors
        rows = _rows(grad, ctx.layout[1]).reshape(unit.shape)  # a copy where dL/dw_hat has the other layout
        return _kernels_of(unit_kernels_backward(rows, unit, inv, active), *ctx.layout), None


def fusable(weight: Tensor) -> bool:
    """Whether the kernels of the fused path take ``weight``: float32 or half, not empty (float64 keeps the
    reference)."""
    return weight.dtype in (torch.float32, torch.float16, torch.bfloat16) and weight.numel() > 0


def unit_kernels(weight: Tensor, eps: float, fused: bool = False) -> Tensor:
    """Each kernel of ``weight`` (Tensor[C_out, ...], flattened after the first axis) divided by max(||w||, eps).

    ``fused`` (the caller's resolved backend): two Triton kernels, one each way, where :func:`fusable`; otherwise
    :class:`_UnitKernels` (Note [unit kernels in one pass])."""
    if fused and fusable(weight):
        return _FusedUnitKernels.apply(weight, eps)
    return _UnitKernels.apply(weight, eps)[0]
