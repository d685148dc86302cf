"""Decoupled operators (thesis Ch. 4): formulas, the fast path against the unfold definition, the
invariants of reference §4.6, the optimisation aids of §4.4 and bad arguments."""

import copy
import itertools
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from sphereml.angular import angular_function
from sphereml.layers.decoupled import (BOUNDED_MAGNITUDES, MAGNITUDES, DecoupledConv2d, DecoupledLinear,
    decoupled_conv2d, decoupled_conv2d_reference, decoupled_factory, decoupled_layers, decoupled_linear,
    magnitude_function)
from sphereml.layers.decoupled_training import (WeightProjection, init_from_pretrained, mean_kernel_norm,
    project_weights, radius_per_channel, scale_kernels, training_aid, training_aids, weighted_gradients)
from sphereml.models import Classifier, plain_cnn
from sphereml.regularizers import Orthogonality, orthogonality_penalty
from sphereml.train import fit

F64 = torch.float64
ANGULARS = ("linear", "cosine", "sigmoid", "sqcosine")

# eqs. 4.4-4.10 written out once more, independently of the library (alpha = 1.3, beta = 0.4, r = 0.8)
A, B, R = 1.3, 0.4, 0.8
FORMULAS = {
    "sphere": lambda n: A + 0 * n,
    "ball": lambda n: A * torch.minimum(n, torch.full_like(n, R)) / R,
    "tanh": lambda n: A * torch.tanh(n / R),
    "linear": lambda n: A * n,
    "seg": lambda n: torch.where(n <= R, A * n, B * n + A * R - B * R),
    "log": lambda n: A * torch.log(1 + n),
    "mix": lambda n: A * n + B * torch.log(1 + n),
}
G = {  # eqs. 4.11-4.14 (sigmoid with k = 0.5: eq. 3.4 as printed)
    "linear": lambda t: -2 * t / math.pi + 1,
    "cosine": torch.cos,
    "sigmoid": lambda t: ((1 + math.exp(-math.pi)) / (1 - math.exp(-math.pi))
                          * (1 - torch.exp(2 * t - math.pi)) / (1 + torch.exp(2 * t - math.pi))),
    "sqcosine": lambda t: torch.sign(torch.cos(t)) * torch.cos(t) ** 2,
}


def _input(seed=0, shape=(2, 3, 7, 7), scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64) * scale


def _layer(seed=0, **kwargs):
    torch.manual_seed(seed)
    return DecoupledConv2d(3, 4, 3, padding=1, **kwargs).double()


@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_magnitude_functions_are_eqs_4_4_to_4_10(magnitude):
    n = torch.cat([torch.linspace(0, 3, 61, dtype=F64), torch.tensor([R, 1e3], dtype=F64)])
    beta = B if magnitude in ("seg", "mix") else None
    torch.testing.assert_close(magnitude_function(n, magnitude, A, beta, R), FORMULAS[magnitude](n))


@pytest.mark.parametrize("magnitude,angular", list(itertools.product(MAGNITUDES, ANGULARS)))
def test_reference_is_the_definition_at_single_patches(magnitude, angular):
    """The unfold reference against h(||x||) g(theta) computed for single patches sliced by hand."""
    x, layer = _input(1), _layer(1)
    beta = B if magnitude in ("seg", "mix") else None
    ref = decoupled_conv2d_reference(x, layer.weight, padding=1, magnitude=magnitude, angular=angular, alpha=A,
                                     beta=beta, radius=R)
    padded = F.pad(x, (1, 1, 1, 1))
    for b, o, i, j in [(0, 0, 0, 0), (1, 3, 3, 4), (0, 2, 6, 6)]:
        patch, w = padded[b, :, i:i + 3, j:j + 3].flatten(), layer.weight[o].detach().flatten()
        theta = torch.arccos(patch @ w / (patch.norm() * w.norm()))
        expected = FORMULAS[magnitude](patch.norm()) * G[angular](theta)
        torch.testing.assert_close(ref[b, o, i, j], expected)


@pytest.mark.parametrize("magnitude,angular", list(itertools.product(MAGNITUDES, ANGULARS)))
def test_layer_equals_the_reference(magnitude, angular):
    x = _input(2)
    layer = _layer(2, magnitude=magnitude, angular=angular, alpha=A, rho=R, beta=B if magnitude == "seg" else None)
    ref = decoupled_conv2d_reference(x, layer.weight, padding=1, magnitude=magnitude, angular=angular, alpha=A,
                                     beta=layer.beta, radius=R)
    torch.testing.assert_close(layer(x), ref)


@pytest.mark.parametrize("weighted,magnitude", [("linear", "sphere"), ("linear", "seg"), (True, "tanh"),
                                                ("tanh_joint", "tanh"), ("tanh_separate", "tanh")])
@pytest.mark.parametrize("angular", ["cosine", "sqcosine"])
def test_weighted_forms_and_conv_geometry_equal_the_reference(weighted, magnitude, angular):
    x = _input(3, (2, 4, 9, 8))
    torch.manual_seed(3)
    weight = torch.randn(6, 2, 3, 2, dtype=F64) * 0.7
    geometry = dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2)
    fast = decoupled_conv2d(x, weight, **geometry, magnitude=magnitude, angular=angular, rho=0.6, weighted=weighted)
    ref = decoupled_conv2d_reference(x, weight, **geometry, magnitude=magnitude, angular=angular, radius=0.6,
                                     rho=0.6, weighted=weighted)
    torch.testing.assert_close(fast, ref)


def test_formulas_of_the_weighted_tanh_forms():
    """Eq. 4.15: alpha tanh(||x|| ||w|| / r) g; eq. 4.16: alpha tanh(||w|| / rho) tanh(||x|| / r) g (1x1 patches)."""
    x = _input(4, (5, 3, 1, 1))
    w = torch.randn(2, 3, 1, 1, dtype=F64) * 3
    xn, wn = x.flatten(1).norm(dim=1)[:, None], w.flatten(1).norm(dim=1)[None, :]
    cos = (x.flatten(1) @ w.flatten(1).T) / (xn * wn)
    joint = decoupled_conv2d(x, w, magnitude="tanh", alpha=2.0, rho=0.7, weighted="tanh_joint").flatten(1)
    separate = decoupled_conv2d(x, w, magnitude="tanh", alpha=2.0, rho=0.7, weighted="tanh_separate").flatten(1)
    torch.testing.assert_close(joint, 2.0 * torch.tanh(xn * wn / 0.7) * cos)
    torch.testing.assert_close(separate, 2.0 * torch.tanh(wn / 0.7) * torch.tanh(xn / 0.7) * cos)


def test_linearly_weighted_linear_cosine_is_ordinary_convolution():
    """||w|| ||x|| cos(theta) = w . x (reference invariant 7), for any conv geometry."""
    x = _input(5, (2, 4, 9, 9))
    torch.manual_seed(5)
    layer = DecoupledConv2d(4, 6, 3, stride=2, padding=1, groups=2, magnitude="linear", weighted=True).double()
    torch.testing.assert_close(layer(x), F.conv2d(x, layer.weight, None, 2, 1, 1, 2))
    lin = DecoupledLinear(4, 3, magnitude="linear", weighted="linear").double()
    v = _input(6, (5, 4))
    torch.testing.assert_close(lin(v), v @ lin.weight.T)


def test_conv_followed_by_relu_is_a_decoupled_operator():
    """§4.5: ReLU(w . x) = ||w|| ||x|| max(0, cos theta)."""
    x, layer = _input(7), _layer(7, magnitude="linear", weighted=True)
    cos = decoupled_conv2d(x, layer.weight, padding=1, magnitude="sphere")  # alpha cos(theta) with alpha = 1
    norm = decoupled_conv2d(x, layer.weight, padding=1, magnitude="linear", weighted=True) / cos
    torch.testing.assert_close(F.relu(F.conv2d(x, layer.weight, padding=1)), norm * cos.clamp_min(0))


@pytest.mark.parametrize("magnitude,angular", list(itertools.product(MAGNITUDES, ANGULARS)))
def test_zero_patch_gives_zero_with_finite_gradients(magnitude, angular):
    x = torch.zeros(2, 3, 5, 5, dtype=F64)
    x[0, :, 2, 2] = 1.0  # one sample has a single non-zero pixel, so most patches are zero
    x.requires_grad_(True)
    layer = _layer(8, magnitude=magnitude, angular=angular)
    out = layer(x)
    assert float(out[1].detach().abs().max()) == 0.0 and float(out[0, :, 4, 4].detach().abs().max()) == 0.0
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()


def test_every_angular_activation_has_the_shape_of_eqs_4_11_to_4_14():
    theta = torch.linspace(0, math.pi, 181, dtype=F64, requires_grad=True)
    for angular in ANGULARS:
        g = angular_function(theta, angular)
        g0, g90, g180 = (float(g[i].detach()) for i in (0, 90, -1))
        assert abs(g0 - 1) < 1e-12 and abs(g90) < 1e-12 and abs(g180 + 1) < 1e-12
        assert bool((g[1:] <= g[:-1]).all())
        torch.testing.assert_close(angular_function(math.pi - theta, angular), -g)
        torch.testing.assert_close(g, G[angular](theta))
    (slope,) = torch.autograd.grad(angular_function(theta, "sqcosine").sum(), theta)
    assert abs(float(slope[90])) < 1e-12  # square cosine is flat at pi/2 (C^1)
    torch.testing.assert_close(slope, -2 * torch.cos(theta).abs() * torch.sin(theta))


def test_bounded_operators_and_pointwise_orderings():
    x = _input(9, scale=1e4)  # huge patches
    outs = {m: _layer(9, magnitude=m, alpha=A, rho=R)(x).detach() for m in MAGNITUDES}
    for m in BOUNDED_MAGNITUDES:
        assert float(outs[m].abs().max()) <= A + 1e-12
    x = _input(10, scale=0.5)
    outs = {m: _layer(10, magnitude=m, alpha=A, rho=R)(x).abs() for m in MAGNITUDES}
    assert bool((outs["tanh"] <= outs["ball"] + 1e-12).all())  # tanh t <= min(t, 1)
    assert bool((outs["log"] <= outs["linear"] + 1e-12).all())  # log(1 + t) <= t


def test_seg_conv_continuity_and_reductions():
    n = torch.tensor([R - 1e-9, R, R + 1e-9], dtype=F64)
    h = magnitude_function(n, "seg", A, B, R)
    assert float(h.max() - h.min()) < 1e-8 and abs(float(h[1]) - A * R) < 1e-12
    x = _input(11)
    seg_alpha = _layer(11, magnitude="seg", alpha=A, beta=A, rho=R)(x)
    torch.testing.assert_close(seg_alpha, _layer(11, magnitude="linear", alpha=A)(x))  # beta = alpha: LinearConv
    seg_zero = _layer(11, magnitude="seg", alpha=A, beta=0.0, rho=R)(x)
    torch.testing.assert_close(seg_zero, A * R * _layer(11, magnitude="ball", alpha=1.0, rho=R)(x))  # beta = 0
    mix = _layer(11, magnitude="mix", alpha=A, beta=B)(x)
    torch.testing.assert_close(mix, _layer(11, magnitude="linear", alpha=A)(x) + _layer(11, magnitude="log",
                                                                                         alpha=B)(x))
    ball = _layer(11, magnitude="ball", rho=R)
    sphere = _layer(11, magnitude="sphere")
    norms = decoupled_conv2d(x, ball.weight, padding=1, magnitude="linear", angular="cosine",
                             weighted=False) / sphere(x)  # ||x|| per position
    outside = norms >= R
    torch.testing.assert_close(ball(x)[outside], sphere(x)[outside])  # BallConv = SphereConv beyond rho


@pytest.mark.parametrize("magnitude,angular", [("tanh", "cosine"), ("ball", "linear"), ("seg", "sqcosine"),
                                               ("mix", "sigmoid"), ("sphere", "cosine")])
def test_gradcheck(magnitude, angular):
    x = _input(12, (1, 2, 4, 4)).requires_grad_(True)
    w = (torch.randn(3, 2, 3, 3, dtype=F64)).requires_grad_(True)
    rho = torch.tensor(0.9, dtype=F64, requires_grad=True)
    fn = lambda x_, w_, r_: decoupled_conv2d(x_, w_, padding=1, magnitude=magnitude, angular=angular,  # noqa
                                             rho=r_)
    assert torch.autograd.gradcheck(fn, (x, w, rho))
    v = _input(13, (3, 5)).requires_grad_(True)
    wl = torch.randn(4, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v_, w_: decoupled_linear(v_, w_, magnitude, angular, rho=0.9), (v, wl))


def test_linear_layer_is_the_conv_operator_on_1x1_maps():
    torch.manual_seed(14)
    lin = DecoupledLinear(5, 3, magnitude="seg", angular="sqcosine", rho=1.5).double()
    v = _input(14, (2, 6, 5))
    ref = decoupled_conv2d_reference(v.reshape(-1, 5, 1, 1), lin.weight.view(3, 5, 1, 1), magnitude="seg",
                                     angular="sqcosine", beta=0.5, radius=1.5).view(2, 6, 3)
    torch.testing.assert_close(lin(v), ref)


def test_unweighted_operators_ignore_the_kernel_norm_and_projection_keeps_the_output():
    """Reference invariant 1: f(c w, x) = f(w, x) for c > 0, so w <- s w_hat changes nothing."""
    x = _input(15)
    net = torch.nn.Sequential(_layer(15, magnitude="tanh", angular="linear"), _layer(16, magnitude="seg"))
    net[1] = DecoupledConv2d(4, 2, 3, magnitude="seg").double()
    before = net(x)
    with torch.no_grad():
        net[0].weight.mul_(torch.rand(4, 1, 1, 1, dtype=F64) * 10 + 0.1)
    assert project_weights(net, scale=2.0) == 2
    torch.testing.assert_close(net(x), before)
    for layer in decoupled_layers(net):
        torch.testing.assert_close(layer.weight.flatten(1).norm(dim=1), torch.full((layer.out_channels,), 2.0,
                                                                                   dtype=F64))
    weighted = torch.nn.Sequential(_layer(17, magnitude="tanh", weighted=True))
    with pytest.raises(ValueError, match="weighted operators"):
        project_weights(weighted)


def test_gradient_of_the_unit_cosine_is_eq_4_17_and_weighted_gradients_undo_the_norm():
    """Eq. 4.17: d(w_hat . x_hat)/dw = (x_hat - c w_hat) / ||w||, perpendicular to w; eq. 4.18's hook
    makes the gradient the same for w and 10 w."""
    g = torch.Generator().manual_seed(18)
    w = torch.randn(6, generator=g, dtype=F64, requires_grad=True)
    x = torch.randn(6, generator=g, dtype=F64)
    c = F.cosine_similarity(w, x, dim=0)
    (grad,) = torch.autograd.grad(c, w)
    w_hat, x_hat = w.detach() / w.detach().norm(), x / x.norm()
    torch.testing.assert_close(grad, (x_hat - c.detach() * w_hat) / w.detach().norm())
    assert abs(float(grad @ w.detach())) < 1e-12
    torch.testing.assert_close(grad.norm(), torch.sqrt(1 - c.detach() ** 2) / w.detach().norm())
    grads = []
    for scale in (1.0, 10.0):
        net = torch.nn.Sequential(_layer(19, magnitude="tanh", angular="sqcosine"))
        with torch.no_grad():
            net[0].weight.mul_(scale)
        handles = weighted_gradients(net)
        net(_input(19)).square().sum().backward()
        grads.append(net[0].weight.grad.clone())
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(grads[0], grads[1])


def test_radius_normalisation_running_mean_and_input_scale_invariance():
    x = _input(20)
    for magnitude in ("ball", "tanh", "seg"):
        layer = _layer(20, magnitude=magnitude, radius_norm=True, rho=0.9)
        out = layer(x)
        assert int(layer.norm_mean_updates) == 1
        patch_norms = decoupled_conv2d(x, layer.weight, padding=1, magnitude="linear", weighted=False) / \
            decoupled_conv2d(x, layer.weight, padding=1, magnitude="sphere")
        torch.testing.assert_close(layer.norm_mean, patch_norms.mean())  # the first update copies the batch mean
        scaled = layer(7.0 * x)  # the running mean, cumulative at first, moves to (m + 7 m) / 2 = 4 m
        if magnitude != "seg":  # seg is linear in ||x|| beyond the radius, so it scales with the input
            torch.testing.assert_close(scaled, out)
        else:
            torch.testing.assert_close(scaled, 7.0 * out)
        torch.testing.assert_close(layer.norm_mean, 4.0 * patch_norms.mean())
        layer.eval()
        ref = decoupled_conv2d_reference(x, layer.weight, padding=1, magnitude=magnitude,
                                         radius=0.9 * float(layer.norm_mean))
        torch.testing.assert_close(layer(x), ref)


def test_running_mean_is_cumulative_then_a_momentum_average():
    layer = _layer(21, magnitude="tanh", radius_norm=True, momentum=0.25)
    means = []
    for scale in (1.0, 3.0, 0.5, 2.0, 4.0):
        x = _input(21, scale=scale)
        layer(x)
        norms = decoupled_conv2d(x, layer.weight, padding=1, magnitude="linear") / \
            decoupled_conv2d(x, layer.weight, padding=1, magnitude="sphere")
        means.append(float(norms.detach().mean()))
    expected = sum(means[:4]) / 4  # weights 1, 1/2, 1/3, 1/4: the plain mean of the first 1 / momentum
    expected = 0.75 * expected + 0.25 * means[4]
    assert abs(float(layer.norm_mean) - expected) < 1e-10
    layer.reset_running_stats()
    assert float(layer.norm_mean) == 1.0 and int(layer.norm_mean_updates) == 0


def test_learnable_rho_is_positive_and_ball_rho_learns_only_from_patches_inside():
    layer = _layer(22, magnitude="ball", learnable_rho=True, rho=0.5)
    x = _input(22, scale=10.0)  # every patch far outside the ball
    layer(x).sum().backward()
    raw = layer.parametrizations.rho.original
    assert float(raw.grad.abs()) == 0.0  # reference invariant 10
    layer.zero_grad()
    layer(_input(22, scale=0.01)).sum().backward()
    assert float(raw.grad.abs()) > 0.0
    with torch.no_grad():
        raw.fill_(-50.0)
    assert float(layer.rho) > 0
    with pytest.raises(ValueError, match="a learned rho must be >"):
        layer.rho = torch.tensor(0.0, dtype=F64)


def test_factory_builds_a_trainable_network_and_projection_callback_keeps_unit_kernels():
    torch.manual_seed(23)
    conv = decoupled_factory(magnitude="tanh", angular="cosine", radius_norm=True, learnable_rho=True)
    net = Classifier(plain_cnn(3, (4, 4, 4), 1, 8, 8, conv_layer=conv, norm_layer="identity"), 3)
    assert len(decoupled_layers(net)) == 3
    g = torch.Generator().manual_seed(23)
    data = torch.utils.data.TensorDataset(torch.rand(32, 1, 8, 8, generator=g), torch.randint(0, 3, (32,),
                                                                                                generator=g))
    fit(net, data, epochs=2, batch_size=8, lr=1e-2, device="cpu", progress=False, callbacks=[WeightProjection(2)])
    for layer in decoupled_layers(net):  # 8 steps, projected after every second one
        torch.testing.assert_close(layer.weight.flatten(1).norm(dim=1), torch.ones(4))
        assert float(layer.rho) != 1.0  # rho learned


def test_training_aid_sets_up_each_aid_and_undoes_the_gradient_hooks():
    torch.manual_seed(27)
    net = Classifier(plain_cnn(3, (4, 4, 4), 1, 8, 8, conv_layer=decoupled_factory(magnitude="tanh")), 3)
    with torch.no_grad():
        for layer in decoupled_layers(net):
            layer.weight.mul_(3.0)
    x = torch.rand(2, 1, 8, 8)

    def kernel_grad():
        net.zero_grad()
        net(x).sum().backward()
        return decoupled_layers(net)[0].weight.grad.clone()

    plain = kernel_grad()
    with training_aid(net, "weighted") as callbacks:
        assert callbacks == []
        norms = decoupled_layers(net)[0].weight.detach().flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        torch.testing.assert_close(kernel_grad(), plain * norms)  # eq. 4.18 inside the block
    torch.testing.assert_close(kernel_grad(), plain)  # and plain gradients after it
    with training_aid(net, "projection", every=5) as callbacks:
        assert [type(c) for c in callbacks] == [WeightProjection] and callbacks[0].every == 5
        assert mean_kernel_norm(net) == pytest.approx(1.0)  # projected on entry
    cnn = Classifier(plain_cnn(3, (4, 4, 4), 1, 8, 8, conv_layer=partial(torch.nn.Conv2d, bias=False)), 3)
    with training_aid(cnn, "projection") as callbacks:  # no decoupled layer: standard gradients
        assert callbacks == []
    twin = copy.deepcopy(net)
    with torch.no_grad():
        decoupled_layers(net)[0].weight.mul_(2.0)  # its kernels' norms: 1 after the projection above, now 2
    plain = kernel_grad()
    with training_aids([twin, net], "weighted") as callbacks:  # one list per network, each with its hooks
        assert callbacks == [[], []]
        torch.testing.assert_close(kernel_grad(), plain * 2.0)
    torch.testing.assert_close(kernel_grad(), plain)
    with training_aids([twin, cnn], "projection", every=3) as callbacks:
        assert callbacks == [[WeightProjection(3)], []] and mean_kernel_norm(twin) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="aid"):
        with training_aid(net, "projected"):
            pass


def test_init_from_pretrained_copies_matching_weights():
    """A linearly weighted LinearConv-cosine network initialised from a CNN computes the same function."""
    torch.manual_seed(24)
    cnn = Classifier(plain_cnn(3, (4, 4, 4), 1, 8, 8, conv_layer=partial(torch.nn.Conv2d, bias=False)), 3).eval()
    conv = decoupled_factory(magnitude="linear", weighted=True)
    dcnet = Classifier(plain_cnn(3, (4, 4, 4), 1, 8, 8, conv_layer=conv), 3).eval()
    copied = init_from_pretrained(dcnet, cnn)
    assert "backbone.body.0.weight" in copied and "head.weight" in copied
    x = torch.rand(5, 1, 8, 8)
    torch.testing.assert_close(dcnet(x), cnn(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no parameter"):
        init_from_pretrained(dcnet, torch.nn.Linear(2, 2))


def test_scale_kernels_gives_weighted_operators_the_same_start_and_mean_kernel_norm_tracks_it():
    torch.manual_seed(25)
    conv = decoupled_factory(magnitude="tanh", weighted="linear")
    net = Classifier(plain_cnn(3, (4, 6, 8), 1, 8, 8, conv_layer=conv), 3)
    with torch.no_grad():  # layer means 1, 2 and 2 (kernels of norms 1 and 3 in turn in the last)
        for layer, norms in zip(decoupled_layers(net), ([1.0], [2.0], [1.0, 3.0])):
            layer.weight.copy_(F.normalize(layer.weight.flatten(1), dim=1).view_as(layer.weight))
            layer.weight.mul_(torch.tensor(norms).repeat(layer.out_channels // len(norms)).view(-1, 1, 1, 1))
    assert mean_kernel_norm(net) == pytest.approx(5 / 3)  # the mean of the layers' means
    with pytest.raises(ValueError, match="weighted operators"):
        project_weights(net)  # projection would change a weighted operator's output
    assert scale_kernels(net, 2.0) is net and mean_kernel_norm(net) == pytest.approx(2.0)
    for layer in decoupled_layers(net):
        torch.testing.assert_close(layer.weight.flatten(1).norm(dim=1), torch.full((layer.out_channels,), 2.0))
    with pytest.raises(ValueError, match="no decoupled layer"):
        scale_kernels(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="norm"):
        scale_kernels(net, 0.0)


def test_a_radius_per_channel_starts_as_the_layers_and_learns_per_channel():
    torch.manual_seed(26)
    conv = decoupled_factory(magnitude="tanh", radius_norm=True, learnable_rho=True, rho=0.7)
    net = Classifier(plain_cnn(3, (4, 6, 8), 1, 8, 8, conv_layer=conv), 3).eval()
    dense = torch.nn.Sequential(torch.nn.Flatten(),
                                DecoupledLinear(12, 5, magnitude="ball", learnable_rho=True, rho=1.5))
    x, v = torch.rand(4, 1, 8, 8), torch.rand(3, 12)
    before, dense_before = net(x), dense(v)
    raw_before = [m.parametrizations.rho.original.clone() for m in decoupled_layers(net)]
    radius_per_channel(net), radius_per_channel(dense)
    torch.testing.assert_close(net(x), before, rtol=0, atol=0)  # exactly the same function at the start
    torch.testing.assert_close(dense(v), dense_before, rtol=0, atol=0)
    net(x)[:, 0].sum().backward()
    for layer, raw in zip(decoupled_layers(net), raw_before):
        assert layer.rho.shape == (layer.out_channels, 1, 1)
        assert torch.equal(layer.parametrizations.rho.original.detach(), raw.expand(layer.out_channels, 1, 1))
        assert layer.parametrizations.rho.original.grad.shape == (layer.out_channels, 1, 1)
        assert len(set(layer.parametrizations.rho.original.grad.flatten().tolist())) > 1  # one rho per channel
    assert dense[1].rho.shape == (5, 1)
    with pytest.raises(ValueError, match="learnable_rho"):
        radius_per_channel(Classifier(plain_cnn(3, (4, 4, 4), 1, 8, 8, conv_layer=decoupled_factory()), 3))


def test_orthogonality_penalty_ignores_norms():
    q = torch.linalg.qr(torch.randn(6, 6, dtype=F64))[0]
    rows = q[:4] * torch.tensor([[0.1], [2.0], [5.0], [1.0]], dtype=F64)
    assert float(orthogonality_penalty(rows)) < 1e-20
    w = torch.randn(3, 2, 2, 2, dtype=F64)
    gram = w.flatten(1) @ w.flatten(1).T
    torch.testing.assert_close(orthogonality_penalty(w), (gram - torch.diag(gram.diagonal())).pow(2).sum())
    net = torch.nn.Sequential(_layer(25))
    reg = Orthogonality(net, beta=0.5)
    torch.testing.assert_close(reg(), 0.5 * orthogonality_penalty(net[0].weight))


@pytest.mark.parametrize("kwargs,message", [
    (dict(magnitude="cube"), "magnitude must be one of"),
    (dict(angular="tanh"), "angular must be one of"),
    (dict(rho=0.0), "rho must be a finite number > 0"),
    (dict(rho=-1.0, learnable_rho=True), "rho must be a finite number > 0.001"),
    (dict(alpha=0.0), "alpha must be a finite number > 0"),
    (dict(magnitude="seg", beta=-0.5), "beta must be a finite number >= 0"),
    (dict(magnitude="linear", weighted="tanh_joint"), "is a form of TanhConv"),
    (dict(weighted="quadratic"), "weighted must be one of"),
    (dict(magnitude="linear", radius_norm=True), "radius_norm=True needs a magnitude with a radius"),
    (dict(magnitude="log", learnable_rho=True), "learnable_rho=True needs a magnitude with a radius"),
    (dict(momentum=0.0), "momentum must be a finite number > 0"),
    (dict(angular="sigmoid", k=0.0), "k must be a finite number > 0"),
    (dict(eps=0.0), "eps must be a finite number > 0"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecoupledConv2d(3, 4, 3, **kwargs)


def test_bad_inputs_and_aid_arguments():
    layer = _layer(26)
    with pytest.raises(ValueError, match=r"input must be Tensor\[B, 3, H, W\]"):
        layer(torch.zeros(2, 4, 5, 5, dtype=F64))
    with pytest.raises(ValueError, match=r"input must be Tensor\[..., 5\]"):
        DecoupledLinear(5, 2)(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="no decoupled layer"):
        project_weights(torch.nn.Conv2d(1, 1, 1))
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        WeightProjection(0)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        project_weights(torch.nn.Sequential(layer), scale=0.0)
    with pytest.raises(ValueError, match="magnitude must be one of"):
        decoupled_factory(magnitude="cube")


def _statistics_net(seed):
    """A decoupled layer with a running E{||x||} and a BatchNorm after it, and 40 one-channel 6x6 images."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(DecoupledConv2d(1, 3, 3, padding=1, magnitude="tanh", radius_norm=True),
                              torch.nn.BatchNorm2d(3)).double()
    x = torch.rand(40, 1, 6, 6, dtype=F64)
    return net, x, torch.utils.data.TensorDataset(x, torch.zeros(40, dtype=torch.long))


def test_recalibrate_reestimates_batchnorm_and_patch_norm_means():
    """recalibration.recalibrate: running statistics equal the cumulative statistics of the data, modes restored."""
    from sphereml.recalibration import recalibrate

    net, x, data = _statistics_net(27)
    net.eval()
    assert recalibrate(net, data, batch_size=10, device="cpu") == 2
    assert not net.training and net[0].momentum == 0.1 and net[1].momentum == 0.1
    norms = decoupled_conv2d(x, net[0].weight, padding=1, magnitude="linear") / \
        decoupled_conv2d(x, net[0].weight, padding=1, magnitude="sphere")
    torch.testing.assert_close(net[0].norm_mean, norms.view(4, -1).mean(1).mean())  # mean of the batch means
    with torch.no_grad():
        net.train()
        outs = [net[0](x[i:i + 10]) for i in range(0, 40, 10)]
    torch.testing.assert_close(net[1].running_mean, torch.stack([o.mean((0, 2, 3)) for o in outs]).mean(0))
    with pytest.raises(ValueError, match="max_batches must be an integer >= 1"):
        recalibrate(net, data, max_batches=0, device="cpu")


def test_recalibrated_restores_the_running_statistics_after_the_block():
    """recalibration.recalibrated: inside, the statistics of recalibrate; after, the ones the model had, and its
    flags."""
    from sphereml.recalibration import recalibrate, recalibrated, stats_fresh

    net, x, data = _statistics_net(28)
    net.train()
    with torch.no_grad():
        net(x[:10] + 1.0)  # running statistics of a different input: what training left
    before = {name: b.clone() for name, b in net.named_buffers()}
    expected = copy.deepcopy(net)
    recalibrate(expected, data, batch_size=10, max_batches=2, device="cpu")
    with recalibrated(net, data, batch_size=10, max_batches=2, device="cpu") as inside:
        assert inside is net and stats_fresh(net) and net.training
        for name, b in net.named_buffers():
            torch.testing.assert_close(b, dict(expected.named_buffers())[name])
        assert not torch.equal(net[1].running_mean, before["1.running_mean"])
    for name, b in net.named_buffers():
        torch.testing.assert_close(b, before[name], rtol=0, atol=0)
    assert not stats_fresh(net) and net[1].momentum == 0.1
    wrong = torch.utils.data.TensorDataset(torch.rand(4, 2, 6, 6, dtype=F64), torch.zeros(4, dtype=torch.long))
    net.eval()
    with pytest.raises(ValueError, match="input must be"):  # two channels for a one-channel layer: the real error
        with recalibrated(net, wrong, device="cpu"):
            pass
    assert not net.training and net[1].momentum == 0.1 and not stats_fresh(net)
    for name, b in net.named_buffers():
        torch.testing.assert_close(b, before[name], rtol=0, atol=0)


@pytest.mark.parametrize("options", [dict(magnitude="tanh", radius_norm=True, learnable_rho=True),
                                     dict(magnitude="seg", angular="sqcosine")])
def test_layer_compiles_without_graph_breaks(options):
    """fullgraph=True fails on any graph break (the running-mean update included); aot_eager traces backward."""
    torch.compiler.reset()
    torch.manual_seed(28)
    layer = DecoupledConv2d(4, 6, 3, padding=1, **options)
    eager = DecoupledConv2d(4, 6, 3, padding=1, **options)
    eager.load_state_dict(layer.state_dict())
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    reference = eager(x)
    (grad_ref,) = torch.autograd.grad(reference.square().sum(), x)
    torch.testing.assert_close(out, reference)
    torch.testing.assert_close(grad, grad_ref)
    if layer.radius_norm:
        torch.testing.assert_close(layer.norm_mean, eager.norm_mean)


def test_bias_corrected_average_is_the_corrected_moving_average_of_the_batch_means():
    """recalibration.BiasCorrectedAverage: after T batches, sum_t (1 - d) d^(T-t) b_t / (1 - d^T) (TF's EMA)."""
    from sphereml.recalibration import BiasCorrectedAverage
    from sphereml.train import StepState

    torch.manual_seed(3)
    norm = torch.nn.BatchNorm1d(2).double().train()
    norm.running_mean.fill_(5.0)  # reset by the callback: no bias towards an old value
    decay = 0.9
    average = BiasCorrectedAverage(norm, decay=decay)
    means = []
    for step in range(1, 5):
        batch = torch.randn(8, 2, dtype=F64) + step
        means.append(batch.mean(0))
        with torch.no_grad():
            norm(batch)
        average(StepState(step=step, epoch=0, loss_tensor=torch.zeros(()), model=norm, optimizer=None))
        weights = [(1 - decay) * decay ** (len(means) - 1 - i) for i in range(len(means))]
        expected = sum(w * m for w, m in zip(weights, means)) / (1 - decay ** len(means))
        torch.testing.assert_close(norm.running_mean, expected)
    with pytest.raises(ValueError, match="decay must be"):
        BiasCorrectedAverage(norm, decay=1.0)
