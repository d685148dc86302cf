"""SphereConv (thesis Ch. 3): oracle agreement, invariants, gradients, bad arguments.

The oracle is the library's readable definition, :func:`sphere_conv2d_reference` (unfold, patch by
patch, g as printed in eqs. 3.2-3.4), which shares no code with the fast path.
"""

import pytest
import torch
import torch.nn.functional as F

from sphereml.angular import ANGULAR
from sphereml.layers.sphereconv import (SphereConv2d, SphereLinear, SphereNorm, sphere_conv2d, sphere_conv2d_reference,
    sphere_linear)

ANGULAR_CASES = [("linear", 0.5), ("cosine", 0.5), ("sigmoid", 0.3), ("sigmoid", 2.0)]
CONV_CASES = [  # (C_in, C_out, kernel, stride, padding, dilation, groups)
    (3, 4, 3, 1, 0, 1, 1),
    (3, 4, 3, 2, 1, 1, 1),
    (4, 6, (3, 2), (1, 2), (2, 1), 2, 2),
    (6, 6, 3, 1, 1, 1, 3),
]


@pytest.mark.parametrize("angular,k", ANGULAR_CASES)
@pytest.mark.parametrize("case", CONV_CASES)
def test_matches_unfold_reference(angular, k, case):
    cin, cout, ks, stride, padding, dilation, groups = case
    torch.manual_seed(0)
    layer = SphereConv2d(cin, cout, ks, stride, padding, dilation, groups, angular=angular, k=k,
                         dtype=torch.float64)
    x = torch.randn(2, cin, 9, 8, dtype=torch.float64)
    out = layer(x)
    ref = sphere_conv2d_reference(x, layer.weight, layer.stride, layer.padding, layer.dilation, groups, angular, k)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert out.abs().max() <= 1.0


@pytest.mark.parametrize("angular,k", ANGULAR_CASES)
def test_sphere_linear_matches_definition(angular, k):
    torch.manual_seed(1)
    x, w = torch.randn(5, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    as_conv = sphere_conv2d_reference(x[:, :, None, None], w[:, :, None, None], angular=angular, k=k)  # 1x1 conv
    torch.testing.assert_close(sphere_linear(x, w, angular=angular, k=k), as_conv[:, :, 0, 0], atol=1e-10, rtol=0)


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


def test_reference_refuses_an_unknown_angular():
    with pytest.raises(ValueError, match="angular must be one of"):
        sphere_conv2d_reference(torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3), angular="tanh")



@pytest.mark.parametrize("angular,learnable_k", [("cosine", False), ("linear", False), ("sigmoid", True)])
def test_layers_compile_without_graph_breaks(angular, learnable_k):
    """fullgraph=True fails on any graph break; aot_eager traces the fused autograd nodes' backward too."""
    torch.compiler.reset()  # each case compiles afresh (no recompile limit across cases)
    torch.manual_seed(16)
    layer = SphereConv2d(4, 6, 3, padding=1, angular=angular, learnable_k=learnable_k)
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    grads = torch.autograd.grad(out.square().sum(), (x, layer.weight))
    grads_ref = torch.autograd.grad(layer(x).square().sum(), (x, layer.weight))
    torch.testing.assert_close(out, layer(x))
    torch.testing.assert_close(grads, grads_ref)
