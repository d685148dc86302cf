"""Constraints kept between optimiser steps: neurons held at their starting lengths.

A neuron's length and direction can be trained apart.  Rotation training (thesis App. E.2, chapter 7) keeps
every neuron's length by construction; :class:`HoldNorms` gives a network in its standard parametrisation the same
lengths, so that an experiment can tell what fixed lengths alone change.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ._checks import layers_with_neurons

__all__ = ["HoldNorms"]

_FLOOR = 1e-30  # the least current length divided by: a neuron of length 0 stays 0


class HoldNorms:
    """A training callback (``fit(..., callbacks=[HoldNorms(layers)])``) that after every optimiser step rescales
    each neuron — a row of a layer's weight flattened to ``(out, fan_in)`` — back to its length when the callback
    was made, so that training changes only the neurons' directions.

    The starting lengths are a non-persistent buffer ``held_length`` on each layer: they move with the network
    (``.to(device)``) and stay out of its ``state_dict``.

    Args:
        layers (iterable of nn.Module): modules with a ``weight`` of at least two dimensions.

    Raises:
        ValueError: no layers, or a layer without a weight of two or more dimensions.
    """

    def __init__(self, layers: Iterable[nn.Module]):
        self.layers = layers_with_neurons("HoldNorms", layers)
        for layer in self.layers:
            layer.register_buffer("held_length", self.lengths(layer), persistent=False)

    @staticmethod
    def lengths(layer: nn.Module) -> torch.Tensor:
        """The lengths of ``layer``'s neurons (Tensor[out])."""
        return torch.linalg.vector_norm(layer.weight.detach().flatten(1), dim=1)

    @torch.no_grad()
    def __call__(self, state=None) -> None:
        """Rescale every neuron to its held length (``state``: the step's, unused)."""
        for layer in self.layers:
            weight = layer.weight
            scale = layer.held_length / self.lengths(layer).clamp_min(_FLOOR)
            weight.mul_(scale.view(-1, *[1] * (weight.dim() - 1)))

    def state_dict(self) -> dict:
        """Nothing: the callback keeps no state of its own between steps (a resumed chapter run restores the weights
        it acts on)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
