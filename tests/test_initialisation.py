import math
from functools import partial

import pytest
import torch
from torch import nn

from sphereml import models
from sphereml.initialisation import he_init_, scs_upstream_init_
from sphereml.layers.decoupled import DecoupledConv2d
from sphereml.layers.scs import SharpenedCosineSimilarity2d
from sphereml.models import Classifier
from sphereml.regularizers.opt import orthogonal_overparameterize


def conv_net(conv_layer=partial(nn.Conv2d, bias=False)):
    return Classifier(models.plain_cnn(6, (8, 16, 32), in_channels=1, image_size=28, feature_dim=32,
                                       conv_layer=conv_layer), 10)


def test_kernels_have_he_variance_and_zero_bias():
    torch.manual_seed(0)
    net = he_init_(nn.Sequential(nn.Conv2d(64, 256, 3), nn.Linear(2048, 512), nn.Linear(512, 10))).requires_grad_(False)
    for layer in net:
        fan_in = layer.weight[0].numel()
        var = float(layer.weight.var())
        assert var == pytest.approx(2 / fan_in, rel=0.05)  # 147k, 1M and 5k draws: within 5 % (>5 sigma)
        assert float(layer.weight.mean()) == pytest.approx(0.0, abs=4 * math.sqrt(2 / fan_in / layer.weight.numel()))
        assert torch.equal(layer.bias, torch.zeros_like(layer.bias))


def test_negative_slope_follows_prelu_gain():
    torch.manual_seed(0)
    layer = he_init_(nn.Linear(1000, 1000), negative_slope=0.25).requires_grad_(False)
    assert float(layer.weight.var()) == pytest.approx(2 / (1 + 0.25**2) / 1000, rel=0.02)


def test_norm_layers_and_slopes_untouched():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.PReLU(8))
    with torch.no_grad():
        net[1].weight.fill_(0.7)
        net[1].bias.fill_(0.3)
    he_init_(net)
    assert torch.equal(net[1].weight, torch.full((8,), 0.7)) and torch.equal(net[1].bias, torch.full((8,), 0.3))
    assert torch.equal(net[2].weight, torch.full((8,), 0.25))


def test_same_seed_same_kernels_whatever_the_operator():
    """Two networks of one seed start from the same kernels: the book's networks differ only in operators."""
    torch.manual_seed(3)
    cnn = he_init_(conv_net())
    torch.manual_seed(3)
    dcnet = he_init_(conv_net(partial(DecoupledConv2d, magnitude="tanh", angular="cosine")))
    convs = [m.weight for m in cnn.modules() if isinstance(m, nn.Conv2d)]
    decoupled = [m.weight for m in dcnet.modules() if isinstance(m, DecoupledConv2d)]
    assert len(convs) == len(decoupled) == 6
    assert all(torch.equal(a, b) for a, b in zip(convs, decoupled))


def test_changes_the_default_start():
    torch.manual_seed(0)
    default = conv_net()
    before = [p.detach().clone() for p in default.parameters()]
    he_init_(default)
    kernels = [(b, p) for b, p in zip(before, default.parameters()) if p.dim() >= 2]
    assert kernels and all(not torch.equal(b, p) for b, p in kernels)
    ratio = [float(p.detach().flatten(1).norm(dim=1).mean() / b.flatten(1).norm(dim=1).mean()) for b, p in kernels]
    assert all(1.9 < r < 3.0 for r in ratio)  # sqrt(6) ~ 2.45 longer than PyTorch's uniform default


def test_parametrised_weights_are_skipped():
    torch.manual_seed(0)
    layer = orthogonal_overparameterize(nn.Conv2d(4, 8, 3))
    before = [p.clone() for p in layer.parameters()]
    he_init_(layer)
    assert all(torch.equal(b, p) for b, p in zip(before, layer.parameters()))


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        he_init_(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="negative_slope"):
        he_init_(nn.Linear(3, 3), negative_slope=-0.1)


def _scs_net():
    torch.manual_seed(0)
    return nn.Sequential(SharpenedCosineSimilarity2d(64, 128, 3, learnable=True, q=0.1), nn.Conv2d(128, 8, 3),
                         SharpenedCosineSimilarity2d(8, 8, 3, p=2.0))


def test_scs_upstream_start_draws_kernels_and_p_as_rohrers_layer_and_leaves_the_rest():
    net = _scs_net()
    conv = net[1].weight.detach().clone()
    assert scs_upstream_init_(net) is net
    with torch.no_grad():
        w, p = net[0].weight, net[0].p
        assert -1 <= float(w.min()) and float(w.max()) <= 1
        assert float(w.var()) == pytest.approx(1 / 3, rel=0.02)  # 74k draws of U(-1, 1)
        assert float(w.flatten(1).norm(dim=1).pow(2).mean()) == pytest.approx(w[0].numel() / 3, rel=0.02)
        assert 1 <= float(p.min()) and float(p.max()) <= 3 and float(p.std()) > 0.4  # U(1, 3): s.d. 0.58
        assert float(net[0].q) == pytest.approx(0.1)
        assert torch.equal(net[1].weight, conv) and net[2].p == 2.0  # a convolution, a fixed p: untouched
        assert -1 <= float(net[2].weight.min()) and float(net[2].weight.max()) <= 1
    assert torch.equal(scs_upstream_init_(_scs_net())[0].weight, net[0].weight)
    with pytest.raises(TypeError, match="nn.Module"):
        scs_upstream_init_(torch.zeros(3))
