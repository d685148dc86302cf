"""Fused Triton kernels for the Euclidean energy: one forward kernel, one backward kernel.

Forward: each program owns ``BLOCK`` rows of Q and walks over the column tiles at or right of
its diagonal tile (the pair matrix is symmetric: off-diagonal tiles count twice, half the Gram
work), forms each Gram tile with ``tl.dot``, evaluates the Riesz kernel, masks i == j and the
ragged edge, and writes one partial sum per row (deterministic; summed in float64).
Backward: each program owns ``BM`` rows and a ``BDO``-wide slice of the gradient, recomputes
the Gram tiles over all of d (no M x M matrix is ever stored, as in flash attention), and
accumulates sum_j D_ij q_j and sum_j D_ij for dE/dq_i = 2 c sum_j D_ij (q_j - q_i) (see
:mod:`~sphereml.energy.tiled`).  The Gram tiles are thus computed d / BDO times: autotuning
chooses BDO = 256 (twice at d = 512, a few hundred bytes of register spills) or 128 (four
times, no spills) on a GPU.  Memory is O(M d); every program writes its own output, so the
result is deterministic and no float atomics are used.

Close pairs (Note [close pairs] in :mod:`~sphereml.energy.kernels`): a tile whose Gram estimate
flags a close pair recomputes r^2 from coordinate differences, and in the backward leaves
those pairs out of the ``tl.dot`` and adds D_ij (q_j - q_i) from explicit differences.  Only
such tiles take the slow path (a loop over coordinates on the CUDA cores), and it is exact in
every matmul precision.

Precision policy (float32 arithmetic only: float64 input is refused, half input is upcast).
The Gram and gradient products follow ``torch.get_float32_matmul_precision()`` when the
energy is called, as PyTorch's own matmuls do:

* ``"highest"`` (PyTorch's default) -> ``input_precision="ieee"``: exact float32 FMA products,
  no tensor cores.  At N = 32768, d = 512 its forward + backward takes about three times dense's
  (the "cases" of benchmarks/results/energy_triton_configs-cuda.json against the dense run of
  energy_fwd_bwd-cuda.json), so ``auto`` does not pick this kernel at "highest".
* ``"high"`` and ``"medium"`` -> ``"tf32"``: one TF32 tensor-core product (10-bit mantissa, unit
  roundoff 2^-11), as cuBLAS does for PyTorch's own matmuls at both settings.  The squared
  distance of a far pair is off by up to 2e-3 (the Gram error emulated for unit rows is
  "gram_error_emulated" in benchmarks/results/energy_fwd_bwd-cpu.json; the error of value and
  gradient on a GPU is still to be recorded: the last suite run there stopped at an illegal memory
  access).  At N = 32768, d = 512 several times faster than dense (the same two files), in O(N d)
  memory instead of dense's O(N^2).  ``"tf32x3"`` (three TF32
  products, float32 accuracy) is not used: an autotuned tf32x3 configuration hit an illegal memory
  access (Triton 3.6; benchmarks/results/energy_triton_configs-cuda.json).

Tested under ``TRITON_INTERPRET=1`` on the CPU (values and gradients against float64 dense,
ragged sizes, duplicates and close pairs, half space, s = 0, 1, 1.5, 2, each precision
setting) and compiled on an H200 (torch 2.11, Triton 3.6: ``tests/test_energy_triton.py``
passes on CUDA tensors, one configuration per kernel; every configuration timed alone in
benchmarks/results/energy_triton_configs-cuda.json).

Autotuning: a few Hopper-friendly block / warp / stage configurations on a GPU
(:mod:`~sphereml.energy._triton_kernels`), one fixed configuration under
``TRITON_INTERPRET=1``; keyed on (M bucket, d, the s fast path, precision).  The M bucket is
``min(next_power_of_2(M), TUNE_CAP)``, and a call with M > TUNE_CAP tunes once on its first
TUNE_CAP rows, so a huge call (N = 2^20) never times several configurations at full size.

Triton has no arccos, so only ``metric="euclidean"`` is fused; the angular energy uses the
tiled backend.  On a CPU-only machine the kernels run under ``TRITON_INTERPRET=1`` (slowly),
which is how the test suite checks them against the dense reference.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor

from .kernels import CLOSE_R2

__all__ = ["TRITON_DTYPES", "PRECISIONS", "TUNE_CAP", "triton_importable", "lazy_module", "next_power_of_2", "cdiv",
           "interpreting", "usable_on", "launchable", "FUSED_BACKENDS", "choose_backend", "matmul_precision",
           "power_path", "TritonEnergy", "triton_energy"]

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PRECISIONS = {"highest": "ieee", "high": "tf32", "medium": "tf32"}  # torch setting -> tl.dot input_precision
TUNE_CAP = 32768  # the largest M bucket of the autotuning key
FUSED_BACKENDS = ("auto", "reference", "fused")  # the backend argument of the fused heads and layers
_tuned_on_prefix: set = set()


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def lazy_module(name: str) -> Callable[[], ModuleType]:
    """A function that returns the module ``name``, imported at its first call: the kernels' modules import Triton,
    which the CPU paths never need, and through the import machinery each launch paid about 1 µs."""
    return functools.cache(functools.partial(importlib.import_module, name))


def next_power_of_2(n: int) -> int:
    """The least power of 2 at least ``n`` (0 for 0), in Python's integers, as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(n: int, block: int) -> int:
    """ceil(n / block) for a launch grid, in Python's integers: ``triton.cdiv`` is a Triton function (a
    ``ConstexprFunction`` in Triton 3.9), whose call from Python cost 3.2 µs of host time here against 0.01 µs, and
    a fused patch layer's step makes eight."""
    return -(-n // block)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def usable_on(points: Tensor) -> bool:
    """Triton can run here: importable, and CUDA tensors (or CPU tensors under the interpreter)."""
    return triton_importable() and (points.is_cuda or (interpreting() and points.device.type == "cpu"))


def launchable(t: Tensor) -> Tensor:
    """``t``, or one element when it is empty: an empty CUDA tensor has a null pointer, which Triton's launcher
    refuses even for an argument the kernel never reads."""
    return t if t.numel() else t.new_empty(1)


def choose_backend(backend: str, x: Tensor, fusable: bool = True) -> str:
    """``"reference"`` or ``"fused"`` for the fused margin heads and patch layers (:data:`FUSED_BACKENDS`).

    ``"auto"`` is ``"reference"`` unless ``SPHEREML_FUSED=1``, which makes it ``"fused"`` for ``fusable`` CUDA
    tensors with Triton installed.  The fused kernels are an opt-in because they were measured slower than
    the reference on a GPU (``benchmarks/results/sphereconv_*-cuda.json``, ``scs_*-cuda.json``,
    ``margin_heads_*-cuda.json``): the patch epilogue in every SphereConv and SCS shape timed, where as an opaque
    operator it also keeps ``torch.compile`` from fusing the epilogue, and the margin heads at C = 10,000 (not
    at C = 100,000)."""
    if backend not in FUSED_BACKENDS:
        raise ValueError(f"backend must be one of {FUSED_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    on = fusable and x.is_cuda and triton_importable() and os.environ.get("SPHEREML_FUSED", "0") == "1"
    return "fused" if on else "reference"


def matmul_precision() -> str:
    """The ``tl.dot`` input precision that matches ``torch.get_float32_matmul_precision()``."""
    return PRECISIONS[torch.get_float32_matmul_precision()]


def _kernels():
    """The kernels' module (:mod:`sphereml.energy._triton_kernels`), by a plain import: :class:`TritonEnergy` is an
    autograd Function that TorchDynamo traces, and it cannot trace the call of a :func:`lazy_module`'s cache."""
    from . import _triton_kernels

    return _triton_kernels


def power_path(s: float) -> int:
    """The ``POWER`` fast path of the kernels' ``riesz``: 0 (log), 1, 2, or -1 (general s)."""
    return int(s) if s in (0.0, 1.0, 2.0) else -1


def _launch(kind: str, q: Tensor, sq: Tensor, s: float, eps: float, precision: str) -> Tensor:
    """Run the forward (``kind="forward"``: Tensor[M] of row partial sums) or backward kernel (Tensor[M, d])."""
    kernels = _kernels()
    m, d = q.shape
    if m > TUNE_CAP and not interpreting() and (kind, d, power_path(s), precision) not in _tuned_on_prefix:
        _launch(kind, q[:TUNE_CAP], sq[:TUNE_CAP], s, eps, precision)  # tunes the key M bucket = TUNE_CAP
        _tuned_on_prefix.add((kind, d, power_path(s), precision))
    m_key = min(next_power_of_2(m), TUNE_CAP)
    args = (q, sq)
    scalars = (m, d, q.stride(0), m_key, float(s), float(eps), CLOSE_R2)
    if kind == "forward":
        out = torch.empty(m, dtype=torch.float32, device=q.device)
        kernels.forward_kernel[lambda meta: (cdiv(m, meta["BLOCK"]),)](
            *args, out, *scalars, POWER=power_path(s), PRECISION=precision)
        return out
    grad = torch.empty_like(q)
    kernels.backward_kernel[lambda meta: (cdiv(m, meta["BM"]), cdiv(d, meta["BDO"]))](
        *args, grad, *scalars, POWER=power_path(s), PRECISION=precision)
    return grad


class TritonEnergy(torch.autograd.Function):
    """``TritonEnergy.apply(points, s, eps)``: Euclidean pair-mean energy with fused kernels (float32 arithmetic)."""

    @staticmethod
    def forward(ctx, points: Tensor, s: float, eps: float) -> Tensor:
        q = points.detach().float().contiguous()  # (M, d)
        sq = (q * q).sum(1)  # (M,)
        precision = matmul_precision()
        partial = _launch("forward", q, sq, s, eps, precision)
        m = len(q)
        ctx.save_for_backward(points)
        ctx.params = (s, eps, precision)
        return (partial.sum(dtype=torch.float64) / (m * (m - 1))).to(points.dtype)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        (points,) = ctx.saved_tensors
        s, eps, precision = ctx.params
        q = points.detach().float().contiguous()
        sq = (q * q).sum(1)
        grad = _launch("backward", q, sq, s, eps, precision)
        m = len(q)
        scale = grad_output.float() * (2.0 / (m * (m - 1)))  # float32: the factor underflows float16
        return (grad * scale).to(points.dtype), None, None


def triton_energy(points: Tensor, s: float, eps: float) -> Tensor:
    """Pair-mean Euclidean energy of ``points`` (Tensor[M, d], float32 or half) through the fused kernels."""
    return TritonEnergy.apply(points, s, eps)
