"""Channels-last tensors in the patch layers' kernels (Note [layouts in the kernels] in ``sphereml.layers._layouts``):
read where they lie, with the NCHW kernels' results, the outputs in their input's layout, and no more operations.

The kernels run compiled on CUDA tensors or, on a CPU-only machine, under ``TRITON_INTERPRET=1`` (set here before
Triton is imported, as in ``test_patch_epilogue.py``), with the GPU's patch norms.  Interpreted, a kernel does the
same arithmetic in the same order in either layout, so its results are the NCHW ones bit for bit; compiled, the
tiles' reductions may run in another order (float32 rounding).  A layer's weight gradient sums each kernel's
squares in another order in channels-last (1e-6 relative).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from sphereml.launches import count_ops  # noqa: E402
from sphereml.layers import _patch_kernels, _window_kernels, patch_norms  # noqa: E402
from sphereml.layers._layouts import dense, position_strides  # noqa: E402
from sphereml.layers.decoupled import decoupled_conv2d  # noqa: E402
from sphereml.layers.magnitudes import Magnitude  # noqa: E402
from sphereml.layers.patch_epilogue import fused_epilogue  # noqa: E402
from sphereml.layers.patches import patch_cosine2d  # noqa: E402
from sphereml.layers.unit_kernels import unit_kernels  # noqa: E402
from sphereml.layers.window_sums import add_window_gradient_  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAST = torch.channels_last
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")  # |c|^p at c = 0, interpreted


@pytest.fixture(autouse=True)
def as_on_a_gpu(monkeypatch):
    """The GPU's patch norms; on CUDA convolutions in full float32 (no TF32)."""
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def _same(got, want, rtol=1e-6):
    """Bit for bit where the kernels are interpreted; to float32 rounding where they are compiled."""
    if DEVICE == "cpu":
        assert torch.equal(got, want), float((got - want).abs().max())
    else:
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()))


class _Recorder:
    """A Triton kernel whose launches record the data pointers of their tensor arguments."""

    def __init__(self, kernel):
        self.kernel, self.pointers = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def record(*args, **kwargs):
            self.pointers.append({a.data_ptr() for a in args if isinstance(a, torch.Tensor)})
            return launch(*args, **kwargs)
        return record


def test_position_strides_flatten_the_positions_where_they_can():
    x = torch.empty(2, 3, 4, 5)
    assert position_strides(x) == (60, 20, 1)
    assert position_strides(x.contiguous(memory_format=LAST)) == (60, 1, 3)
    assert position_strides(torch.zeros(()).expand(2, 3, 4, 5)) == (0, 0, 0)  # a .sum()'s gradient
    assert position_strides(x[:, :, :1]) == (60, 20, 1) and position_strides(x[..., :1]) == (60, 20, 5)
    assert position_strides(x.transpose(2, 3)) is None and position_strides(x[..., ::2]) is None
    assert dense(x) and dense(x.contiguous(memory_format=LAST)) and not dense(x.transpose(2, 3))


# (epilogue, parameter, q, magnitude): the kernels' forms that read dL/dy, and write dL/da and dL/dr
EPILOGUE_FORMS = {"cosine": ("cosine", None, None, None),
                  "sharpen, p per channel, q": ("sharpen", torch.linspace(0.6, 2.5, 6), 0.01, None),
                  "sigmoid, tanh magnitude with a learned radius": ("sigmoid", 0.3, None, "tanh"),
                  "linear, magnitude tensor": ("linear", None, None, "tensor")}


def _epilogue_step(form, layout, upstream_layout):
    """y and the gradients of the inner products, squared norms and tensor parameters, with y's and dL/dy's
    layouts (upstream ``"sum"``: a dL/dy broadcast from one value; ``"transposed"``: one whose positions do not
    flatten)."""
    epilogue, param, q, magnitude = EPILOGUE_FORMS[form]
    g = torch.Generator().manual_seed(3)
    inner = torch.randn(3, 6, 5, 7, generator=g).to(DEVICE).contiguous(memory_format=layout).requires_grad_(True)
    sq = (inner.detach().square().reshape(3, 2, 3, 5, 7).sum(2) * 1.5 + 0.1).requires_grad_(True)
    leaves = [inner, sq]
    if isinstance(param, torch.Tensor):
        param = param.to(DEVICE).requires_grad_(True)
        leaves.append(param)
    if magnitude == "tanh":
        radius = torch.tensor(0.7, device=DEVICE, requires_grad=True)
        magnitude = Magnitude("tanh", 1.2, 0.0, radius)
        leaves.append(radius)
    elif magnitude == "tensor":
        magnitude = torch.rand(3, 2, 5, 7, generator=g).to(DEVICE).requires_grad_(True)
        leaves.append(magnitude)
    y = fused_epilogue(inner, sq, q, epilogue, param, 2, 1e-6, magnitude=magnitude)
    if upstream_layout == "sum":
        return y, *torch.autograd.grad(y.sum(), leaves)
    upstream = torch.randn(3, 6, 7, 5, generator=g).to(DEVICE).transpose(2, 3)  # positions that do not flatten
    if upstream_layout != "transposed":
        upstream = upstream.contiguous(memory_format=upstream_layout)
    return y, *torch.autograd.grad(y, leaves, upstream)


@pytest.mark.parametrize("upstream", [torch.contiguous_format, LAST, "sum", "transposed"],
                         ids=["dL/dy NCHW", "dL/dy channels-last", "dL/dy expanded", "dL/dy transposed"])
@pytest.mark.parametrize("form", EPILOGUE_FORMS)
def test_the_epilogue_gives_the_nchw_results_in_channels_last(form, upstream):
    """Inner products in channels-last: the output and dL/d(inner products) keep their layout, and values and
    gradients are the NCHW kernels' for a dL/dy in NCHW, in channels-last, broadcast from one value (a ``.sum()``'s)
    or with positions that do not flatten (which tensors the kernels read where they lie: the next test)."""
    want = _epilogue_step(form, torch.contiguous_format, upstream)
    got = _epilogue_step(form, LAST, upstream)
    assert got[0].is_contiguous(memory_format=LAST) and want[0].is_contiguous()
    assert got[1].is_contiguous(memory_format=LAST)  # dL/d(inner products) in their layout
    assert len(got) == len(want) >= 3
    for a, b in zip(got, want):
        _same(a, b)


def test_the_epilogue_reads_channels_last_and_broadcast_tensors_where_they_lie(monkeypatch):
    """The kernels get the caller's channels-last inner products and a dL/dy in y's layout or broadcast from one
    value themselves, not copies; a dL/dy in NCHW is copied into y's layout."""
    recorders = {name: _Recorder(getattr(_patch_kernels, name)) for name in ("forward_kernel", "backward_kernel")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(_patch_kernels, name, recorder)
    inner = torch.randn(2, 4, 5, 6, device=DEVICE).contiguous(memory_format=LAST).requires_grad_(True)
    sq = inner.detach().square().sum(1, keepdim=True) + 0.5
    upstreams = [torch.ones((), device=DEVICE).expand(inner.shape), torch.randn_like(inner)]
    upstreams.append(upstreams[1].contiguous())
    for upstream in upstreams:
        torch.autograd.grad(fused_epilogue(inner, sq, None, "sigmoid", 0.4, 1, 1e-6), inner, upstream)
    assert all(inner.data_ptr() in pointers for pointers in recorders["forward_kernel"].pointers)
    read = [{inner.data_ptr(), upstream.data_ptr()} <= pointers
            for upstream, pointers in zip(upstreams, recorders["backward_kernel"].pointers)]
    assert upstreams[1].is_contiguous(memory_format=LAST) and read == [True, True, False]


def test_offsets_past_two_to_the_31_do_not_wrap():
    """The offsets of a tile's elements in the second sample of 64 channels at 6,000 x 6,000 (2.3e9 values each),
    NCHW and channels-last, as Python's integers give them: the tile's first element in int64 (an int32 product
    wraps past 2^31)."""
    import triton
    import triton.language as tl

    @triton.jit
    def offsets(OUT, G, CG, SB, SC, SP, C0, P0):
        first, tile = _patch_kernels.tile_offsets(1 * G, G, CG, C0, P0, 2, 2, SB, SC, SP)  # sample 1
        tl.store(OUT + tl.arange(0, 2)[:, None] * 2 + tl.arange(0, 2)[None, :], first + tile)
    c, p = 64, 6000 * 6000
    for s_c, s_p in ((p, 1), (1, c)):
        out = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
        offsets[(1,)](out, 1, c, c * p, s_c, s_p, c - 2, p - 2)
        want = [[c * p + ch * s_c + pos * s_p for pos in (p - 2, p - 1)] for ch in (c - 2, c - 1)]
        assert out.tolist() == want and min(min(row) for row in want) > 2**32


def test_a_tile_spanning_two_to_the_31_elements_is_refused():
    """Offsets within a tile are int32: an NCHW tile of 32 channels over 7e7 positions is a named error, a
    channels-last one is not."""
    from sphereml.layers._layouts import check_tile_span

    positions = 70_000_000
    with pytest.raises(ValueError, match="spans 2\\^31 elements or more"):
        check_tile_span((64 * positions, positions, 1), 32, 128)
    check_tile_span((64 * positions, 1, 64), 32, 128)


@pytest.mark.parametrize("x_layout,grad_layout", [(LAST, LAST), (LAST, torch.contiguous_format),
                                                  (torch.contiguous_format, LAST)],
                         ids=["both channels-last", "x channels-last", "dL/dx channels-last"])
def test_the_window_gradient_in_either_layout(monkeypatch, x_layout, grad_layout):
    """dL/dx += 2 x dL/de with x and dL/dx each NCHW or channels-last: in place in dL/dx's layout, with x read where
    it lies, and the NCHW results (a 2 x 2 window with stride 2 over 3 groups of 2 channels)."""
    recorder = _Recorder(_window_kernels.window_gradient_kernel)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 7, 9, generator=g).to(DEVICE)
    grad_x = torch.randn(x.shape, generator=g).to(DEVICE)
    grad_sq = torch.randn(2, 3, 4, 4, generator=g).to(DEVICE)
    window = ((2, 2), (2, 2), (1, 0), (1, 1))
    want = grad_x.clone()
    add_window_gradient_(want, x, grad_sq, *window)
    x, got = x.contiguous(memory_format=x_layout), grad_x.contiguous(memory_format=grad_layout)
    pointer = got.data_ptr()
    monkeypatch.setattr(_window_kernels, "window_gradient_kernel", recorder)
    add_window_gradient_(got, x, grad_sq, *window)
    assert got.data_ptr() == pointer and got.is_contiguous(memory_format=grad_layout)
    assert {x.data_ptr(), pointer} <= recorder.pointers[0]
    _same(got, want)


def _layers(rho, q, p):
    return {"SphereConv (sigmoid k)": lambda x, w: patch_cosine2d(x, w, stride=(2, 1), padding=1, groups=2,
                                                                   angular="sigmoid", k=0.4, backend="fused"),
            "SCS (learned q and p)": lambda x, w: patch_cosine2d(x, w, padding=(0, 1), groups=2, q=q, power=p,
                                                                  backend="fused"),
            "decoupled (learned rho)": lambda x, w: decoupled_conv2d(x, w, dilation=2, padding=2, groups=2, rho=rho,
                                                                     backend="fused")}


@pytest.mark.parametrize("layouts", [(LAST, LAST), (LAST, torch.contiguous_format), (torch.contiguous_format, LAST)],
                         ids=["x and w channels-last", "x channels-last", "w channels-last"])
@pytest.mark.parametrize("name", list(_layers(None, None, None)))
def test_fused_layers_in_channels_last(name, layouts):
    """A fused SphereConv, SCS and decoupled layer with x or w (or both, as ``model.to(memory_format=
    torch.channels_last)`` makes them) in channels-last: the output and dL/dx in channels-last, dL/dw in w's layout,
    and the NCHW layer's values and gradients."""
    g = torch.Generator().manual_seed(7)
    x0, w0 = torch.randn(2, 6, 9, 7, generator=g).to(DEVICE), torch.randn(4, 3, 3, 3, generator=g).to(DEVICE)
    results = []
    for x_layout, w_layout in (layouts, (torch.contiguous_format,) * 2):
        q, p, rho = (torch.tensor(v, device=DEVICE, requires_grad=True) for v in (0.1, 1.5, 0.8))
        x = x0.contiguous(memory_format=x_layout).requires_grad_(True)
        w = w0.contiguous(memory_format=w_layout).requires_grad_(True)
        out = _layers(rho, q, p)[name](x, w)
        target = torch.linspace(-1.0, 1.0, out.numel(), device=DEVICE).reshape(out.shape)
        grads = torch.autograd.grad((out * target).sum(), (x, w, q, p, rho), allow_unused=True)
        results.append([out, *(t for t in grads if t is not None)])
    got, want = results
    assert got[0].is_contiguous(memory_format=LAST) and got[1].is_contiguous(memory_format=LAST)
    assert got[2].is_contiguous(memory_format=layouts[1])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_under_autocast_a_channels_last_layer_keeps_its_layout():
    """A fused SphereConv under bf16 autocast (the node convolves autocast's copies, which keep x's and w's
    layout): a bf16 output and a float32 dL/dx in channels-last, and the NCHW layer's values to bf16's rounding."""
    g = torch.Generator().manual_seed(10)
    x0, w0 = torch.randn(2, 8, 7, 7, generator=g).to(DEVICE), torch.randn(4, 8, 3, 3, generator=g).to(DEVICE)
    results = []
    for layout in (LAST, torch.contiguous_format):
        x = x0.contiguous(memory_format=layout).requires_grad_(True)
        w = w0.contiguous(memory_format=layout).requires_grad_(True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = patch_cosine2d(x, w, padding=1, backend="fused")
        target = torch.linspace(-1.0, 1.0, out.numel(), device=DEVICE).reshape(out.shape)
        results.append((out, *torch.autograd.grad((out.float() * target).sum(), (x, w))))
    (out, grad_x, grad_w), want = results
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=LAST)
    assert grad_x.dtype == torch.float32 and grad_x.is_contiguous(memory_format=LAST)
    for a, b in zip((out, grad_x, grad_w), want):
        torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1e-2 * float(b.abs().max()))


def test_channels_last_takes_no_more_operations():
    """Forward + backward of a fused SphereConv and a decoupled layer: the same 11 operations in channels-last as in
    NCHW (no copy of x or of the kernels, the box sums in their kernels), as ``nn.Conv2d`` takes its 4 in either.
    Copies inside the operators are not counted: the recorder tests above look at those."""
    counts = {}
    for layout in (torch.contiguous_format, LAST):
        x = torch.randn(2, 16, 6, 6, device=DEVICE).contiguous(memory_format=layout).requires_grad_(True)
        w = torch.randn(8, 16, 3, 3, device=DEVICE).contiguous(memory_format=layout).requires_grad_(True)
        for name, layer in {"nn.Conv2d": lambda: torch.nn.functional.conv2d(x, w, padding=1),
                            "SphereConv": lambda: patch_cosine2d(x, w, padding=1, backend="fused"),
                            "decoupled": lambda: decoupled_conv2d(x, w, padding=1, backend="fused")}.items():
            counts[name, layout] = count_ops(lambda f=layer: torch.autograd.grad(f().sum(), (x, w))).by_op
    for name in ("nn.Conv2d", "SphereConv", "decoupled"):
        assert counts[name, LAST] == counts[name, torch.contiguous_format], name
    assert sum(counts["SphereConv", LAST].values()) == sum(counts["decoupled", LAST].values()) == 11
    assert sum(counts["nn.Conv2d", LAST].values()) == 4


@pytest.mark.parametrize("layouts", [(torch.contiguous_format, LAST), (LAST, torch.contiguous_format),
                                     (LAST, LAST)], ids=["dL/dw_hat channels-last", "w channels-last", "both"])
def test_unit_kernels_in_either_layout(layouts):
    """The fused unit kernels on a weight and with an upstream gradient dL/dw_hat each NCHW or channels-last: w_hat
    and dL/dw in the weight's layout, and the reference node's values."""
    g = torch.Generator().manual_seed(8)
    w0, upstream = torch.randn(6, 4, 3, 3, generator=g).to(DEVICE), torch.randn(6, 4, 3, 3, generator=g).to(DEVICE)
    w_layout, grad_layout = layouts
    results = []
    for fused in (True, False):
        w = w0.contiguous(memory_format=w_layout).requires_grad_(True)
        unit = unit_kernels(w, 1e-6, fused)
        results.append((unit, *torch.autograd.grad(unit, w, upstream.contiguous(memory_format=grad_layout))))
    (unit, grad), want = results[0], results[1]
    assert unit.is_contiguous(memory_format=w_layout) and grad.is_contiguous(memory_format=w_layout)
    for a, b in zip((unit, grad), want):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6 * float(b.detach().abs().max()))


def test_a_channels_last_layer_compiles_as_one_graph():
    """``torch.compile(fullgraph=True)`` of a fused channels-last SCS layer: eager's output, in eager's layout (the
    operators' shapes and strides as traced are those they return), and eager's gradients."""
    torch.compiler.reset()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 6, 8, 8, generator=g).to(DEVICE).contiguous(memory_format=LAST).requires_grad_(True)
    w = torch.randn(4, 6, 3, 3, generator=g).to(DEVICE).contiguous(memory_format=LAST).requires_grad_(True)

    def layer(a, b):
        return patch_cosine2d(a, b, padding=1, q=0.05, power=2.0, backend="fused")
    compiled = torch.compile(layer, fullgraph=True)
    got, want = compiled(x, w), layer(x, w)
    assert got.stride() == want.stride() and got.is_contiguous(memory_format=LAST)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got.square().sum(), (x, w)), torch.autograd.grad(want.square().sum(), (x, w))):
        torch.testing.assert_close(a, b)
