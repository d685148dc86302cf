"""What one operation costs the host, by the way it is issued: the fixed price of every kernel on a GPU.

Where kernels are small, eager PyTorch on a GPU waits on the host: the operations a regulariser adds to a CNN-9 step
cost 20-35 µs each on the H200 and H100 runs, and the fused margin heads and patch epilogue, which replace many aten
operations by a few custom operators that launch Triton kernels, lost to the reference paths wherever the work was
small.  Whether a fused path can pay depends on what each of its calls costs the host, which this measures.

Each candidate issues ``CALLS`` calls on a one-element tensor without waiting, then waits once, so its time per call
is the host's (each kernel ends before the next is issued).  The candidates: an aten ``add`` (the baseline); the same
recorded for autograd; a ``torch.autograd.Function`` around it, in the form whose forward takes the context, in the
form with ``setup_context`` (every node of the library) and on the library's base, which skips the standard ``apply``'s
signature binding (Note [a lean apply] in :mod:`sphereml._autograd`); a ``torch.library.custom_op`` around it,
without and with a registered autograd formula, and with gradients off, as the library calls its kernels' operators
inside its autograd nodes, both as is and defined through :func:`sphereml._custom_ops.custom_op`, which calls the
implementation directly there (Note [direct eager calls]); and, with Triton and CUDA, a one-block Triton kernel
launched directly and from inside either custom operator (:mod:`benchmarks._launch_kernels`).  The result file gives
microseconds per call beside the ratios.
"""

from __future__ import annotations

import torch

from sphereml._autograd import Function
from sphereml._custom_ops import custom_op
from sphereml.energy.triton_backend import usable_on

from .harness import compare, save, smoke_or

CALLS = 200  # calls per timed candidate call


def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _triton_plus_one(x: torch.Tensor) -> torch.Tensor:
    """x + 1 by a Triton kernel: the fused paths' pattern."""
    from ._launch_kernels import add_one

    return add_one(x)


def _custom_add_one(name: str, define=torch.library.custom_op, body=_plus_one):
    """x + 1 (by ``body``) as the custom operator ``sphereml_bench::<name>``, with its fake (no autograd formula
    yet), defined by ``torch.library.custom_op`` or the library's :func:`sphereml._custom_ops.custom_op`."""
    @define(f"sphereml_bench::{name}", mutates_args=())
    def add_one(x: torch.Tensor) -> torch.Tensor:
        return body(x)

    add_one.register_fake(torch.empty_like)
    return add_one


_add_one = _custom_add_one("add_one")
_add_one_differentiable = _custom_add_one("add_one_differentiable")
_add_one_differentiable.register_autograd(lambda ctx, grad: grad)
_direct_add_one = _custom_add_one("direct_add_one", custom_op)


class _AddOneWithContext(torch.autograd.Function):
    """x + 1 as an autograd node whose forward takes the context (the older form, which torch.func cannot use)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @staticmethod
    def backward(ctx, grad):
        return grad


class _AddOne(torch.autograd.Function):
    """x + 1 as an autograd node with ``setup_context``, the form of the library's nodes."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


class _LeanAddOne(Function):
    """The same node on the library's base (Note [a lean apply] in :mod:`sphereml._autograd`)."""

    forward, setup_context, backward = _AddOne.forward, _AddOne.setup_context, _AddOne.backward


_triton_add_one = _custom_add_one("triton_add_one", body=_triton_plus_one)
_direct_triton_add_one = _custom_add_one("direct_triton_add_one", custom_op, _triton_plus_one)


def _repeated(fn, x: torch.Tensor, calls: int, grad: bool = True):
    """The ``calls`` calls; with ``grad=False`` under ``torch.no_grad``, as inside an autograd node's forward."""
    def run():
        with torch.set_grad_enabled(grad):
            for _ in range(calls):
                fn(x)

    return run


def run(device: torch.device, calls: int = CALLS) -> dict:
    calls = smoke_or(calls, 2)
    x = torch.zeros(1, device=device)
    leaf = torch.zeros(1, device=device, requires_grad=True)
    candidates = {
        "aten add": _repeated(lambda t: t + 1, x, calls),
        "aten add, autograd": _repeated(lambda t: t + 1, leaf, calls),
        "autograd.Function, forward(ctx, x)": _repeated(_AddOneWithContext.apply, leaf, calls),
        "autograd.Function, setup_context": _repeated(_AddOne.apply, leaf, calls),
        "sphereml Function (lean apply)": _repeated(_LeanAddOne.apply, leaf, calls),
        "custom_op": _repeated(_add_one, x, calls),
        "custom_op, autograd": _repeated(_add_one_differentiable, leaf, calls),
        "custom_op, no grad": _repeated(_add_one, x, calls, grad=False),
        "sphereml custom_op, no grad": _repeated(_direct_add_one, x, calls, grad=False),
    }
    if usable_on(x) and x.is_cuda:  # the interpreter's launches on the CPU say nothing about a GPU's
        from ._launch_kernels import add_one

        candidates["Triton kernel"] = _repeated(add_one, x, calls)
        candidates["Triton kernel in a custom_op"] = _repeated(_triton_add_one, x, calls, grad=False)
        candidates["Triton kernel in a sphereml custom_op"] = _repeated(_direct_triton_add_one, x, calls, grad=False)
    print(f"--- host time per call, {calls} calls of each on a one-element tensor, waited for once")
    result = compare("launch_overhead", candidates, baseline="aten add", device=device, repeats=5,
                     extra={"calls": calls})
    result["microseconds_per_call"] = {label: 1e6 * seconds / calls for label, seconds in result["seconds"].items()}
    for label, micro in result["microseconds_per_call"].items():
        print(f"launch_overhead                {label:36s} {micro:7.1f} µs per call")
    save(result, "launch_overhead", device)  # again, with the time per call
    return result
