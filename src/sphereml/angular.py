"""Angular activations g(theta): the functions of the angle that SphereConv (thesis Ch. 3), GA-Softmax
(eq. 3.11), the decoupled operators (Ch. 4) and sharpened cosine similarity apply to a cosine.

===========  ======================================================  =========
``angular``  g(theta)                                                thesis
===========  ======================================================  =========
linear       1 - 2 theta / pi                                         eq. 3.2
cosine       cos(theta)                                               eq. 3.3
sigmoid      tanh((pi/2 - theta) / (2k)) / tanh(pi / (4k)),  k > 0    eq. 3.4
sqcosine     sign(cos theta) cos^2 theta                              eq. 4.14
===========  ======================================================  =========

All four map [0, pi] onto [1, -1] with g(pi/2) = 0 and g(pi - theta) = -g(theta).  The first three
(:data:`ANGULAR`) are SphereConv's and GA-Softmax's; square cosine (the decoupled networks' eq. 4.14,
:data:`DECOUPLED_ANGULAR`) is computed as c * abs(c) from c = cos(theta): C^1, with slope 0 at pi/2.  The
sigmoid row is eq. 3.4 rewritten: the printed ratio of exponentials equals this tanh ratio
exactly, and the tanh form cannot overflow (the printed form needs exp(pi / 2k), which is
inf in float32 for k < 0.018).

Two entry points: :func:`angular_function` takes the angle (any real value, for g(m theta)),
:func:`angular_activation` takes the cosine, which is what a layer computes, and evaluates
linear and sigmoid g in one fused autograd node each.

Note [angle for linear and sigmoid]
    Linear and sigmoid g need theta = arccos(c), whose derivative -1 / sqrt(1 - c^2) is
    infinite at c = +-1 (a patch parallel to its kernel).  :func:`stable_arccos` keeps the exact
    value arccos(c) but floors 1 - c^2 at 1e-10 in the backward pass, so d theta / d c is
    at most 1e5 in magnitude (and it is multiplied by dc/dx, which vanishes there).  Clamping c away
    from +-1 instead (as :func:`~sphereml.geometry.safe_angle` does) would shift the output
    by up to sqrt(2 eps) radians at the poles.  Cosine g is computed from c directly and
    never touches arccos.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._autograd import Function
from ._checks import one_of, real_number

__all__ = ["ANGULAR", "DECOUPLED_ANGULAR", "check_angular", "check_k", "angular_function", "angular_activation",
           "stable_arccos", "inverse_sine"]

ANGULAR = ("linear", "cosine", "sigmoid")  # SphereConv (Ch. 3) and GA-Softmax
DECOUPLED_ANGULAR = ANGULAR + ("sqcosine",)  # the decoupled operators (Ch. 4, eqs. 4.11-4.14)
POLE_FLOOR = 1e-10  # floor on 1 - c^2 in d arccos / dc, Note [angle for linear and sigmoid]


def check_angular(angular: str, choices: tuple[str, ...] = ANGULAR) -> str:
    """``angular`` if it names one of ``choices`` (default :data:`ANGULAR`), else a ``ValueError``."""
    return one_of("angular", angular, choices)


def check_k(k) -> float | Tensor:
    """A positive sigmoid curvature.  A tensor (a learned per-filter k) passes unchecked: a value
    check would synchronise the device on every forward, and its parametrisation keeps it > 0."""
    if isinstance(k, Tensor):
        return k
    return real_number("k", k, above=0.0)


def angular_function(theta: Tensor, angular: str = "cosine", k: float | Tensor = 0.5) -> Tensor:
    """g(theta) of eqs. 3.2-3.4 and 4.14 evaluated at angles ``theta`` (any real values, for g(m theta) too).

    Args:
        theta (Tensor): angles; [0, pi] for the output range [-1, 1].
        angular (str): ``"linear"``, ``"cosine"``, ``"sigmoid"`` or ``"sqcosine"``.
        k (float or Tensor): sigmoid curvature > 0 (broadcast against ``theta``).

    Returns:
        Tensor shaped like ``theta`` (broadcast with ``k``).
    """
    angular = check_angular(angular, DECOUPLED_ANGULAR)
    if angular == "linear":
        return 1.0 - theta * (2.0 / math.pi)
    if angular == "cosine":
        return torch.cos(theta)
    if angular == "sqcosine":
        cos = torch.cos(theta)
        return torch.sign(cos) * cos.square()
    k = check_k(k)
    scale = math.tanh(math.pi / (4.0 * k)) if not isinstance(k, Tensor) else torch.tanh(math.pi / (4.0 * k))
    return torch.tanh((math.pi / 2.0 - theta) / (2.0 * k)) / scale


def inverse_sine(cos: Tensor) -> Tensor:
    """1 / sin(theta) = 1 / sqrt(1 - c^2) with 1 - c^2 floored at ``POLE_FLOOR`` (a new tensor).

    See Note [angle for linear and sigmoid].
    """
    return (cos * cos).neg_().add_(1.0).clamp_min_(POLE_FLOOR).rsqrt_()


class _Arccos(Function):
    """arccos(c) on [-1, 1] with the derivative floored at the poles: Note [angle for linear and sigmoid]."""

    generate_vmap_rule = True  # several seeds at once (sphereml.multiseed)

    @staticmethod
    def forward(cos: Tensor) -> Tensor:
        return torch.arccos(cos.clamp(-1.0, 1.0))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])  # inverse_sine floors 1 - c^2 beyond the poles as at them: no clamp

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (cos,) = ctx.saved_tensors
        return inverse_sine(cos).mul_(grad).neg_()


def stable_arccos(cos: Tensor) -> Tensor:
    """theta = arccos(c), exact on [-1, 1] (c clamped), with a finite gradient at c = +-1.

    See Note [angle for linear and sigmoid].
    """
    return _Arccos.apply(cos)


class _LinearFromCos(Function):
    """Linear g(arccos(c)) = 1 - 2 arccos(c) / pi in one autograd node: dg/dc = (2 / pi) / sin(theta).

    One node instead of a chain of autograd nodes: from about 1.6x to 1.35-1.45x of
    ``nn.Conv2d`` forward + backward at 64 channels, 32x32, batch 32 on our 2-core CPU
    (``benchmarks/bench_sphereconv.py``).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(cos: Tensor) -> Tensor:
        return 1.0 - torch.arccos(cos.clamp(-1.0, 1.0)) * (2.0 / math.pi)  # out of place: see _DivideByPatchNorm

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (cos,) = ctx.saved_tensors
        return inverse_sine(cos).mul_(grad).mul_(2.0 / math.pi)


class _SigmoidFromCos(Function):
    """Sigmoid g(arccos(c)) = tanh(u) / T in one autograd node, u = (pi/2 - theta) / 2k, T = tanh(pi / 4k).

    k is a number or a tensor broadcast against c (a number stays on the host: no copy to the device per
    call).  With sech^2 = 1 - tanh^2 from the saved tanh(u),

        dg/dc = sech^2(u) / (2k T sin(theta)),
        dg/dk = -sech^2(u) u / (k T) + tanh(u) (1 - T^2) pi / (4 k^2 T^2)   (summed over the broadcast axes).

    u is saved only when k is a tensor (which may need a gradient).  Against autograd through
    :func:`angular_function`: 1.6x -> 1.35-1.55x of ``nn.Conv2d`` for a fixed k, 1.8-2.0x -> about 1.6x for
    a learned one (``benchmarks/bench_sphereconv.py``).  The output itself is not saved: a following in-place
    ReLU may modify it.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(cos: Tensor, k: Tensor | float) -> tuple[Tensor, ...]:
        """(g, tanh(u)) for a number k; (g, tanh(u), u, T) for a tensor k, whose gradient needs u."""
        u = torch.arccos(cos.clamp(-1.0, 1.0)).sub_(math.pi / 2.0).neg_().div_(2.0 * k)  # (pi/2 - theta) / 2k
        if not isinstance(k, Tensor):
            th = u.tanh_()
            return th / math.tanh(math.pi / (4.0 * k)), th
        th, t = torch.tanh(u), torch.tanh(math.pi / (4.0 * k))
        return th / t, th, u, t

    @staticmethod
    def setup_context(ctx, inputs, output):
        cos, k = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        if isinstance(k, Tensor):
            _, th, u, t = output
            ctx.save_for_backward(cos, th, u, k, t)
        else:
            ctx.save_for_backward(cos, output[1], None)
            ctx.numbers = (k, math.tanh(math.pi / (4.0 * k)))

    @staticmethod
    def backward(ctx, grad: Tensor | None, *_):
        if grad is None:
            return None, None
        saved = ctx.saved_tensors
        cos, th, u, k, t = saved if len(saved) == 5 else (*saved, *ctx.numbers)
        sech2 = th.square().neg_().add_(1.0)
        grad_cos = grad_k = None
        if ctx.needs_input_grad[0]:
            grad_cos = inverse_sine(cos).mul_(sech2).mul_(grad).div_(2.0 * k * t)
        if ctx.needs_input_grad[1]:
            dg_dk = sech2.mul_(u).div_(-k * t).add_(th * ((1.0 - t * t) * math.pi / (4.0 * k * k * t * t)))
            grad_k = dg_dk.mul_(grad).sum_to_size(k.shape)
        return grad_cos, grad_k


def angular_activation(cos: Tensor, angular: str = "cosine", k: float | Tensor = 0.5) -> Tensor:
    """g(theta) from c = cos(theta); see Note [angle for linear and sigmoid].

    Args:
        cos (Tensor): cosines in [-1, 1].
        angular (str), k (float or Tensor): as in :func:`angular_function`; linear and sigmoid
            are one fused autograd node each (a tensor k, e.g. a learned one, gets its gradient too).

    Returns:
        Tensor shaped like ``cos`` with values in [-1, 1].
    """
    angular = check_angular(angular, DECOUPLED_ANGULAR)
    if angular == "cosine":
        return cos
    if angular == "sqcosine":
        return cos * cos.abs()
    if angular == "linear":
        return _LinearFromCos.apply(cos)
    k = check_k(k)
    return _SigmoidFromCos.apply(cos, k)[0]
