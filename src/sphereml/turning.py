"""How far neurons turn: the angle between each neuron and its own direction at a reference time.

Under BatchNorm a layer ignores the scale of its weights, so what an optimiser step changes is its neurons'
directions, and the angle they turn in a step is the layer's effective learning rate.  Unlike a gradient norm or a
learning rate, it compares across parametrisations: a plain weight, OPT's learnt rotation of fixed neurons, a
weight held at its length (chapters 7 and 9 start their arms at matched turning rates and print them).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from ._checks import layers_with_neurons
from .geometry import normalize
from .train import Tracker

__all__ = ["neuron_directions", "mean_turn", "TurnTracker"]


def _weights(layers: Iterable[nn.Module]) -> list[Tensor]:
    """Each layer's neurons as rows, ``(out, fan_in)``, detached; a named error where a layer has none."""
    return [layer.weight.detach().flatten(1) for layer in layers_with_neurons("turning", layers)]


def neuron_directions(layers: Iterable[nn.Module]) -> list[Tensor]:
    """Each layer's neurons (its weight's rows, flattened to ``(out, fan_in)``) as unit vectors: a copy, one tensor
    per layer."""
    return [normalize(weight).clone() for weight in _weights(layers)]


def mean_turn(layers: Iterable[nn.Module], start: list[Tensor]) -> float:
    """The mean over every neuron of ``layers`` of the angle, in degrees, between it and its direction in ``start``
    (:func:`neuron_directions` of the same layers, earlier).  Reads the result on the host: for monitoring, not for a
    training step."""
    weights = _weights(layers)
    if len(start) != len(weights) or any(s.shape != w.shape for s, w in zip(start, weights)):
        raise ValueError("start must hold neuron_directions of the same layers "
                         f"({[tuple(w.shape) for w in weights]}), got {[tuple(s.shape) for s in start]}")
    # 2 asin(|u - v| / 2), the angle between unit vectors u and v: exact for small turns, where acos(u.v) loses
    # half its digits (a cosine of 1 - 1e-8 is 1 in float32)
    chords = torch.cat([(normalize(w) - s.to(w.device)).norm(dim=1) for w, s in zip(weights, start)])
    return float(torch.rad2deg(2 * torch.asin((chords / 2).clamp(max=1.0))).mean())


class TurnTracker(Tracker):
    """A :class:`~sphereml.train.Tracker` of how far ``layers``' neurons have turned since it was made
    (:func:`mean_turn`, degrees): it records after the first optimiser step, and every ``every`` steps if given.

    ``TurnTracker(layers).values[0]`` after training is the first step's turn, the effective learning rate the
    training started with."""

    def __init__(self, layers: Iterable[nn.Module], every: int | None = None):
        self.layers = list(layers)
        self.start = neuron_directions(self.layers)
        super().__init__(lambda state: mean_turn(self.layers, self.start), sys.maxsize if every is None else every)
