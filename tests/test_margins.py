"""Large-margin heads: invariants of reference §1.6 and §2.6, GA-/W-Softmax, gradients, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

from sphereml.angular import ANGULAR, angular_activation, angular_function
from sphereml.geometry import normalize
from sphereml.heads.margins import (ArcFaceLoss, ASoftmaxLoss, CosFaceLoss, GASoftmaxLoss, LambdaSchedule, LSoftmaxLoss,
    NormalizedSoftmaxLoss, WSoftmaxLoss)
from sphereml.heads.targets import chebyshev_cos, multiplicative_psi
from sphereml.models import MLP, Classifier
from sphereml.train import evaluate, fit

D, C = 5, 4


def _batch(n=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g, dtype=dtype), torch.randint(C, (n,), generator=g)


def _all_heads():
    return [
        NormalizedSoftmaxLoss(D, C), NormalizedSoftmaxLoss(D, C, s=10.0),
        LSoftmaxLoss(D, C, m=3), ASoftmaxLoss(D, C, m=4), ASoftmaxLoss(D, C, m=1.5, s=8.0, detach_margin=True),
        CosFaceLoss(D, C, s=16.0), ArcFaceLoss(D, C, s=16.0),
    ]


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
    fit(full, data, epochs=2, batch_size=16, device="cpu", progress=False)
    part = make()
    ckpt = tmp_path / "run.pt"
    fit(part, data, epochs=1, batch_size=16, device="cpu", progress=False, checkpoint=ckpt)
    resumed = make()
    fit(resumed, data, epochs=2, batch_size=16, device="cpu", progress=False, checkpoint=ckpt)
    assert int(resumed.head.schedule.step) == int(full.head.schedule.step) == 8
    torch.testing.assert_close(resumed.head.weight, full.head.weight)


def test_fit_and_evaluate_use_the_heads_own_loss():
    """The one loss path: Classifier.loss_and_logits delegates to a margin head; evaluate reports that loss."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 6, generator=g), torch.randint(3, (32,), generator=g)
    torch.manual_seed(0)
    model = Classifier(MLP(6, 4, hidden=(8,)), 3, head=ASoftmaxLoss(4, 3, m=4)).eval()
    loss, logits = model.loss_and_logits(x, y)
    features = model.features(x)
    torch.testing.assert_close(loss, model.head.loss(features, y))
    torch.testing.assert_close(logits, model.head(features))
    plain_ce = F.cross_entropy(model(x), y)
    assert float(loss.detach()) > float(plain_ce.detach())  # the margin raises the loss above plain cross-entropy
    result = evaluate(model, torch.utils.data.TensorDataset(x, y), device="cpu")
    assert result["loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
    assert result["accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("make,message", [
    (lambda: LSoftmaxLoss(D, C, m=0), "m must be an integer >= 1"),
    (lambda: LSoftmaxLoss(D, C, m=2.5), "multiple-angle formula"),
    (lambda: ASoftmaxLoss(D, C, m=1.5), "multiple-angle formula"),
    (lambda: ASoftmaxLoss(D, C, m=0.5, detach_margin=True), "m must be a finite number >= 1"),
    (lambda: LSoftmaxLoss(D, C, lambda_=-1.0), "lambda_ must be a finite number >= 0"),
    (lambda: ASoftmaxLoss(D, C, lambda_="big"), "lambda_ must be a number >= 0 or a LambdaSchedule"),
    (lambda: CosFaceLoss(D, C, s=-1.0), "scale s must be a finite number > 0"),
    (lambda: CosFaceLoss(D, C, m=-0.1), "margin m must be a finite number >= 0"),
    (lambda: ArcFaceLoss(D, C, m=4.0), "angular margin m must be a finite number >= 0 and < 3.14"),
    (lambda: ArcFaceLoss(D, C, s=0.0), "scale s must be a finite number > 0"),
    (lambda: NormalizedSoftmaxLoss(D, C, s=-2.0), "scale s must be a finite number > 0"),
    (lambda: NormalizedSoftmaxLoss(0, C), "in_features must be an integer >= 1"),
    (lambda: NormalizedSoftmaxLoss(D, True), "num_classes must be an integer >= 1"),
    (lambda: LSoftmaxLoss(D, C, m=True), "multiple-angle formula"),
])
def test_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
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
    from sphereml.heads.margin_ce import weight_normalized_linear

    x, _ = _batch(5)
    w = torch.randn(C, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w[1] *= 1e-3
    # Central differences err by about eps² / ||w_1||³ (truncation) plus 1e-16 |f| / eps (rounding): with
    # gradcheck's eps = 1e-6 the short row put one Jacobian entry 2.6e-5 off in a CI run (w was unseeded then);
    # eps = 1e-8 keeps both terms near 1e-8, below gradcheck's atol of 1e-5.
    assert torch.autograd.gradcheck(
        lambda a, b: weight_normalized_linear(a, b, 1e-12), (x.requires_grad_(True), w.requires_grad_(True)), eps=1e-8)
    torch.testing.assert_close(weight_normalized_linear(x, w, 1e-12), x @ normalize(w).T)
    zero_row = torch.zeros(C, D, dtype=torch.float64, requires_grad=True)
    weight_normalized_linear(x, zero_row, 1e-12).sum().backward()
    assert bool(torch.isfinite(zero_row.grad).all())


# ---------------------------------------------------------------- GA-Softmax / W-Softmax (thesis eqs. 3.10, 3.11)

def _features(seed=9):
    torch.manual_seed(seed)
    return torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 4, (16,))


def _same_weight(*heads):
    for head in heads[1:]:
        head.weight.data.copy_(heads[0].weight)
    return heads


def test_cosine_w_softmax_is_modified_softmax_and_cosine_ga_is_a_softmax():
    x, y = _features()
    w, modified = _same_weight(WSoftmaxLoss(5, 4, "cosine").double(), NormalizedSoftmaxLoss(5, 4).double())
    torch.testing.assert_close(w.loss(x, y), modified.loss(x, y))
    ga, a = _same_weight(GASoftmaxLoss(5, 4, m=4, angular="cosine").double(), ASoftmaxLoss(5, 4, m=4).double())
    torch.testing.assert_close(ga.loss(x, y), a.loss(x, y))
    torch.testing.assert_close(ga(x), a(x))


@pytest.mark.parametrize("angular", ANGULAR)
def test_ga_with_m1_is_w_softmax_and_margin_raises_loss(angular):
    x, y = _features(10)
    one, w, ga = _same_weight(GASoftmaxLoss(5, 4, m=1, angular=angular).double(),
                              WSoftmaxLoss(5, 4, angular).double(),
                              GASoftmaxLoss(5, 4, m=3, angular=angular).double())
    torch.testing.assert_close(one.loss(x, y), w.loss(x, y))
    assert float(ga.loss(x, y).detach()) > float(w.loss(x, y).detach())
    assert w(x).abs().max() <= x.norm(dim=1).max() + 1e-12  # logits are ||x|| g(theta)


def test_linear_ga_target_is_linear_in_theta_without_saddle_points():
    x, y = _features(11)
    head = GASoftmaxLoss(5, 4, m=4, angular="linear").double()
    theta = torch.arccos(head.cosine(x).gather(1, y[:, None]))
    target = head.margin_logits(x, y).gather(1, y[:, None])
    torch.testing.assert_close(target, x.norm(dim=1, keepdim=True) * (1 - 8 * theta / math.pi))
    t = torch.linspace(0.01, math.pi - 0.01, 200, dtype=torch.float64, requires_grad=True)
    (slope,) = torch.autograd.grad(angular_function(4 * t, "linear").sum(), t)
    torch.testing.assert_close(slope, torch.full_like(slope, -8 / math.pi))


def test_s_softmax_uses_a_fixed_scale():
    x, y = _features(12)
    head = WSoftmaxLoss(5, 4, "sigmoid", k=0.3, s=16.0).double()
    torch.testing.assert_close(head(x), 16.0 * angular_activation(head.cosine(x), "sigmoid", 0.3))
    torch.testing.assert_close(head(3 * x), head(x))


@pytest.mark.parametrize("angular", ANGULAR)
def test_ga_softmax_gradcheck_and_finite_at_cos_one(angular):
    x, y = _features(13)
    head = GASoftmaxLoss(5, 4, m=2, angular=angular).double()
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda f: head.loss(f, y), (x,))
    aligned = head.weight.detach()[y].clone().requires_grad_(True)  # cos(theta_y) = 1 exactly
    head.loss(aligned, y).backward()
    assert torch.isfinite(aligned.grad).all() and torch.isfinite(head.weight.grad).all()


def test_ga_softmax_bad_arguments():
    with pytest.raises(ValueError, match="integer"):
        GASoftmaxLoss(5, 4, m=1.5, angular="cosine")
    with pytest.raises(ValueError, match="m must be"):
        GASoftmaxLoss(5, 4, m=0.5)
    with pytest.raises(ValueError, match="angular must be one of"):
        WSoftmaxLoss(5, 4, "arc")
    with pytest.raises(ValueError, match="k must be"):
        GASoftmaxLoss(5, 4, angular="sigmoid", k=0.0)


@pytest.mark.parametrize("head", _all_heads() + [GASoftmaxLoss(D, C, m=2, angular="sigmoid", k=0.3)],
                         ids=lambda h: type(h).__name__)
def test_heads_compile_without_graph_breaks(head):
    """No data-dependent check on the loss path: ``torch.compile(fullgraph=True)`` traces the whole loss."""
    torch.compiler.reset()  # each case compiles afresh (no recompile limit across cases)
    x, y = _batch(seed=5, dtype=torch.float32)
    x.requires_grad_(True)
    compiled = torch.compile(head.loss, fullgraph=True, backend="aot_eager")
    value = compiled(x, y)
    (grad,) = torch.autograd.grad(value, x)
    (grad_ref,) = torch.autograd.grad(head.loss(x, y), x)
    torch.testing.assert_close(value, head.loss(x, y))
    torch.testing.assert_close(grad, grad_ref)
