"""Training aids for decoupled networks (thesis §4.4, App. C.7): weight projection, weighted gradients and
initialisation from a pretrained network.

The gradient of an unweighted operator with respect to a kernel is (eq. 4.17)

    d(w_hat . x_hat) / dw = (x_hat - cos(theta) w_hat) / ||w||,

perpendicular to w and shrinking as 1 / ||w||.  A step perpendicular to w can only lengthen it
(Pythagoras), so ||w|| grows through training and the effective learning rate decays.  Two remedies:

* weight projection, w <- s w_hat every few steps (§4.4.1, s = 1): valid because an unweighted
  operator ignores ||w||; a step of norm d then turns the kernel by the fixed angle arctan(d / s);
* weighted gradients, dL/dw multiplied by ||w|| (eq. 4.18): the update no longer depends on ||w||, and
  the angle a step turns, arctan(d / ||w||), adapts to the kernel's norm (App. C.7, Fig. C.5).

The third aid (§4.4.3) starts a decoupled network from a trained CNN of the same architecture.

For comparisons of the aids: :func:`scale_kernels` gives every variant the same starting norm (weighted
operators too), :func:`mean_kernel_norm` tracks the growth eq. 4.17 predicts, and :func:`radius_per_channel`
switches a network to the released code's radius (one per output channel).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
from torch import Tensor, nn

from .._checks import integer, one_of, real_number
from .decoupled import decoupled_layers
from ..train import StepState

__all__ = ["AIDS", "project_weights", "WeightProjection", "weighted_gradients", "training_aid", "training_aids",
           "init_from_pretrained",
           "scale_kernels", "mean_kernel_norm", "radius_per_channel"]

AIDS = ("standard", "projection", "weighted")  # training_aid: plain gradients, §4.4.1, eq. 4.18


def _decoupled(model: nn.Module, what: str) -> list[nn.Module]:
    layers = decoupled_layers(model)
    if not layers:
        raise ValueError(f"{what}: the model has no decoupled layer")
    return layers


def _unweighted_layers(model: nn.Module, what: str) -> list[nn.Module]:
    layers = _decoupled(model, what)
    weighted = [type(m).__name__ for m in layers if m.weighted]
    if weighted:
        raise ValueError(f"{what} changes the output of weighted operators ({', '.join(weighted)}); "
                         "use it with unweighted ones")
    return layers


@torch.no_grad()
def project_weights(model: nn.Module, scale: float = 1.0) -> int:
    """Weight projection (§4.4.1): w <- s w / ||w|| for every kernel of every decoupled layer.

    The output of an unweighted operator does not depend on ||w||, so the forward pass is unchanged;
    the projection only undoes the growth of ||w|| that shrinks the gradient (eq. 4.17).  Weighted
    operators raise a ``ValueError``.  Returns the number of layers projected.
    """
    scale = real_number("scale", scale, above=0.0)
    layers = _unweighted_layers(model, "weight projection")
    for layer in layers:
        _project(layer.weight, scale, layer.eps, lead=1)
    return len(layers)


def _project(w: Tensor, scale: float, eps: float, lead: int) -> None:
    """``w <- scale * w / ||w||`` in place, one norm per index of ``w``'s first ``lead`` dimensions."""
    norms = w.flatten(lead).norm(dim=lead).clamp_min(eps)
    w.mul_(scale / norms.view(*w.shape[:lead], *([1] * (w.dim() - lead))))


class WeightProjection:
    """A :func:`~sphereml.train.fit` callback: :func:`project_weights` every ``every`` optimiser steps.

    The thesis projects "every certain number of iterations" with s = 1 and gives no period;
    ``every=1`` (the default) projects after every step.  It also projects the stacked weights of
    :func:`~sphereml.multiseed.fit_seeds` (:meth:`stacked`): every seed at once, one operation per layer.
    """

    def __init__(self, every: int = 1, scale: float = 1.0):
        self.every = integer("every", every, at_least=1)
        self.scale = real_number("scale", scale, above=0.0)

    def __call__(self, state: StepState) -> None:
        if state.step % self.every == 0:
            project_weights(state.model, self.scale)

    def state_dict(self) -> dict:
        """Nothing: the callback keeps no state of its own between steps (a resumed chapter run restores the weights
        it acts on)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __eq__(self, other) -> bool:
        return type(other) is WeightProjection and (self.every, self.scale) == (other.every, other.scale)

    def __hash__(self) -> int:
        return hash((self.every, self.scale))

    @torch.no_grad()
    def stacked(self, step: int, model: nn.Module, params: dict[str, Tensor]) -> None:
        """:func:`project_weights` of every seed's kernels, ``params`` holding ``model``'s parameters stacked over
        the seeds along a first dimension (:func:`~sphereml.multiseed.stack_state`)."""
        if step % self.every:
            return
        layers = set(_unweighted_layers(model, "weight projection"))
        for name, layer in model.named_modules():
            if layer in layers:
                _project(params[f"{name}.weight"], self.scale, layer.eps, lead=2)


def weighted_gradients(model: nn.Module) -> list:
    """Weighted gradients (eq. 4.18): each kernel's gradient is multiplied by its own ||w||.

    For an unweighted operator dL/dw = (dL/d(w_hat)) / ||w|| (eq. 4.17), so the product does not depend on
    ||w||: the update no longer shrinks as the kernel grows.  Registers a gradient hook on the weight of
    every decoupled layer (unweighted ones only) and returns the hook handles (``handle.remove()`` undoes it).
    """
    handles = []
    for layer in _unweighted_layers(model, "weighted gradients"):
        weight = layer.weight

        def hook(grad: Tensor, weight: Tensor = weight) -> Tensor:
            scale = weight.detach().flatten(1).norm(dim=1).view(-1, *([1] * (grad.dim() - 1)))
            return grad * scale

        handles.append(weight.register_hook(hook))
    return handles


@contextmanager
def training_aid(model: nn.Module, aid: str = "projection", every: int = 1):
    """Train ``model`` with one of the aids of §4.4 inside the block; yields the :func:`~sphereml.train.fit`
    callbacks it needs (a list to extend).

    ``"projection"``: the kernels projected to unit norm now and every ``every`` steps (:class:`WeightProjection`);
    ``"weighted"``: weighted gradients (eq. 4.18), the hooks removed when the block ends; ``"standard"``: nothing.
    A model without decoupled layers (the CNN baseline) trains with standard gradients whatever ``aid`` says.
    """
    one_of("aid", aid, AIDS)
    if not decoupled_layers(model):
        aid = "standard"
    handles = weighted_gradients(model) if aid == "weighted" else []
    if aid == "projection":
        project_weights(model)
    try:
        yield [WeightProjection(every)] if aid == "projection" else []
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def training_aids(models, aid: str = "projection", every: int = 1):
    """:func:`training_aid` for each of ``models`` (the seeds of one comparison): yields one list of callbacks per
    model, every hook removed at the end.  :func:`~sphereml.multiseed.fit_seeds` takes the projection's callbacks;
    the weighted gradients' hooks it refuses (its stacked copies of the weights would not carry them)."""
    with ExitStack() as aids:
        yield [aids.enter_context(training_aid(model, aid, every)) for model in models]


@torch.no_grad()
def init_from_pretrained(model: nn.Module, pretrained: nn.Module) -> list[str]:
    """Initialise ``model`` from a trained network of the same architecture (§4.4.3): copy every parameter
    and buffer whose name and shape match (conv kernels, BatchNorm, classifier); the decoupled layers'
    own state (rho, E{||x||}) keeps its value.  Returns the copied names; ``ValueError`` when none match."""
    source = pretrained.state_dict()
    target = model.state_dict()
    copied = [name for name, value in target.items() if name in source and source[name].shape == value.shape]
    if not copied:
        raise ValueError("no parameter of the pretrained network matches the model by name and shape")
    model.load_state_dict({name: source[name] for name in copied}, strict=False)
    return copied


@torch.no_grad()
def scale_kernels(model: nn.Module, norm: float = 1.0) -> nn.Module:
    """Before training: every kernel of every decoupled layer scaled to ``||w|| = norm``, weighted operators too
    (whose output it changes, unlike :func:`project_weights`), so that variants start from the same norm.
    Returns ``model``."""
    norm = real_number("norm", norm, above=0.0)
    for layer in _decoupled(model, "scale_kernels"):
        w = layer.weight
        w.div_(w.flatten(1).norm(dim=1).clamp_min(layer.eps).div(norm).view(-1, *([1] * (w.dim() - 1))))
    return model


def mean_kernel_norm(model: nn.Module) -> float:
    """The mean over the decoupled layers of each layer's mean kernel norm ||w|| (host reads: not per step)."""
    layers = _decoupled(model, "mean_kernel_norm")
    layer_means = [float(m.weight.detach().flatten(1).norm(dim=1).mean()) for m in layers]
    return sum(layer_means) / len(layer_means)


@torch.no_grad()
def radius_per_channel(model: nn.Module) -> nn.Module:
    """The released code's radius (wy1iu/DCNets): one learned rho per output channel instead of one per layer.

    Every layer with a learned rho (``learnable_rho=True``) gets one raw parameter per output channel, each a
    copy of the layer's own, so the network computes the same function until they move apart; other layers
    are left alone.  Make the optimiser afterwards.  Returns ``model``."""
    layers = [m for m in _decoupled(model, "radius_per_channel") if getattr(m, "learnable_rho", False)]
    if not layers:
        raise ValueError("radius_per_channel: no decoupled layer learns its radius (learnable_rho=True)")
    for layer in layers:
        shape = (layer.weight.shape[0],) + (1,) * max(1, layer.weight.dim() - 2)  # conv (C, 1, 1), linear (C, 1)
        raw = layer.parametrizations.rho.original
        layer.parametrizations.rho.original = nn.Parameter(raw.detach().expand(shape).clone())
    return model
