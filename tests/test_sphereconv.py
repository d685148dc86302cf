"""SphereConv (thesis Ch. 3): oracle agreement, invariants, gradients, limits, bad arguments."""

import math

import pytest
import torch
import torch.nn.functional as F

from sphereml import models
from sphereml.margins import ASoftmaxLoss, GASoftmaxLoss, NormalizedSoftmaxLoss, WSoftmaxLoss
from sphereml.regularizers import Orthonormality, orthonormality_penalty
from sphereml.sphereconv import (
    ANGULAR,
    SphereConv2d,
    SphereLinear,
    SphereNorm,
    angular_activation,
    angular_function,
    sphere_conv2d,
    sphere_linear,
    stable_arccos,
)

ANGULAR_CASES = [("linear", 0.5), ("cosine", 0.5), ("sigmoid", 0.3), ("sigmoid", 2.0)]
CONV_CASES = [  # (C_in, C_out, kernel, stride, padding, dilation, groups)
    (3, 4, 3, 1, 0, 1, 1),
    (3, 4, 3, 2, 1, 1, 1),
    (4, 6, (3, 2), (1, 2), (2, 1), 2, 2),
    (6, 6, 3, 1, 1, 1, 3),
]


def _printed_sigmoid(theta, k):
    """Eq. 3.4 exactly as printed (ratio of exponentials); fine in float64 for moderate k."""
    a = math.exp(-math.pi / (2 * k))
    e = torch.exp(theta / k - math.pi / (2 * k))
    return (1 + a) / (1 - a) * (1 - e) / (1 + e)


def _oracle_g(theta, angular, k):
    if angular == "linear":
        return 1 - 2 * theta / math.pi
    if angular == "cosine":
        return torch.cos(theta)
    return _printed_sigmoid(theta, k)


def _unfold_oracle(x, w, stride, padding, dilation, groups, angular, k):
    """The definition, patch by patch: theta between each kernel and its whole receptive field."""
    b, cin, h, wd = x.shape
    cout, kh, kw = w.shape[0], w.shape[2], w.shape[3]
    outs = []
    for g in range(groups):
        xs = x[:, g * cin // groups:(g + 1) * cin // groups]
        ws = w[g * cout // groups:(g + 1) * cout // groups].flatten(1)  # (C_out/g, C_in/g*kh*kw)
        patches = F.unfold(xs, (kh, kw), dilation=dilation, padding=padding, stride=stride)  # (B, D, L)
        cos = torch.einsum("od,bdl->bol", ws, patches)
        cos = cos / (ws.norm(dim=1)[None, :, None] * patches.norm(dim=1)[:, None, :])
        outs.append(_oracle_g(torch.arccos(cos.clamp(-1, 1)), angular, k))
    out = torch.cat(outs, 1)
    ref = F.conv2d(x, w, None, stride, padding, dilation, groups)
    return out.view(b, cout, *ref.shape[2:])


@pytest.mark.parametrize("angular,k", ANGULAR_CASES)
@pytest.mark.parametrize("case", CONV_CASES)
def test_matches_unfold_oracle(angular, k, case):
    cin, cout, ks, stride, padding, dilation, groups = case
    torch.manual_seed(0)
    layer = SphereConv2d(cin, cout, ks, stride, padding, dilation, groups, angular=angular, k=k,
                         dtype=torch.float64)
    x = torch.randn(2, cin, 9, 8, dtype=torch.float64)
    out = layer(x)
    ref = _unfold_oracle(x, layer.weight, layer.stride, layer.padding, layer.dilation, groups, angular, k)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert out.abs().max() <= 1.0


@pytest.mark.parametrize("angular,k", ANGULAR_CASES)
def test_sphere_linear_matches_definition(angular, k):
    torch.manual_seed(1)
    x, w = torch.randn(5, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    cos = (x / x.norm(dim=1, keepdim=True)) @ (w / w.norm(dim=1, keepdim=True)).T
    torch.testing.assert_close(sphere_linear(x, w, angular=angular, k=k),
                               _oracle_g(torch.arccos(cos), angular, k), atol=1e-10, rtol=0)


def test_padding_modes_and_same_padding():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    reflect = SphereConv2d(3, 4, 3, padding=1, padding_mode="reflect", dtype=torch.float64)
    plain = SphereConv2d(3, 4, 3, padding=0, dtype=torch.float64)
    plain.weight.data.copy_(reflect.weight)
    torch.testing.assert_close(reflect(x), plain(F.pad(x, (1, 1, 1, 1), mode="reflect")))
    same = SphereConv2d(3, 4, 3, padding="same", dilation=2, dtype=torch.float64)
    assert same(x).shape == (2, 4, 8, 8)


@pytest.mark.parametrize("angular,k", ANGULAR_CASES)
def test_invariant_to_positive_scaling_of_patches_and_kernels(angular, k):
    torch.manual_seed(3)
    layer = SphereConv2d(2, 5, 2, stride=2, angular=angular, k=k, dtype=torch.float64)  # disjoint 2x2 patches
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    patch_scale = torch.rand(3, 1, 3, 3, dtype=torch.float64) * 10 + 0.01  # one constant per patch
    scaled_x = x * patch_scale.repeat_interleave(2, 2).repeat_interleave(2, 3)
    out = layer(x)
    torch.testing.assert_close(layer(scaled_x), out)
    layer.weight.data *= torch.rand(5, 1, 1, 1, dtype=torch.float64) * 10 + 0.01  # one constant per kernel
    torch.testing.assert_close(layer(x), out)
    torch.testing.assert_close(layer(-x), -out)  # g(pi - theta) = -g(theta)


@pytest.mark.parametrize("angular,k", ANGULAR_CASES)
def test_gradients_are_orthogonal_to_input_and_weight(angular, k):
    """0-homogeneity in x and in w gives <dL/dx, x> = 0 and <dL/dw_j, w_j> = 0 (Euler)."""
    torch.manual_seed(4)
    layer = SphereConv2d(3, 4, 3, padding=1, angular=angular, k=k, dtype=torch.float64)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    (layer(x) * torch.randn(2, 4, 6, 6, dtype=torch.float64)).sum().backward()
    assert abs(float((x.grad * x.detach()).sum())) < 1e-10
    per_kernel = (layer.weight.grad * layer.weight).flatten(1).sum(1)
    assert per_kernel.abs().max() < 1e-10


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
def test_gradcheck_conv_and_linear(angular, k):
    torch.manual_seed(5)
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    kk = torch.full((4, 1, 1), k, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x_, w_, k_: sphere_conv2d(x_, w_, None, 2, 1, 1, 2, angular, k_), (x, w, kk))
    xl, wl = torch.randn(3, 6, dtype=torch.float64, requires_grad=True), torch.randn(4, 6, dtype=torch.float64,
                                                                                       requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: sphere_linear(a, b, angular=angular, k=k), (xl, wl))


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


@pytest.mark.parametrize("angular,k", ANGULAR_CASES)
def test_finite_gradients_on_zero_and_constant_inputs(angular, k):
    layer = SphereConv2d(2, 3, 3, padding=1, angular=angular, k=k)
    with torch.no_grad():
        layer.weight[0] = 1.0  # kernel 0 is parallel to a constant patch: cos = 1 exactly
    for x in (torch.zeros(2, 2, 5, 5), torch.full((2, 2, 5, 5), 3.0)):
        x.requires_grad_(True)
        layer.zero_grad()
        out = layer(x)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
        if not x.detach().any():
            assert out.abs().max() == 0  # zero patch: theta = pi/2, g = 0 (Note [zero patch])
    interior = layer(torch.full((1, 2, 5, 5), 3.0))[0, 0, 1:-1, 1:-1]
    torch.testing.assert_close(interior, torch.ones_like(interior), atol=2e-3, rtol=0)


def test_half_precision_and_channels_last_inputs():
    """Patch norms are summed in float32 (x^2 overflows float16 above 256); any memory layout works."""
    torch.manual_seed(14)
    layer = SphereConv2d(4, 6, 3, padding=1, groups=2)
    x = torch.randn(2, 4, 7, 7) * 300
    ref = layer(x)
    out = layer.half()(x.half())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
    layer.float()
    x.requires_grad_(True)
    (grad_ref,) = torch.autograd.grad((layer(x) * ref).sum(), x)
    x_cl = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    channels_last = layer(x_cl)  # oneDNN picks another algorithm
    (grad_cl,) = torch.autograd.grad((channels_last * ref).sum(), x_cl)
    torch.testing.assert_close(channels_last, ref, atol=5e-4, rtol=0)
    torch.testing.assert_close(grad_cl, grad_ref, atol=1e-5, rtol=1e-3)


def test_learnable_k_stays_positive_and_round_trips():
    torch.manual_seed(6)
    layer = SphereConv2d(3, 5, 3, angular="sigmoid", learnable_k=True)
    torch.testing.assert_close(layer.k, torch.full((5,), 0.5))
    opt = torch.optim.SGD(layer.parameters(), lr=10.0)
    x = torch.randn(4, 3, 6, 6)
    for _ in range(50):  # push k down hard: the loss grows with k
        opt.zero_grad()
        (100 * layer.k.sum() - layer(x).abs().mean()).backward()
        opt.step()
    k = layer.k.detach()
    assert bool((k > 0).all()) and float(k.max()) < 0.5
    clone = SphereConv2d(3, 5, 3, angular="sigmoid", learnable_k=True)
    clone.load_state_dict(layer.state_dict())
    torch.testing.assert_close(clone(x), layer(x))
    with torch.no_grad():
        layer.k = torch.full((5,), 0.3)  # assignable through right_inverse
    torch.testing.assert_close(layer.k, torch.full((5,), 0.3))
    assert "learnable_k=True" in repr(layer)


def test_per_channel_k_gradient_gradcheck():
    cos = (torch.rand(3, 4, 5, 5, dtype=torch.float64) * 1.8 - 0.9).requires_grad_(True)
    k = (torch.rand(4, 1, 1, dtype=torch.float64) + 0.1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda c, kk: angular_activation(c, "sigmoid", kk), (cos, k))


def test_learnable_k_gradient_matches_finite_differences():
    torch.manual_seed(7)
    layer = SphereLinear(6, 3, angular="sigmoid", learnable_k=True, dtype=torch.float64)
    x = torch.randn(4, 6, dtype=torch.float64)
    raw = layer.parametrizations.k.original
    layer(x).sum().backward()
    h, numeric = 1e-6, []
    for j in range(3):
        with torch.no_grad():
            raw[j] += h
            up = float(layer(x).sum())
            raw[j] -= 2 * h
            down = float(layer(x).sum())
            raw[j] += h
        numeric.append((up - down) / (2 * h))
    torch.testing.assert_close(raw.grad, torch.tensor(numeric, dtype=torch.float64), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("angular", ANGULAR)
def test_output_may_be_modified_in_place(angular):
    """SphereConv -> ReLU(inplace=True), the pattern of a network without BatchNorm, backpropagates."""
    torch.manual_seed(15)
    net = torch.nn.Sequential(SphereConv2d(3, 4, 3, padding=1, angular=angular), torch.nn.ReLU(inplace=True))
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    net(x).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(net[0].weight.grad).all()


def test_sphere_norm_is_per_sample_unlike_batch_norm():
    torch.manual_seed(8)
    norm = SphereNorm(3, 4, 3, padding=1)
    bn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)).train()
    x, others = torch.randn(1, 3, 6, 6), torch.randn(5, 3, 6, 6) * 3
    torch.testing.assert_close(norm(torch.cat([x, others]))[:1], norm(x))
    assert not torch.allclose(bn(torch.cat([x, others]))[:1], bn(torch.cat([x, others[:1]]))[:1])
    rescaled = SphereNorm(3, 4, 3, padding=1, rescale=True, beta=2.0, gamma=0.5)
    rescaled.weight.data.copy_(norm.weight)
    torch.testing.assert_close(rescaled(x), 2.0 * norm(x) + 0.5)
    assert {"beta", "gamma"} <= {n for n, _ in rescaled.named_parameters()}
    fixed = SphereNorm(3, 4, 3, rescale=True, learn_rescale=False)
    assert {n for n, _ in fixed.named_parameters()} == {"weight"} and "beta" in fixed.state_dict()


def test_bad_arguments():
    with pytest.raises(ValueError, match="angular must be one of"):
        SphereConv2d(3, 4, 3, angular="tanh")
    with pytest.raises(ValueError, match="k must be a finite number > 0"):
        SphereConv2d(3, 4, 3, angular="sigmoid", k=0.0)
    with pytest.raises(ValueError, match="k must be"):
        angular_function(torch.zeros(3), "sigmoid", -1.0)
    with pytest.raises(ValueError, match="kernel_size"):
        SphereConv2d(3, 4, 0)
    with pytest.raises(ValueError, match="kernel_size"):
        SphereConv2d(3, 4, 3.0)
    with pytest.raises(ValueError, match="stride"):
        SphereConv2d(3, 4, 3, stride=(1, 0))
    with pytest.raises(ValueError, match="padding"):
        SphereConv2d(3, 4, 3, padding=-1)
    with pytest.raises(ValueError, match="padding"):
        SphereConv2d(3, 4, 3, padding="full")
    with pytest.raises(ValueError, match="divisible by groups"):
        SphereConv2d(3, 4, 3, groups=2)
    with pytest.raises(ValueError, match="learnable_k needs angular='sigmoid'"):
        SphereConv2d(3, 4, 3, learnable_k=True)
    with pytest.raises(ValueError, match="in_channels"):
        SphereConv2d(0, 4, 3)
    with pytest.raises(ValueError, match=r"Tensor\[B, 3, H, W\]"):
        SphereConv2d(3, 4, 3)(torch.zeros(1, 2, 5, 5))
    with pytest.raises(ValueError, match=r"Tensor\[..., 6\]"):
        SphereLinear(6, 2)(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="eps"):
        SphereLinear(6, 2, eps=0.0)


def test_layers_are_found_by_regularisers_and_factories():
    net = models.spherenet(9, angular="sigmoid", k=0.3, widths=(4, 6, 8), in_channels=1, image_size=28,
                           feature_dim=16, sphere_fc=True)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 9 and all(isinstance(m, SphereConv2d) and m.angular == "sigmoid" for m in convs)
    assert isinstance(net.feature, SphereLinear)
    assert net(torch.randn(2, 1, 28, 28)).shape == (2, 16)
    assert type(models.spherenet(3, widths=(4, 6, 8), feature_dim=16).feature) is torch.nn.Linear
    expected = sum(orthonormality_penalty(m.weight) for m in convs)
    torch.testing.assert_close(Orthonormality(beta=1.0)(net), expected)
    plain = models.plain_cnn(18, in_channels=3, image_size=32)
    assert sum(isinstance(m, torch.nn.Conv2d) for m in plain.modules()) == 18
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in plain.modules()) == 18
    assert plain.feature.out_features == 256
    with pytest.raises(ValueError, match="multiple of 3"):
        models.plain_cnn(10)
    v1, v2 = models.sphere_resnet(32), models.sphere_resnet(32, sphere_shortcut=False)
    assert sum(isinstance(m, torch.nn.Conv2d) for m in v1.modules()) == 1 + 30 + 2
    assert all(isinstance(m, SphereConv2d) for m in v1.modules() if isinstance(m, torch.nn.Conv2d))
    shortcuts = [b.shortcut[0] for b in v2.stages if isinstance(b.shortcut, torch.nn.Sequential)]
    assert len(shortcuts) == 2 and not any(isinstance(m, SphereConv2d) for m in shortcuts)
    assert v1(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="6n \\+ 2"):
        models.resnet(30)
    assert [len(models.resnet(d).stages) for d in (20, 32)] == [9, 15]


# --- GA-Softmax / W-Softmax (thesis eqs. 3.10, 3.11) ---

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
