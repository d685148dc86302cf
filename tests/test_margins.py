"""Large-margin heads and psi: invariants of reference §1.6 and §2.6, gradients, schedules, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

from sphereml.geometry import chebyshev_cos, normalize, psi
from sphereml.margins import (
    ArcFaceLoss,
    ASoftmaxLoss,
    CosFaceLoss,
    LambdaSchedule,
    LSoftmaxLoss,
    NormalizedSoftmaxLoss,
    arcface_psi,
    head_loss,
    multiplicative_psi,
)
from sphereml.models import MLP, Classifier
from sphereml.train import fit

D, C = 5, 4
GRID = torch.linspace(0, math.pi, 100_001, dtype=torch.float64)


def _batch(n=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g, dtype=dtype), torch.randint(C, (n,), generator=g)


def _all_heads():
    return [
        NormalizedSoftmaxLoss(D, C), NormalizedSoftmaxLoss(D, C, s=10.0),
        LSoftmaxLoss(D, C, m=3), ASoftmaxLoss(D, C, m=4), ASoftmaxLoss(D, C, m=1.5, s=8.0, detach_margin=True),
        CosFaceLoss(D, C, s=16.0), ArcFaceLoss(D, C, s=16.0),
    ]


# ---------------------------------------------------------------- psi and Chebyshev (§1.6 items 1-3)

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


# ---------------------------------------------------------------- heads: identities

def test_lsoftmax_m1_is_bias_free_softmax():
    x, y = _batch()
    head = LSoftmaxLoss(D, C, m=1).double()
    torch.testing.assert_close(head.margin_logits(x, y), x @ head.weight.T)
    torch.testing.assert_close(head.loss(x, y), F.cross_entropy(x @ head.weight.T, y))


def test_asoftmax_m1_is_modified_softmax():
    x, y = _batch()
    head = ASoftmaxLoss(D, C, m=1).double()
    modified = x.norm(dim=1, keepdim=True) * (normalize(x) @ normalize(head.weight).T)
    torch.testing.assert_close(head.margin_logits(x, y), modified)
    plain = NormalizedSoftmaxLoss(D, C).double()
    plain.weight.data.copy_(head.weight)
    torch.testing.assert_close(head.loss(x, y), plain.loss(x, y))


@pytest.mark.parametrize("m", [2, 3, 4])
def test_margin_loss_is_at_least_the_plain_loss(m):
    x, y = _batch(64, seed=m)
    lsoft = LSoftmaxLoss(D, C, m=m).double()
    assert lsoft.loss(x, y).item() >= F.cross_entropy(x @ lsoft.weight.T, y).item()
    asoft = ASoftmaxLoss(D, C, m=m).double()
    assert asoft.loss(x, y).item() >= F.cross_entropy(asoft.logits(x), y).item()


def test_additive_margins_raise_the_loss_and_vanish_at_zero():
    x, y = _batch()
    for cls in (CosFaceLoss, ArcFaceLoss):
        with_margin = cls(D, C, s=10.0).double()
        without = cls(D, C, s=10.0, m=0.0).double()
        without.weight.data.copy_(with_margin.weight)
        assert with_margin.loss(x, y).item() > without.loss(x, y).item()
        torch.testing.assert_close(without.margin_logits(x, y), without.logits(x))


def test_lambda_infinity_recovers_softmax():
    x, y = _batch()
    lsoft = LSoftmaxLoss(D, C, m=4, lambda_=math.inf).double()
    torch.testing.assert_close(lsoft.margin_logits(x, y), x @ lsoft.weight.T)
    asoft = ASoftmaxLoss(D, C, m=4, lambda_=1e12).double()
    torch.testing.assert_close(asoft.margin_logits(x, y), asoft.logits(x))


def test_annealed_target_lies_between_psi_and_cos():
    x, y = _batch(64)
    head = ASoftmaxLoss(D, C, m=3).double()
    cos = head.cosine(x).gather(1, y[:, None]).squeeze(1)
    scale = x.norm(dim=1)
    full = multiplicative_psi(cos, 3) * scale
    for lam in (0.5, 5.0, 50.0):
        head.lambda_ = lam
        target = head.margin_logits(x, y).gather(1, y[:, None]).squeeze(1)
        assert bool((target <= cos * scale + 1e-12).all()) and bool((target >= full - 1e-12).all())


def test_only_the_target_logit_changes():
    x, y = _batch()
    for head in _all_heads():
        head = head.double()
        diff = head.margin_logits(x, y) != head.logits(x)
        assert not bool(diff[F.one_hot(y, C).bool().logical_not()].any()), type(head).__name__


def test_normalised_heads_ignore_weight_scale_and_predict_by_angle():
    x, y = _batch()
    for head in (ASoftmaxLoss(D, C), CosFaceLoss(D, C), NormalizedSoftmaxLoss(D, C)):
        head = head.double()
        before = head.margin_logits(x, y)
        head.weight.data *= torch.rand(C, 1, dtype=torch.float64) * 5 + 0.1
        torch.testing.assert_close(head.margin_logits(x, y), before)
        assert torch.equal(head.logits(x).argmax(1), head.cosine(x).argmax(1))


# ---------------------------------------------------------------- gradients

@pytest.mark.parametrize("make", [
    lambda: LSoftmaxLoss(D, C, m=2), lambda: LSoftmaxLoss(D, C, m=4, lambda_=3.0),
    lambda: ASoftmaxLoss(D, C, m=4), lambda: ASoftmaxLoss(D, C, m=3, s=4.0, lambda_=2.0),
    lambda: CosFaceLoss(D, C, s=4.0), lambda: ArcFaceLoss(D, C, s=4.0, m=0.3),
    lambda: NormalizedSoftmaxLoss(D, C, s=3.0),
])
def test_gradcheck_float64(make):
    """Exact gradients w.r.t. features and weights at random points (away from branch points a.s.)."""
    wrapper = _LossOf(make().double())
    x, y = _batch(6, seed=3)
    w = wrapper.head.weight.detach().clone()

    def loss(x_, w_):
        return torch.func.functional_call(wrapper, {"head.weight": w_}, (x_, y))

    assert torch.autograd.gradcheck(loss, (x.requires_grad_(True), w.requires_grad_(True)), eps=1e-6, atol=1e-5)


class _LossOf(torch.nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x, y):
        return self.head.loss(x, y)


def _grads_at(head, x, y):
    x = x.clone().requires_grad_(True)
    head.zero_grad()
    head.loss(x, y).backward()
    return x.grad, head.weight.grad


@pytest.mark.parametrize("head", _all_heads(), ids=lambda h: type(h).__name__)
def test_finite_gradients_at_degenerate_points(head):
    head = head.double()
    w = head.weight.detach()
    y = torch.tensor([0, 1, 2, 3])
    # features exactly along (cos = 1) and against (cos = -1) their class weight, and zero
    for x in (w[y].clone(), -w[y].clone(), torch.zeros(4, D, dtype=torch.float64)):
        gx, gw = _grads_at(head, x, y)
        assert bool(torch.isfinite(gx).all()) and bool(torch.isfinite(gw).all()), type(head).__name__


@pytest.mark.parametrize("m", [2, 3, 4])
def test_finite_gradients_at_branch_points(m):
    head = ASoftmaxLoss(2, 2, m=m).double()
    head.weight.data = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    for k in range(1, m):
        angle = k * math.pi / m
        x = torch.tensor([[math.cos(angle), math.sin(angle)]], dtype=torch.float64)
        gx, gw = _grads_at(head, x, torch.tensor([0]))
        assert bool(torch.isfinite(gx).all()) and bool(torch.isfinite(gw).all())


def test_detached_margin_has_the_gradient_of_plain_cosine():
    x, y = _batch()
    detached = ASoftmaxLoss(D, C, m=2, s=5.0, detach_margin=True).double()
    exact = ASoftmaxLoss(D, C, m=2, s=5.0).double()
    exact.weight.data.copy_(detached.weight)
    torch.testing.assert_close(detached.margin_logits(x, y), exact.margin_logits(x, y))
    xd = x.clone().requires_grad_(True)
    target = detached.margin_logits(xd, y).gather(1, y[:, None]).sum()
    (gd,) = torch.autograd.grad(target, xd)
    xc = x.clone().requires_grad_(True)
    (gc,) = torch.autograd.grad(5.0 * detached.cosine(xc).gather(1, y[:, None]).sum(), xc)
    torch.testing.assert_close(gd, gc)


# ---------------------------------------------------------------- schedule

def test_lambda_schedule_values():
    sphereface = LambdaSchedule.sphereface()
    assert sphereface.value(0) == 1000.0
    assert sphereface.value(100) == pytest.approx(1000 / 13)
    assert sphereface.value(10**6) == 5.0
    lsoft = LambdaSchedule.lsoftmax()
    assert lsoft.value(5000) == pytest.approx(1000 * (1 + 2.5e-5 * 5000) ** -35)


def test_schedule_advances_only_in_training_and_lives_in_state_dict():
    head = ASoftmaxLoss(D, C, lambda_=LambdaSchedule.sphereface()).double()
    x, y = _batch()
    for _ in range(3):
        head.loss(x, y)
    head.eval()
    head.loss(x, y)
    assert int(head.schedule.step) == 3
    state = head.state_dict()
    assert int(state["schedule.step"]) == 3
    resumed = ASoftmaxLoss(D, C, lambda_=LambdaSchedule.sphereface()).double()
    resumed.load_state_dict(state)
    assert resumed.schedule.value() == head.schedule.value() == pytest.approx(1000 / 1.36)


def test_resumed_fit_continues_the_schedule(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randint(3, (64,), generator=g))

    def make():
        torch.manual_seed(0)
        return Classifier(MLP(6, 4, hidden=(8,)), 3, head=ASoftmaxLoss(4, 3, lambda_=LambdaSchedule.sphereface()))

    full = make()
    fit(full, data, epochs=2, batch_size=16, loss_fn=head_loss, device="cpu", progress=False)
    part = make()
    ckpt = tmp_path / "run.pt"
    fit(part, data, epochs=1, batch_size=16, loss_fn=head_loss, device="cpu", progress=False, checkpoint=ckpt)
    resumed = make()
    fit(resumed, data, epochs=2, batch_size=16, loss_fn=head_loss, device="cpu", progress=False, checkpoint=ckpt)
    assert int(resumed.head.schedule.step) == int(full.head.schedule.step) == 8
    torch.testing.assert_close(resumed.head.weight, full.head.weight)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("make", [
    lambda: LSoftmaxLoss(D, C, m=0), lambda: LSoftmaxLoss(D, C, m=2.5), lambda: ASoftmaxLoss(D, C, m=1.5),
    lambda: ASoftmaxLoss(D, C, m=0.5, detach_margin=True), lambda: LSoftmaxLoss(D, C, lambda_=-1.0),
    lambda: ASoftmaxLoss(D, C, lambda_="big"), lambda: CosFaceLoss(D, C, s=-1.0), lambda: CosFaceLoss(D, C, m=-0.1),
    lambda: ArcFaceLoss(D, C, m=4.0), lambda: ArcFaceLoss(D, C, s=0.0), lambda: NormalizedSoftmaxLoss(D, C, s=-2.0),
    lambda: NormalizedSoftmaxLoss(0, C), lambda: LambdaSchedule(base=-1.0), lambda: LSoftmaxLoss(D, C, m=True),
])
def test_bad_arguments(make):
    with pytest.raises(ValueError):
        make()


def test_bad_inputs():
    head = ASoftmaxLoss(D, C)
    x = torch.randn(3, D)
    with pytest.raises(ValueError, match="labels must lie"):
        head.loss(x, torch.tensor([0, 1, C]))
    with pytest.raises(ValueError, match="labels must lie"):
        head.loss(x, torch.tensor([0, -1, 2]))
    with pytest.raises(ValueError, match="int64"):
        head.loss(x, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="Tensor\\[3\\]"):
        head.loss(x, torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="features must be"):
        head.loss(torch.randn(3, D + 1), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="integer"):
        chebyshev_cos(x, 1.5)


def test_weight_normalized_linear_backward():
    from sphereml.margins import _WeightNormalizedLinear

    x, _ = _batch(5)
    w = torch.randn(C, D, dtype=torch.float64)
    w[1] *= 1e-3
    assert torch.autograd.gradcheck(
        lambda a, b: _WeightNormalizedLinear.apply(a, b, 1e-12), (x.requires_grad_(True), w.requires_grad_(True)))
    torch.testing.assert_close(_WeightNormalizedLinear.apply(x, w, 1e-12), x @ normalize(w).T)
    zero_row = torch.zeros(C, D, dtype=torch.float64, requires_grad=True)
    _WeightNormalizedLinear.apply(x, zero_row, 1e-12).sum().backward()
    assert bool(torch.isfinite(zero_row.grad).all())


def test_reaching_schedule_hits_its_floor_on_time():
    sched = LambdaSchedule.reaching(5.0, steps=100)
    assert sched.value(0) == 1000.0 and sched.value(40) == pytest.approx(5.0) and sched.value(99) == 5.0
    assert sched.value(39) > 5.0
    assert LambdaSchedule.reaching(0.0, steps=100).value(40) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        LambdaSchedule.reaching(5.0, steps=0)
