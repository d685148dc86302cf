"""Weights packed into the batched energy's blocks (sphereml.energy.packing), on a CPU's plan and an accelerator's.

The accelerator's plan (fan-ins sharing zero-padded blocks, Note [blocks by device]) is emulated on the CPU by making
``batched.on_accelerator`` say True; it must give the CPU plan's energies and gradients to rounding.
"""

import pytest
import torch

from sphereml import regularizers as R
from sphereml.energy import batched
from sphereml.energy.batched import ACCELERATOR_COLUMN_WASTE, LayerEnergies
from sphereml.energy.packing import WeightPacking, column_groups
from sphereml.launches import count_ops

F64 = torch.float64


def _padded_reference(weights, blocks):
    """The blocks written plainly: each weight's rows zero-padded to the block's widest fan-in, then stacked."""
    out = []
    for members in blocks:
        rows = max(weights[i].shape[0] for i in members)
        width = max(weights[i][0].numel() for i in members)
        padded = [torch.nn.functional.pad(weights[i].flatten(1), (0, width - weights[i][0].numel(),
                                                                 0, rows - weights[i].shape[0])) for i in members]
        out.append(torch.stack(padded).to(F64))
    return out


def _weights(dtype=F64, seed=0):
    """Six weights of four fan-ins (12, 27, 8, 5) and ragged neuron counts, as a small network has them."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 3, 2, 2), (4, 3, 3, 3), (7, 8), (5, 3, 2, 2), (3, 5), (9, 8)]
    return [torch.randn(*s, generator=g, dtype=dtype) for s in shapes]


def test_column_groups_keep_one_block_per_fan_in_without_a_waste_bound():
    shapes = [torch.Size(w.shape) for w in _weights()]
    assert column_groups(shapes) == [[0, 3], [1], [2, 5], [4]]  # fan-ins 12, 27, 8, 5 in order of appearance


def test_column_groups_merge_fan_ins_within_the_waste_bound():
    shapes = [torch.Size(w.shape) for w in _weights()]
    assert column_groups(shapes, 1.0) == [[1], [0, 3], [2, 5], [4]]  # widest first; no padding allowed
    assert column_groups(shapes, 100.0) == [[1, 0, 3, 2, 5, 4]]
    # a 27-wide block of 4 rows (432 multiply-adds) and the 12-wide weights of 6 and 5 rows (732): 3 x 6^2 x 27 =
    # 2,916 > 2 x 1,164, but < 3 x 1,164
    assert column_groups(shapes, 2.0)[0] == [1]
    assert column_groups(shapes, 3.0)[0] == [1, 0, 3]
    # a tiny layer may join a large one (2 x 256^2 x 2304 multiply-adds for 256^2 x 2304 + 64^2 x 3), eight may not
    big = [torch.Size((256, 2304)), torch.Size((64, 3))]
    assert column_groups(big, ACCELERATOR_COLUMN_WASTE) == [[0, 1]]
    assert column_groups(big[:1] + big[1:] * 8, ACCELERATOR_COLUMN_WASTE) == [[0], list(range(1, 9))]


@pytest.mark.parametrize("waste", [None, 2.0, 100.0])
def test_packing_equals_padding_and_stacking(waste):
    weights = _weights()
    blocks = column_groups([w.shape for w in weights], waste)
    got = WeightPacking([w.shape for w in weights], blocks)(weights)
    for a, b in zip(got, _padded_reference(weights, blocks)):
        assert a.shape == b.shape and torch.equal(a, b)


def test_packing_gradient_is_the_padding_s_and_passes_gradcheck():
    weights = [w.requires_grad_(True) for w in _weights()]
    blocks = column_groups([w.shape for w in weights], 100.0)
    packing = WeightPacking([w.shape for w in weights], blocks)
    probes = [torch.randn(*b.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
              for b in _padded_reference(weights, blocks)]
    mine = torch.autograd.grad(sum((b * p).sum() for b, p in zip(packing(weights), probes)), weights)
    plain = torch.autograd.grad(sum((b * p).sum() for b, p in zip(_padded_reference(weights, blocks), probes)),
                                weights)
    for a, b in zip(mine, plain):
        assert torch.equal(a, b)
    assert torch.autograd.gradcheck(lambda *w: packing(w), weights)


def test_packing_costs_the_same_operations_for_any_number_of_weights():
    """Forward: a concatenation, a cast and a gather; backward: a concatenation and a gather and a cast."""
    counts = []
    for copies in (1, 4):
        weights = [w.float().requires_grad_(True) for _ in range(copies) for w in _weights()]
        packing = WeightPacking([w.shape for w in weights], column_groups([w.shape for w in weights], 100.0))
        packing(weights)  # the constants, once
        counts.append(count_ops(lambda: sum(b.sum() for b in packing(weights)).backward()).by_op)
    assert counts[0] == counts[1]
    assert counts[0]["aten::index_select"] == 2 and counts[0]["aten::_to_copy"] == 2, counts[0]


def test_packing_under_vmap_packs_each_seed():
    weights = _weights()
    stacked = [torch.stack([w, 2 * w + 1]) for w in weights]
    packing = WeightPacking([w.shape for w in weights], column_groups([w.shape for w in weights], 100.0))
    got = torch.func.vmap(lambda *w: packing(w)[0])(*stacked)
    expected = torch.stack([packing([s[k] for s in stacked])[0] for k in range(2)])
    assert torch.equal(got, expected)


def test_packing_refuses_wrong_shapes_and_blocks():
    weights = _weights()
    with pytest.raises(ValueError, match="every weight once"):
        WeightPacking([w.shape for w in weights], [[0, 1], [1, 2, 3, 4, 5]])
    packing = WeightPacking([w.shape for w in weights], column_groups([w.shape for w in weights]))
    with pytest.raises(ValueError, match="shapes"):
        packing(weights[::-1])


@pytest.mark.parametrize("dtype, tolerance", [(F64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("half_space", [False, True])
def test_accelerator_plan_gives_the_cpu_plan_s_energies_and_gradients(monkeypatch, dtype, tolerance, half_space):
    weights = _weights(dtype)
    weights[2][3] = weights[2][1]  # a duplicate neuron (r^2 at the floor)
    weights[5][0] = 0.0  # a zero neuron (under the norm floor)
    weights = [w.requires_grad_(True) for w in weights]
    results = {}
    for accelerator in (False, True):
        monkeypatch.setattr(batched, "on_accelerator", lambda device, a=accelerator: a)
        energies = LayerEnergies([w.shape for w in weights], 2.0, half_space=half_space,
                                 coefficients=[1.0, 2.0, 0.5, 1.0, 3.0, 1.0])
        values = energies(weights)
        total = energies.total(weights)
        results[accelerator] = (values.detach(), total.detach(), torch.autograd.grad(total, weights))
        assert len(energies.blocks(torch.device("cpu"))) == (2 if accelerator else 4)
    cpu, accelerator = results[False], results[True]
    torch.testing.assert_close(accelerator[0], cpu[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(accelerator[1], cpu[1], rtol=1e-12, atol=0)
    for a, b in zip(accelerator[2], cpu[2]):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * float(b.abs().max()))


def test_mhe_on_the_accelerator_plan_uses_one_gram_product_each_way(monkeypatch):
    """The CNN's three fan-ins (27, 72, 144) share one block: one batched product each way (three on a CPU)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 16, 3), torch.nn.Flatten(), torch.nn.Linear(16 * 3 * 3, 10))
    products = {}
    for accelerator in (False, True):
        monkeypatch.setattr(batched, "on_accelerator", lambda device, a=accelerator: a)
        reg = R.MHE(net, half_space=True)
        reg.before_step()
        by_op = count_ops(lambda: reg.penalty().backward()).by_op
        products[accelerator] = (by_op["aten::bmm"], by_op["aten::baddbmm"])
    assert products == {False: (3, 3), True: (1, 1)}, products


def test_accelerator_plan_compiles_without_a_first_eager_call(monkeypatch):
    """The plan for an accelerator is made with the regulariser, so a penalty compiled before any eager call traces
    no plan-making (which reads tensors on the host), as on a GPU box: made on a machine with an accelerator, then
    compiled for weights there (the CPU's weights standing in for them)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3), torch.nn.Flatten(),
                              torch.nn.Linear(16 * 5 * 5, 10))
    with monkeypatch.context() as patch:
        patch.setattr(torch.accelerator, "is_available", lambda: True)
        reg = R.MHE(net, half_space=True)
    monkeypatch.setattr(batched, "on_accelerator", lambda device: True)
    torch.compiler.reset()
    compiled = torch.compile(reg.penalty, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(), reg.penalty(), rtol=1e-12, atol=0)


def test_empty_or_wrong_weights_are_refused_by_name():
    energies = LayerEnergies([torch.Size((5, 3)), torch.Size((4, 6))])
    with pytest.raises(ValueError, match="shapes"):
        energies([])
    with pytest.raises(ValueError, match="shapes"):
        energies.total([torch.randn(5, 3)])
