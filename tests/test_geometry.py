import math

import pytest
import torch

from sphereml.geometry import (angle_matrix, cosine_matrix, min_pair_angle, most_collinear_pair, normalize,
                               pair_angles, pair_cosines, safe_angle, sample_sphere)
from sphereml.heads.targets import arcface_psi, chebyshev_cos, integer_margin, multiplicative_psi, psi

GRID = torch.linspace(0, math.pi, 100_001, dtype=torch.float64)


def test_normalize_unit_rows_and_zero_vector():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1e-30, 0.0]])
    y = normalize(x)
    assert torch.allclose(y[0], torch.tensor([0.6, 0.8]))
    assert torch.equal(y[1], torch.zeros(2))
    assert torch.isfinite(y).all()


def test_normalize_zero_vector_has_finite_gradient():
    x = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    normalize(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_normalize_gradcheck():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(normalize, (x,))


def test_cosine_matrix_matches_definition_and_is_scale_invariant():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(4, 5, generator=g, dtype=torch.float64)
    expected = torch.stack([torch.stack([(ai @ bj) / (ai.norm() * bj.norm()) for bj in b]) for ai in a])
    assert torch.allclose(cosine_matrix(a, b), expected)
    scale = torch.rand(6, 1, generator=g, dtype=torch.float64) * 10 + 0.1
    assert torch.allclose(cosine_matrix(a * scale, b * 3.0), expected)
    self_cos = cosine_matrix(a)
    assert torch.allclose(self_cos.diagonal(), torch.ones(6, dtype=torch.float64))
    assert torch.allclose(self_cos, self_cos.T)


def test_cosine_matrix_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"Tensor\[N, d\]"):
        cosine_matrix(torch.randn(3))
    with pytest.raises(ValueError, match=r"Tensor\[M, 4\]"):
        cosine_matrix(torch.randn(3, 4), torch.randn(3, 5))


@pytest.mark.parametrize("c", [1.0, -1.0, 1.0 + 1e-6, -1.0 - 1e-6, 0.0])
def test_safe_angle_finite_gradient_at_poles(c):
    cos = torch.tensor([c], dtype=torch.float64, requires_grad=True)
    theta = safe_angle(cos)
    theta.sum().backward()
    assert torch.isfinite(theta).all() and torch.isfinite(cos.grad).all()
    assert 0.0 <= float(theta.detach()) <= math.pi


def test_safe_angle_accuracy_away_from_poles_and_near_them():
    cos = torch.linspace(-0.999, 0.999, 101, dtype=torch.float64)
    assert torch.allclose(safe_angle(cos), torch.arccos(cos), atol=1e-12)
    assert abs(float(safe_angle(torch.tensor(1.0, dtype=torch.float64)))) <= math.sqrt(2e-7) * (1 + 1e-6)


def test_angle_matrix_of_identical_and_opposite_vectors_has_finite_gradient():
    a = torch.tensor([[1.0, 2.0], [-1.0, -2.0], [0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    theta = angle_matrix(a)
    theta.sum().backward()
    assert torch.isfinite(a.grad).all()
    theta = theta.detach()
    assert float(theta[0, 1]) == pytest.approx(math.pi, abs=1e-3)
    assert float(theta[0, 2]) == pytest.approx(math.pi / 2)  # a zero vector is orthogonal to everything


def test_bad_eps():
    with pytest.raises(ValueError, match="eps must be > 0"):
        normalize(torch.ones(2), eps=0.0)
    with pytest.raises(ValueError, match=r"eps must be in \(0, 1\)"):
        safe_angle(torch.ones(2), eps=1.5)


def test_sample_sphere_unit_norm_and_uniform_moments():
    g = torch.Generator().manual_seed(1)
    n, d = 20000, 5
    x = sample_sphere(n, d, generator=g, dtype=torch.float64)
    assert x.shape == (n, d)
    assert torch.allclose(x.norm(dim=1), torch.ones(n, dtype=torch.float64))
    # uniform on S^{d-1}: E[x] = 0 and E[x x^T] = I/d.  Each entry of the sample mean has
    # std 1/sqrt(n d) ~ 3.2e-3; 6 sigma bounds give a false-failure probability < 1e-8.
    assert x.mean(0).abs().max() < 6 / math.sqrt(n * d)
    second = x.T @ x / n
    assert torch.allclose(second, torch.eye(d, dtype=torch.float64) / d, atol=0.01)


def test_sample_sphere_is_reproducible_and_validates():
    a = sample_sphere(4, 3, generator=torch.Generator().manual_seed(7))
    b = sample_sphere(4, 3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    assert sample_sphere(0, 3).shape == (0, 3)
    with pytest.raises(ValueError, match="d must be an integer >= 1"):
        sample_sphere(3, 0)
    with pytest.raises(ValueError, match="n must be an integer >= 0"):
        sample_sphere(-1, 3)


# ---------------------------------------------------------------- psi and Chebyshev (reference §1.6 items 1-3)

@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
def test_psi_shape_invariants(m):
    values = psi(GRID, m)
    assert float(values[0]) == pytest.approx(1.0)
    assert float(values[-1]) == pytest.approx(1 - 2 * m)
    assert bool((values.diff() <= 1e-12).all()), "psi must be non-increasing"
    assert float(values.diff().abs().max()) < 1e-3, "psi must be continuous (no jumps on a fine grid)"
    assert bool((values <= torch.cos(GRID) + 1e-12).all()), "psi must lie below cos"
    if m == 1:
        torch.testing.assert_close(values, torch.cos(GRID))


@pytest.mark.parametrize("m", [2, 3, 4])
def test_psi_derivative_vanishes_at_branch_points(m):
    theta = torch.tensor([k * math.pi / m for k in range(m + 1)], dtype=torch.float64)
    eps = 1e-6
    inside = theta.clamp(eps, math.pi - eps)
    slope = (psi(inside + eps, m) - psi(inside - eps, m)) / (2 * eps)
    assert float(slope.abs().max()) < 1e-4
    mid = torch.tensor([(k + 0.5) * math.pi / m for k in range(m)], dtype=torch.float64)
    assert bool(((psi(mid + eps, m) - psi(mid - eps, m)) < 0).all())


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
def test_chebyshev_equals_cos_m_theta(m):
    err = (chebyshev_cos(torch.cos(GRID), m) - torch.cos(m * GRID)).abs().max()
    assert float(err) < 1e-13


def test_chebyshev_matches_binomial_expansion():
    c = torch.cos(GRID[::97])
    for m in (2, 3, 4, 6):
        binomial = sum((-1) ** n * math.comb(m, 2 * n) * c ** (m - 2 * n) * (1 - c * c) ** n for n in range(m // 2 + 1))
        torch.testing.assert_close(chebyshev_cos(c, m), binomial)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_multiplicative_psi_from_cos_equals_psi_from_angle(m):
    theta = GRID[1:-1:101]
    torch.testing.assert_close(multiplicative_psi(torch.cos(theta), m), psi(theta, m))


def test_real_m_psi_is_continuous_and_monotone():
    values = psi(GRID, 1.5)
    assert bool((values.diff() <= 1e-12).all()) and float(values.diff().abs().max()) < 1e-3
    assert float(values[0]) == 1.0


def test_arcface_psi_monotone_continuous_and_below_cos():
    c = torch.cos(GRID)
    for m in (0.1, 0.5, 1.0):
        values = arcface_psi(c, m)
        assert bool((values.diff() <= 1e-12).all())
        assert float(values.diff().abs().max()) < 1e-3
        assert bool((values <= c + 1e-12).all())
        safe = (GRID <= math.pi - m - 1e-6) & (GRID >= 2e-3)  # sin(theta) is floored at 1e-3
        torch.testing.assert_close(values[safe], torch.cos(GRID[safe] + m))
    # the naive cos(theta + m) is not monotone on [0, pi]: the reason for the tail
    assert bool((torch.cos(GRID + 0.5).diff() > 0).any())


@pytest.mark.parametrize("m,message", [(0, "m must be an integer >= 1"), (1.5, "multiple-angle formula"),
                                       (True, "multiple-angle formula"), ("2", "multiple-angle formula")])
def test_integer_margin_refuses_non_integers(m, message):
    with pytest.raises(ValueError, match=message):
        integer_margin(m)
    assert integer_margin(3.0) == 3



def test_pair_cosines_list_each_unordered_pair_once():
    w = torch.randn(5, 2, 3, dtype=torch.float64)
    unit = torch.nn.functional.normalize(w.flatten(1), dim=1)
    expected = [float(unit[i] @ unit[j]) for i in range(5) for j in range(i + 1, 5)]
    assert pair_cosines(w).tolist() == pytest.approx(expected, abs=1e-12)


def test_pair_angles_of_lines_identify_a_neuron_with_its_negative():
    w = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    angles = pair_angles(w)
    assert angles.tolist() == pytest.approx([math.pi, math.pi / 4, 3 * math.pi / 4], abs=1e-3)
    lines = pair_angles(w, lines=True)
    assert lines.tolist() == pytest.approx([0.0, math.pi / 4, math.pi / 4], abs=1e-3)
    assert float(min_pair_angle(w)) == pytest.approx(math.pi / 4)
    assert float(min_pair_angle(w, lines=True)) == pytest.approx(0.0, abs=1e-3)
    assert float(min_pair_angle(torch.eye(4))) == pytest.approx(math.pi / 2)


def test_min_pair_angle_has_finite_gradients_on_duplicate_neurons():
    w = torch.ones(3, 4, dtype=torch.float64, requires_grad=True)
    min_pair_angle(w, lines=True).backward()
    assert torch.isfinite(w.grad).all()


def test_pair_angles_refuse_a_single_neuron():
    with pytest.raises(ValueError, match="N >= 2"):
        pair_cosines(torch.randn(1, 3))


def test_most_collinear_pair_names_the_layer_and_keeps_the_sign():
    g = torch.Generator().manual_seed(3)
    loose = torch.eye(4, dtype=torch.float64)  # orthogonal neurons: cosines 0
    tight = torch.randn(5, 2, 3, generator=g, dtype=torch.float64)
    tight[3] = -2.0 * tight[1] + 1e-3 * torch.randn(2, 3, generator=g, dtype=torch.float64)  # nearly opposite
    close = torch.eye(4, dtype=torch.float64)
    close[2] = close[0] + 0.05 * close[1]  # cosine +0.9988 with the first: the largest cosine, not the largest |cos|
    layer, cosine = most_collinear_pair([loose, close, tight, loose.neg()])
    assert layer == 2 and -1.0 < cosine < -0.9995
    assert cosine == pytest.approx(float(pair_cosines(tight).min()))
    assert most_collinear_pair([loose, close]) == (1, pytest.approx(float(pair_cosines(close).max())))
    with pytest.raises(ValueError, match="at least one layer"):
        most_collinear_pair([])
