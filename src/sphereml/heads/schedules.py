"""The lambda schedule that phases a multiplicative margin in during training (thesis §2.2.7, App. A.7)."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import integer, real_number

__all__ = ["LambdaSchedule"]


class LambdaSchedule(nn.Module):
    """The annealing weight lambda(t) = max(lambda_min, base (1 + gamma t)^(-power)) (thesis §2.2.7, App. A.7).

    The annealed target logit is (lambda * softmax logit + margin logit) / (1 + lambda):
    a very large lambda is plain softmax, lambda = 0 the full margin.  The thesis gives
    only lambda_min = 5 for faces; the presets are the authors' released settings.

    The step counter ``t`` is a buffer, so it is saved in the owning head's ``state_dict``
    and a resumed run continues the schedule.  A head advances it by one on every
    training-mode call of ``loss`` (never in eval mode).  A Python copy of the counter is kept
    beside the buffer (and refreshed when a state dict is loaded), so reading lambda never
    copies the buffer back from a GPU: no device synchronisation per step.

    Args:
        base (float): lambda at t = 0. Default: 1000.
        gamma (float): time scale. Default: 0.12.
        power (float): decay exponent. Default: 1.
        lambda_min (float): floor. Default: 0.
    """

    def __init__(self, base: float = 1000.0, gamma: float = 0.12, power: float = 1.0, lambda_min: float = 0.0):
        super().__init__()
        self.base, self.gamma, self.power, self.lambda_min = (
            real_number(name, value, at_least=0.0)
            for name, value in (("base", base), ("gamma", gamma), ("power", power), ("lambda_min", lambda_min)))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self._step = 0  # the buffer's value, on the host

    @classmethod
    def lsoftmax(cls) -> "LambdaSchedule":
        """The released L-Softmax MNIST example: base 1000, gamma 2.5e-5, power 35, lambda_min 0."""
        return cls(base=1000.0, gamma=2.5e-5, power=35.0, lambda_min=0.0)

    @classmethod
    def sphereface(cls) -> "LambdaSchedule":
        """The released SphereFace face model: base 1000, gamma 0.12, power 1, lambda_min 5."""
        return cls(base=1000.0, gamma=0.12, power=1.0, lambda_min=5.0)

    @classmethod
    def reaching(cls, lambda_min: float, steps: int, fraction: float = 0.4, base: float = 1000.0) -> "LambdaSchedule":
        """A power-1 schedule from ``base`` that reaches ``lambda_min`` after ``fraction * steps`` steps.

        The released schedules assume tens of thousands of iterations; this compresses the same
        shape into a short run.  A floor of 0 is treated as 1 for the timing (it is then approached
        like 1 / t).
        """
        integer("steps", steps, at_least=1)
        fraction = real_number("fraction", fraction, above=0.0)
        gamma = (base / max(lambda_min, 1.0) - 1.0) / max(fraction * steps, 1.0)
        return cls(base=base, gamma=max(gamma, 0.0), power=1.0, lambda_min=lambda_min)

    def value(self, step: int | None = None) -> float:
        """lambda at ``step`` (default: the current step)."""
        t = self._step if step is None else step
        return max(self.lambda_min, self.base * (1.0 + self.gamma * t) ** (-self.power))

    def advance(self) -> None:
        self.step += 1
        self._step += 1

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._step = int(self.step)

    def extra_repr(self) -> str:
        return (f"base={self.base}, gamma={self.gamma}, power={self.power}, lambda_min={self.lambda_min}, "
                f"step={self._step}")
