"""Sharpened cosine similarity and max-abs pooling: the definition, invariants (reference D.1-D.2), gradients."""

import pytest
import torch
import torch.nn.functional as F

from sphereml.layers.patches import patch_cosine2d
from sphereml.layers.scs import (P_MIN, MaxAbsPool2d, SharpenedCosineSimilarity2d, max_abs_pool2d, scs_conv2d,
    scs_conv2d_reference, sharpen)

F64 = torch.float64
CONV_CASES = [  # (C_in, C_out, kernel, stride, padding, dilation, groups)
    (3, 4, 3, 1, 0, 1, 1),
    (3, 4, 3, 2, 1, 1, 1),
    (4, 6, (3, 2), (1, 2), (2, 1), 2, 2),
]


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("p,q", [(1.0, 0.0), (2.0, 1e-3), (0.5, 0.3), (3.7, 1.0)])
@pytest.mark.parametrize("case", CONV_CASES)
def test_matches_the_unfold_definition(p, q, case):
    cin, cout, ks, stride, padding, dilation, groups = case
    torch.manual_seed(0)
    layer = SharpenedCosineSimilarity2d(cin, cout, ks, stride, padding, dilation, groups, p=p, q=q, dtype=F64)
    x = _x(2, cin, 9, 8)
    ref = scs_conv2d_reference(x, layer.weight, p, q, layer.stride, layer.padding, layer.dilation, groups)
    torch.testing.assert_close(layer(x), ref, atol=1e-12, rtol=0)


def test_learned_per_channel_p_matches_the_definition():
    torch.manual_seed(1)
    layer = SharpenedCosineSimilarity2d(3, 5, 3, padding=1, learnable=True, p=2.0, q=0.05, dtype=F64)
    with torch.no_grad():
        layer.p = torch.linspace(0.5, 3.0, 5, dtype=F64)
    x = _x(2, 3, 6, 6, seed=1)
    ref = scs_conv2d_reference(x, layer.weight, layer.p.detach().view(-1, 1, 1), float(layer.q.detach()), 1, 1)
    torch.testing.assert_close(layer(x), ref, atol=1e-12, rtol=0)


def test_bounded_sign_preserving_odd_and_kernel_scale_invariant():
    torch.manual_seed(2)
    layer = SharpenedCosineSimilarity2d(3, 6, 3, padding=1, p=2.5, q=0.1, dtype=F64)
    x = _x(2, 3, 7, 7, seed=2)
    out = layer(x)
    assert out.abs().max() <= 1.0
    inner = F.conv2d(x, layer.weight, None, 1, 1)
    assert torch.equal(torch.sign(out), torch.sign(inner))
    torch.testing.assert_close(layer(-x), -out)
    with torch.no_grad():
        layer.weight.mul_(torch.rand(6, 1, 1, 1, dtype=F64) * 10 + 0.1)  # one positive scale per kernel
    torch.testing.assert_close(layer(x), out)


def test_p1_q0_is_the_cosine_and_q_damps_faint_patches():
    torch.manual_seed(3)
    w = _x(4, 3, 3, 3, seed=3)
    x = _x(2, 3, 6, 6, seed=4)
    torch.testing.assert_close(scs_conv2d(x, w, p=1.0, q=0.0, padding=1), patch_cosine2d(x, w, padding=1))
    strong = scs_conv2d(10 * x, w, p=2.0, q=0.5, padding=1).abs()
    weak = scs_conv2d(0.1 * x, w, p=2.0, q=0.5, padding=1).abs()
    limit = scs_conv2d(x, w, p=2.0, q=0.0, padding=1).abs()
    assert bool((weak <= strong).all()) and bool((strong <= limit + 1e-12).all())  # |SCS(a s)| grows with a


def test_sharpening_is_monotone_in_p():
    c = torch.linspace(-0.99, 0.99, 199, dtype=F64)
    values = [sharpen(c, p).abs() for p in (0.5, 1.0, 2.0, 4.0)]
    torch.testing.assert_close(values[1], c.abs())
    for lower, higher in zip(values[1:], values[:-1]):
        assert bool((lower <= higher).all())


def test_the_kernel_gradient_is_perpendicular_to_every_kernel():
    """Degree-0 homogeneity in each kernel: <dL/dk_j, k_j> = 0, so plain SGD can only grow kernel norms."""
    torch.manual_seed(5)
    layer = SharpenedCosineSimilarity2d(3, 5, 3, padding=1, p=2.0, q=0.1, learnable=True, dtype=F64)
    x = _x(4, 3, 6, 6, seed=5)
    (layer(x) * _x(4, 5, 6, 6, seed=6)).sum().backward()
    per_kernel = (layer.weight.grad * layer.weight.detach()).flatten(1).sum(1)
    assert per_kernel.abs().max() < 1e-12
    before = layer.weight.detach().flatten(1).norm(dim=1)
    with torch.no_grad():
        layer.weight -= 0.5 * layer.weight.grad
    assert bool((layer.weight.detach().flatten(1).norm(dim=1) >= before).all())


@pytest.mark.parametrize("learnable", [False, True])
def test_gradcheck_away_from_zero_cosine(learnable):
    torch.manual_seed(7)
    x = (_x(2, 2, 5, 5, seed=7)).requires_grad_(True)
    w = _x(3, 2, 3, 3, seed=8).requires_grad_(True)
    p = (torch.rand(3, 1, 1, dtype=F64) + 0.8).requires_grad_(learnable)
    q = torch.tensor(0.2, dtype=F64, requires_grad=learnable)
    assert torch.autograd.gradcheck(lambda a, b, pp, qq: scs_conv2d(a, b, pp, qq, padding=1), (x, w, p, q))


@pytest.mark.parametrize("learnable", [False, True])
@pytest.mark.parametrize("p", [0.5, 1.0, 2.0])
def test_finite_gradients_at_zero_cosine_zero_patches_and_alignment(p, learnable):
    # q = 0 makes c = 1 exact for a parallel patch; a learned q must be > 0, so it is tiny there
    layer = SharpenedCosineSimilarity2d(2, 3, 3, padding=1, p=p, q=1e-8 if learnable else 0.0, learnable=learnable)
    with torch.no_grad():
        layer.weight[0] = 1.0  # kernel 0 parallel to a constant patch: c = 1
        layer.weight[1, 0], layer.weight[1, 1] = 1.0, -1.0  # kernel 1 orthogonal to it: c = 0 exactly
    for x in (torch.zeros(2, 2, 5, 5), torch.full((2, 2, 5, 5), 3.0)):
        x.requires_grad_(True)
        layer.zero_grad()
        out = layer(x)
        out.sum().backward()
        grads = [x.grad, layer.weight.grad] + [q.grad for q in layer.parameters() if q is not layer.weight]
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
        assert out.abs().max() <= 1.0
    assert float(layer(torch.full((1, 2, 5, 5), 3.0))[0, 0, 2, 2].detach()) == pytest.approx(1.0, abs=1e-6)
    assert layer(torch.zeros(1, 2, 5, 5)).abs().max() == 0  # zero patches give 0


def test_bfloat16_autocast_is_finite():
    torch.manual_seed(9)
    layer = SharpenedCosineSimilarity2d(4, 6, 3, padding=1, learnable=True)
    x = (torch.randn(2, 4, 8, 8) * 300).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all() and torch.isfinite(x.grad).all()
    torch.testing.assert_close(out.float(), layer(x).detach(), atol=3e-2, rtol=0)


def test_learned_p_stays_positive_and_round_trips():
    torch.manual_seed(10)
    layer = SharpenedCosineSimilarity2d(3, 4, 3, learnable=True, p=2.0, q=1e-3)
    torch.testing.assert_close(layer.p, torch.full((4,), 2.0))
    torch.testing.assert_close(layer.q, torch.tensor(1e-3))
    opt = torch.optim.SGD(layer.parameters(), lr=50.0)
    x = torch.randn(4, 3, 6, 6)
    for _ in range(20):  # push p and q down hard
        opt.zero_grad()
        (layer.p.sum() + 100 * layer.q - layer(x).abs().mean()).backward()
        opt.step()
    assert bool((layer.p > 0).all()) and float(layer.q.detach()) > 0
    raw = SharpenedCosineSimilarity2d(3, 4, 3, learnable=True, p_param="raw")
    with torch.no_grad():
        raw.parametrizations.p.original.fill_(-5.0)
    torch.testing.assert_close(raw.p, torch.full((4,), P_MIN))
    clone = SharpenedCosineSimilarity2d(3, 4, 3, learnable=True)
    clone.load_state_dict(layer.state_dict())
    torch.testing.assert_close(clone(x), layer(x))
    assert "p_param='exp'" in repr(layer) and "p=2, q=0.001" in repr(SharpenedCosineSimilarity2d(3, 4, 3))
    biased = SharpenedCosineSimilarity2d(3, 4, 3, bias=True)
    torch.testing.assert_close(biased(x), sharpen(biased.cosine(x), 2.0) + biased.bias.view(-1, 1, 1))


def test_layers_compile_without_graph_breaks():
    torch.compiler.reset()
    layer = SharpenedCosineSimilarity2d(3, 4, 3, padding=1, learnable=True)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    compiled = torch.compile(torch.nn.Sequential(layer, MaxAbsPool2d(2)), fullgraph=True, backend="aot_eager")
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    (grad_ref,) = torch.autograd.grad(max_abs_pool2d(layer(x), 2).sum(), x)
    torch.testing.assert_close(grad, grad_ref)


# ---------------------------------------------------------------- max-abs pooling (reference D.2)

def test_max_abs_pool_keeps_the_signed_largest_magnitude():
    x = _x(2, 3, 6, 6, seed=11)
    out = max_abs_pool2d(x, 2)
    torch.testing.assert_close(out.abs(), F.max_pool2d(x.abs(), 2))
    windows = F.unfold(x, 2, stride=2).view(2, 3, 4, -1)  # (B, C, window, L)
    assert bool((windows == out.flatten(2)[:, :, None, :]).any(2).all())  # the output is an element of its window
    torch.testing.assert_close(max_abs_pool2d(-x, 2), -out)
    torch.testing.assert_close(max_abs_pool2d(x.abs(), 2), F.max_pool2d(x.abs(), 2))  # = MaxPool on x >= 0
    tie = torch.tensor([[[[2.0, -2.0], [0.5, 1.0]]]])
    assert float(max_abs_pool2d(tie, 2)) == 2.0  # +a wins a tie with -a, as upstream


def test_max_abs_pool_routes_the_gradient_to_the_selected_element():
    x = torch.tensor([[[[1.0, -3.0], [2.0, 0.5]]]], requires_grad=True)
    max_abs_pool2d(x, 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([[[[0.0, 1.0], [0.0, 0.0]]]]))
    pool = MaxAbsPool2d(3, stride=2, padding=1)
    assert pool(torch.randn(1, 2, 7, 7)).shape == (1, 2, 4, 4) and "kernel_size=(3, 3)" in repr(pool)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("make,message", [
    (lambda: SharpenedCosineSimilarity2d(3, 4, 3, p=0.0), "p must be a finite number > 0"),
    (lambda: SharpenedCosineSimilarity2d(3, 4, 3, p=-1.0), "p must be a finite number > 0"),
    (lambda: SharpenedCosineSimilarity2d(3, 4, 3, q=-0.1), "q must be a finite number >= 0"),
    (lambda: SharpenedCosineSimilarity2d(3, 4, 3, q=0.0, learnable=True), "q must be a finite number > 0"),
    (lambda: SharpenedCosineSimilarity2d(3, 4, 3, p=0.05, learnable=True, p_param="raw"), "p must be a finite"),
    (lambda: SharpenedCosineSimilarity2d(3, 4, 3, p_param="softplus"), "p_param must be one of"),
    (lambda: SharpenedCosineSimilarity2d(3, 4, 0), "kernel_size must be an integer >= 1"),
    (lambda: SharpenedCosineSimilarity2d(3, 4, 3, stride=0), "stride must be an integer >= 1"),
    (lambda: SharpenedCosineSimilarity2d(3, 4, 3, groups=2), "divisible by groups"),
    (lambda: SharpenedCosineSimilarity2d(True, 4, 3), "in_channels must be an integer >= 1"),
    (lambda: SharpenedCosineSimilarity2d(3, 4, 3)(torch.zeros(1, 2, 5, 5)), r"Tensor\[B, 3, H, W\]"),
    (lambda: scs_conv2d(torch.zeros(1, 1, 3, 3), torch.ones(1, 1, 3, 3), q=-1.0), "q must be a finite number >= 0"),
    (lambda: sharpen(torch.zeros(3), 0.0), "p must be a finite number > 0"),
    (lambda: MaxAbsPool2d(2, padding=2), "padding must be at most half the kernel size"),
    (lambda: MaxAbsPool2d(0), "kernel_size must be an integer >= 1"),
])
def test_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()
