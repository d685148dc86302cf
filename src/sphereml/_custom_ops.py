"""The library's custom operators, called without the dispatcher where nothing needs it.

Note [direct eager calls]
    The fused paths register their Triton kernels as ``torch.library.custom_op`` operators (the patch epilogue, the
    margin heads' passes, the energy's pair kernels), so that ``torch.compile(fullgraph=True)`` sees one opaque
    operator with a fake implementation.  In eager mode the price is the dispatcher's round trip through Python: with
    gradients off, a one-argument ``custom_op`` cost 10.3 µs of host time here against 3.3 µs called directly and
    2.1 µs for an aten ``add`` (``python -m benchmarks launches``), and two of the margin heads' operators, of three
    outputs each, about 19 µs more than their implementations.  On a GPU whose host issues
    every launch, that is paid once per kernel.  All the library's calls are made inside its autograd nodes' forward
    and backward, where gradients are off and the operator's autograd, autocast and device kernels have nothing to
    do (it has no autocast kernel: autocast reaches the operations inside it either way).

    :func:`custom_op` defines the operator as ``torch.library.custom_op`` does and returns an :class:`Operator`,
    whose call runs the Python implementation directly when the call is plain eager: not traced by
    ``torch.compile`` or ``torch.export``, gradients off, no ``torch.func`` transform, no dispatch or function
    mode (a ``FakeTensorMode``, an operation counter such as :func:`sphereml.launches.count_ops`), and every tensor
    argument a plain tensor or parameter.  Otherwise it calls the registered operator, so tracing, counting and
    subclasses see the operator as before.  The checks cost about a microsecond.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

__all__ = ["Operator", "custom_op", "plain_eager"]

_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def plain_eager(args: Iterable) -> bool:
    """True when a call with ``args`` needs nothing of the dispatcher (Note [direct eager calls])."""
    if (torch.compiler.is_compiling() or torch.is_grad_enabled() or torch._C._are_functorch_transforms_active()
            or torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()):
        return False
    return all(type(a) in _PLAIN_TENSORS for a in args if isinstance(a, Tensor))


class Operator:
    """A registered custom operator (``torch.ops.<namespace>.<name>``) with its Python implementation, called
    directly in plain eager calls (Note [direct eager calls])."""

    def __init__(self, name: str, implementation: Callable, mutates_args: Iterable[str] | str):
        self.name, self.implementation = name, implementation
        self.definition = torch.library.custom_op(name, implementation, mutates_args=mutates_args)
        namespace, op_name = name.split("::")
        self.packet = getattr(getattr(torch.ops, namespace), op_name)

    def __call__(self, *args):
        if plain_eager(args):
            return self.implementation(*args)
        return self.packet(*args)

    def register_fake(self, fake: Callable) -> Callable:
        """Registers the operator's fake (meta) implementation, as ``CustomOpDef.register_fake``."""
        return self.definition.register_fake(fake)


def custom_op(name: str, *, mutates_args: Iterable[str] | str) -> Callable[[Callable], Operator]:
    """``torch.library.custom_op(name, mutates_args=...)`` as a decorator that returns an :class:`Operator`."""
    return lambda implementation: Operator(name, implementation, mutates_args)
