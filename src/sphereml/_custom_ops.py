"""The library's custom operators, called without the dispatcher where nothing needs it.

Note [direct eager calls]
    The fused paths register their Triton kernels as ``torch.library.custom_op`` operators (the patch epilogue, the
    margin heads' passes, the energy's pair kernels), so that ``torch.compile(fullgraph=True)`` sees one opaque
    operator with a fake implementation.  In eager mode the price is the dispatcher's round trip through Python: with
    gradients off, a one-argument ``custom_op`` cost 11.9 µs of host time here against 3.7 µs called directly and
    2.3 µs for an aten ``add`` (``python -m benchmarks launches``), and two of the margin heads' operators, of three
    outputs each, about 19 µs more than their implementations.  On a GPU whose host issues every launch, that is
    paid once per kernel.  The library calls its operators inside its autograd nodes' forward and backward, where
    gradients are off and the operator's autograd, autocast and device kernels have nothing to do (none has an
    autocast kernel: autocast reaches the operations inside it either way); the public
    :func:`sphereml.heads.margin_tail.margin_tail` may be called anywhere, and with gradients on reaches the
    operator.

    :func:`custom_op` defines the operator as ``torch.library.custom_op`` does and returns an :class:`Operator`,
    whose call runs the Python implementation directly when the call is plain eager: not traced by
    ``torch.compile``, ``torch.export`` or ``torch.jit.trace``, gradients off and no forward-mode level open, no
    ``torch.func`` transform, no dispatch or function mode (a ``FakeTensorMode``, an operation counter such as
    :func:`sphereml.launches.count_ops`), positional arguments only, each a plain tensor or parameter, a number, a
    string or None (not a subclass, nor an ``torch.fx`` proxy).  There it also bumps the version counters of the
    arguments the operator mutates, as the dispatcher does.  Otherwise it calls the registered operator, so tracing,
    counting and subclasses see the operator as before.  The checks cost about a microsecond.  What the direct call
    skips is the dispatcher's checks of a call (outputs that alias inputs, arguments converted to the schema's
    types), which the compiled and differentiated calls still make, and any kernel registered for the operator later
    (an autocast or per-device one): this module registers none.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.autograd import forward_ad

__all__ = ["Operator", "custom_op", "plain_eager"]

_PLAIN_TYPES = frozenset({Tensor, torch.nn.Parameter, int, float, bool, str, type(None)})


def plain_eager(args: Iterable) -> bool:
    """True when a call with ``args`` needs nothing of the dispatcher (Note [direct eager calls])."""
    if (torch.compiler.is_compiling() or torch.is_grad_enabled() or forward_ad._current_level >= 0
            or torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled() or torch._C._get_tracing_state() is not None):
        return False
    return _PLAIN_TYPES.issuperset(map(type, args))


class Operator:
    """A registered custom operator (``torch.ops.<namespace>.<name>``) with its Python implementation, called
    directly in plain eager calls (Note [direct eager calls])."""

    def __init__(self, name: str, implementation: Callable, mutates_args: Iterable[str]):
        if isinstance(mutates_args, str):  # "unknown": the direct call could not bump the right version counters
            raise ValueError(f"mutates_args must name the mutated arguments, got {mutates_args!r}")
        self.name, self.implementation = name, implementation
        self.definition = torch.library.custom_op(name, implementation, mutates_args=mutates_args)
        namespace, op_name = name.split("::")
        self.packet = getattr(getattr(torch.ops, namespace), op_name)
        parameters = list(inspect.signature(implementation).parameters)
        self.mutated = tuple(parameters.index(arg) for arg in mutates_args)

    def __call__(self, *args, **kwargs):
        if kwargs or not plain_eager(args):
            return self.packet(*args, **kwargs)
        out = self.implementation(*args)
        for position in self.mutated:  # as the dispatcher's ADInplaceOrView kernel does
            if position < len(args) and args[position] is not None:
                torch.autograd.graph.increment_version(args[position])
        return out

    def register_fake(self, fake: Callable) -> Callable:
        """Registers the operator's fake (meta) implementation, as ``CustomOpDef.register_fake``."""
        return self.definition.register_fake(fake)


def custom_op(name: str, *, mutates_args: Iterable[str]) -> Callable[[Callable], Operator]:
    """``torch.library.custom_op(name, mutates_args=...)`` as a decorator that returns an :class:`Operator`."""
    return lambda implementation: Operator(name, implementation, mutates_args)
