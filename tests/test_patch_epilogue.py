"""The fused patch epilogue (patch-norm division, clamp and SCS sharpening in one Triton kernel each way)
against the reference nodes in float64.

The kernels run compiled on CUDA tensors or, on a CPU-only machine, under ``TRITON_INTERPRET=1`` (set here
before Triton is imported, as in ``test_energy_triton.py``).  Float32 tolerances: 2e-6 relative to the
largest entry on values, 5e-5 on gradients (p < 1 makes d|c|^p/dc large near c = 0).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from sphereml.launches import count_ops  # noqa: E402
from sphereml.patches import patch_cosine2d  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")  # |c|^p at c = 0, interpreted


def _run(backend, x, w, q, p, dtype, device, **conv):
    """Output and gradients of x, w (and q, p when tensors) for a fixed random upstream gradient."""
    def leaf(v):  # q and p stay float32 under bf16, as parameters do
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        return v.to(device, wide).requires_grad_(True) if torch.is_tensor(v) else v
    xx, ww = (v.to(device, dtype).requires_grad_(True) for v in (x, w))
    qq, pp = leaf(q), leaf(p)
    out = patch_cosine2d(xx, ww, q=qq, power=pp, backend=backend, **conv)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    (out * g).sum().backward()
    return [out.detach()] + [v.grad for v in (xx, ww, qq, pp) if torch.is_tensor(v)]


CASES = {
    "cosine": dict(q=None, p=None),
    "q number, groups 2": dict(q=0.01, p=None, groups=2),
    "q tensor, p number": dict(q=torch.tensor(0.05), p=2.0),
    "q number, p per channel, groups 2": dict(q=1e-3, p=torch.rand(10, 1, 1) + 0.5, groups=2),
    "p 0-d tensor, stride 2": dict(q=None, p=torch.tensor(1.7), stride=2),
    "same padding, dilation 2": dict(q=1e-3, p=3.0, padding="same", dilation=2),
}


@pytest.mark.parametrize("case", CASES)
def test_fused_epilogue_matches_float64_reference(case):
    spec = dict(CASES[case])
    q, p = spec.pop("q"), spec.pop("p")
    spec.setdefault("padding", 1)
    x = torch.randn(3, 6, 7, 9, generator=torch.Generator().manual_seed(0))
    x[0, :, :4, :4] = 0.0  # zero patches: c = 0, the floors of Note [zero patch] and [sharpening without NaN]
    w = torch.randn(10, 6 // spec.get("groups", 1), 3, 3, generator=torch.Generator().manual_seed(2))

    def as64(v):
        return v.double() if torch.is_tensor(v) else v
    ref = _run("reference", x, w, as64(q), as64(p), torch.float64, "cpu", **spec)
    fused = _run("fused", x, w, q, p, torch.float32, DEVICE, **spec)
    assert len(fused) == len(ref)
    for i, (a, b) in enumerate(zip(ref, fused)):
        tolerance = 2e-6 if i == 0 else 5e-5
        torch.testing.assert_close(b.double().cpu(), a, rtol=0, atol=tolerance * float(a.abs().max()))


def test_fused_epilogue_in_bf16_stays_in_bf16():
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(3))
    w = torch.randn(5, 4, 3, 3, generator=torch.Generator().manual_seed(4))
    ref = _run("reference", x, w, 1e-3, 2.0, torch.float64, "cpu", padding=1)
    fused = _run("fused", x, w, 1e-3, 2.0, torch.bfloat16, DEVICE, padding=1)
    assert all(t.dtype == torch.bfloat16 for t in fused)
    for a, b in zip(ref, fused):
        torch.testing.assert_close(b.double().cpu(), a, rtol=0, atol=2e-2 * float(a.abs().max()))


def test_fused_epilogue_reads_the_activations_less_often():
    """Operations touching a B x C_out x H' x W' tensor in forward + backward of SCS: 5 (the convolution and
    its backward, one kernel each way, the loss's sum) against 17 on the reference path (division, clamp,
    sharpening and their backward); nn.Conv2d alone has 3."""
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    w = torch.randn(8, 4, 3, 3, requires_grad=True)
    size = 2 * 8 * 6 * 6
    counts = {backend: count_ops(lambda b=backend: patch_cosine2d(x, w, padding=1, q=1e-3, power=2.0, backend=b)
                                 .sum().backward(), touching=size).total for backend in ("reference", "fused")}
    assert counts["fused"] <= 5 and counts["reference"] >= counts["fused"] + 10, counts


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


def test_backend_errors_are_named():
    x, w = torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3)
    with pytest.raises(ValueError, match="backend must be one of"):
        patch_cosine2d(x, w, backend="triton")
    with pytest.raises(ValueError, match="backend='fused' needs"):
        patch_cosine2d(x.double(), w.double(), backend="fused")
    with pytest.raises(ValueError, match="power"):
        patch_cosine2d(x, w, power=0.0)


def test_auto_is_the_reference_on_the_cpu():
    x, w = torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3)
    ref = patch_cosine2d(x, w, backend="reference", power=2.0)
    torch.testing.assert_close(patch_cosine2d(x, w, power=2.0), ref, rtol=0, atol=0)


def test_kernels_compile_for_sm90_without_spills():
    """Both kernels for each form of q and p, float32 and bf16, compiled for an H100 here (in a subprocess:
    the kernels of this process are interpreted)."""
    pytest.importorskip("triton.compiler", reason="needs Triton's compiler")
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = "import json; from benchmarks.bench_scs import compile_check; print(json.dumps(compile_check()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], text=True,
                          capture_output=True, env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.splitlines()[-1])
    assert len(rows) == 12
    for row in rows:
        assert row["spill_store_bytes"] in (0, None), row
