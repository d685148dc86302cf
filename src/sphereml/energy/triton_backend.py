"""Fused Triton kernels for the Euclidean energy: one forward kernel, one backward kernel.

Forward: each program owns ``BM`` rows of Q, walks over all column tiles, forms the Gram tile
with ``tl.dot`` (float32, IEEE precision), evaluates the Riesz kernel, masks i == j and the
ragged edge, and writes one partial sum per row.  Backward: each program owns ``BM`` rows and a
``BDO``-wide slice of the output gradient, recomputes the Gram tiles (no M x M matrix is ever
stored, as in flash attention), and accumulates sum_j D_ij q_j and sum_j D_ij for
dE/dq_i = 2 c sum_j D_ij (q_j - q_i) (see :mod:`~sphereml.energy.tiled`).

Triton has no arccos, so only ``metric="euclidean"`` is fused; the angular energy uses the
tiled backend.  On a CPU-only machine the kernels run under ``TRITON_INTERPRET=1`` (slowly),
which is how the test suite checks them against the dense reference.  One block
configuration is used (multi-config autotuning needs a GPU driver).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

BM, BN, BD = 64, 64, 32


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def usable_on(points: Tensor) -> bool:
    """Triton can run here: importable, and CUDA tensors (or CPU tensors under the interpreter)."""
    return triton_importable() and (points.is_cuda or (interpreting() and points.device.type == "cpu"))


def _kernels():
    """Import the kernels on first use (see :mod:`sphereml.energy._triton_kernels`)."""
    import triton

    from . import _triton_kernels

    return triton, _triton_kernels.forward_kernel, _triton_kernels.backward_kernel


def _launch_parts(points: Tensor):
    triton, forward_kernel, backward_kernel = _kernels()
    q = points.detach().float().contiguous()
    sq = (q * q).sum(1).contiguous()
    return triton, forward_kernel, backward_kernel, q, sq


class TritonEnergy(torch.autograd.Function):
    """``TritonEnergy.apply(points, s, eps)``: Euclidean pair-mean energy with fused kernels."""

    @staticmethod
    def forward(ctx, points: Tensor, s: float, eps: float) -> Tensor:
        triton, forward_kernel, _, q, sq = _launch_parts(points)
        m, d = q.shape
        partial = torch.empty(m, dtype=torch.float32, device=q.device)
        forward_kernel[(triton.cdiv(m, BM),)](q, sq, partial, m, d, q.stride(0), float(s), float(eps), LOG=s == 0,
                                              BM=BM, BN=BN, BD=BD)
        ctx.save_for_backward(points)
        ctx.params = (s, eps)
        return (partial.sum(dtype=torch.float64) / (m * (m - 1))).to(points.dtype)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (points,) = ctx.saved_tensors
        s, eps = ctx.params
        triton, _, backward_kernel, q, sq = _launch_parts(points)
        m, d = q.shape
        bdo = min(128, max(16, triton.next_power_of_2(d)))
        grad = torch.empty_like(q)
        backward_kernel[(triton.cdiv(m, BM), triton.cdiv(d, bdo))](
            q, sq, grad, m, d, q.stride(0), float(s), float(eps), LOG=s == 0, BM=BM, BN=BN, BD=BD, BDO=bdo)
        scale = grad_output * (2.0 / (m * (m - 1)))
        return (grad * scale).to(points.dtype), None, None


def triton_energy(points: Tensor, s: float, eps: float) -> Tensor:
    """Pair-mean Euclidean energy of ``points`` (Tensor[M, d]) through the fused kernels."""
    return TritonEnergy.apply(points, s, eps)
