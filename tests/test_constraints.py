"""HoldNorms: neurons back at their starting lengths after every step, directions free."""

import pytest
import torch
from torch import nn

from sphereml.constraints import HoldNorms
from sphereml.train import fit


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def test_lengths_stay_and_directions_move_under_fit():
    net = _net()
    layers = [net[0], net[3]]
    start = [HoldNorms.lengths(m).clone() for m in layers]
    directions = [m.weight.detach().flatten(1) / s[:, None] for m, s in zip(layers, start)]
    data = torch.utils.data.TensorDataset(torch.randn(64, 1, 8, 8), torch.randint(0, 3, (64,)))
    fit(net, data, epochs=2, batch_size=16, lr=0.5, optimizer="sgd", callbacks=[HoldNorms(layers)], device="cpu")
    for m, s, d in zip(layers, start, directions):
        torch.testing.assert_close(HoldNorms.lengths(m), s, rtol=1e-6, atol=0)
        moved = (m.weight.detach().flatten(1) / s[:, None] - d).norm()
        assert moved > 1e-3  # the directions trained


def test_lengths_move_with_the_network_and_stay_out_of_its_state():
    net = _net()
    HoldNorms([net[0]])
    assert "0.held_length" not in net.state_dict()
    net.to(torch.float64)
    assert net[0].held_length.dtype == torch.float64


def test_a_zero_neuron_stays_zero_and_finite():
    layer = nn.Linear(5, 3)
    with torch.no_grad():
        layer.weight[1] = 0
    hold = HoldNorms([layer])
    with torch.no_grad():
        layer.weight.mul_(3.0)
        layer.weight[1] = 0
    hold()
    assert torch.isfinite(layer.weight).all() and layer.weight[1].abs().max() == 0
    torch.testing.assert_close(HoldNorms.lengths(layer), layer.held_length)


@pytest.mark.parametrize("layers", [[], [nn.ReLU()], [nn.BatchNorm1d(3)]])
def test_bad_layers_raise(layers):
    with pytest.raises(ValueError, match="HoldNorms needs"):
        HoldNorms(layers)
