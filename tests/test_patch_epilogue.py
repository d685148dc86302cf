"""The fused patch epilogue (patch-norm division, clamp and g(theta) or SCS sharpening in one Triton kernel
each way) against the reference nodes in float64.

The kernels run compiled on CUDA tensors or, on a CPU-only machine, under ``TRITON_INTERPRET=1`` (set here
before Triton is imported, as in ``test_energy_triton.py``).  Float32 tolerances: 2e-6 relative to the
largest entry on values, 5e-5 on gradients (p < 1 makes d|c|^p/dc large near c = 0; the fused arccos is a
polynomial with error <= 2e-8).
"""

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from conftest import sm90_compile_rows  # noqa: E402
from sphereml.launches import count_ops  # noqa: E402
from sphereml.layers.patches import patch_cosine2d  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")  # |c|^p at c = 0, interpreted


def _run(backend, x, w, q, p, dtype, device, k=None, **conv):
    """Output and gradients of x, w (and of q, p, k when tensors) for a fixed random upstream gradient."""
    def leaf(v):  # q, p and k stay float32 under bf16, as parameters do
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        return v.to(device, wide).requires_grad_(True) if torch.is_tensor(v) else v
    xx, ww = (v.to(device, dtype).requires_grad_(True) for v in (x, w))
    qq, pp, kk = leaf(q), leaf(p), leaf(k)
    extra = {} if kk is None else {"k": kk}
    out = patch_cosine2d(xx, ww, q=qq, power=pp, backend=backend, **extra, **conv)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    (out * g).sum().backward()
    return [out.detach()] + [v.grad for v in (xx, ww, qq, pp, kk) if torch.is_tensor(v)]


@contextlib.contextmanager
def _empty_as_nan():
    """Every new uninitialised tensor filled with NaN (``torch.use_deterministic_algorithms``), so that an output
    element a kernel leaves unwritten shows in the results."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


SEEDED = torch.Generator().manual_seed(9)
CASES = {
    "cosine": dict(q=None, p=None),
    "q number, groups 2": dict(q=0.01, p=None, groups=2),
    "q tensor, p number": dict(q=torch.tensor(0.05), p=2.0),
    "q number, p per channel, groups 2": dict(q=1e-3, p=torch.rand(10, 1, 1, generator=SEEDED) + 0.5, groups=2),
    "q tensor, p per channel, groups 2, stride 2": dict(q=torch.tensor(0.03), p=torch.rand(10, 1, 1, generator=SEEDED)
                                                        + 0.5, groups=2, stride=2),
    "p 0-d tensor, stride 2": dict(q=None, p=torch.tensor(1.7), stride=2),
    "same padding, dilation 2": dict(q=1e-3, p=3.0, padding="same", dilation=2),
    "linear": dict(q=None, p=None, angular="linear"),
    "sigmoid, k number": dict(q=None, p=None, angular="sigmoid", k=0.3),
    "sigmoid, k per channel, groups 2": dict(q=None, p=None, angular="sigmoid",
                                             k=torch.rand(10, 1, 1, generator=SEEDED) * 2 + 0.05, groups=2),
    "sqcosine, q tensor": dict(q=torch.tensor(0.02), p=None, angular="sqcosine"),
}


@pytest.mark.parametrize("case", CASES)
def test_fused_epilogue_matches_float64_reference(case):
    spec = dict(CASES[case])
    q, p, k = spec.pop("q"), spec.pop("p"), spec.pop("k", None)
    spec.setdefault("padding", 1)
    x = torch.randn(3, 6, 7, 9, generator=torch.Generator().manual_seed(0))
    x[0, :, :4, :4] = 0.0  # zero patches: c = 0, the floors of Note [zero patch] and [sharpening without NaN]
    w = torch.randn(10, 6 // spec.get("groups", 1), 3, 3, generator=torch.Generator().manual_seed(2))

    def as64(v):
        return v.double() if torch.is_tensor(v) else v
    ref = _run("reference", x, w, as64(q), as64(p), torch.float64, "cpu", k=as64(k), **spec)
    with _empty_as_nan():
        fused = _run("fused", x, w, q, p, torch.float32, DEVICE, k=k, **spec)
    assert len(fused) == len(ref)
    for i, (a, b) in enumerate(zip(ref, fused)):
        tolerance = 2e-6 if i == 0 else 5e-5
        torch.testing.assert_close(b.double().cpu(), a, rtol=0, atol=tolerance * float(a.abs().max()))


@pytest.mark.parametrize("angular", ["linear", "sigmoid"])
def test_fused_epilogue_at_the_poles_is_exact_and_finite(angular):
    """Patches parallel and antiparallel to a kernel (c = +-1): g = +-1 within float32's resolution of the
    angle there (1 - c >= 6e-8 gives theta up to 3.5e-4), and finite gradients (the derivative of arccos floored
    as in Note [angle for linear and sigmoid])."""
    w = torch.randn(3, 4, 1, 1, generator=torch.Generator().manual_seed(5))
    x = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(6))
    x[0, :, 0, 0], x[0, :, 0, 1] = 2.0 * w[0, :, 0, 0], -w[0, :, 0, 0]
    x, w = x.to(DEVICE).requires_grad_(True), w.to(DEVICE).requires_grad_(True)
    out = patch_cosine2d(x, w, angular=angular, backend="fused")
    out.sum().backward()
    torch.testing.assert_close(out[0, 0, 0, :2].cpu(), torch.tensor([1.0, -1.0]), rtol=0, atol=1e-3)
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("k", [50.0, 1000.0])
def test_fused_sigmoid_keeps_its_accuracy_for_a_large_k(k):
    """Large k makes u and tanh(pi / 4k) small: the kernels' tanh keeps a small relative error there.  (dg/dk is
    then a difference of two nearly equal terms, as in the reference node: only its finiteness is checked.)"""
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(7))
    w = torch.randn(5, 4, 3, 3, generator=torch.Generator().manual_seed(8))
    ref = _run("reference", x, w, None, None, torch.float64, "cpu", k=torch.full((5, 1, 1), k, dtype=torch.float64),
               padding=1, angular="sigmoid")
    fused = _run("fused", x, w, None, None, torch.float32, DEVICE, k=torch.full((5, 1, 1), k), padding=1,
                 angular="sigmoid")
    for a, b in zip(ref[:3], fused[:3]):
        torch.testing.assert_close(b.double().cpu(), a, rtol=0, atol=2e-5 * float(a.abs().max()))
    assert torch.isfinite(fused[3]).all()


@pytest.mark.parametrize("q", [None, 0.01, torch.tensor(0.01)], ids=["no q", "q number", "q learned"])
def test_squared_norms_gradient_under_and_over_the_floor(q):
    """dL/dsq = dL/dm / 2n where sq >= eps^2 and 0 under the floor, and a learned q's dL/dq = sum of dL/dm, both
    written by the backward kernel; against autograd through sqrt(max(sq, eps^2)) in float64.  A layer meets the
    floor at patches shorter than eps but not zero (a zero patch has dL/dm = 0 either way)."""
    from sphereml.layers.patch_epilogue import fused_epilogue

    g, eps = torch.Generator().manual_seed(11), 1e-3
    sq = torch.rand(2, 1, 4, 5, generator=g, dtype=torch.float64)
    sq[0] *= eps * eps  # every position of the first sample under the floor
    inner = (torch.rand(2, 3, 4, 5, generator=g, dtype=torch.float64) - 0.5) * sq.clamp_min(eps * eps).sqrt()
    upstream = torch.randn(inner.shape, generator=g, dtype=torch.float64)
    q = q.clone() if torch.is_tensor(q) else q  # the parameter's tensor is shared by the cases
    leaves = [sq.clone().requires_grad_(True), q.double().requires_grad_(True) if torch.is_tensor(q) else q]
    m = leaves[0].clamp_min(eps * eps).sqrt() + (0.0 if q is None else leaves[1])
    grads = torch.autograd.grad((inner / m * upstream).sum(), [v for v in leaves if torch.is_tensor(v)])
    fused_leaves = [sq.float().to(DEVICE).requires_grad_(True), q.to(DEVICE).requires_grad_(True)
                    if torch.is_tensor(q) else q]
    out = fused_epilogue(inner.float().to(DEVICE), fused_leaves[0], fused_leaves[1], "cosine", None, 1, eps)
    fused = torch.autograd.grad((out * upstream.float().to(DEVICE)).sum(),
                                [v for v in fused_leaves if torch.is_tensor(v)])
    assert torch.equal(fused[0][0].cpu(), torch.zeros_like(fused[0][0].cpu())) and grads[0][1].abs().min() > 0
    for want, got in zip(grads, fused):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("kwargs", [{}, {"angular": "sigmoid"}, {"power": 2.0}])
def test_fused_epilogue_keeps_nan(kwargs):
    x = torch.randn(1, 2, 4, 4)
    x[0, 0, 1, 1] = float("nan")
    w = torch.randn(3, 2, 3, 3)
    ref = patch_cosine2d(x, w, padding=1, backend="reference", **kwargs)
    fused = patch_cosine2d(x.to(DEVICE), w.to(DEVICE), padding=1, backend="fused", **kwargs).cpu()
    assert torch.equal(ref.isnan(), fused.isnan()) and ref.isnan().any()


def test_fused_epilogue_in_bf16_stays_in_bf16():
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(3))
    w = torch.randn(5, 4, 3, 3, generator=torch.Generator().manual_seed(4))
    ref = _run("reference", x, w, 1e-3, 2.0, torch.float64, "cpu", padding=1)
    fused = _run("fused", x, w, 1e-3, 2.0, torch.bfloat16, DEVICE, padding=1)
    assert all(t.dtype == torch.bfloat16 for t in fused)
    for a, b in zip(ref, fused):
        torch.testing.assert_close(b.double().cpu(), a, rtol=0, atol=2e-2 * float(a.abs().max()))


EPILOGUE_FORMS = {"cosine": ({}, 8), "linear": ({"angular": "linear"}, 19), "sigmoid": ({"angular": "sigmoid"}, 26),
                  "SCS": ({"q": 1e-3, "power": 2.0}, 17)}


@pytest.mark.parametrize("form", EPILOGUE_FORMS)
def test_fused_epilogue_reads_the_activations_less_often(form):
    """Operations touching a B x C_out x H' x W' tensor in forward + backward: 5 fused (the convolution and its
    backward, one kernel each way, the loss's sum) against 8 (cosine) to 26 (sigmoid) on the reference path;
    nn.Conv2d alone has 3."""
    kwargs, reference = EPILOGUE_FORMS[form]
    x = torch.randn(2, 4, 6, 6, device=DEVICE, requires_grad=True)
    w = torch.randn(8, 4, 3, 3, device=DEVICE, requires_grad=True)
    size = 2 * 8 * 6 * 6
    counts = {backend: count_ops(lambda b=backend: patch_cosine2d(x, w, padding=1, backend=b, **kwargs)
                                 .sum().backward(), touching=size).total for backend in ("reference", "fused")}
    assert counts == {"reference": reference, "fused": 5}


def test_fused_layer_passes_over_its_input_once_each_way_on_a_gpu(monkeypatch):
    """The GPU's patch norms (Note [one pass over the input]) on the fused path: operations touching the input's size
    in forward + backward (more input than output channels): the convolution and its backward, the energy's
    reduction and the norms' dL/dx added into the convolution's in place (Note [convolution and norms in one
    node]; the reference path's product and sum make 5)."""
    from sphereml.layers import patch_norms
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    x = torch.randn(2, 16, 6, 6, device=DEVICE, requires_grad=True)
    w = torch.randn(4, 16, 3, 3, device=DEVICE, requires_grad=True)
    count = count_ops(lambda: patch_cosine2d(x, w, padding=1, backend="fused").sum().backward(), touching=x.numel())
    assert count.total == 4, count.by_op


def test_fused_epilogue_compiles_without_graph_breaks():
    torch.compiler.reset()
    x = torch.randn(2, 4, 6, 6, requires_grad=True, device=DEVICE)
    w = torch.randn(5, 4, 3, 3, requires_grad=True, device=DEVICE)
    q, p = torch.tensor(1e-2, device=DEVICE, requires_grad=True), torch.full((5, 1, 1), 1.5, device=DEVICE,
                                                                            requires_grad=True)

    def layer(inputs):
        return patch_cosine2d(inputs, w, padding=1, q=q, power=p, backend="fused")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(x).square().sum(), (x, w, q, p))
    grads_eager = torch.autograd.grad(layer(x).square().sum(), (x, w, q, p))
    for a, b in zip(grads, grads_eager):
        torch.testing.assert_close(a, b)


def test_fused_decoupled_layer_compiles_without_graph_breaks(monkeypatch):
    """A radius-normalised TanhConv in training on the fused path: the kernels take h with the radius
    rho E{||x||} as a tensor (the batch mean, no gradient); one graph, the eager gradients and running mean."""
    from sphereml.layers import decoupled

    monkeypatch.setattr(decoupled, "resolve_backend", lambda backend, inputs: "fused")
    torch.compiler.reset()
    x = torch.randn(2, 4, 6, 6, requires_grad=True, device=DEVICE)
    layers = [decoupled.DecoupledConv2d(4, 5, 3, padding=1, radius_norm=True).to(DEVICE) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    compiled = torch.compile(layers[0], fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x).square().sum(), (x, layers[0].weight))
    want = torch.autograd.grad(layers[1](x).square().sum(), (x, layers[1].weight))
    for a, b in zip(got + (layers[0].norm_mean,), want + (layers[1].norm_mean,)):
        torch.testing.assert_close(a, b)
    assert "sphereml::patch_epilogue" in count_ops(lambda: layers[1](x)).by_op


def test_operators_pass_opcheck():
    """Schemas, fake tensors and dispatch of the two operators (torch.library.opcheck): a learned q with a sharpening,
    and a decoupled operator's h in the kernels with a tensor radius and its gradient."""
    ops = torch.ops.sphereml
    g = torch.Generator().manual_seed(18)
    inner, sq = torch.randn(2, 6, 3, 3, generator=g).to(DEVICE), (torch.rand(2, 2, 3, 3, generator=g) + 0.5).to(DEVICE)
    grad, q, r = torch.randn(inner.shape, generator=g).to(DEVICE), torch.tensor(0.1), torch.tensor(1.5)
    no_h = (0, 0.0, 0.0, None, None)
    tanh = (3, 1.0, 0.0, r.to(DEVICE), None)
    torch.library.opcheck(ops.patch_epilogue, (inner, sq, q.to(DEVICE), None, None, 2.0, None, *no_h, 1, 2, 1e-6))
    torch.library.opcheck(ops.patch_epilogue, (inner, sq, None, None, None, None, None, *tanh, 0, 2, 1e-6))
    mag = (torch.rand(sq.shape, generator=g) + 0.5).to(DEVICE)
    torch.library.opcheck(ops.patch_epilogue, (inner, sq, None, None, None, None, mag, *no_h, 0, 2, 1e-6))
    torch.library.opcheck(ops.patch_epilogue_backward, (grad, inner, sq, None, None, None, None, mag, *no_h, 0, 2,
                                                        1e-6, 0))
    torch.library.opcheck(ops.patch_epilogue_backward, (grad, inner, sq, q.to(DEVICE), None, None, 2.0, None, *no_h,
                                                        1, 2, 1e-6, 1))
    torch.library.opcheck(ops.patch_epilogue_backward, (grad, inner, sq, None, None, None, None, None, *tanh, 0, 2,
                                                        1e-6, 2))


def test_a_parameter_tensor_for_an_epilogue_without_one_is_refused():
    """The kernels read a tensor parameter (and write its partial sums) only for sharpening and the sigmoid."""
    ops = torch.ops.sphereml
    inner, sq = torch.randn(1, 2, 3, 3).to(DEVICE), (torch.rand(1, 1, 3, 3) + 0.5).to(DEVICE)
    a, no_h = torch.ones(2).to(DEVICE), (0, 0.0, 0.0, None, None)
    with pytest.raises(ValueError, match="needs an epilogue of \\('sharpen', 'sigmoid'\\), got 'cosine'"):
        ops.patch_epilogue(inner, sq, None, None, a, None, None, *no_h, 0, 1, 1e-6)
    with pytest.raises(ValueError, match="got 'sqcosine'"):
        ops.patch_epilogue_backward(torch.ones_like(inner), inner, sq, None, None, a, None, None, *no_h, 4, 1, 1e-6, 0)


def test_backend_errors_are_named():
    x, w = torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3)
    with pytest.raises(ValueError, match="backend must be one of"):
        patch_cosine2d(x, w, backend="triton")
    with pytest.raises(ValueError, match="backend='fused' needs"):
        patch_cosine2d(x.double(), w.double(), backend="fused")
    with pytest.raises(ValueError, match="power"):
        patch_cosine2d(x, w, power=0.0)
    with pytest.raises(ValueError, match="k must be"):
        patch_cosine2d(x, w, angular="sigmoid", k=0.0)
    with pytest.raises(ValueError, match="eps"):
        patch_cosine2d(x, w, eps=0.0)
    with pytest.raises(ValueError, match="fused epilogue takes k or p"):  # a 1-D k broadcasts along W
        patch_cosine2d(x.to(DEVICE), w.to(DEVICE), angular="sigmoid", k=torch.ones(3, device=DEVICE), backend="fused")


def test_auto_is_the_reference_on_the_cpu():
    x, w = torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3)
    ref = patch_cosine2d(x, w, backend="reference", power=2.0)
    torch.testing.assert_close(patch_cosine2d(x, w, power=2.0), ref, rtol=0, atol=0)


def test_kernels_compile_for_sm90_without_spills():
    """Both kernels for each form of q, p and h, float32 and bf16, in NCHW (and four forms in channels-last, two
    backward forms with a broadcast dL/dy), compiled for an H100 here (in a subprocess: the kernels of this process
    are interpreted)."""
    rows = sm90_compile_rows("bench_scs")
    assert len(rows) == 76
    for row in rows:
        assert row["spill_store_bytes"] in (0, None), row
        assert row["registers"] is None or row["registers"] <= 255, row


DECOUPLED = [("tanh", "cosine"), ("ball", "linear"), ("linear", "sigmoid"), ("seg", "sqcosine"), ("mix", "cosine"),
             ("sphere", "linear"), ("log", "sigmoid")]


@pytest.mark.parametrize("radius", ["learned", "number", "tensor"])
@pytest.mark.parametrize("magnitude,angular", DECOUPLED)
def test_fused_decoupled_operator_matches_float64_reference(magnitude, angular, radius):
    """Unweighted decoupled operators h(||x||) g(theta) (thesis eq. 4.3) on the fused path: the kernels evaluate h,
    dh/dn and, for a learned rho, the shares of dL/drho themselves, whether the radius is a number, a tensor or a
    learned tensor."""
    from sphereml.layers.decoupled import decoupled_conv2d

    x = torch.randn(2, 6, 7, 7, generator=torch.Generator().manual_seed(10))
    x[0, :, :3, :3] = 0.0
    w = torch.randn(8, 3, 3, 3, generator=torch.Generator().manual_seed(11))

    def run(backend, dtype, device):
        xx, ww = (v.to(device, dtype).clone().requires_grad_(True) for v in (x, w))
        rho = 2.0 if radius == "number" else torch.tensor(
            2.0, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=device,
            requires_grad=radius == "learned")
        out = decoupled_conv2d(xx, ww, padding=1, groups=2, magnitude=magnitude, angular=angular, rho=rho, k=0.4,
                               backend=backend)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(12)).to(device, dtype)
        (out * g).sum().backward()
        return out.detach(), xx.grad, ww.grad, rho.grad if radius == "learned" else None
    ref = run("reference", torch.float64, "cpu")
    fused, ref32 = run("fused", torch.float32, DEVICE), run("reference", torch.float32, DEVICE)
    for i, (a, b, c) in enumerate(zip(ref, fused, ref32)):
        if a is None:  # rho: no gradient for the magnitudes without a radius
            assert b is None
            continue
        # no worse than twice PyTorch's own float32 error (STYLE rule 13): rho's gradient, one sum over every
        # position, carries float32 rounding of 5e-5 relative in both paths on some CPUs
        own = float((c.double().cpu() - a).abs().max())
        tolerance = (2e-6 if i == 0 else 5e-5) * max(float(a.abs().max()), 1e-12)
        torch.testing.assert_close(b.double().cpu(), a, rtol=0, atol=tolerance + 2 * own)


@pytest.mark.parametrize("scale", [1e-4, 1e15])
def test_fused_decoupled_norms_hold_while_their_squares_fit_float32(scale):
    """The fused path's norms come from float32 squares (Note [fused decoupled norms]): patches of norm ~5e15
    (squares ~3e31) and ~5e-4 (squares ~3e-7, above the floor eps^2 = 1e-12) give the reference's values and
    gradients, with h = alpha ||x|| unbounded."""
    from sphereml.layers.decoupled import decoupled_conv2d

    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(16)).to(DEVICE) * scale
    w = torch.randn(4, 3, 3, 3, generator=torch.Generator().manual_seed(17)).to(DEVICE)

    def run(backend):
        xx, ww = (v.clone().requires_grad_(True) for v in (x, w))
        out = decoupled_conv2d(xx, ww, padding=1, magnitude="linear", angular="sigmoid", backend=backend)
        (out / scale).square().sum().backward()
        return out.detach(), xx.grad, ww.grad
    for ref, fused in zip(run("reference"), run("fused")):
        torch.testing.assert_close(fused, ref, rtol=2e-5, atol=2e-5 * float(ref.abs().max()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="compiled, the kernels' square root is approximate "
                    "(sqrt.approx.f32), so n = r does not hold exactly there; either side is a subgradient")
@pytest.mark.parametrize("magnitude", ["ball", "seg"])
def test_the_kernels_magnitude_takes_the_references_side_at_its_kink(magnitude):
    """At ||x|| = r exactly (every patch (3, 4) against r = 5) ball's clamp passes the gradient and seg takes its
    inner branch, in the kernels as in :func:`magnitude_function` (with a cosine g the reference's h / n form,
    alpha / max(n, r), takes the outer side: a subgradient either way)."""
    from sphereml.layers.decoupled import decoupled_conv2d

    x = torch.tensor([3.0, 4.0], device=DEVICE).view(1, 2, 1, 1).repeat(2, 1, 3, 3)
    w = torch.randn(4, 2, 1, 1, generator=torch.Generator().manual_seed(15)).to(DEVICE)

    def run(backend):
        xx, ww = (v.clone().requires_grad_(True) for v in (x, w))
        out = decoupled_conv2d(xx, ww, magnitude=magnitude, angular="linear", rho=5.0, backend=backend)
        out.square().sum().backward()
        return out.detach(), xx.grad, ww.grad
    for ref, fused in zip(run("reference"), run("fused")):
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-6)


def test_a_depthwise_radius_per_channel_takes_h_as_a_tensor():
    """With one channel per group a radius per channel still gives one h per group and position: autograd evaluates
    h, the kernels multiply by it (HAS_MAG) and write dL/dh, and the values and gradients (rho's included) are the
    reference's."""
    from sphereml.layers.decoupled import decoupled_conv2d

    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(19))
    w = torch.randn(4, 1, 3, 3, generator=torch.Generator().manual_seed(20))

    def run(backend):
        xx, ww = (v.to(DEVICE).requires_grad_(True) for v in (x, w))
        rho = torch.linspace(0.5, 2.0, 4, device=DEVICE).view(4, 1, 1).requires_grad_(True)
        out = decoupled_conv2d(xx, ww, padding=1, groups=4, magnitude="tanh", angular="sigmoid", rho=rho,
                               backend=backend)
        out.square().sum().backward()
        return out.detach(), xx.grad, ww.grad, rho.grad
    assert "aten::tanh" in count_ops(lambda: run("fused")).by_op  # h by autograd, outside the kernels
    for ref, fused in zip(run("reference"), run("fused")):
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-6)


def test_a_tensor_alpha_keeps_its_gradient_on_the_fused_path():
    """The kernels take alpha and beta as numbers; tensors keep h on autograd, so that they get their gradients."""
    from sphereml.layers.decoupled import decoupled_conv2d

    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(21)).to(DEVICE)
    w = torch.randn(4, 3, 3, 3, generator=torch.Generator().manual_seed(22)).to(DEVICE)

    def run(backend):
        alpha = torch.tensor(1.5, device=DEVICE, requires_grad=True)
        decoupled_conv2d(x, w, padding=1, magnitude="mix", alpha=alpha, backend=backend).square().sum().backward()
        return alpha.grad
    torch.testing.assert_close(run("fused"), run("reference"), rtol=1e-5, atol=0)


def test_a_radius_per_channel_keeps_the_reference_path_and_its_values():
    """The released DCNets code learns one radius per output channel: h(||x||) then differs per channel, which
    the fused epilogue (one factor per group and position) cannot take, so the fused backend computes it on the
    reference nodes, with the reference's values and gradients (an H200 run of chapter 4 failed here)."""
    from sphereml.layers.decoupled import decoupled_conv2d

    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(13))
    w = torch.randn(5, 4, 3, 3, generator=torch.Generator().manual_seed(14))

    def run(backend):
        xx, ww = (v.to(DEVICE).requires_grad_(True) for v in (x, w))
        rho = torch.linspace(0.5, 2.0, 5, device=DEVICE).view(5, 1, 1).requires_grad_(True)
        out = decoupled_conv2d(xx, ww, padding=1, magnitude="tanh", rho=rho, backend=backend)
        out.square().sum().backward()
        return out.detach(), xx.grad, ww.grad, rho.grad
    for ref, fused in zip(run("reference"), run("fused")):
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-6)


def test_a_magnitude_of_another_shape_is_refused():
    from sphereml.layers.magnitudes import Magnitude
    from sphereml.layers.patch_epilogue import fused_epilogue

    inner, sq = torch.randn(2, 5, 3, 3, device=DEVICE), torch.rand(2, 1, 3, 3, device=DEVICE) + 0.5
    with pytest.raises(ValueError, match="magnitude must have the patch norms' shape"):
        fused_epilogue(inner, sq, None, "cosine", None, 1, 1e-6, magnitude=torch.ones(2, 5, 3, 3, device=DEVICE))
    with pytest.raises(ValueError, match="needs q=None"):
        fused_epilogue(inner, sq, 0.1, "cosine", None, 1, 1e-6, magnitude=Magnitude("tanh", 1.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="radius as a number or a one-value tensor"):
        fused_epilogue(inner, sq, None, "cosine", None, 1, 1e-6, magnitude=Magnitude("tanh", 1.0, 0.0,
                                                                                      torch.ones(5, 1, 1)))


def test_weighted_decoupled_operators_keep_the_reference_path():
    from sphereml.layers.decoupled import decoupled_conv2d

    x, w = torch.randn(1, 2, 5, 5, device=DEVICE), torch.randn(3, 2, 3, 3, device=DEVICE)
    counts = {b: count_ops(lambda b=b: decoupled_conv2d(x, w, weighted="tanh_joint", backend=b)).by_op
              for b in ("reference", "fused")}
    assert counts["reference"] == counts["fused"] and "sphereml::patch_epilogue" not in counts["fused"]


def test_fused_kernels_are_an_opt_in(monkeypatch):
    """"auto" takes the reference paths of the patch layers and the margin heads, on a GPU box too, unless
    SPHEREML_FUSED=1 (the fused kernels were measured slower on an H200); the switch is read at each call."""
    from sphereml.energy.triton_backend import choose_backend, triton_importable

    cuda_like = type("CudaLike", (), {"is_cuda": True})()
    monkeypatch.delenv("SPHEREML_FUSED", raising=False)
    assert choose_backend("auto", cuda_like) == "reference"
    monkeypatch.setenv("SPHEREML_FUSED", "0")
    assert choose_backend("auto", cuda_like) == "reference"
    monkeypatch.setenv("SPHEREML_FUSED", "1")
    assert (choose_backend("auto", cuda_like) == "fused") == triton_importable()
    assert choose_backend("auto", cuda_like, fusable=False) == "reference"


