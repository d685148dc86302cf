"""Neuron turning: the angle each neuron moves, the effective learning rate that compares across parametrisations."""

import math

import pytest
import torch
from torch import nn

from sphereml.regularizers import opt
from sphereml.train import fit
from sphereml.turning import TurnTracker, mean_turn, neuron_directions


def _rotate_rows(weight, degrees):
    """Every row turned by ``degrees`` in the plane of its first two coordinates (rows that lie in that plane)."""
    t = math.radians(degrees)
    turn = torch.tensor([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]], dtype=weight.dtype)
    return weight @ turn.T


def test_a_known_turn_is_measured_in_degrees_whatever_the_scale():
    """Rows turned by 30 degrees in one layer and 60 in another (twice as many neurons): the mean is over neurons,
    and scaling the weights, which changes no direction, changes nothing."""
    a, b = nn.Linear(2, 3, bias=False), nn.Linear(2, 6, bias=False)
    start = neuron_directions([a, b])
    with torch.no_grad():
        a.weight.copy_(3.0 * _rotate_rows(a.weight, 30.0))
        b.weight.copy_(0.1 * _rotate_rows(b.weight, 60.0))
    assert mean_turn([a, b], start) == pytest.approx((3 * 30 + 6 * 60) / 9, rel=1e-5)
    assert mean_turn([a], start[:1]) == pytest.approx(30.0, rel=1e-5)
    tiny = nn.Linear(2, 4, bias=False)  # float32: a thousandth of a degree, where acos of the cosine reads 0
    start = neuron_directions([tiny])
    with torch.no_grad():
        tiny.weight.copy_(_rotate_rows(tiny.weight.double(), 1e-3).float())
    assert mean_turn([tiny], start) == pytest.approx(1e-3, rel=0.05)


def test_turning_is_the_effective_rate_under_batchnorm():
    """A conv followed by BatchNorm ignores its weights' scale, so the gradient scales as 1 / c and one SGD step turns
    the neurons about 1 / c^2 as far: weights twice as long turn about a quarter as far."""
    def first_turn(scale):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3))
        with torch.no_grad():
            net[0].weight.mul_(scale)
        tracker = TurnTracker([net[0]])
        data = torch.utils.data.TensorDataset(torch.randn(32, 2, 8, 8), torch.randint(0, 3, (32,)))
        fit(net, data, epochs=1, batch_size=32, lr=1e-3, optimizer="sgd", momentum=0.0, callbacks=[tracker],
            device="cpu", progress=False)
        return tracker.values[0]

    small, large = first_turn(1.0), first_turn(2.0)
    assert small > 0.0
    assert large / small == pytest.approx(0.25, rel=0.02)


def test_the_tracker_records_the_first_step_and_every_nth():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 3))
    data = torch.utils.data.TensorDataset(torch.randn(32, 1, 4, 4), torch.randint(0, 3, (32,)))
    first, every = TurnTracker([net[1]]), TurnTracker([net[1]], every=2)
    start = neuron_directions([net[1]])
    fit(net, data, epochs=1, batch_size=8, lr=0.1, optimizer="sgd", callbacks=[first, every], device="cpu",
        progress=False)
    assert first.steps == [1] and every.steps == [1, 2, 4]
    assert every.values[-1] == pytest.approx(mean_turn([net[1]], start), rel=1e-6)  # after the last step, 4
    assert first.values[0] == every.values[0] > 0.0
    assert every.values[2] > every.values[0]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="at least one layer"):
        neuron_directions([])
    with pytest.raises(ValueError, match="two or more dimensions"):
        TurnTracker([nn.ReLU()])
    layer = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="neuron_directions of the same layers"):
        mean_turn([layer], neuron_directions([nn.Linear(3, 4)]))
    with pytest.raises(ValueError, match="every"):
        TurnTracker([layer], every=0)


def test_the_tracker_follows_a_rotated_layer():
    """An OPT layer's weight is R V, recomputed from the raw matrix: the tracker reads it as the chapters do, and a
    step that moves only the raw matrix turns the neurons (V itself never changes)."""
    torch.manual_seed(2)
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 3))
    opt.orthogonal_overparameterize(net[1], "gs", generator=torch.Generator().manual_seed(0), raw_std="unit",
                                    orthogonal_start=True)
    fixed = opt.fixed_neurons(net[1]).clone()
    tracker, start = TurnTracker([net[1]]), neuron_directions([net[1]])
    data = torch.utils.data.TensorDataset(torch.randn(8, 1, 4, 4), torch.randint(0, 3, (8,)))
    fit(net, data, epochs=1, batch_size=8, lr=0.1, optimizer="sgd", callbacks=[tracker], device="cpu", progress=False)
    torch.testing.assert_close(opt.fixed_neurons(net[1]), fixed)
    assert tracker.steps == [1] and tracker.values[0] > 0.0
    assert tracker.values[0] == pytest.approx(mean_turn([net[1]], start), rel=1e-6)
