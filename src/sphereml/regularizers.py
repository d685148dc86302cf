"""Weight regularisers added to a task loss: ``fit(..., regularizer=reg)`` calls ``reg(model)`` every step.

* :class:`Orthonormality` — ||W W^T - I||_F^2 per layer on the flattened kernels (thesis §3.2.4;
  the baseline of the MHE chapter and the "kernel orthogonality" of the convolutional-similarity paper).
* :class:`ConvSimilarity` — beta * sum over conv layers of L_CS (seed 004, Algorithm 2).
* :class:`MHE` — minimum hyperspherical energy on hidden and output layers (thesis eq. 5.4).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._checks import real_number
from .convsim import model_similarity
from .energy import METRICS, hyperspherical_energy
from .models import conv_weights

__all__ = ["orthonormality_penalty", "Orthonormality", "ConvSimilarity", "MHE"]


def _check_weight_factor(name: str, value: float) -> float:
    return real_number(name, value, at_least=0.0)


def orthonormality_penalty(weight: Tensor) -> Tensor:
    """||W W^T - I||_F^2 with one row per output unit (a conv kernel flattened over C x k x k).

    Zero exactly when the rows are orthonormal; needs at most as many rows as columns to
    be reachable (otherwise its minimum is positive).
    """
    if weight.dim() < 2:
        raise ValueError(f"weight must have an output axis and at least one input axis, got {tuple(weight.shape)}")
    rows = weight.flatten(1)  # (S, C*k*k)
    gram = rows @ rows.T
    return (gram - torch.eye(len(rows), dtype=gram.dtype, device=gram.device)).pow(2).sum()


class Orthonormality:
    """beta * sum over conv (and optionally linear) layers of :func:`orthonormality_penalty`."""

    def __init__(self, beta: float = 1e-3, include_linear: bool = False):
        self.beta = _check_weight_factor("beta", beta)
        self.include_linear = include_linear

    def __call__(self, model: nn.Module) -> Tensor:
        weights = conv_weights(model)
        if self.include_linear:
            weights += [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
        if not weights:
            raise ValueError("the model has no layer this regulariser applies to")
        return self.beta * sum(orthonormality_penalty(w) for w in weights)


class ConvSimilarity:
    """beta * sum over every conv layer of :func:`~sphereml.convsim.conv_similarity` (seed 004, Algorithm 2).

    Args:
        beta (float): weight of the penalty (the paper uses 1e-3). Default: 1e-3.
        mode, method, normalized: passed to :func:`~sphereml.convsim.conv_similarity`.
    """

    def __init__(self, beta: float = 1e-3, mode: str | int = "full", method: str = "auto", normalized: bool = False):
        self.beta = _check_weight_factor("beta", beta)
        self.mode, self.method, self.normalized = mode, method, normalized

    def loss(self, model: nn.Module) -> Tensor:
        """The unweighted sum of L_CS over the conv layers of ``model``."""
        return model_similarity(model, self.mode, self.method, self.normalized)

    def __call__(self, model: nn.Module) -> Tensor:
        return self.beta * self.loss(model)


def _output_module(model: nn.Module) -> nn.Module | None:
    head = getattr(model, "head", None)
    if head is not None and isinstance(getattr(head, "weight", None), Tensor):
        return head
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


class MHE:
    """Minimum hyperspherical energy regulariser (thesis eq. 5.4):

        lambda_hidden * sum_hidden E_s(layer) + lambda_output * E_s(classifier),

    each E_s the pair mean of :func:`~sphereml.energy.hyperspherical_energy` over the layer's
    neurons (a conv kernel flattened over C x k x k is one neuron).  Hidden layers are every
    conv and linear layer except the output layer, which is ``model.head`` when it has a
    ``weight`` (a :class:`~sphereml.models.Classifier`), else the last ``nn.Linear``.  The output
    layer always uses the full-space energy (§5.3.4); ``half_space`` applies to hidden layers.

    Args:
        model (nn.Module): the network; its layers are found once, here.
        s, metric, backend: passed to :func:`~sphereml.energy.hyperspherical_energy`.
        half_space (bool): half-space MHE in hidden layers. Default: False.
        lambda_hidden, lambda_output (float): weights (the thesis's defaults: 10 for full-space and
            1 for half-space hidden MHE, 1 for the output layer; App. D.1). Default: 1 and 1.
    """

    def __init__(self, model: nn.Module, s: float = 2.0, half_space: bool = False, metric: str = "euclidean",
                 lambda_hidden: float = 1.0, lambda_output: float = 1.0, backend: str = "auto"):
        self.lambda_hidden = _check_weight_factor("lambda_hidden", lambda_hidden)
        self.lambda_output = _check_weight_factor("lambda_output", lambda_output)
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        self.s = real_number("s", s, at_least=0.0)
        self.half_space, self.metric, self.backend = half_space, metric, backend
        output = _output_module(model)
        self.hidden = [m for m in model.modules()
                       if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)) and m is not output
                       and m.weight.shape[0] >= 2]
        use_output = output is not None and self.lambda_output > 0 and output.weight.shape[0] >= 2
        self.output = output if use_output else None
        if not self.hidden and self.output is None:
            raise ValueError("the model has no layer with at least 2 neurons to regularise")

    def _energy(self, layer: nn.Module, half_space: bool) -> Tensor:
        return hyperspherical_energy(layer.weight, self.s, self.metric, half_space, backend=self.backend)

    def energies(self) -> dict[str, Tensor]:
        """The hidden-layer energies (list order = module order) and the output energy."""
        out = {"hidden": [self._energy(m, self.half_space) for m in self.hidden]}
        if self.output is not None:
            out["output"] = self._energy(self.output, False)  # classifier neurons: full space (§5.3.4)
        return out

    def __call__(self, model: nn.Module | None = None) -> Tensor:
        total = torch.zeros(())
        if self.lambda_hidden > 0:
            total = total + self.lambda_hidden * sum(self._energy(m, self.half_space) for m in self.hidden)
        if self.output is not None:
            total = total + self.lambda_output * self._energy(self.output, False)
        return total
