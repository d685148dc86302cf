"""The batched energy's pair kernels (sphereml.energy._pair_kernels) against its PyTorch chain (sphereml.energy.gram).

Both are float64, so they agree to rounding: 1e-12 relative on the energies and on dE/dgram (relative to its
largest entry).  The kernels are compiled on CUDA and interpreted here (``TRITON_INTERPRET=1``, set before Triton
is imported).  Cases: ragged sizes over several row and column tiles, zero padding rows, a zero point (under the
norm floor), duplicate and antipodal points (r^2 at the floor eps), half-space weights, s = 0, 1, 1.5, 2.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from conftest import sm90_compile_rows  # noqa: E402

from sphereml import launches  # noqa: E402
from sphereml import regularizers as R  # noqa: E402
from sphereml.energy import batched, gram  # noqa: E402
from sphereml.energy.batched import PointSets, pair_weights  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _bucket(half: bool, seed: int = 0):
    """Three sets padded to N = 37 rows (37, 30 and 2 points), d = 5, with a duplicate, an antipodal pair and a
    zero point."""
    g = torch.Generator().manual_seed(seed)
    sizes, rows = (37, 30, 2), 37
    points = torch.zeros(3, rows, 5, dtype=torch.float64)
    for b, n in enumerate(sizes):
        points[b, :n] = torch.randn(n, 5, generator=g, dtype=torch.float64)
    points[0, 4] = points[0, 3]  # a duplicate
    points[0, 6] = -2.0 * points[0, 5]  # antipodal (a close pair of the half space)
    points[1, 7] = 0.0  # a zero point
    minus, plus = pair_weights(PointSets(rows, sizes, (half,) * 3), "pair_mean")
    return points @ points.mT, minus, plus if half else None


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("s", [0.0, 1.0, 1.5, 2.0])
def test_pair_kernels_match_the_pytorch_chain(s, half):
    grams, minus, plus = _bucket(half)
    grad = torch.tensor([0.7, -1.3, 2.0], dtype=torch.float64)
    ops, on = torch.ops.sphereml, {"device": DEVICE}
    energies = ops.gram_pair_energies(grams.to(**on), minus.to(**on), None if plus is None else plus.to(**on), s,
                                      1e-7)
    gradient = ops.gram_pair_gradient(grams.to(**on), minus.to(**on), None if plus is None else plus.to(**on),
                                      grad.to(**on), s, 1e-7)
    torch.testing.assert_close(energies.cpu(), gram._energy_chunk(grams, minus, plus, s, "euclidean", 1e-7),
                               rtol=1e-12, atol=0)
    expected = gram._gradient_chunk(grams, minus, plus, grad, s, "euclidean", 1e-7)
    torch.testing.assert_close(gradient.cpu(), expected, rtol=0, atol=1e-12 * float(expected.abs().max()))
    assert torch.isfinite(gradient).all()


def test_pair_operators_pass_opcheck():
    grams, minus, plus = (t.to(DEVICE) for t in _bucket(True, seed=1))
    grad = torch.tensor([1.0, 0.5, -2.0], dtype=torch.float64, device=DEVICE)
    for weights in ((minus, plus), (minus, None)):
        torch.library.opcheck(torch.ops.sphereml.gram_pair_energies, (grams, *weights, 2.0, 1e-7))
        torch.library.opcheck(torch.ops.sphereml.gram_pair_gradient, (grams, *weights, grad, 1.5, 1e-7))


def _small_net():
    """Three convolutions and a linear layer (four fan-ins), on the device the kernels run on."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3),
                              torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3), torch.nn.Flatten(), torch.nn.LazyLinear(10))
    net(torch.randn(1, 3, 9, 9))
    return net.to(DEVICE)


@pytest.mark.parametrize("half_space", [False, True])
def test_mhe_with_the_pair_kernels_equals_the_chain(monkeypatch, half_space):
    """MHE's penalty and its gradient through the kernels: those of the PyTorch chain, on every layer."""
    net = _small_net()
    reg = R.MHE(net, half_space=half_space)
    results = {}
    for backend in ("reference", "fused"):
        monkeypatch.setattr(gram, "PAIRS_BACKEND", backend)
        net.zero_grad()
        penalty = reg.penalty()
        penalty.backward()
        results[backend] = (penalty.detach(), [p.grad.clone() for p in net.parameters() if p.grad is not None])
    torch.testing.assert_close(results["fused"][0], results["reference"][0], rtol=1e-12, atol=0)
    for a, b in zip(results["fused"][1], results["reference"][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # float32 weights: the same float64 energies


@pytest.mark.parametrize("shared_blocks", [False, True])
def test_pair_kernels_cut_a_cnn9_step_by_one_chain_per_bucket(monkeypatch, shared_blocks):
    """HS-MHE on a CNN-9 (narrow, for the interpreter's sake): the kernels replace each bucket's ~56 element-wise
    operations by three (at the thesis's widths 64/128/256 a step makes 200 operations, 100 without MHE).  With one
    block per fan-in the step has several buckets; with the fan-ins sharing blocks, as a GPU packs them by default
    (ACCELERATOR_COLUMN_WASTE), this narrow network has one (an H100, 2026-12-06: 198 -> 137 operations)."""
    from test_step_cost import REGULARIZERS, _cnn9, _step

    monkeypatch.setattr(gram, "CPU_CHUNK", 2**62)  # as on a GPU (tests/test_step_cost.py)
    monkeypatch.setattr(batched, "MERGE_MAX", 2**62)
    monkeypatch.setattr(batched, "MERGE_WASTE", batched.ACCELERATOR_MERGE_WASTE)
    if shared_blocks:
        monkeypatch.setattr(batched, "on_accelerator", lambda device: True)  # the GPU's packing on either device
    else:
        monkeypatch.setattr(batched, "ACCELERATOR_COLUMN_WASTE", None)  # one block per fan-in on either device
    counts = {}
    for backend in ("reference", "fused"):
        monkeypatch.setattr(gram, "PAIRS_BACKEND", backend)
        net = _cnn9(widths=(8, 16, 32)).to(DEVICE)
        reg = REGULARIZERS["HS-MHE"](net)
        counts[backend] = launches.count_ops(_step(net, reg.weighted_penalty)).total
    buckets = len(reg._engine.plan(torch.device(DEVICE)).engine.prepare(torch.device(DEVICE))[0])
    assert buckets >= (1 if shared_blocks else 2), buckets
    assert counts["fused"] <= counts["reference"] - 45 * buckets, (buckets, counts)


def test_pair_kernels_compile_for_sm90_without_spills():
    rows = sm90_compile_rows("bench_comhe")
    assert len(rows) == 16
    for row in rows:
        assert row["spill_store_bytes"] in (0, None), row


def test_mhe_with_the_pair_kernels_compiles_as_one_graph(monkeypatch):
    """The two custom operators trace under torch.compile(fullgraph=True), with the chain's gradients."""
    monkeypatch.setattr(gram, "PAIRS_BACKEND", "fused")
    torch.compiler.reset()
    net = _small_net()
    reg = R.MHE(net, half_space=True)
    compiled = torch.compile(reg.penalty, fullgraph=True, backend="aot_eager")
    value = compiled()
    value.backward()
    grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    net.zero_grad()
    monkeypatch.setattr(gram, "PAIRS_BACKEND", "reference")
    reg.penalty().backward()
    for a, p in zip(grads, [p for p in net.parameters() if p.grad is not None]):
        torch.testing.assert_close(a, p.grad, rtol=1e-6, atol=1e-7)


def test_pair_kernels_leave_vmap_to_the_chain(monkeypatch):
    """Under torch.func.vmap (several seeds' penalties, sphereml.multiseed) the chain runs: no batching rule needed."""
    monkeypatch.setattr(gram, "PAIRS_BACKEND", "fused")
    grams, minus, plus = _bucket(True)
    stacked = torch.stack([grams, 2.0 * grams])
    energies = torch.func.vmap(lambda g: gram.gram_energies(g, minus, plus, 2.0, "euclidean", 1e-7))(stacked)
    expected = torch.stack([gram._energy_chunk(g, minus, plus, 2.0, "euclidean", 1e-7) for g in stacked])
    torch.testing.assert_close(energies, expected, rtol=1e-12, atol=0)


def test_mhe_with_the_pair_kernels_reads_nothing_on_the_host(monkeypatch):
    monkeypatch.setattr(gram, "PAIRS_BACKEND", "fused")
    net = _small_net()
    reg = R.MHE(net, half_space=True)
    reg.penalty()  # the device constants, made once
    with launches.no_host_sync():
        reg.penalty().backward()
