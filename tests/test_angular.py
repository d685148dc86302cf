"""Angular activations g(theta) (thesis eqs. 3.2-3.4): forms, limits, the derivative erratum, fused nodes."""

import math

import pytest
import torch

from sphereml.angular import ANGULAR, angular_activation, angular_function, check_angular, stable_arccos

ANGULAR_CASES = [("linear", 0.5), ("cosine", 0.5), ("sigmoid", 0.3), ("sigmoid", 2.0)]


def _printed_sigmoid(theta, k):
    """Eq. 3.4 exactly as printed (ratio of exponentials); fine in float64 for moderate k."""
    a = math.exp(-math.pi / (2 * k))
    e = torch.exp(theta / k - math.pi / (2 * k))
    return (1 + a) / (1 - a) * (1 - e) / (1 + e)


def test_linear_form_and_range():
    theta = torch.linspace(0, math.pi, 101, dtype=torch.float64)
    torch.testing.assert_close(angular_activation(torch.cos(theta), "linear"), 1 - 2 * theta / math.pi,
                               atol=1e-7, rtol=0)  # exact up to arccos's own conditioning at the poles
    assert float(angular_activation(torch.ones(1), "linear")) == 1.0
    for angular, k in ANGULAR_CASES:
        g = angular_function(theta, angular, k)
        assert abs(float(g[0]) - 1) < 1e-12 and abs(float(g[50])) < 1e-12 and abs(float(g[-1]) + 1) < 1e-12
        assert bool((g[1:] <= g[:-1]).all())  # monotone decreasing
        torch.testing.assert_close(angular_function(math.pi - theta, angular, k), -g)


@pytest.mark.parametrize("k", [0.1, 0.3, 0.5, 0.7, 5.0, 50.0])
def test_tanh_form_equals_printed_sigmoid(k):
    theta = torch.linspace(0, math.pi, 201, dtype=torch.float64)
    torch.testing.assert_close(angular_function(theta, "sigmoid", k), _printed_sigmoid(theta, k),
                               atol=1e-13, rtol=0)


def test_sigmoid_limits_linear_and_step():
    theta = torch.linspace(0, math.pi, 401, dtype=torch.float64)
    linear = angular_function(theta, "linear")
    gaps = [float((angular_function(theta, "sigmoid", k) - linear).abs().max()) for k in (0.7, 5.0, 50.0)]
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-4
    away = (theta - math.pi / 2).abs() > 0.05
    step = torch.sign(math.pi / 2 - theta)
    tiny_k = angular_function(theta, "sigmoid", 1e-3)
    assert torch.isfinite(tiny_k).all()  # the printed form would need exp(pi / 0.002)
    torch.testing.assert_close(tiny_k[away], step[away])


@pytest.mark.parametrize("k", [0.1, 0.3, 0.7])
def test_sigmoid_derivative_erratum(k):
    """Autograd equals -(1/2k) sech^2((pi/2 - theta)/2k) / tanh(pi/4k); the printed eq. 3.6 factor lacks
    coth(pi/4k)."""
    theta = torch.linspace(0.1, 3.0, 30, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(angular_function(theta, "sigmoid", k).sum(), theta)
    t = theta.detach()
    corrected = -(1 / (2 * k)) / torch.cosh((math.pi / 2 - t) / (2 * k)) ** 2 / math.tanh(math.pi / (4 * k))
    e = torch.exp(t / k - math.pi / (2 * k))
    printed = -2 * e / (k * (1 + e) ** 2)
    torch.testing.assert_close(grad, corrected)
    torch.testing.assert_close(grad / printed, torch.full_like(t, 1 / math.tanh(math.pi / (4 * k))))


@pytest.mark.parametrize("angular,k", ANGULAR_CASES)
def test_fused_activation_equals_autograd_path(angular, k):
    """The fused nodes (number k, tensor k) equal plain autograd through angular_function(stable_arccos)."""
    cos = torch.cat([torch.rand(20, dtype=torch.float64) * 2 - 1, torch.linspace(-1, 1, 41, dtype=torch.float64)])
    weights = torch.randn_like(cos)
    results = []
    k_tensor = torch.tensor(k, dtype=torch.float64)
    reference = lambda c_, a_, k_: angular_function(stable_arccos(c_), a_, k_)  # noqa: E731
    for kk, fn in ((k, angular_activation), (k_tensor, angular_activation), (k_tensor, reference)):
        c = cos.clone().requires_grad_(True)
        out = fn(c, angular, kk)
        (grad,) = torch.autograd.grad((out * weights).sum(), c)
        results.append((out, grad))
    interior = cos.abs() < 1  # at c = +-1 the gradients are floored differently (all finite)
    for other in results[:2]:
        torch.testing.assert_close(other[0], results[2][0])
        torch.testing.assert_close(other[1][interior], results[2][1][interior])
    assert torch.isfinite(results[0][1]).all()  # c = +-1: both floored, finite
    c = cos.clone().requires_grad_(True)
    out = angular_activation(c * 1.0, angular, k)  # (a non-leaf, so cosine may be modified in place too)
    out.relu_()  # a following in-place activation must not corrupt the backward pass
    (grad,) = torch.autograd.grad((out * weights).sum(), c)
    torch.testing.assert_close(grad, results[0][1] * (results[0][0] > 0))
    interior = cos[:20].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda c: angular_activation(c, angular, k), (interior,))


def test_per_channel_k_gradient_gradcheck():
    cos = (torch.rand(3, 4, 5, 5, dtype=torch.float64) * 1.8 - 0.9).requires_grad_(True)
    k = (torch.rand(4, 1, 1, dtype=torch.float64) + 0.1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda c, kk: angular_activation(c, "sigmoid", kk), (cos, k))


def test_stable_arccos_is_exact_with_finite_gradient_at_the_poles():
    c = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0], dtype=torch.float64, requires_grad=True)
    theta = stable_arccos(c)
    torch.testing.assert_close(theta, torch.arccos(c.detach()))
    theta.sum().backward()
    assert torch.isfinite(c.grad).all()
    torch.testing.assert_close(c.grad[1:4], -1 / torch.sqrt(1 - c.detach()[1:4] ** 2))


def test_bad_arguments():
    assert check_angular("cosine") == "cosine" and ANGULAR == ("linear", "cosine", "sigmoid")
    with pytest.raises(ValueError, match="angular must be one of"):
        check_angular("tanh")
    with pytest.raises(ValueError, match="angular must be one of"):
        angular_activation(torch.zeros(3), "arc")
    with pytest.raises(ValueError, match="k must be a finite number > 0"):
        angular_function(torch.zeros(3), "sigmoid", -1.0)
    with pytest.raises(ValueError, match="k must be a finite number > 0"):
        angular_activation(torch.zeros(3), "sigmoid", 0.0)
