"""The base of the library's autograd nodes: ``torch.autograd.Function`` with a leaner ``apply``.

Note [a lean apply]
    Twelve of the library's hand-written autograd nodes define ``setup_context``, the form that ``torch.func`` and
    ``generate_vmap_rule`` (several seeds at once, :mod:`sphereml.multiseed`) need.  For such a class,
    ``torch.autograd.Function.apply`` (PyTorch 2.13 here) binds every call's arguments to ``forward``'s signature
    with ``inspect.signature``, only to fill in defaults that our callers always pass: about 10 µs of host time per
    call here, so that one node costs 16 µs against 6 µs for the same node without ``setup_context``
    (``python -m benchmarks launches``; pytorch/pytorch#189573 tracks it upstream).  A GPU's host issues every
    launch, and a regularised CNN-9 step calls 7-10 such nodes, a patch layer two or three per step.
    :meth:`Function.apply` goes straight to the base's C++ ``apply`` when every argument of ``forward`` is given
    positionally and no ``torch.func`` transform is active, with the dead-wrapper unwrapping the standard path does
    there; otherwise (a transform, keywords, omitted defaults) it takes the standard path.  Under ``torch.compile``
    TorchDynamo traces the node as any ``autograd.Function``, not this method.
"""

from __future__ import annotations

import inspect

import torch
from torch._C._functorch import is_functorch_wrapped_tensor

try:  # private, as the standard apply's own use of it; a PyTorch without it takes the standard path
    from torch._functorch.utils import unwrap_dead_wrappers
except ImportError:  # pragma: no cover - PyTorch 2.1 to 2.13 have it
    unwrap_dead_wrappers = None

__all__ = ["Function", "transformed"]


def transformed(*tensors: torch.Tensor | None) -> bool:
    """Whether any of ``tensors`` is wrapped by a ``torch.func`` transform (vmap, grad), for which the library's
    custom operators and some in-place operations have no rules (False while TorchDynamo traces): a node's forward
    may see plain tensors where its backward sees wrapped ones."""
    return not torch.compiler.is_compiling() and any(
        t is not None and is_functorch_wrapped_tensor(t) for t in tensors)


def _arity(cls: type) -> int:
    """The number of parameters of ``cls.forward``, taken once per class and kept on the class with its forward."""
    kept = cls.__dict__.get("_sphereml_arity")
    if kept is None or kept[0] is not cls.forward:
        kept = (cls.forward, len(inspect.signature(cls.forward).parameters))
        cls._sphereml_arity = kept
    return kept[1]


class Function(torch.autograd.Function):
    """``torch.autograd.Function`` without the per-call signature binding (Note [a lean apply])."""

    @classmethod
    def apply(cls, *args, **kwargs):
        if (kwargs or unwrap_dead_wrappers is None or len(args) != _arity(cls)
                or torch._C._are_functorch_transforms_active()):
            return super().apply(*args, **kwargs)
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))
