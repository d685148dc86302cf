"""The patch layers' kernels on the unit sphere (Note [unit kernels in one pass]): the fused path's two Triton kernels
against the float64 definition w / max(||w||, eps) and against the reference node.

The kernels run compiled on CUDA tensors or, on a CPU-only machine, under ``TRITON_INTERPRET=1`` (set here before
Triton is imported, as in ``test_patch_epilogue.py``).  Tolerances: the dtype's rounding of each output, relative to
the largest entry of its row (float32 1e-6; half 1e-3; bfloat16 1e-2).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from conftest import sm90_compile_rows  # noqa: E402
from sphereml.launches import count_ops  # noqa: E402
from sphereml.layers import decoupled, patch_norms  # noqa: E402
from sphereml.layers.decoupled import DecoupledConv2d, decoupled_conv2d  # noqa: E402
from sphereml.layers.patches import patch_cosine2d  # noqa: E402
from sphereml.layers.unit_kernels import _UnitKernels, unit_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}
FLOOR = {torch.float32: 1e-6, torch.float64: 1e-6, torch.float16: 1e-2, torch.bfloat16: 1e-6}  # half: g / eps < 65,504


def definition(w: torch.Tensor, eps: float) -> torch.Tensor:
    """w / max(||w||, eps) per flattened kernel, in float64 autograd."""
    flat = w.flatten(1)
    return (flat / torch.linalg.vector_norm(flat, dim=1, keepdim=True).clamp_min(eps)).view_as(w)


def kernels(dtype: torch.dtype, scale: float = 1.0) -> tuple[torch.Tensor, float]:
    """(w, eps): seven 3 x 3 x 3 kernels (27 values: ragged against the interpreter's 16-wide slices, and seven rows
    against its four-row programs) in ``dtype``, their entries about ``scale`` in size, and a floor eps of
    FLOOR[dtype] x ``scale``: ordinary kernels, a zero kernel, one a third of the floor long, one ten times it."""
    eps = FLOOR[dtype] * scale
    w = torch.randn(7, 3, 3, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * scale
    w[1], w[2], w[3] = 0.0, w[2] * eps / (3 * w[2].norm()), w[3] * 10 * eps / w[3].norm()
    return w.to(dtype), eps


def run(w: torch.Tensor, eps: float, fused: bool, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = w.detach().clone().to(DEVICE).requires_grad_(True)
    out = unit_kernels(leaf, eps, fused)
    (out * upstream.to(DEVICE, out.dtype)).sum().backward()
    return out.detach().cpu(), leaf.grad.cpu()


def close(got: torch.Tensor, want: torch.Tensor, tolerance: float):
    scale = want.flatten(1).abs().amax(1).clamp_min(1e-30).view(-1, *(1,) * (want.dim() - 1))
    assert ((got.double() - want) / scale).abs().max() <= tolerance, ((got.double() - want) / scale).abs().max()


@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30], ids=["unit", "tiny", "huge"])
def test_fused_unit_kernels_match_the_definition(dtype, scale):
    """Values and gradients against the float64 definition, with a zero kernel, one under the floor (gradient g / eps,
    no projection) and one over it; float32 kernels of entries about 1e-30 and 1e30, whose squares a float32 sum
    would lose (the kernels sum them in float64)."""
    if dtype != torch.float32 and scale != 1.0:
        pytest.skip("half and bfloat16 hold neither 1e-30 nor (half) 1e30")
    w, eps = kernels(dtype, scale)
    upstream = torch.randn(w.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    exact = w.double().requires_grad_(True)
    want = definition(exact, eps)
    (want * upstream.to(dtype).double()).sum().backward()
    out, grad = run(w, eps, True, upstream)
    assert out.dtype == grad.dtype == dtype
    close(out, want.detach(), TOLERANCE[dtype])
    close(grad, exact.grad, TOLERANCE[dtype])
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(grad).all()


@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
def test_fused_unit_kernels_match_the_reference_node(dtype):
    """The fused path and :class:`_UnitKernels` (the CPU's and the reference's) to the dtype's rounding."""
    w, eps = kernels(dtype)
    upstream = torch.randn(w.shape, generator=torch.Generator().manual_seed(7))
    for got, want in zip(run(w, eps, True, upstream), run(w, eps, False, upstream)):
        close(got, want.double(), 2 * TOLERANCE[dtype])


@pytest.mark.parametrize("layout", ["many tiles", "channels_last", "linear", "3-d"])
def test_fused_unit_kernels_take_any_layout_and_size(layout):
    """More rows and columns than a GPU's program holds (20 x 144 against 8 x 128: several programs, several
    slices, ragged ends), a channels-last kernel, a linear layer's weight and a 3-d convolution's."""
    g = torch.Generator().manual_seed(10)
    w = {"many tiles": torch.randn(20, 16, 3, 3, generator=g), "linear": torch.randn(5, 33, generator=g),
         "channels_last": torch.randn(6, 4, 3, 3, generator=g).to(memory_format=torch.channels_last),
         "3-d": torch.randn(4, 2, 3, 3, 3, generator=g)}[layout]
    upstream = torch.randn(w.shape, generator=g)
    for got, want in zip(run(w, 1e-6, True, upstream), run(w, 1e-6, False, upstream)):
        close(got, want.double(), 2 * TOLERANCE[torch.float32])


def test_a_nan_kernel_stays_nan_and_leaves_the_others_alone():
    w, eps = kernels(torch.float32)
    w[4, 0, 0, 0] = float("nan")
    out, grad = run(w, eps, True, torch.ones(w.shape))
    assert out[4].isnan().all() and grad[4].isnan().all()
    rest = [0, 1, 2, 3, 5, 6]
    ref_out, ref_grad = run(w[rest], eps, False, torch.ones(w[rest].shape))
    torch.testing.assert_close(out[rest], ref_out, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(grad[rest], ref_grad, rtol=2e-6, atol=1e-6 * float(ref_grad.abs().max()))


def test_a_non_contiguous_upstream_gradient():
    """The backward kernel reads the gradient as rows: a transposed upstream gradient is made contiguous first."""
    w, eps = kernels(torch.float32)
    w = w.reshape(7, 27)
    upstream = torch.randn(27, 7, generator=torch.Generator().manual_seed(8)).T
    for got, want in zip(run(w, eps, True, upstream), run(w, eps, False, upstream)):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6 * float(want.abs().max()))


def test_float64_kernels_keep_the_reference_node():
    """The kernels take float32 and half; float64 weights take :class:`_UnitKernels`, bit for bit."""
    w, eps = kernels(torch.float64)
    upstream = torch.randn(w.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    fused, reference = run(w, eps, True, upstream), run(w, eps, False, upstream)
    assert all(torch.equal(a, b) for a, b in zip(fused, reference))
    assert torch.equal(reference[0], _UnitKernels.apply(w.to(DEVICE), eps)[0].cpu())


def test_one_kernel_each_way():
    """The fused path launches one operator forward and one backward, where the reference node dispatches 15
    operations (Note [unit kernels in one pass])."""
    w, eps = kernels(torch.float32)
    w = w.to(DEVICE).requires_grad_(True)
    g = torch.randn(w.shape, device=DEVICE)
    counts = {fused: count_ops(lambda f=fused: torch.autograd.grad(unit_kernels(w, eps, f), w, g)).by_op
              for fused in (True, False)}
    assert counts[True] == {"sphereml::unit_kernels": 1, "sphereml::unit_kernels_backward": 1}, counts[True]
    assert sum(counts[False].values()) == 15, counts[False]


def test_fused_patch_layers_operation_budget(monkeypatch):
    """A fused SphereConv (cosine) and SCS (fixed p and q) forward + backward, the loss's sum included, with the GPU's
    patch norms: 11 operations each (14 with the box sums as convolutions: Note [box sums in a kernel]; 16 with the
    convolution and the norms in two nodes, whose dL/dx autograd adds: Note [convolution and norms in one node]; 35
    with the reference node for the kernels and dL/dm turned into dL/dsq by six operations outside the backward
    kernel); the decoupled operator (TanhConv x cosine) 11 too, with h in the kernels (Note [fused decoupled norms];
    42 with the scaled norms and autograd through h, 57 with autograd through its kernels' norms too), with a
    learned rho too (the kernel writes dL/drho's shares; the operator sums them); nn.Conv2d 4.  Tensors of x's size:
    2 passes for nn.Conv2d, 4 for each patch layer."""
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    x = torch.randn(2, 16, 6, 6, device=DEVICE, requires_grad=True)
    w = torch.randn(8, 16, 3, 3, device=DEVICE, requires_grad=True)
    rho = torch.tensor(1.0, device=DEVICE, requires_grad=True)
    layers = {"nn.Conv2d": lambda: torch.nn.functional.conv2d(x, w, padding=1),
              "SphereConv": lambda: patch_cosine2d(x, w, padding=1, backend="fused"),
              "SCS": lambda: patch_cosine2d(x, w, padding=1, q=1e-3, power=2.0, backend="fused"),
              "decoupled": lambda: decoupled_conv2d(x, w, padding=1, backend="fused"),
              "decoupled, learned rho": lambda: decoupled_conv2d(x, w, padding=1, rho=rho, backend="fused")}
    counts, passes = {}, {}
    for name, layer in layers.items():
        inputs = (x, w, rho) if "rho" in name else (x, w)
        counts[name] = count_ops(lambda f=layer, i=inputs: torch.autograd.grad(f().sum(), i)).total
        passes[name] = count_ops(lambda f=layer, i=inputs: torch.autograd.grad(f().sum(), i),
                                 touching=x.numel()).total - 2 * (name != "nn.Conv2d")  # minus w's two kernels
    assert counts == {"nn.Conv2d": 4, "SphereConv": 11, "SCS": 11, "decoupled": 11, "decoupled, learned rho": 11}, \
        counts
    assert passes == {"nn.Conv2d": 2, "SphereConv": 4, "SCS": 4, "decoupled": 4, "decoupled, learned rho": 4}, passes


@pytest.mark.parametrize("weighted", [False, "linear", "tanh_joint"])
def test_decoupled_layers_take_the_kernels_unless_weighted(weighted, monkeypatch):
    """On the fused path an unweighted DecoupledConv2d normalises its kernels by the two kernels; a weighted one keeps
    autograd through ||w||, which its output needs.  Outputs and gradients as on the reference path (convolutions in
    full float32 on a GPU: TF32 would round the two paths' kernels, one rounding step apart, to different values)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 4, 6, 6, generator=g).to(DEVICE)
    layer = DecoupledConv2d(4, 5, 3, padding=1, weighted=weighted).to(DEVICE)

    def step():
        layer.zero_grad()
        xx = x.clone().requires_grad_(True)
        out = layer(xx)
        out.square().sum().backward()
        return out.detach(), xx.grad, layer.weight.grad.clone()
    reference = step()
    monkeypatch.setattr(decoupled, "resolve_backend", lambda backend, inputs: "fused")
    fused = step()
    for got, want in zip(fused, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    ops = count_ops(lambda: layer(x)).by_op
    assert ("sphereml::unit_kernels" in ops) == (weighted is False), ops


def test_fused_unit_kernels_compile_without_graph_breaks():
    torch.compiler.reset()
    w, eps = kernels(torch.float32)
    w = w.to(DEVICE).requires_grad_(True)
    g = torch.randn(w.shape, device=DEVICE)

    def loss(v):
        return (unit_kernels(v, eps, True) * g).sum()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(torch.autograd.grad(compiled(w), w)[0], torch.autograd.grad(loss(w), w)[0])


def test_kernels_compile_for_sm90_without_spills():
    """Both kernels for float32, bf16 and fp16 weights, compiled for an H100 here (in a subprocess: the kernels of
    this process are interpreted)."""
    rows = sm90_compile_rows("bench_sphereconv")
    assert len(rows) == 6
    for row in rows:
        assert row["spill_store_bytes"] in (0, None), row
        assert row["registers"] is None or row["registers"] <= 128, row


def test_operators_pass_opcheck():
    """Schemas, fake tensors and dispatch of the two operators (torch.library.opcheck), float32 and bf16."""
    ops = torch.ops.sphereml
    for dtype in (torch.float32, torch.bfloat16):
        w, eps = kernels(dtype)
        rows = w.reshape(7, 27).to(DEVICE)
        torch.library.opcheck(ops.unit_kernels, (rows, eps))
        torch.library.opcheck(ops.unit_kernels, (rows.T.contiguous().T, eps))  # column-major rows
        unit, inv, active = ops.unit_kernels(rows, eps)
        torch.library.opcheck(ops.unit_kernels_backward, (torch.randn(rows.shape, device=DEVICE).to(dtype), unit, inv,
                                                          active))
