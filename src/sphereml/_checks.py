"""Argument checks shared by the modules: one clear ``ValueError`` per bad argument.

Every public function validates its arguments through these helpers, so the messages read the
same everywhere: the argument's name, the value received and the valid range or set.  ``bool``
is never accepted as a number.  Checks on tensors look only at what costs nothing (dtype,
shape, device); a check that would read tensor values from a GPU (and so synchronise it) runs
only on CPU tensors.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor

from . import launches


def real_number(name: str, value, *, at_least: float | None = None, above: float | None = None,
                below: float | None = None, at_most: float | None = None) -> float:
    """``value`` as a float if it is a finite real number within the given bounds (bool is refused)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (at_least is None or value >= at_least) and (above is None or value > above)
    ok = ok and (below is None or value < below) and (at_most is None or value <= at_most)
    if not ok:
        bounds = [f">= {at_least:g}" if at_least is not None else "", f"> {above:g}" if above is not None else "",
                  f"< {below:g}" if below is not None else "", f"<= {at_most:g}" if at_most is not None else ""]
        bounds_text = " and ".join(b for b in bounds if b)
        raise ValueError(f"{name} must be a finite number{' ' + bounds_text if bounds_text else ''}, got {value!r}")
    return float(value)


def integer(name: str, value, *, at_least: int | None = None, at_most: int | None = None) -> int:
    """``value`` if it is an int (not a bool) within ``[at_least, at_most]``."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (at_least is None or value >= at_least) and (at_most is None or value <= at_most)
    if not ok:
        if at_least is not None and at_most is not None:
            bounds = f" in [{at_least}, {at_most}]"
        elif at_least is not None:
            bounds = f" >= {at_least}"
        elif at_most is not None:
            bounds = f" <= {at_most}"
        else:
            bounds = ""
        raise ValueError(f"{name} must be an integer{bounds}, got {value!r}")
    return value


def one_of(name: str, value, choices: Iterable):
    """``value`` if it is one of ``choices`` (compared with ``==``; bools never match numbers)."""
    choices = tuple(choices)
    if isinstance(value, bool) or not any(value == c and type(value) is type(c) for c in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def labels(name: str, value, n: int, num_classes: int | None = None) -> Tensor:
    """Class labels: an int64 ``Tensor[n]``; on the CPU, also values in ``[0, num_classes)``.

    The range is not checked for GPU tensors (reading their values would synchronise the
    device on every step and break ``torch.compile`` graphs); there an out-of-range label
    fails inside the loss with PyTorch's own device-side error, or, in a fused margin head's
    kernels, makes the loss NaN.
    """
    if not isinstance(value, Tensor) or value.dtype != torch.int64:
        raise ValueError(f"{name} must be an int64 (long) tensor, got {getattr(value, 'dtype', type(value).__name__)}")
    if value.shape != (n,):
        raise ValueError(f"{name} must be Tensor[{n}], got shape {tuple(value.shape)}")
    if num_classes is not None and n and values_readable(value):
        low, high = int(value.min()), int(value.max())
        if low < 0 or high >= num_classes:
            raise ValueError(f"{name} must lie in [0, {num_classes}), got range [{low}, {high}]")
    return value


def values_readable(t: Tensor) -> bool:
    """Whether a value check may read ``t``: a CPU tensor, eagerly, outside :func:`sphereml.launches.no_host_sync`
    (which runs code as it would run on a GPU, where reading a value synchronises the device) and outside
    ``torch.func`` transforms (``vmap`` over several seeds, :mod:`sphereml.multiseed`, cannot read a value)."""
    return (t.device.type == "cpu" and not torch.compiler.is_compiling() and not launches.checking_host_reads()
            and not is_functorch_wrapped_tensor(t))


def layers_with_neurons(owner: str, layers: Iterable) -> list:
    """``layers`` as a list, if it holds at least one module and each has a ``weight`` of two or more dimensions
    (its neurons are the rows of the weight flattened to ``(out, fan_in)``); ``owner`` names the caller."""
    layers = list(layers)
    if not layers:
        raise ValueError(f"{owner} needs at least one layer")
    for layer in layers:
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() < 2:
            raise ValueError(f"{owner} needs layers with a weight of two or more dimensions, got {layer!r}")
    return layers
