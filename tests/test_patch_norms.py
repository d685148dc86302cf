"""Patch norms with one pass over the input each way (sphereml.layers.patch_norms): values and gradients against
their definitions in both the CPU's and the GPU's forms, the floors, extreme magnitudes, half inputs, vmap, and
the passes over the input counted."""

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from sphereml.launches import count_ops
from sphereml.layers import patch_norms, window_sums
from sphereml.layers.decoupled import decoupled_conv2d
from sphereml.layers.patch_norms import channel_energy, conv_and_squared_norms, patch_norm, squared_patch_norms
from sphereml.layers.patches import patch_cosine2d

F64 = torch.float64
WINDOW = ((3, 3), (1, 1), (1, 1), (1, 1))  # kernel size, stride, padding, dilation


@pytest.fixture(autouse=True)
def box_sums_by_convolution(monkeypatch):
    """The node's box sums as convolutions, its form where the Triton kernels do not take x (the kernels' form is
    tested against this one in test_window_sums.py)."""
    monkeypatch.setattr(window_sums, "takes", lambda x: False)


@pytest.fixture(params=["cpu form", "gpu form"])
def form(request, monkeypatch):
    """Each test runs with the CPU's reductions and with the GPU's (one vector_norm each), both on this device."""
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: request.param == "gpu form")
    return request.param


def energy_definition(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, c, h, w = x.shape
    return x.square().reshape(b, groups, c // groups, h, w).sum(2)


def norm_definition(x: torch.Tensor, kernel_size, stride, padding, dilation, groups: int) -> torch.Tensor:
    """||x_patch|| by unfolding each group's patches (zero padding included)."""
    b, c = x.shape[:2]
    norms = [F.unfold(part, kernel_size, dilation, padding, stride).norm(dim=1) for part in x.chunk(groups, 1)]
    out = torch.stack(norms, 1)
    size = F.conv2d(x[:, :groups], x.new_ones(groups, 1, *kernel_size), None, stride, padding, dilation, groups)
    return out.reshape(size.shape)


@pytest.mark.parametrize("groups", [1, 2])
def test_channel_energy_is_the_sum_of_squares_with_its_gradient(form, groups):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 5, 3, generator=g, dtype=F64, requires_grad=True)
    torch.testing.assert_close(channel_energy(x, groups), energy_definition(x, groups), rtol=1e-12, atol=0)
    assert torch.autograd.gradcheck(lambda v: channel_energy(v, groups), (x,))
    assert torch.autograd.gradgradcheck(lambda v: channel_energy(v, groups), (x,))
    x32 = x.detach().float().requires_grad_(True)
    grad = torch.randn(2, groups, 5, 3, generator=g)
    (got,) = torch.autograd.grad(channel_energy(x32, groups), x32, grad)
    torch.testing.assert_close(got, (2 * x32.detach().reshape(2, groups, -1, 5, 3) * grad.unsqueeze(2))
                               .reshape(x32.shape), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_accumulate_in_float32(form, dtype):
    """Squares of 300 overflow float16: the energy is float32, equal to the upcast input's; dL/dx in x's dtype."""
    x = (torch.randn(2, 6, 4, 4, generator=torch.Generator().manual_seed(1)) * 300).to(dtype).requires_grad_(True)
    energy = channel_energy(x, 2)
    assert energy.dtype == torch.float32 and bool(torch.isfinite(energy).all())
    torch.testing.assert_close(energy, energy_definition(x.detach().float(), 2), rtol=1e-6, atol=0)
    sq = squared_patch_norms(x, *WINDOW, 2)
    torch.testing.assert_close(sq, norm_definition(x.detach().float(), *WINDOW, 2).square(), rtol=1e-5, atol=0)
    (grad,) = torch.autograd.grad(energy.sum(), x)
    assert grad.dtype == dtype


@pytest.mark.parametrize("groups,stride,dilation", [(1, (1, 1), (1, 1)), (2, (2, 1), (1, 2))])
def test_patch_norm_matches_unfold_with_the_gradient_x_over_the_norm(form, groups, stride, dilation):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 7, 6, generator=g, dtype=F64, requires_grad=True)
    window = ((3, 2), stride, (1, 1), dilation)
    torch.testing.assert_close(patch_norm(x, *window, groups, 1e-6), norm_definition(x, *window, groups),
                               rtol=1e-12, atol=0)
    assert torch.autograd.gradcheck(lambda v: patch_norm(v, *window, groups, 1e-6), (x,))
    assert torch.autograd.gradgradcheck(lambda v: patch_norm(v, *window, groups, 1e-6), (x,))
    grad = torch.randn(norm_definition(x, *window, groups).shape, generator=g, dtype=F64)  # not one-hot
    (got,) = torch.autograd.grad(patch_norm(x, *window, groups, 1e-6), x, grad)
    (want,) = torch.autograd.grad(norm_definition(x, *window, groups), x, grad)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_patch_norm_gradient_is_autograds_through_the_floors(form):
    """Zero patches and patches below eps (the floors active) get zero gradient and the others x / ||x||, as
    autograd through the composite clamp(sqrt(clamp(box sum of x^2)), eps) gives."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 8, 8, generator=g)
    x[0, :, :5, :5] = 0.0  # patches wholly inside are zero
    x[1, :, :5, :5] *= 1e-9  # and below eps = 1e-6
    x.requires_grad_(True)
    grad = torch.randn(2, 1, 8, 8, generator=g)
    (got,) = torch.autograd.grad(patch_norm(x, *WINDOW, 1, 1e-6), x, grad)
    tiny = torch.finfo(torch.float32).tiny
    composite = F.conv2d(x.square().sum(1, keepdim=True), x.new_ones(1, 1, 3, 3), padding=1)
    (want,) = torch.autograd.grad(composite.clamp_min(tiny).sqrt().clamp_min(1e-6), x, grad)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(got[:, :, :3, :3].abs().max()) == 0.0  # every patch over these positions is floored


def test_the_cpu_keeps_the_composites_gradients_to_the_bit():
    """On the CPU the decoupled operators' norms are autograd through their forward: the numbers of the composite
    the chapters' recorded cpu runs used, to the bit (a change at rounding moved 84 of chapter 4's 129)."""
    x = torch.randn(2, 3, 7, 7, generator=torch.Generator().manual_seed(13), requires_grad=True)
    grad = torch.randn(2, 1, 7, 7, generator=torch.Generator().manual_seed(14))
    tiny = torch.finfo(torch.float32).tiny

    def composite(v):
        scale = v.detach().abs().amax(dim=(1, 2, 3), keepdim=True).clamp_min(tiny)
        squares = F.conv2d((v / scale).square().sum(1, keepdim=True), v.new_ones(1, 1, 3, 3), padding=1)
        return (squares.clamp_min(tiny).sqrt() * scale).clamp_min(1e-6)
    got, want = patch_norm(x, *WINDOW, 1, 1e-6), composite(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0],
                               rtol=0, atol=0)


@pytest.mark.parametrize("magnitude", [1e30, 1e-30])
def test_patch_norm_neither_overflows_nor_underflows(form, magnitude):
    """float32 squares of 1e30 are inf and of 1e-30 are 0: the norms and gradients are still right."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 5, 5, generator=g, dtype=F64)
    want = norm_definition(x, *WINDOW, 1) * magnitude
    x32 = (x * magnitude).float().requires_grad_(True)
    norm = patch_norm(x32, *WINDOW, 1, 1e-38)
    torch.testing.assert_close(norm.double(), want, rtol=1e-5, atol=0)
    (grad,) = torch.autograd.grad(norm.sum(), x32)
    x.requires_grad_(True)
    (want_grad,) = torch.autograd.grad(norm_definition(x, *WINDOW, 1).sum(), x)  # x / ||x||: the same at any scale
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_patch_norm_of_half_inputs(form, dtype):
    """Half inputs: the norm in x's dtype, right to its rounding (float16 without the scale: its squares fit
    float32), the gradient in x's dtype and within a few of its roundings of x / ||x||."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 6, 6, generator=g, dtype=F64) * 100
    xh = x.to(dtype).requires_grad_(True)
    exact = xh.detach().double().requires_grad_(True)
    norm = patch_norm(xh, *WINDOW, 1, 1e-6)
    want = norm_definition(exact, *WINDOW, 1)
    assert norm.dtype == dtype
    torch.testing.assert_close(norm.double(), want.detach(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-3, atol=0)
    grad = torch.randn(want.shape, generator=g, dtype=F64)
    (got,) = torch.autograd.grad(norm, xh, grad.to(dtype))
    (want_grad,) = torch.autograd.grad(want, exact, grad)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want_grad, rtol=0.03, atol=0.03 * float(want_grad.abs().max()))


@pytest.mark.parametrize("dtype,magnitude,eps", [(torch.float32, 1e-30, 0.0), (torch.float16, 1.0, 1e-8)])
def test_floors_that_round_to_zero_give_zero_gradients(form, dtype, magnitude, eps):
    """Where the floored norm itself rounds to 0 (eps = 0 below the root's floor, or an eps under float16's
    smallest number), the gradient there is 0, not 0 * inf = NaN."""
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(8)) * magnitude
    x[0, :, :4, :4] = 0.0
    x = x.to(dtype).requires_grad_(True)
    (grad,) = torch.autograd.grad(patch_norm(x, *WINDOW, 1, eps).sum(), x)
    assert bool(torch.isfinite(grad).all())


def test_patch_norm_propagates_nan():
    x = torch.randn(1, 2, 4, 4)
    x[0, 0, 0, 0] = float("nan")
    assert bool(torch.isnan(patch_norm(x, *WINDOW, 1, 1e-6)).any())


def test_autocast_leaves_the_sums_of_squares_in_float32(form):
    """Under bf16 autocast the box sums (convolutions) would run in bf16: they stay float32, to the bit."""
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(6), requires_grad=True)
    want = (squared_patch_norms(x, *WINDOW, 1), patch_norm(x, *WINDOW, 1, 1e-6))
    want_grad = torch.autograd.grad(want[0].sum() + want[1].sum(), x)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = (squared_patch_norms(x, *WINDOW, 1), patch_norm(x, *WINDOW, 1, 1e-6))
        got_grad = torch.autograd.grad(got[0].sum() + got[1].sum(), x)[0]
    for a, b in zip(got + (got_grad,), want + (want_grad,)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_both_nodes_map_over_seeds(form):
    """torch.func.vmap over a leading seed axis (sphereml.multiseed) equals one call per seed, gradients too."""
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(3, 2, 4, 5, 5, generator=g)

    def loss(x):
        return patch_norm(x, *WINDOW, 2, 1e-6).sum() + channel_energy(x, 2).square().sum()
    mapped = torch.func.vmap(torch.func.grad(loss))(xs)
    for seed in range(3):
        torch.testing.assert_close(mapped[seed], torch.func.grad(loss)(xs[seed]))


def test_patch_layers_pass_over_their_input_once_each_way_on_a_gpu(monkeypatch):
    """The GPU's forms, counted on the CPU: operations that read or write a tensor of the input's size, forward +
    backward, with more input channels than output channels (so that only x-sized tensors count).  nn.Conv2d: its
    convolution and backward.  A patch layer adds the energy's reduction, dL/dx's one product and autograd's sum
    of the two dL/dx; the decoupled operator's scaled norms one reduction and one division more."""
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    x = torch.randn(2, 16, 6, 6, requires_grad=True)
    w = torch.randn(4, 16, 3, 3, requires_grad=True)
    layers = {"nn.Conv2d": lambda: F.conv2d(x, w, padding=1), "SphereConv": lambda: patch_cosine2d(x, w, padding=1),
              "SCS": lambda: patch_cosine2d(x, w, padding=1, q=1e-3, power=2.0),
              "decoupled": lambda: decoupled_conv2d(x, w, padding=1)}
    counts = {}
    for name, layer in layers.items():
        x.grad = None
        counts[name] = count_ops(lambda f=layer: f().sum().backward(), touching=x.numel()).total
    assert counts == {"nn.Conv2d": 2, "SphereConv": 5, "SCS": 5, "decoupled": 7}


def test_forward_mode_gives_the_definitions_directional_derivatives(form):
    """torch.func.jvp through both nodes (forward-mode AD, jacfwd, hessian) equals the definitions'."""
    g = torch.Generator().manual_seed(9)
    x, t = (torch.randn(2, 4, 5, 5, generator=g, dtype=F64) for _ in range(2))
    for node, definition in ((lambda v: channel_energy(v, 2), lambda v: energy_definition(v, 2)),
                             (lambda v: patch_norm(v, *WINDOW, 2, 1e-6), lambda v: norm_definition(v, *WINDOW, 2))):
        _, got = torch.func.jvp(node, (x,), (t,))
        _, want = torch.func.jvp(definition, (x,), (t,))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        with torch.autograd.forward_ad.dual_level():  # the node itself, x requiring a gradient
            dual = torch.autograd.forward_ad.make_dual(x.clone().requires_grad_(True), t)
            torch.testing.assert_close(torch.autograd.forward_ad.unpack_dual(node(dual)).tangent, want,
                                       rtol=1e-12, atol=1e-14)


def test_second_derivatives_in_forward_over_reverse_mode(form):
    """torch.func.hessian (forward mode over reverse mode) of a function of the patch norms equals the
    definition's."""
    x = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(12), dtype=F64)

    def through(norm_of):
        return lambda v: norm_of(v).square().sum() + norm_of(v).sum()
    got = torch.func.hessian(through(lambda v: patch_norm(v, *WINDOW, 1, 1e-6)))(x)
    want = torch.func.hessian(through(lambda v: norm_definition(v, *WINDOW, 1)))(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_meta_tensors_give_shapes():
    x, w = torch.empty(2, 4, 8, 8, device="meta"), torch.empty(6, 4, 3, 3, device="meta")
    assert decoupled_conv2d(x, w, padding=1).shape == (2, 6, 8, 8)
    assert patch_norm(x.requires_grad_(True), *WINDOW, 2, 1e-6).shape == (2, 2, 8, 8)
    inner, sq = conv_and_squared_norms(x, w, 1, 1, 1, 1)  # meta is not the CPU: the node, with no autocast to ask
    assert inner.shape == (2, 6, 8, 8) and sq.shape == (2, 1, 8, 8)


@pytest.mark.parametrize("padding", [0, "valid", "same"])
def test_patch_norm2d_takes_the_layers_paddings(padding):
    from sphereml.layers.patches import patch_norm2d
    x = torch.randn(1, 2, 6, 7, generator=torch.Generator().manual_seed(10), dtype=F64)
    numbers = {0: (0, 0), "valid": (0, 0), "same": (1, 1)}[padding]
    torch.testing.assert_close(patch_norm2d(x, 3, padding=padding),
                               norm_definition(x, (3, 3), (1, 1), numbers, (1, 1), 1), rtol=1e-12, atol=0)


def test_the_layers_agree_in_both_forms(monkeypatch):
    """SphereConv, SCS and the decoupled operator: outputs and gradients in the GPU's forms equal the CPU's."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 6, 7, 7, generator=g, dtype=F64)
    w = torch.randn(4, 3, 3, 3, generator=g, dtype=F64)
    layers = {"SphereConv": lambda a, b: patch_cosine2d(a, b, padding=1, groups=2),
              "SCS": lambda a, b: patch_cosine2d(a, b, padding=1, groups=2, q=1e-3, power=2.0),
              "decoupled": lambda a, b: decoupled_conv2d(a, b, padding=1, groups=2)}
    for name, layer in layers.items():
        results = []
        for accelerator in (False, True):
            monkeypatch.setattr(patch_norms, "on_accelerator", lambda device, a=accelerator: a)
            xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            out = layer(xx, ww)
            results.append((out, *torch.autograd.grad(out.square().sum(), (xx, ww))))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=name)


def test_autocast_is_switched_off_only_where_it_is_on():
    """The reductions and box sums run with autocast off (on a GPU it would copy a bf16 input to float32 for the
    norm and run the box sums in bf16); without autocast, or on a device without it (meta), nothing is entered."""
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert isinstance(patch_norms._autocast_off(cpu), nullcontext)
    assert isinstance(patch_norms._autocast_off(meta), nullcontext)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with patch_norms._autocast_off(cpu):
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")


def _conv_and_norms_loss(x, w, groups, node: bool):
    """A loss of both outputs, through the node (the GPU's form) or through the two computed apart."""
    if node:
        inner, sq = conv_and_squared_norms(x, w, (1, 1), (1, 1), (1, 1), groups)
    else:
        inner, sq = F.conv2d(x, w, None, 1, 1, 1, groups), squared_patch_norms(x, *WINDOW, groups)
    target = torch.linspace(-1.0, 1.0, inner.numel(), dtype=torch.float64).reshape(inner.shape).to(inner.dtype)
    return (inner * target).sum() + sq.sqrt().sum()


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("groups", [1, 2])
def test_convolution_and_norms_in_one_node_give_the_two_apart(monkeypatch, groups, layout):
    """Note [convolution and norms in one node]: values and the gradients of x and w as when the convolution and
    the squared norms are computed apart (float32), and float64 gradcheck of both outputs."""
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    g = torch.Generator().manual_seed(31)
    x, w = torch.randn(2, 4, 6, 6, generator=g), torch.randn(6, 4 // groups, 3, 3, generator=g)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    results = []
    for node in (True, False):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = _conv_and_norms_loss(xx, ww, groups, node)
        results.append([loss.detach(), *torch.autograd.grad(loss, (xx, ww))])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    xx = x.clone().requires_grad_(True)
    assert count_ops(lambda: _conv_and_norms_loss(xx, w, groups, True).backward()).by_op["aten::addcmul_"] == 1
    xx, ww = x.double().requires_grad_(True), w.double().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: conv_and_squared_norms(a, b, (1, 1), (1, 1), (1, 1), groups),
                                    (xx, ww))


GEOMETRIES = [((2, 2), (1, 1), (1, 1), (3, 3), 1), ((2, 1), (1, 0), (1, 2), (3, 2), 2), (1, 2, 2, (3, 3), 4),
              ((3, 1), (0, 2), (2, 1), (2, 3), 1)]  # stride, padding, dilation, kernel, groups


@pytest.mark.parametrize("outputs", ["both", "inner", "sq"])
@pytest.mark.parametrize("stride,padding,dilation,kernel,groups", GEOMETRIES)
def test_convolution_and_norms_in_any_geometry(monkeypatch, stride, padding, dilation, kernel, groups, outputs):
    """Strides, asymmetric paddings, dilations, non-square kernels and groups (numbers or pairs), with a loss of
    both outputs or of one (the other's incoming gradient None): float64 gradients as the two computed apart, and
    gradgradcheck."""
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    g = torch.Generator().manual_seed(35)
    x = torch.randn(2, 4, 7, 6, generator=g, dtype=F64)
    w = torch.randn(4, 4 // groups, *kernel, generator=g, dtype=F64)

    def loss(node, a, b):
        if node:
            inner, sq = conv_and_squared_norms(a, b, stride, padding, dilation, groups)
        else:
            inner = F.conv2d(a, b, None, stride, padding, dilation, groups)
            sq = squared_patch_norms(a, kernel, *(patch_norms_pair(v) for v in (stride, padding, dilation)), groups)
        return {"both": inner.sin().sum() + sq.sqrt().sum(), "inner": inner.sin().sum(), "sq": sq.sqrt().sum()}[outputs]
    results = []
    for node in (True, False):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        results.append(torch.autograd.grad(loss(node, xx, ww), (xx, ww), allow_unused=True))
    for got, want in zip(*results):
        assert (got is None) == (want is None) or float(want.abs().max()) == 0.0
        if want is not None and got is not None:
            torch.testing.assert_close(got, want)
    xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda a, b: loss(True, a, b), (xx, ww))


def patch_norms_pair(value):
    return (value, value) if isinstance(value, int) else value


def test_convolution_and_norms_map_over_samples(monkeypatch):
    """Per-sample gradients by torch.func (vmap of grad) as a loop over the samples."""
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    g = torch.Generator().manual_seed(36)
    x, w = torch.randn(3, 2, 5, 5, generator=g), torch.randn(3, 2, 3, 3, generator=g)

    def loss(sample, weight):
        inner, sq = conv_and_squared_norms(sample[None], weight, 1, 1, 1, 1)
        return inner.square().sum() + sq.sqrt().sum()
    with pytest.warns(UserWarning, match="batching rule for aten::addcmul_"):  # a performance warning
        mapped = torch.func.vmap(torch.func.grad(loss), in_dims=(0, None))(x, w)
    for i in range(3):
        torch.testing.assert_close(mapped[i], torch.func.grad(loss)(x[i], w))


@pytest.mark.parametrize("needs", ["x", "w"])
def test_convolution_and_norms_with_one_input_needing_a_gradient(monkeypatch, needs):
    """Where x needs no gradient (a network's first layer) the two stay apart; where w needs none the node gives
    x's alone (the fallback's choice and the node's output mask)."""
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    g = torch.Generator().manual_seed(32)
    x, w = torch.randn(2, 3, 5, 5, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    leaf = (x if needs == "x" else w).requires_grad_(True)
    grads = [torch.autograd.grad(_conv_and_norms_loss(x, w, 1, node), leaf)[0] for node in (True, False)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_convolution_and_norms_of_half_inputs(monkeypatch, dtype):
    """Half x: the squared norms in float32, dL/dx added into the convolution's half gradient in float32 and
    rounded once."""
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    g = torch.Generator().manual_seed(33)
    x, w = torch.randn(2, 4, 5, 5, generator=g), torch.randn(3, 4, 3, 3, generator=g)
    results = []
    for node in (True, False):
        xx, ww = x.to(dtype).requires_grad_(True), w.to(dtype).requires_grad_(True)
        inner, sq = conv_and_squared_norms(xx, ww, (1, 1), (1, 1), (1, 1), 1) if node else (
            F.conv2d(xx, ww, None, 1, 1), squared_patch_norms(xx, *WINDOW, 1))
        assert sq.dtype == torch.float32 and inner.dtype == dtype
        grad_x = torch.autograd.grad(inner.float().sum() + sq.sum(), xx)[0]
        assert grad_x.dtype == dtype
        results.append(grad_x.float())
    torch.testing.assert_close(results[0], results[1], rtol=2e-2, atol=2e-2)


def test_convolution_and_norms_compile_as_one_graph(monkeypatch):
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    torch.compiler.reset()
    g = torch.Generator().manual_seed(34)
    x, w = torch.randn(2, 4, 6, 6, generator=g).requires_grad_(True), torch.randn(5, 4, 3, 3, generator=g)

    def loss(inputs):
        return _conv_and_norms_loss(inputs, w, 1, True)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(torch.autograd.grad(compiled(x), x)[0], torch.autograd.grad(loss(x), x)[0])
