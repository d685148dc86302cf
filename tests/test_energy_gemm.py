"""What only the ``gemm`` energy backend has: blocks of rows, the gradient formed in the forward pass, its launches.

Its values and gradients against the dense reference (close pairs, duplicates, half space, weights, every s,
half input, the matmul precisions) run with the fused kernels' in ``test_energy_triton.py``.  Interpreted on
CPU tensors (``TRITON_INTERPRET=1``, 16 x 32 tiles, d-slices of 16) where there is no GPU.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="the Triton kernel tests need the triton package")

from conftest import sm90_compile_rows  # noqa: E402
from test_energy_precision import close_pair_points  # noqa: E402

from sphereml import launches  # noqa: E402
from sphereml.energy import hyperspherical_energy as E  # noqa: E402
from sphereml.energy.dense import dense_energy  # noqa: E402
from sphereml.energy.gemm_backend import block_rows, gemm_energy  # noqa: E402
from sphereml.energy.kernels import CLOSE_R2  # noqa: E402
from sphereml.energy.tiled import tiled_energy  # noqa: E402
from sphereml.geometry import normalize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("one_thread")


def _unit(n, d, seed=0):
    return normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))


def _value_and_grad(points, s, block=None, dense=False):
    """(value, gradient) in float64 on the CPU, of gemm in blocks of ``block`` rows (or of dense)."""
    x = points.detach().clone().requires_grad_(True)
    value = dense_energy(x, s, "euclidean", 1e-7) if dense else gemm_energy(x, s, 1e-7, block)
    value.backward()
    return value.detach().double().cpu(), x.grad.double().cpu()


def _close_to_dense(points32, s, block, rtol=1e-5):
    """Value, and every row's gradient, within ``rtol`` (10 rtol for a gradient row) of float64 dense: rows of
    far pairs only are held to their own size, not to the close pairs' far larger gradients."""
    exact_value, exact_grad = _value_and_grad(points32.double().cpu(), s, dense=True)
    value, grad = _value_and_grad(points32.to(DEVICE), s, block)
    torch.testing.assert_close(value, exact_value, rtol=rtol, atol=0)
    row_error = (grad - exact_grad).norm(dim=1) / exact_grad.norm(dim=1)
    assert float(row_error.max()) <= 10 * rtol, (int(row_error.argmax()), float(row_error.max()))


@pytest.mark.parametrize("block", [1, 7, 33, 130])
def test_every_block_size_gives_the_dense_energy(block):
    """Ragged blocks (130 = 7 x 18 + 4), close pairs inside one block and across two (rows 0-1 and 3-100), and
    the rows with far pairs only (the product D Q and its row-sum term) each to its own precision."""
    w = close_pair_points(130, 40, "chord 1e-2", seed=3)
    w[100] = w[3] * 2.5  # a duplicate direction of another length, in a later block
    _close_to_dense(normalize(w), 2.0, block)


@pytest.mark.parametrize("block", [7, 33])
def test_far_pairs_only_over_several_blocks(block):
    _close_to_dense(normalize(close_pair_points(90, 30, "random", seed=8)), 1.0, block)


def test_pairs_on_both_sides_of_the_close_threshold():
    """Pairs at r^2 just below and just above CLOSE_R2 (where the kernels switch from the Gram estimate to the exact
    difference) and just inside and outside the candidate margin 2 CLOSE_R2, each pair in a tile of its own (16 x 32
    tiles under the interpreter): values and gradients stay those of dense."""
    base = _unit(80, 24, seed=5)
    w = base.clone()
    pairs = {(0, 1): 0.98, (20, 45): 1.02, (40, 70): 1.98, (60, 5): 2.02}  # (row, column): r^2 / CLOSE_R2
    for (i, j), ratio in pairs.items():
        u, t = base[i], base[j] - (base[j] @ base[i]) * base[i]
        theta = 2 * math.asin(math.sqrt(ratio * CLOSE_R2) / 2)  # the angle of chord sqrt(r2)
        w[j] = math.cos(theta) * u + math.sin(theta) * t / t.norm()
    for s in (0.0, 2.0):
        _close_to_dense(w.float(), s, 16)


def test_the_forward_pass_keeps_the_gradient_only_when_one_is_wanted():
    """With a gradient wanted the forward pass forms it (the backward only scales it); without, the same value
    from fewer launches; two runs are bit for bit the same (no atomics)."""
    w = close_pair_points(70, 19, "duplicate", seed=1).to(DEVICE)
    counted = {}
    for wanted in (True, False):
        x = w.clone().requires_grad_(wanted)
        counted[wanted] = launches.count_ops(lambda: gemm_energy(x, 2.0, 1e-7, 16))
    assert counted[False].total < counted[True].total
    products = {wanted: count.by_op["aten::mm.out"] for wanted, count in counted.items()}
    assert products == {True: 2 * 5, False: 5}  # 70 rows in 5 blocks of 16
    x = w.clone().requires_grad_(True)
    with torch.no_grad():  # a tensor that requires a gradient, but autograd is off: none is formed
        quiet = launches.count_ops(lambda: gemm_energy(x, 2.0, 1e-7, 16))
        value = gemm_energy(x, 2.0, 1e-7, 16)
    assert quiet.by_op["aten::mm.out"] == 5 and not value.requires_grad
    runs = [_value_and_grad(w, 2.0, 16) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    torch.testing.assert_close(value.double().cpu(), runs[0][0], rtol=1e-6, atol=0)  # other kernel variant
    scaled = w.clone().requires_grad_(True)
    (3.0 * gemm_energy(scaled, 2.0, 1e-7, 16)).backward()
    torch.testing.assert_close(scaled.grad.double().cpu(), 3.0 * runs[0][1], rtol=1e-6, atol=0)


def test_launches_grow_with_blocks_only_and_nothing_is_read_on_the_host():
    """A fixed number of operations per block of rows, whatever the number of points in it; no host read."""
    def ops(n, block):
        x = _unit(n, 12, seed=n).float().to(DEVICE).requires_grad_(True)
        return launches.count_ops(lambda: gemm_energy(x, 2.0, 1e-7, block).backward()).total

    per_block = ops(96, 32) - ops(96, 48)  # 3 blocks against 2
    assert 0 < per_block <= 8
    assert ops(192, 64) == ops(96, 32)  # twice the points, the same three blocks
    x = close_pair_points(50, 9, "duplicate", seed=4).to(DEVICE).requires_grad_(True)
    E(x, half_space=True, backend="gemm").backward()  # compiles the kernels (on a GPU) outside the checks
    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        with launches.no_host_sync():
            E(x, half_space=True, backend="gemm").backward()
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def test_block_rows_and_bad_arguments():
    with pytest.raises(ValueError, match="block must be an integer >= 1"):
        gemm_energy(torch.randn(5, 3), 2.0, 1e-7, 0)
    with pytest.raises(ValueError, match=r"points must be a Tensor\[M >= 2, d\]"):
        gemm_energy(torch.randn(1, 3), 2.0, 1e-7)
    assert block_rows(10) == 10
    assert block_rows(2**20) == 2**8  # a Gram block of 2^28 numbers
    assert block_rows(100, budget=250) == 2
    assert block_rows(100, budget=50) == 1


def test_compiles_without_graph_breaks():
    """The two kernels are custom operators (``sphereml::energy_pair_sums``, ``sphereml::energy_close_gradient``):
    ``torch.compile(fullgraph=True)`` traces the whole energy, and its gradient is the eager one."""
    torch.compiler.reset()
    w = close_pair_points(40, 9, "duplicate", seed=2).to(DEVICE)

    def energy(x):
        return E(x, half_space=True, backend="gemm")

    compiled = torch.compile(energy, fullgraph=True, backend="aot_eager")
    eager, traced = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
    energy(eager).backward()
    compiled(traced).backward()
    torch.testing.assert_close(traced.grad, eager.grad, rtol=1e-5, atol=1e-6 * float(eager.grad.abs().max()))


def test_kernels_compile_for_sm90_without_spills():
    """Both kernels for every s fast path, compiled for an H100 here: no spills, and registers low enough for
    several programs per multiprocessor (the pair kernel is bound by memory; 32 x 128 tiles took 255 registers)."""
    rows = sm90_compile_rows("bench_energy", "gemm_compile_check")
    assert len(rows) == 12
    for row in rows:
        assert row["spill_store_bytes"] in (0, None), row
        assert row["registers"] is None or row["registers"] <= 128, row


def test_fewer_products_and_passes_than_tiled_and_no_host_read():
    """What ``auto`` weighs when it sends a large float32 set on a GPU to gemm rather than tiled: per block of rows
    two matrix products against tiled's three (its backward forms the Gram block again), fewer operations in all,
    and no host read where tiled gathers close pairs with ``nonzero``."""
    w = normalize(close_pair_points(96, 12, "duplicate", seed=6)).to(DEVICE)
    energies = {"gemm": lambda x: gemm_energy(x, 2.0, 1e-7, 32), "tiled": lambda x: tiled_energy(x, 2.0, "euclidean",
                                                                                                 1e-7, 32)}
    counts = {b: launches.count_ops(lambda: energy(w.clone().requires_grad_(True)).backward())
              for b, energy in energies.items()}
    products = {b: sum(n for op, n in c.by_op.items() if op.split(".")[0] in ("aten::mm", "aten::addmm"))
                for b, c in counts.items()}
    assert products == {"gemm": 2 * 3, "tiled": 3 * 3}, products  # 96 rows in 3 blocks
    assert counts["gemm"].total < counts["tiled"].total / 2, (counts["gemm"].total, counts["tiled"].total)
    assert counts["tiled"].by_op["aten::nonzero"] > 0 and counts["gemm"].by_op["aten::nonzero"] == 0


def test_custom_operators_pass_opcheck():
    """``torch.library.opcheck``: schemas (the mutated block and gradient rows), fake tensors, autograd registration."""
    q = normalize(close_pair_points(40, 6, "duplicate", seed=9)).to(DEVICE)
    sq = (q * q).sum(1)
    for with_grad in (True, False):
        torch.library.opcheck(torch.ops.sphereml.energy_pair_sums.default,
                              (q[:20] @ q.T, q, sq, 0, 2.0, 1e-7, with_grad))
    flags = torch.ones(2, 2, dtype=torch.int32, device=DEVICE)  # every tile flagged: the close pairs' full path
    torch.library.opcheck(torch.ops.sphereml.energy_close_gradient.default, (torch.zeros(20, 6, device=DEVICE), q,
                                                                             sq, flags, 0, 2.0, 1e-7))
