"""What a training step asks of the device, counted and checked on the CPU: operations and host reads.

On a GPU a small layer's time is set by launches and synchronisations, not by arithmetic: each
aten operation is about one kernel launch (~5-30 µs), and each read of a device tensor on the host
(``.item()``, ``bool(t)``, ``nonzero``, a boolean mask) stalls the host until the device has caught up.
Both can be seen without a GPU, at the level of PyTorch's dispatcher, which is what the tests and
benchmarks use this module for:

* :func:`count_ops` runs a function and counts the aten operations it dispatches (views, which launch
  nothing, apart), so a test can hold a training step to an operation budget;
* :func:`no_host_sync` is a context in which any operation that needs a tensor's values on the host raises
  :class:`HostSyncError`, so a test can prove that a step never synchronises.  On CUDA, pair it with
  ``torch.cuda.set_sync_debug_mode("error")``, which catches the rest (device-to-host copies);
* :func:`compiled_ops` lists the operations of the graphs that ``torch.compile`` makes of a step, so a test can
  catch those of :data:`CAPTURE_UNSAFE`, which a CUDA graph (``fit(compile="reduce-overhead")``) cannot capture;
* :func:`on_accelerator` is what the orthogonalisers and the batched energy's packing ask of a device where they
  compute differently on a GPU (a Cholesky factorisation for a QR, blocks shared by fan-ins); the tests that
  count or check a GPU's operations on the CPU make it say True.  The energy's choice of backend for one point set
  (``hyperspherical_energy``'s ``"auto"``) still asks ``is_cuda`` and is tested apart.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCount", "count_ops", "HostSyncError", "no_host_sync", "checking_host_reads", "HOST_READS",
           "CAPTURE_UNSAFE", "compiled_ops", "on_accelerator"]

# Operations whose result the host can only know by reading device memory (or whose output shape
# depends on tensor values, which is the same thing for the host).
HOST_READS = frozenset({
    "aten::_local_scalar_dense",  # .item(), bool(t), int(t), float(t)
    "aten::nonzero", "aten::masked_select", "aten::unique_dim", "aten::_unique", "aten::_unique2",
    "aten::unique_consecutive", "aten::equal", "aten::is_nonzero", "aten::allclose",
})

# Operations that a CUDA graph cannot capture (Note [what a CUDA graph cannot capture]).
CAPTURE_UNSAFE = HOST_READS | frozenset({
    "aten::_linalg_solve_ex", "aten::linalg_lu_factor_ex", "aten::linalg_lu", "aten::linalg_lu_solve",
    "aten::_linalg_eigh",
})


@dataclass
class OpCount:
    """The aten operations dispatched by one call: ``total`` (all but views), ``views`` and ``by_op``.

    ``total`` slightly overstates the kernel launches: a few of its operations allocate or relabel memory and
    launch nothing (``empty``, ``_unsafe_view``, the profiler's ``record_function`` markers), 13 of a plain
    CNN-9 training step's 100 and 15 of its 200 with HS-MHE (torch 2.13).
    """

    total: int = 0
    views: int = 0
    by_op: Counter = field(default_factory=Counter)

    def most_common(self, k: int = 8) -> list[tuple[str, int]]:
        return self.by_op.most_common(k)


class _Counter(TorchDispatchMode):
    def __init__(self, count: "OpCount", touching: int):
        super().__init__()
        self.count, self.touching = count, touching

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.touching:
            tensors = [*args, *(out if isinstance(out, (tuple, list)) else [out])]
            if not any(isinstance(t, torch.Tensor) and t.numel() >= self.touching for t in tensors):
                return out
        if func.is_view:
            self.count.views += 1
        else:
            self.count.total += 1
            self.count.by_op[func.name()] += 1
        return out


def count_ops(fn: Callable[[], object], touching: int = 0) -> OpCount:
    """Call ``fn()`` once and count the aten operations it dispatches (forward, backward and optimiser).

    View operations (``view``, ``transpose``, ``detach``, ...) move no data and launch no kernel; they are
    counted apart in ``views``.  Each of the others is about one kernel launch on a GPU (:class:`OpCount`).
    ``touching=n`` counts only the operations that read or write a tensor of at least n elements (e.g. the
    B x C logits of a classifier: the passes over memory that set a large layer's time).
    """
    count = OpCount()
    with _Counter(count, touching):
        fn()
    return count


class HostSyncError(RuntimeError):
    """An operation read tensor values on the host inside :func:`no_host_sync`."""


def _is_boolean_index(func, args) -> bool:
    if func.name() not in ("aten::index.Tensor", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class _Guard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name in HOST_READS or _is_boolean_index(func, args):
            raise HostSyncError(f"{name} reads tensor values on the host (a device synchronisation on a GPU)")
        return func(*args, **(kwargs or {}))


_guards = 0  # how many no_host_sync blocks are open


def checking_host_reads() -> bool:
    """True inside :func:`no_host_sync`: argument checks that read values of CPU tensors only (never of GPU
    tensors) skip them, so the block runs the code path a GPU would."""
    return _guards > 0


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise :class:`HostSyncError` on any host read of tensor data inside the block.

    Caught: ``item`` / ``bool`` / ``int`` / ``float`` of a tensor, ``nonzero``, ``masked_select``, ``unique``,
    boolean-mask indexing and assignment, ``equal`` / ``allclose``, and the Python-level ``tolist``,
    ``numpy`` and ``cpu``, which bypass the dispatcher.  Value checks that the library runs on CPU tensors
    only (:func:`checking_host_reads`) are skipped, as they are for GPU tensors.
    """
    global _guards
    patched = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

    def refuse(name):
        def method(*args, **kwargs):
            raise HostSyncError(f"Tensor.{name}() copies tensor data to the host")
        return method

    try:
        _guards += 1
        for name in patched:
            setattr(torch.Tensor, name, refuse(name))
        with _Guard():
            yield
    finally:
        _guards -= 1
        for name, method in patched.items():
            setattr(torch.Tensor, name, method)


def on_accelerator(device: torch.device) -> bool:
    """Whether ``device`` takes the library's GPU forms (anything but the CPU).  The tests that count or check a
    GPU's operations on the CPU make a module's ``on_accelerator`` say True."""
    return torch.device(device).type != "cpu"


def compiled_ops(fn: Callable[[], torch.Tensor]) -> set[str]:
    """The aten operations of the forward and backward graphs that ``torch.compile(fn, fullgraph=True)`` makes, by
    name (``aten::mm``): ``fn()`` is compiled, called once and its result's sum differentiated.  The graphs are
    AOTAutograd's, before inductor lowers them; the call resets dynamo's caches for the whole process first.
    Raises RuntimeError when no forward graph (or, for a result that needs a gradient, no backward graph) was made.

    Note [what a CUDA graph cannot capture]
        ``fit(compile="reduce-overhead")`` records a compiled step into a CUDA graph, which fails on any operation
        that synchronises the host or launches work the capture cannot see (:data:`CAPTURE_UNSAFE`): the host reads
        of :data:`HOST_READS`; the LU factorisation behind ``linalg.solve`` (on an H100 on 2026-12-06 OPT's compiled
        Cayley step failed with "operation not permitted when stream is capturing" at ``_linalg_solve_ex``; its
        ``lu_factor`` and ``lu_solve`` run the same factorisation); and ``linalg.eigh``, which checks its
        convergence on the host (a synchronisation in ``tests/test_step_cost.py``'s CUDA test).  That the Cholesky
        factorisations and triangular solves of the same run were captured is inferred from the order of its
        steps, not seen.  The list is made by hand: operations found unsafe on a GPU belong in it, and the CPU
        tests check the compiled paths they cover against it.
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    seen: set[str] = set()
    graphs = []

    def recorder(kind):
        def record(graph: torch.fx.GraphModule, example_inputs):
            graphs.append(kind)
            seen.update(node.target.name() for node in graph.graph.nodes
                        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload))
            return make_boxed_func(graph.forward)
        return record

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    out = torch.compile(fn, fullgraph=True, backend=backend)()
    if out.requires_grad:
        out.sum().backward()
    if "forward" not in graphs or out.requires_grad and "backward" not in graphs:
        raise RuntimeError(f"compiled_ops saw the graphs {graphs}: nothing checked")
    return seen
