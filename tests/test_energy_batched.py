"""The batched, sync-free energy (Note [batched energy]): oracles against dense, the fused gradient, packing."""

import itertools

import pytest
import torch

from sphereml.energy import gram, hyperspherical_energy
from sphereml.energy.batched import LayerEnergies, PointSets, SetEnergies, buckets, pair_weights
from sphereml.energy.gram import gram_energies, gram_energies_reference
from sphereml.launches import count_ops, no_host_sync

F64 = torch.float64
VARIANTS = list(itertools.product([0.0, 1.0, 2.0], ["euclidean", "angular"], [False, True]))


def _weights(dtype=F64, seed=0):
    """Layers of several fan-ins and sizes (two share fan-in 27 with different sizes), a zero neuron and a
    duplicated direction (floored), as a regulariser meets them."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 3, 3, 3), (8, 27), (5, 27), (12, 4), (2, 3)]
    ws = [torch.randn(*shape, generator=g, dtype=F64) for shape in shapes]
    ws[1][3] = 2.0 * ws[1][2]  # the same direction: r^2 = 0, floored
    ws[2][0] = 0.0  # a dead neuron
    return [w.to(dtype) for w in ws]


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("s,metric,half", VARIANTS)
def test_layer_energies_equal_dense_values_and_gradients_float64(s, metric, half):
    ws = _weights()
    mine = [w.clone().requires_grad_(True) for w in ws]
    ref = [w.clone().requires_grad_(True) for w in ws]
    got = LayerEnergies([w.shape for w in ws], s, metric, half)(mine)
    expected = torch.stack([hyperspherical_energy(w, s, metric, half, backend="dense") for w in ref])
    weights = torch.arange(1.0, 6.0, dtype=F64)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    for a, b in zip(mine, ref):
        # the dead neuron's gradient is 1e12 times an O(1e-16) sum that cancels exactly here
        live = b.flatten(1).norm(dim=1) > 0
        assert _relative(a.grad.flatten(1)[live], b.grad.flatten(1)[live]) < 1e-12


@pytest.mark.parametrize("s,metric,half", VARIANTS)
def test_fused_gradient_equals_autograd_of_the_plain_formula(s, metric, half):
    x = torch.randn(3, 6, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    x[1, 2] = 0.0
    x[2, 4] = 3.0 * x[2, 3]
    minus, plus = pair_weights(PointSets(6, (6, 5, 6), (half, False, half)), "pair_mean")
    plus = plus if half else None
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    fused = gram_energies(a @ a.mT, minus, plus, s, metric, 1e-7)
    plain = gram_energies_reference(b @ b.mT, minus, plus, s, metric, 1e-7)
    grad = torch.tensor([0.5, -2.0, 1.5], dtype=F64)
    (fused * grad).sum().backward()
    (plain * grad).sum().backward()
    torch.testing.assert_close(fused, plain, rtol=1e-14, atol=0)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12 * b.grad.abs().max().item())


@pytest.mark.parametrize("metric", ["euclidean", "angular"])
@pytest.mark.parametrize("s", [0.0, 2.0])
def test_gradcheck_of_the_fused_energy(metric, s):
    y = torch.randn(2, 5, 3, dtype=F64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    minus, plus = pair_weights(PointSets(5, (5, 4), (True, False)), "pair_mean")
    assert torch.autograd.gradcheck(lambda t: gram_energies(t @ t.mT, minus, plus, s, metric, 1e-7), (y,))


def test_gram_backward_is_one_product_per_block_and_passes_gradcheck():
    """dE/dX = 2 Gbar X with Gbar symmetric: one batched product per block each way (autograd's backward of
    X @ X.mT makes two and an add), exact to gradcheck's tolerance through padding, merging and half space."""
    ws = [w.requires_grad_(True) for w in _weights()]
    energies = LayerEnergies([w.shape for w in ws], 2.0, half_space=[True, False, True, True, False])
    count = count_ops(lambda: energies.total(ws).backward())
    products = {op: n for op, n in count.by_op.items() if op in ("aten::bmm", "aten::baddbmm", "aten::mm")}
    blocks = len(energies.blocks(torch.device("cpu")))
    assert products == {"aten::bmm": blocks, "aten::baddbmm": blocks}, products
    full = _weights()
    small = [full[1][:3, :4], full[2][:2, :4], full[3][:3], full[4]]  # fan-ins 4 (padded 2 -> 3) and 3
    small = [w.detach().clone().requires_grad_(True) for w in small]
    total = LayerEnergies([w.shape for w in small], 1.0, half_space=True).total
    assert torch.autograd.gradcheck(lambda *w: total(w), small)


def test_cpu_chunks_give_the_same_numbers(monkeypatch):
    x = torch.randn(7, 9, 5, dtype=F64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    minus, plus = pair_weights(PointSets(9, (9,) * 7, (True,) * 7), "pair_mean")
    whole = gram_energies(x @ x.mT, minus, plus, 2.0, "euclidean", 1e-7)
    (g_whole,) = torch.autograd.grad(whole.sum(), x)
    monkeypatch.setattr(gram, "CPU_CHUNK", 81 * 2)  # two sets per chunk, the last one alone
    assert len(gram._chunks(x @ x.mT)) == 4
    chunked = gram_energies(x @ x.mT, minus, plus, 2.0, "euclidean", 1e-7)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), x)
    torch.testing.assert_close(chunked, whole, rtol=1e-15, atol=0)
    torch.testing.assert_close(g_chunked, g_whole, rtol=1e-14, atol=0)


def test_float32_near_duplicates_are_more_exact_than_float32_dense():
    """Two neurons at chord 1e-3 in float32: the float64 Gram is closer to the float64 truth than dense's own
    float32 result (which already recomputes close pairs from differences), and within 1e-6."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 64, generator=g, dtype=F64)
    w[1] = w[0] + 1e-3 * torch.randn(64, generator=g, dtype=F64) / 8
    w32 = w.float()
    truth = hyperspherical_energy(w32.double(), 2.0, half_space=True, backend="dense")
    mine = LayerEnergies([w.shape], 2.0, half_space=True)([w32])[0]
    dense32 = hyperspherical_energy(w32, 2.0, half_space=True, backend="dense")
    assert abs(mine.item() - truth.item()) / truth.item() < 1e-9
    assert abs(mine.item() - truth.item()) <= abs(dense32.item() - truth.item())


def test_float64_close_pairs_within_the_stated_bound():
    """Float64 input: r^2 from the Gram matrix is exact to ~1e-15 absolute (Note [batched energy])."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(6, 30, generator=g, dtype=F64)
    for chord in (1e-1, 1e-2, 1e-3):
        w[1] = w[0] / w[0].norm() + chord * torch.nn.functional.normalize(torch.randn(30, generator=g, dtype=F64),
                                                                            dim=0)
        got = LayerEnergies([w.shape], 2.0)([w])[0]
        expected = hyperspherical_energy(w, 2.0, backend="dense")
        assert abs((got - expected).item()) / expected.item() < 1e-14 / chord**2


def test_pair_sum_is_the_pair_mean_times_the_pairs():
    ws = _weights()
    mean = LayerEnergies([w.shape for w in ws], 2.0, half_space=True)(ws)
    total = LayerEnergies([w.shape for w in ws], 2.0, half_space=True, reduction="pair_sum")(ws)
    pairs = torch.tensor([2 * len(w) * (2 * len(w) - 1) for w in ws], dtype=F64)
    torch.testing.assert_close(total, mean * pairs, rtol=1e-13, atol=0)


def test_total_weighs_layers_and_matches_the_sum():
    ws = _weights()
    coefficients = [0.5, 2.0, 1.0, 3.0, 0.25]
    energies = LayerEnergies([w.shape for w in ws], 1.0, half_space=[True, False, True, False, True],
                             coefficients=coefficients)
    expected = (energies(ws) * torch.tensor(coefficients, dtype=F64)).sum()
    torch.testing.assert_close(energies.total(ws), expected, rtol=1e-14, atol=0)


def test_backend_batched_of_hyperspherical_energy():
    w = _weights()[1]
    for s, metric, half in VARIANTS:
        torch.testing.assert_close(hyperspherical_energy(w, s, metric, half, backend="batched"),
                                   hyperspherical_energy(w, s, metric, half, backend="dense"), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="backend='batched' has no weights"):
        hyperspherical_energy(w, backend="batched", weights=torch.ones(len(w), dtype=F64))


def test_no_host_reads_in_a_batched_evaluation():
    ws = [w.float().requires_grad_(True) for w in _weights()]
    energies = LayerEnergies([w.shape for w in ws], 2.0, half_space=True)
    energies.prepare(torch.device("cpu"))
    with no_host_sync():
        energies.total(ws).backward()
    assert all(w.grad is not None for w in ws)


def test_buckets_merge_while_the_padding_stays_small():
    # (rows N, sets B): the 256-point sets take the 200-point ones (waste 1.3x), not the 16-point ones
    assert buckets([(256, 4), (200, 3), (16, 10)]) == [(256, [0, 1]), (16, [2])]
    assert buckets([(64, 1)]) == [(64, [0])]
    assert buckets([(10, 1), (10, 2)]) == [(10, [0, 1])]
    assert buckets([(256, 1), (16, 1)], waste=1e9) == [(256, [0, 1])]
    # a block too large to copy into a bucket stays alone, and the others still merge
    assert buckets([(256, 512), (256, 4), (200, 3)], largest=2**22) == [(256, [0]), (256, [1, 2])]


def test_set_energies_pad_merged_blocks_exactly():
    g = torch.Generator().manual_seed(6)
    big, small = torch.randn(2, 9, 4, generator=g, dtype=F64), torch.randn(3, 8, 4, generator=g, dtype=F64)
    engine = SetEnergies([PointSets(9, (9, 7), (True, False)), PointSets(8, (8, 8, 6), (False,) * 3)], 2.0)
    assert engine.prepare(torch.device("cpu"))[0] == [(9, [0, 1])]
    small[2, 6:] = 0.0  # a block's padding rows are zero
    big[1, 7:] = 0.0
    out = engine([big, small])
    expected = [hyperspherical_energy(big[0], 2.0, half_space=True), hyperspherical_energy(big[1, :7], 2.0)]
    expected += [hyperspherical_energy(small[i, :n], 2.0) for i, n in enumerate((8, 8, 6))]
    torch.testing.assert_close(torch.cat(out), torch.stack(expected), rtol=1e-12, atol=0)


@pytest.mark.parametrize("merged", [True, False])
def test_joined_energies_are_the_blocks_in_order_with_fewer_operations_from_one_bucket(merged, monkeypatch):
    """joined() is __call__'s blocks concatenated; from a single bucket holding every block in order it hands back the
    bucket's own energies, one operation fewer each way (no split to undo, no concatenation)."""
    monkeypatch.setattr(gram, "CPU_CHUNK", 2**62)  # one chunk, as on a GPU
    g = torch.Generator().manual_seed(7)
    points = [torch.randn(2, 9, 4, generator=g, dtype=F64), torch.randn(3, 8 if merged else 3, 4, generator=g,
                                                                          dtype=F64)]
    engine = SetEnergies([PointSets(9, (9, 9), (True, False)), PointSets(points[1].shape[1], (3,) * 3, (False,) * 3)],
                         2.0)
    assert len(engine.prepare(torch.device("cpu"))[0]) == (1 if merged else 2)
    points[1][:, 3:] = 0.0
    torch.testing.assert_close(engine.joined(points), torch.cat(engine(points)), rtol=0, atol=0)

    def step(evaluate):
        leaves = [p.clone().requires_grad_() for p in points]
        evaluate(leaves).sum().backward()

    saved = count_ops(lambda: step(lambda x: torch.cat(engine(x)))).total - count_ops(
        lambda: step(engine.joined)).total
    assert saved == (2 if merged else 0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="every set needs 2 <= n <= 4 points"):
        PointSets(4, (1,), (False,))
    with pytest.raises(ValueError, match="one entry per set"):
        PointSets(4, (3, 3), (False,))
    with pytest.raises(ValueError, match="at least one block"):
        SetEnergies([])
    with pytest.raises(ValueError, match="reduction must be one of"):
        SetEnergies([PointSets(3, (3,), (False,))], reduction="sum")
    with pytest.raises(ValueError, match="shapes must list weights"):
        LayerEnergies([(5,)])
    with pytest.raises(ValueError, match="half_space must be a bool or one per weight"):
        LayerEnergies([(5, 3)], half_space=[True, False])
    energies = LayerEnergies([(5, 3)])
    with pytest.raises(ValueError, match=r"weights must have the shapes"):
        energies([torch.randn(4, 3)])
    with pytest.raises(ValueError, match=r"weights must have the shapes"):  # total and pack check them too
        LayerEnergies([(4, 3), (5, 3)]).total([torch.randn(5, 3), torch.randn(4, 3)])
    with pytest.raises(ValueError, match="coefficients must give one number per weight"):
        LayerEnergies([(5, 3)], coefficients=[1.0, 2.0])
    with pytest.raises(ValueError, match="expected 1 blocks"):
        SetEnergies([PointSets(3, (3,), (False,))])([])
