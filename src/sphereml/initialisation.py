"""Starting points of networks: He initialisation, the thesis's, and the start of Rohrer's SCS layer.

The thesis initialises its networks "following [38]", He et al. (2015), *Delving deep into rectifiers*
(§2.5, App. C.1.1, App. E.2.2, §7.4): every kernel drawn from a zero-mean Gaussian of variance
``2 / ((1 + a²) · fan_in)`` — ``a`` the negative slope of a (P)ReLU that follows, 0 for ReLU — and every bias
set to zero.  PyTorch's own default (uniform, variance ``1 / (3 · fan_in)``) starts each kernel about
``√6 ≈ 2.4`` times shorter; without BatchNorm a plain ReLU network then shrinks its signal by about that factor
per layer, and with BatchNorm the shorter kernels turn faster under the same learning rate.  A Gaussian kernel
also points in a direction uniform on the sphere, which a per-entry uniform draw does not.

Rohrer's May-2022 SCS layer, the one the SCS paper ran, starts its kernels from entries uniform in [-1, 1] (so
``‖k‖² ≈ d / 3`` for a kernel of ``d`` entries, against about ``1 / 3`` for PyTorch's default) and a learned
exponent ``p`` from uniform in [1, 3] (:func:`scs_upstream_init_`).  The layer ignores a kernel's length, but not
how far one optimiser step turns it, so the start sets how fast the kernel norms move.
"""

from __future__ import annotations

import torch
from torch import nn

from ._checks import real_number
from .layers.scs import SharpenedCosineSimilarity2d

__all__ = ["he_init_", "scs_upstream_init_"]


@torch.no_grad()
def he_init_(model: nn.Module, negative_slope: float = 0.0) -> nn.Module:
    """Redraw every kernel of ``model`` as He et al. (2015, eq. 10) prescribe: ``N(0, 2 / ((1 + a²) fan_in))``
    with ``a = negative_slope``, biases zero.

    A kernel is a module's own ``weight`` parameter with two or more dimensions (convolutions, linear layers,
    SphereConv, decoupled and SCS kernels, margin heads); normalisation layers and PReLU slopes keep theirs.
    Kernels are drawn from the global generator in module order, so two networks of the same shapes built
    after the same ``torch.manual_seed`` get the same kernels whatever their operators.  A weight under
    ``torch.nn.utils.parametrize`` is not a module's own parameter and is skipped: initialise before
    parametrising.  Returns ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"he_init_ needs an nn.Module, got {type(model).__name__}")
    slope = real_number("negative_slope", negative_slope, at_least=0.0)
    for module in model.modules():
        own = dict(module.named_parameters(recurse=False))
        if "weight" not in own or own["weight"].dim() < 2:
            continue
        nn.init.kaiming_normal_(own["weight"], a=slope, mode="fan_in", nonlinearity="leaky_relu")
        if "bias" in own:
            own["bias"].zero_()
    return model


@torch.no_grad()
def scs_upstream_init_(model: nn.Module) -> nn.Module:
    """Redraw every :class:`~sphereml.layers.scs.SharpenedCosineSimilarity2d` of ``model`` as Rohrer's May-2022
    layer starts: kernel entries uniform in [-1, 1] and, where ``p`` is learned, each kernel's ``p`` uniform in
    [1, 3] (``q`` keeps its value).  Other modules are left as they are; draws come from the global generator in
    module order.  Returns ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"scs_upstream_init_ needs an nn.Module, got {type(model).__name__}")
    for module in model.modules():
        if isinstance(module, SharpenedCosineSimilarity2d):
            nn.init.uniform_(module.weight, -1.0, 1.0)
            if module.learnable:
                module.p = torch.empty_like(module.p).uniform_(1.0, 3.0)
    return model
