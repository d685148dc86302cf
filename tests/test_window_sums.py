"""The patch norms' box sum and its adjoint as Triton kernels (Note [box sums in a kernel]): against the depthwise
convolutions they replace, over strides, paddings, dilations, kernel sizes and groups, half inputs, through the
node of the convolution and its norms, counted, compiled and opchecked.

The kernels run compiled on CUDA tensors or, on a CPU-only machine, under ``TRITON_INTERPRET=1`` (set here before
Triton is imported, as in ``test_patch_epilogue.py``; the interpreter's blocks are 4 channels x 16 positions, so
the images below span several of each).  Tolerances: the squared norms are the same float32 squares summed in
another order (1e-6 relative); gradients in float32 1e-5, and in half one rounding of the float32 sum.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from conftest import sm90_compile_rows  # noqa: E402
from sphereml.launches import count_ops  # noqa: E402
from sphereml.layers import patch_norms, window_sums  # noqa: E402
from sphereml.layers.decoupled import decoupled_conv2d  # noqa: E402
from sphereml.layers.patch_norms import conv_and_squared_norms  # noqa: E402
from sphereml.layers.patches import patch_cosine2d  # noqa: E402
from sphereml.layers.window_sums import add_window_gradient_, squared_norms_by_window  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (kernel, stride, padding, dilation, groups, image): windows that overlap, skip positions (stride > window),
# reach past the image, dilate, and images of several position blocks
GEOMETRIES = [((3, 3), (1, 1), (1, 1), (1, 1), 1, (6, 6)), ((3, 3), (2, 2), (1, 1), (1, 1), 2, (9, 7)),
              ((3, 2), (2, 1), (1, 0), (1, 2), 2, (7, 6)), ((2, 3), (3, 1), (0, 2), (2, 1), 1, (8, 6)),
              ((1, 1), (3, 3), (0, 0), (1, 1), 1, (7, 7)), ((5, 5), (1, 1), (4, 4), (2, 2), 3, (5, 11))]


@pytest.fixture(autouse=True)
def as_on_a_gpu(monkeypatch):
    """The node in its GPU form; on CUDA the reference convolutions in full float32 (no TF32), and deterministic (the
    autocast tests compare two bf16 weight gradients)."""
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)


def _inputs(geometry, channels=12, dtype=torch.float32, seed=0):
    (kh, kw), _, _, _, groups, (h, w) = geometry
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, channels, h, w, generator=g).to(DEVICE, dtype)
    weight = torch.randn(5 * groups, channels // groups, kh, kw, generator=g).to(DEVICE, dtype)
    return x, weight


def _box_sum(energy, kernel, stride, padding, dilation):
    groups = energy.shape[1]
    return F.conv2d(energy, energy.new_ones(groups, 1, *kernel), None, stride, padding, dilation, groups)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_window_sums_are_the_box_sums_of_the_squares(geometry):
    kernel, stride, padding, dilation, groups, _ = geometry
    x, _ = _inputs(geometry)
    norms = x.reshape(2, groups, -1, *x.shape[2:]).norm(dim=2)
    got = squared_norms_by_window(norms, kernel, stride, padding, dilation)
    want = _box_sum(norms.double().square(), kernel, stride, padding, dilation)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_window_gradient_is_the_box_sums_adjoint_added_in(geometry):
    """dL/dx + 2 x conv_T(dL/ds), the adjoint as the convolution's input gradient, in place."""
    kernel, stride, padding, dilation, groups, _ = geometry
    x, _ = _inputs(geometry)
    g = torch.Generator().manual_seed(1)
    grad_x = torch.randn(x.shape, generator=g).to(DEVICE)
    out_shape = _box_sum(x[:, :groups], kernel, stride, padding, dilation).shape
    grad_sq = torch.randn(out_shape, generator=g).to(DEVICE)
    adjoint = torch.nn.grad.conv2d_input((2, groups, *x.shape[2:]), x.new_ones(groups, 1, *kernel, dtype=torch.float64),
                                         grad_sq.double(), stride, padding, dilation, groups)
    want = (grad_x.double() + 2 * x.double() * adjoint.repeat_interleave(x.shape[1] // groups, 1)).float()
    pointer = grad_x.data_ptr()
    add_window_gradient_(grad_x, x, grad_sq, kernel, stride, padding, dilation)
    assert grad_x.data_ptr() == pointer
    torch.testing.assert_close(grad_x, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("outputs", ["both", "inner", "sq"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_the_node_gives_the_convolutions_values_and_gradients(monkeypatch, geometry, outputs):
    """conv_and_squared_norms with the kernels against the same node with the convolutions (its form where the
    kernels do not take x), with a loss of both outputs or one (dL/du None: dL/dx starts from zeros)."""
    kernel, stride, padding, dilation, groups, _ = geometry
    x, weight = _inputs(geometry, seed=2)
    results = []
    for kernels in (True, False):
        monkeypatch.setattr(window_sums, "takes", lambda t, k=kernels: k)
        xx, ww = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        inner, sq = conv_and_squared_norms(xx, ww, stride, padding, dilation, groups)
        loss = {"both": inner.sin().sum() + sq.sqrt().sum(), "inner": inner.sin().sum(), "sq": sq.sqrt().sum()}
        results.append([sq.detach(), *torch.autograd.grad(loss[outputs], (xx, ww), allow_unused=True)])
    for got, want in zip(*results):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_layers_with_the_kernels_give_the_reference_layers(monkeypatch):
    """SphereConv (sigmoid k), SCS (learned q and p) and the decoupled operator (TanhConv x cosine, learned rho),
    fused with the GPU's norms and the kernels, against their reference paths as the CPU runs them: outputs and the
    gradients of every input."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, 9, 7, generator=g).to(DEVICE)
    w = torch.randn(4, 3, 3, 3, generator=g).to(DEVICE)
    q, p, rho = (torch.tensor(v, device=DEVICE) for v in (0.1, 1.5, 0.8))
    layers = {"SphereConv": lambda a, b, c, d, e, f: patch_cosine2d(a, b, stride=(2, 1), padding=1, groups=2,
                                                                    angular="sigmoid", k=0.4, backend=f),
              "SCS": lambda a, b, c, d, e, f: patch_cosine2d(a, b, padding=(0, 1), groups=2, q=c, power=d, backend=f),
              "decoupled": lambda a, b, c, d, e, f: decoupled_conv2d(a, b, dilation=2, padding=2, groups=2, rho=e,
                                                                     backend=f)}
    for name, layer in layers.items():
        results = []
        for backend in ("fused", "reference"):
            monkeypatch.setattr(patch_norms, "on_accelerator", lambda device, b=backend: b == "fused")
            inputs = [t.clone().requires_grad_(True) for t in (x, w, q, p, rho)]
            out = layer(*inputs, backend)
            target = torch.linspace(-1.0, 1.0, out.numel(), device=DEVICE).reshape(out.shape)
            grads = torch.autograd.grad((out * target).sum(), inputs, allow_unused=True)
            results.append([out, *(t for t in grads if t is not None)])
        assert len(results[0]) == len(results[1]) > 2, name
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


def _autocast_step(node, x, weight, geometry, create_graph=False):
    """(u, s, dL/dx, dL/dw) under bf16 autocast by the node or the two apart (autocast's convolution, then the
    norms); with ``create_graph`` also d(||dL/dx||^2)/dw."""
    kernel, stride, padding, dilation, groups, _ = geometry
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        inner, sq = conv_and_squared_norms(x, weight, stride, padding, dilation, groups) if node else (
            F.conv2d(x, weight, None, stride, padding, dilation, groups),
            patch_norms.squared_patch_norms(x, kernel, stride, padding, dilation, groups))
    target = torch.linspace(-1.0, 1.0, inner.numel(), device=DEVICE).reshape(inner.shape)
    grads = torch.autograd.grad((inner.float() * target).sum() + sq.sqrt().sum(), (x, weight),
                                create_graph=create_graph)
    if create_graph:
        grads = (*grads, torch.autograd.grad(grads[0].float().square().sum(), weight)[0])
    return inner, sq, *grads


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [True, False])
def test_under_autocast_the_node_convolves_autocasts_copies(monkeypatch, kernels, x_dtype):
    """bf16 autocast, float32 w and float32 x or (a former layer's output) bf16 x: the node's u is autocast's bf16
    convolution to the bit, s stays float32, and the gradients of x and w, in their dtypes, are those of the two
    apart to rounding; with the kernels or the convolutions for the box sums, in one node (five operations fewer
    with the kernels for float32 x: the box sum's square, kernel of ones and convolution, its adjoint and the sum of
    two dL/dx become the two kernels)."""
    if not kernels:
        monkeypatch.setattr(window_sums, "takes", lambda t: False)
    x, weight = _inputs(GEOMETRIES[1], seed=10)
    x = x.to(x_dtype)
    results, counts = [], []
    for node in (True, False):
        xx, ww = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        results.append(_autocast_step(node, xx, ww, GEOMETRIES[1]))
        counts.append(count_ops(lambda n=node, a=xx, b=ww: _autocast_step(n, a, b, GEOMETRIES[1])).total)
    (inner, sq, grad_x, grad_w), want = results
    assert inner.dtype == torch.bfloat16 and sq.dtype == grad_w.dtype == torch.float32 and grad_x.dtype == x_dtype
    torch.testing.assert_close(inner, want[0], rtol=0, atol=0)
    torch.testing.assert_close(sq, want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_w, want[3], rtol=1e-5, atol=1e-5)
    # bf16 dL/dx: the apart path rounds the norms' share, then the sum, to bf16, the node the sum once: two roundings
    ulp = torch.finfo(x_dtype).eps * float(want[2].float().abs().max())
    torch.testing.assert_close(grad_x.float(), want[2].float(), rtol=0, atol=2 * ulp if x_dtype == torch.bfloat16
                               else 1e-5)
    fewer = (5 if kernels else 2) + (x_dtype == torch.bfloat16)  # apart, bf16 x's share takes a cast of its factor
    assert counts[1] - counts[0] == fewer, counts


def test_under_autocast_a_double_backward_sees_the_casts():
    """create_graph=True under autocast: the backward casts x and w again, so that second derivatives (here of
    ||dL/dx||^2 in w, which flows through the convolution's input gradient) are the two apart's."""
    x, weight = _inputs(GEOMETRIES[1], seed=12)
    results = []
    for node in (True, False):
        xx, ww = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        results.append(_autocast_step(node, xx, ww, GEOMETRIES[1], create_graph=True))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_sum_in_float32_and_round_once(dtype):
    geometry = GEOMETRIES[1]
    kernel, stride, padding, dilation, groups, _ = geometry
    x, _ = _inputs(geometry, dtype=dtype, seed=3)
    norms = x.float().reshape(2, groups, -1, *x.shape[2:]).norm(dim=2)
    sq = squared_norms_by_window(norms, kernel, stride, padding, dilation)
    grad_sq = torch.linspace(-1.0, 1.0, sq.numel(), device=DEVICE).reshape(sq.shape)
    grad_x = torch.linspace(2.0, -2.0, x.numel(), device=DEVICE).reshape(x.shape).to(dtype)
    adjoint = torch.nn.grad.conv2d_input((2, groups, *x.shape[2:]), sq.new_ones(groups, 1, *kernel), grad_sq, stride,
                                         padding, dilation, groups).repeat_interleave(x.shape[1] // groups, 1)
    want = (grad_x.float() + x.float() * (2 * adjoint)).to(dtype)
    add_window_gradient_(grad_x, x, grad_sq, kernel, stride, padding, dilation)
    assert grad_x.dtype == dtype
    torch.testing.assert_close(grad_x.float(), want.float(), rtol=torch.finfo(dtype).eps, atol=1e-6)


def test_nan_stays_nan_and_the_other_windows_are_left_alone():
    x, _ = _inputs(GEOMETRIES[0], seed=4)
    norms = x.norm(dim=1, keepdim=True)
    norms[0, 0, 0, 0] = float("nan")
    sq = squared_norms_by_window(norms, (3, 3), (1, 1), (1, 1), (1, 1))
    assert sq[0, 0, :2, :2].isnan().all() and not sq[0, 0, 2:].isnan().any() and not sq[1].isnan().any()


def test_the_kernels_take_only_what_they_can():
    x = torch.randn(2, 4, 5, 5, device=DEVICE)
    assert window_sums.takes(x) and window_sums.takes(x.half())
    assert not window_sums.takes(x.double())
    assert window_sums.takes(x.contiguous(memory_format=torch.channels_last))  # Note [layouts in the kernels]
    assert not window_sums.takes(x.transpose(2, 3)) and not window_sums.takes(x[:, :, ::2])
    assert not torch.func.vmap(lambda t: torch.tensor(window_sums.takes(t)))(x).any()
    with pytest.raises(ValueError, match="each contiguous in NCHW or channels-last"):
        add_window_gradient_(x.transpose(2, 3), x, x[:, :1], (3, 3), (1, 1), (1, 1), (1, 1))
    with pytest.raises(ValueError, match=r"dL/ds of shape \(2, 1, 5, 5\) for this window, got \(2, 1, 3, 3\)"):
        add_window_gradient_(torch.zeros_like(x), x, x[:, :1, :3, :3], (3, 3), (1, 1), (1, 1), (1, 1))
    with pytest.raises(ValueError, match="dL/ds of shape"):  # 3 groups do not divide 4 channels
        add_window_gradient_(torch.zeros_like(x), x, x[:, :3], (3, 3), (1, 1), (1, 1), (1, 1))
    with pytest.raises(ValueError, match="float32 channel norms"):
        squared_norms_by_window(x[:, :1].half(), (3, 3), (1, 1), (1, 1), (1, 1))


def test_per_sample_gradients_keep_the_convolutions():
    """Under torch.func (vmap of grad, per-sample gradients) the node takes the convolutions, which have batching
    rules: the same gradients as a loop over the samples (torch.func.grad: the forward takes the sums' kernel, the
    backward, which sees wrapped tensors, the convolutions)."""
    x, weight = _inputs(GEOMETRIES[1], seed=8)

    def loss(sample, w):
        inner, sq = conv_and_squared_norms(sample[None], w, 2, 1, 1, 2)
        return inner.square().sum() + sq.sqrt().sum()
    with pytest.warns(UserWarning, match="batching rule for aten::addcmul_"):  # a performance warning
        mapped = torch.func.vmap(torch.func.grad(loss), in_dims=(0, None))(x, weight)
    for i in range(x.shape[0]):
        torch.testing.assert_close(mapped[i], torch.func.grad(loss)(x[i], weight))


def test_three_operations_fewer_than_the_convolutions(monkeypatch):
    """Forward + backward of the node: one operator for the box sum (for the square, the kernel of ones and the
    convolution) and one for its adjoint added into dL/dx (for the convolution's adjoint and ``addcmul_``)."""
    x, weight = _inputs(GEOMETRIES[0], seed=5)
    x.requires_grad_(True)

    def step():
        inner, sq = conv_and_squared_norms(x, weight, 1, 1, 1, 1)
        return torch.autograd.grad(inner.sum() + sq.sum(), x)
    counts = {}
    for kernels in (True, False):
        monkeypatch.setattr(window_sums, "takes", lambda t, k=kernels: k)
        counts[kernels] = count_ops(step).by_op
    assert counts[True]["sphereml::window_sums"] == counts[True]["sphereml::add_window_gradient_"] == 1
    assert "aten::addcmul_" not in counts[True] and counts[False]["aten::addcmul_"] == 1
    assert counts[True]["aten::convolution"] == counts[True]["aten::convolution_backward"] == 1
    assert sum(counts[False].values()) - sum(counts[True].values()) == 3, (counts[True], counts[False])


def test_operators_pass_opcheck():
    x = torch.randn(2, 6, 7, 5, device=DEVICE)
    norms = x.reshape(2, 2, 3, 7, 5).norm(dim=2)
    geometry = (3, 3, 2, 1, 1, 1, 1, 1)
    torch.library.opcheck(torch.ops.sphereml.window_sums.default, (norms, *geometry))
    grad_sq = torch.ops.sphereml.window_sums(norms, *geometry)
    torch.library.opcheck(torch.ops.sphereml.add_window_gradient_.default, (torch.randn_like(x), x, grad_sq, *geometry))


def _compiled_graphs(loss, inputs) -> dict:
    """The aten operations (and functionalised operators) of the forward and backward graphs that
    ``torch.compile(loss, fullgraph=True)`` makes, after checking its gradients against eager's."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    torch.compiler.reset()
    graphs = {}

    def recorder(kind):
        def record(graph, example_inputs):
            graphs[kind] = {str(n.args[0] if "auto_functionalized" in str(n.target) else n.target)
                            for n in graph.graph.nodes if n.op == "call_function"}
            return make_boxed_func(graph.forward)
        return record
    compiled = torch.compile(loss, fullgraph=True, backend=aot_autograd(fw_compiler=recorder("forward"),
                                                                        bw_compiler=recorder("backward")))
    for got, want in zip(torch.autograd.grad(compiled(*inputs), inputs), torch.autograd.grad(loss(*inputs), inputs)):
        torch.testing.assert_close(got, want)
    return graphs


@pytest.mark.parametrize("autocast", [False, True])
def test_the_node_compiles_as_one_graph_with_both_kernels(autocast):
    """``fullgraph=True``, with and without bf16 autocast: the forward graph holds the sums' operator and the
    backward the gradient's (in place, so functionalised), and the gradients are eager's."""
    x, weight = _inputs(GEOMETRIES[2], seed=6)
    inputs = (x.requires_grad_(True), weight.requires_grad_(True))

    def loss(a, b):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            inner, sq = conv_and_squared_norms(a, b, (2, 1), (1, 0), (1, 2), 2)
        return inner.float().square().sum() + sq.sqrt().sum()
    graphs = _compiled_graphs(loss, inputs)
    assert "sphereml.window_sums.default" in graphs["forward"], graphs["forward"]
    assert "sphereml.add_window_gradient_.default" in graphs["backward"], graphs["backward"]


def test_a_double_backward_differentiates_the_convolutions(monkeypatch):
    """With create_graph=True the backward takes the box sum's adjoint by convolution, which autograd differentiates
    (the gradient operator has no derivative): second derivatives as the convolutions' form gives them."""
    x, weight = _inputs(GEOMETRIES[1], seed=9)
    results = []
    for kernels in (True, False):
        monkeypatch.setattr(window_sums, "takes", lambda t, k=kernels: k)
        xx = x.clone().requires_grad_(True)
        inner, sq = conv_and_squared_norms(xx, weight, 2, 1, 1, 2)
        (grad,) = torch.autograd.grad(inner.square().sum() + sq.sqrt().sum(), xx, create_graph=True)
        results.append((grad, *torch.autograd.grad(grad.square().sum(), xx)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_kernels_compile_for_sm90_without_spills():
    """Both kernels at 3 x 3 and 5 x 5 windows, the gradient's for float32, bf16 and fp16 inputs in NCHW,
    channels-last, and x channels-last with an NCHW dL/dx, compiled for an H100 here (in a subprocess: the kernels of
    this process are interpreted)."""
    rows = sm90_compile_rows("bench_sphereconv", "window_compile_check")
    assert len(rows) == 20
    for row in rows:
        assert row["spill_store_bytes"] in (0, None), row
        assert row["registers"] is None or row["registers"] <= 128, row
