"""Regularisers bound to a model's layers once: the layer rule, orthonormality, convolutional similarity, MHE."""

import pytest
import torch

from sphereml import models
from sphereml.regularizers.convsim import conv_similarity
from sphereml.energy import hyperspherical_energy as E
from sphereml.heads.margins import ASoftmaxLoss
from sphereml.models import Classifier, ConvNet
from sphereml.regularizers import (MHE, ConvSimilarity, Orthonormality, feature_map_cosines, iterative_initialization,
    model_similarity, orthonormality_penalty, output_layer, select_layers)
from sphereml.layers.sphereconv import SphereConv2d, SphereLinear
from sphereml.train import fit

F64 = torch.float64


def _net(head=None):
    torch.manual_seed(0)
    return Classifier(ConvNet(1, 8, widths=(4, 6)), 10, head=head)


# ---------------------------------------------------------------- the layer rule

def test_select_layers_rule():
    net = _net()
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    feature, head = net.backbone.feature, net.head
    assert output_layer(net) is head
    assert select_layers(net) == convs + [feature, head]
    assert select_layers(net, include_output=False) == convs + [feature]
    assert select_layers(net, ("conv",)) == convs
    assert select_layers(net, ("linear",), include_output=False) == [feature]
    margin = _net(head=ASoftmaxLoss(8, 10))
    assert output_layer(margin) is margin.head and select_layers(margin)[-1] is margin.head  # a head is "linear"
    resnet = models.resnet18()
    assert output_layer(resnet) is resnet.classifier and len(select_layers(resnet, ("conv",))) == 20
    assert output_layer(torch.nn.Conv2d(1, 2, 3)) is None
    with pytest.raises(ValueError, match="kind must be one of"):
        select_layers(net, ("attention",))


def test_sphere_layers_are_selected_like_the_layers_they_replace():
    net = models.spherenet(9, angular="sigmoid", k=0.3, widths=(4, 6, 8), in_channels=1, image_size=28,
                           feature_dim=16, sphere_fc=True)
    convs = select_layers(net, ("conv",))
    assert len(convs) == 9 and all(isinstance(m, SphereConv2d) for m in convs)
    assert isinstance(select_layers(net, ("linear",))[0], SphereLinear)
    reg = Orthonormality(net, beta=1.0)
    torch.testing.assert_close(reg(), sum(orthonormality_penalty(m.weight) for m in convs))


# ---------------------------------------------------------------- orthonormality and convolutional similarity

def test_orthonormality_and_conv_similarity_on_a_model():
    model = ConvNet(1, 8, widths=(4, 6))
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    reg = ConvSimilarity(model, beta=0.5)
    torch.testing.assert_close(reg(), 0.5 * sum(conv_similarity(m.weight) for m in convs))
    torch.testing.assert_close(model_similarity(model), reg.penalty())
    ortho = Orthonormality(model, beta=2.0, include_linear=True)
    assert ortho.layers == convs + [model.feature]
    torch.testing.assert_close(ortho(), 2.0 * sum(orthonormality_penalty(m.weight) for m in ortho.layers))
    q, _ = torch.linalg.qr(torch.randn(9, 4, dtype=F64))
    assert float(orthonormality_penalty(q.T.reshape(4, 1, 3, 3))) < 1e-20


def test_a_regulariser_follows_the_weights_it_was_bound_to():
    model = ConvNet(1, 8, widths=(4, 6))
    reg = Orthonormality(model, beta=1.0)
    before = float(reg().detach())
    with torch.no_grad():
        for m in reg.layers:
            m.weight.mul_(2.0)
    assert float(reg().detach()) != pytest.approx(before)


def test_fit_adds_the_regulariser_every_step():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.rand(32, 1, 28, 28, generator=g), torch.randint(10, (32,), generator=g))
    model = _net()
    reg = MHE(model, s=2.0, beta_hidden=1.0, beta_output=1.0)
    history = fit(model, data, epochs=1, batch_size=16, regularizer=reg, device="cpu", progress=False)
    assert history.epochs[0]["reg"] > 0


def test_iterative_initialization_lowers_loss_and_shrinks_kernels():
    torch.manual_seed(0)
    model = ConvNet(1, 8, widths=(4, 6))
    history = iterative_initialization(model, steps=30, lr=1e-2)
    assert len(history["loss"]) == 31
    assert history["loss"][-1] < 0.5 * history["loss"][0]
    assert history["squared_norm"][-1] < history["squared_norm"][0]
    torch.testing.assert_close(torch.tensor(history["loss"][-1]), model_similarity(model).detach(),
                               rtol=1e-5, atol=1e-7)


def _two_conv_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.BatchNorm2d(3), torch.nn.ReLU(),
                               torch.nn.Conv2d(3, 4, 3, stride=2), torch.nn.BatchNorm2d(4), torch.nn.Flatten())


def test_feature_map_cosines_against_pairwise_cosines():
    """Oracle: every pair of bias-free maps of each conv, cosines one pair at a time, in training mode."""
    net, x = _two_conv_net().double(), torch.randn(5, 2, 9, 9, dtype=F64)
    oracle_net = _two_conv_net().double().train()
    first, second = oracle_net[0], oracle_net[3]
    with torch.no_grad():
        hidden = oracle_net[:3](x)
        layer_maps = [torch.nn.functional.conv2d(x, first.weight, None, 1, 1),
                      torch.nn.functional.conv2d(hidden, second.weight, None, 2, 0)]
    expected = []
    for maps in layer_maps:
        flat, c = maps.flatten(2), maps.shape[1]
        pairs = [torch.nn.functional.cosine_similarity(flat[:, i], flat[:, j], dim=1).abs()
                 for i in range(c) for j in range(c) if i != j]
        expected.append(torch.stack(pairs).mean(0))
    torch.testing.assert_close(feature_map_cosines(net, x), torch.stack(expected).mean(0), rtol=1e-12, atol=1e-12)


def test_feature_map_cosines_known_values_and_model_left_alone():
    parallel = torch.nn.Conv2d(1, 2, 1, bias=False)
    with torch.no_grad():
        parallel.weight.copy_(torch.tensor([1.0, -2.0]).view(2, 1, 1, 1))
    torch.testing.assert_close(feature_map_cosines(parallel, torch.rand(3, 1, 4, 4) + 0.1), torch.ones(3))
    picks = torch.nn.Conv2d(2, 2, 1, bias=False)
    with torch.no_grad():
        picks.weight.copy_(torch.eye(2).view(2, 2, 1, 1))
    x = torch.zeros(2, 2, 4, 4)
    x[:, 0, :2], x[:, 1, 2:] = 1.0, 3.0  # disjoint supports: orthogonal maps
    torch.testing.assert_close(feature_map_cosines(picks, x), torch.zeros(2))
    net = _two_conv_net().eval()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    feature_map_cosines(net, torch.randn(4, 2, 9, 9))
    assert not net.training and all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())


def test_feature_map_cosines_bad_arguments():
    with pytest.raises(ValueError, match="at least two kernels"):
        feature_map_cosines(torch.nn.Sequential(torch.nn.Conv2d(2, 1, 3), torch.nn.Flatten()), torch.randn(1, 2, 5, 5))
    with pytest.raises(ValueError, match="padding_mode"):
        feature_map_cosines(torch.nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"), torch.randn(1, 1, 5, 5))


# ---------------------------------------------------------------- MHE

def test_mhe_regulariser_sums_layer_energies():
    model = _net()
    reg = MHE(model, s=1.0, half_space=True, beta_hidden=0.5, beta_output=2.0)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    expected = 0.5 * sum(E(m.weight, s=1.0, half_space=True) for m in convs + [model.backbone.feature])
    expected = expected + 2.0 * E(model.head.weight, s=1.0)  # output layer: full space
    torch.testing.assert_close(reg(), expected)
    assert reg.output is model.head and len(reg.hidden) == 3
    hidden = reg.energies()["hidden"]
    assert reg.mean_hidden_energy() == pytest.approx(float(sum(hidden).detach()) / 3)
    assert "hidden_layers=3" in repr(reg)


def test_mhe_skips_one_neuron_layers_and_a_zero_output_weight():
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
    reg = MHE(net, beta_output=1.0)
    assert reg.output is None and reg.hidden == [net[0]]  # the 1-neuron output layer has no pairs
    assert MHE(_net(), beta_output=0.0).output is None


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("call,message", [
    (lambda: ConvSimilarity(ConvNet(1, 2, widths=(2,)), beta=-1.0), "beta must be a finite number >= 0"),
    (lambda: ConvSimilarity(torch.nn.Linear(2, 2)), "no layer of kind"),
    (lambda: Orthonormality(torch.nn.Linear(2, 2)), "no layer of kind"),
    (lambda: Orthonormality(ConvNet(1, 2, widths=(2,)), beta=float("inf")), "beta must be a finite number"),
    (lambda: iterative_initialization(torch.nn.Linear(2, 2), steps=1), "no layer of kind"),
    (lambda: iterative_initialization(ConvNet(1, 2, widths=(2,)), steps=-1), "steps must be an integer >= 0"),
    (lambda: iterative_initialization(ConvNet(1, 2, widths=(2,)), steps=True), "steps must be an integer >= 0"),
    (lambda: MHE(torch.nn.Linear(3, 1), beta_output=0.0), "no layer with at least 2 neurons"),
    (lambda: MHE(ConvNet(1, 4, widths=(4,)), beta_hidden=-1.0), "beta_hidden must be a finite number >= 0"),
    (lambda: MHE(ConvNet(1, 4, widths=(4,)), metric="cosine"), "metric must be one of"),
    (lambda: MHE(ConvNet(1, 4, widths=(4,)), s=-1.0), "s must be a finite number >= 0"),
    (lambda: orthonormality_penalty(torch.randn(3)), "output axis"),
])
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()
