from functools import partial

import pytest
import torch
from torch import nn

from sphereml import models
from sphereml.models import MLP, Classifier, ConvAutoencoder, ConvNet, get_layer


@pytest.mark.parametrize("feature_dim", [2, 3, 64])
def test_convnet_feature_shape(feature_dim):
    net = ConvNet(1, feature_dim, widths=(8, 16))
    assert net(torch.randn(5, 1, 28, 28)).shape == (5, feature_dim)


def test_feature_layer_has_no_relu_by_default_so_2d_features_leave_the_first_quadrant():
    torch.manual_seed(0)
    f = ConvNet(1, 2, widths=(4,))(torch.randn(64, 1, 28, 28))
    assert (f < 0).any()
    g = ConvNet(1, 2, widths=(4,), feature_act=True)(torch.randn(64, 1, 28, 28))
    assert (g >= 0).all()


def test_factories_swap_operators():
    calls = []

    class MyConv(nn.Conv2d):
        def __init__(self, *a, **k):
            calls.append(a[:2])
            super().__init__(*a, **k)

    net = ConvNet(3, 10, widths=(4, 8), depth=2, image_size=32, conv_layer=MyConv,
                  act_layer="gelu", norm_layer="batchnorm", linear_layer=partial(nn.Linear, bias=False))
    assert calls == [(3, 4), (4, 4), (4, 8), (8, 8)]
    assert any(isinstance(m, nn.GELU) for m in net.modules())
    assert any(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    assert net.feature.bias is None
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_bad_layer_names_and_shapes():
    with pytest.raises(ValueError, match="unknown layer name 'spherical'"):
        get_layer("spherical", "conv")
    with pytest.raises(ValueError, match="layer must be a name"):
        get_layer(3, "conv")
    with pytest.raises(ValueError, match="too small for 3"):
        ConvNet(1, 2, widths=(4, 4, 4), image_size=7)
    assert ConvNet(1, 2, widths=(4, 4, 4), image_size=28)(torch.zeros(1, 1, 28, 28)).shape == (1, 2)  # 28->14->7->3
    with pytest.raises(ValueError, match="feature_dim must be an integer >= 1"):
        ConvNet(1, 0)
    with pytest.raises(ValueError, match="depth must be an integer >= 1"):
        ConvNet(1, 2, depth=True)
    with pytest.raises(ValueError, match="widths must name at least one stage"):
        ConvNet(1, 2, widths=())


def test_classifier_exposes_features_and_weight():
    model = Classifier(MLP(64, 2, hidden=(16,)), num_classes=10)
    x = torch.randn(7, 1, 8, 8)
    assert model.features(x).shape == (7, 2)
    assert model(x).shape == (7, 10)
    assert torch.allclose(model(x), model.features(x) @ model.head.weight.T + model.head.bias)
    assert model.head.weight.shape == (10, 2)


def test_autoencoder_reconstructs_shape_and_range():
    ae = ConvAutoencoder()
    with torch.no_grad():
        y = ae(torch.rand(3, 1, 28, 28))
    assert y.shape == (3, 1, 28, 28) and float(y.min()) >= 0 and float(y.max()) <= 1


def test_autoencoder_code_parts_factorise_the_inner_product():
    torch.manual_seed(0)
    ae = ConvAutoencoder(channels=(6, 10)).double()
    x = torch.rand(4, 1, 28, 28, dtype=torch.float64)
    x[0] = 0.0  # an all-zero image: cos must stay finite
    with torch.no_grad():
        parts = ae.code_parts(x)
        assert torch.allclose(parts["inner"], parts["magnitude"] * parts["cos"], atol=1e-10)
        assert torch.allclose(parts["inner"] + parts["bias"], ae.code_conv(ae.stem(x)))
        assert torch.isfinite(parts["cos"]).all() and parts["cos"].abs().max() <= 1
        assert torch.allclose(ae.decode(parts["inner"] + parts["bias"]), ae(x))
        # the magnitude tensor has channel-rank 1: every channel is ||w_j|| times one map
        for m in parts["magnitude"][1:]:
            s = torch.linalg.svdvals(m.flatten(1))
            assert s[1] <= 1e-10 * s[0]


def test_block_cnn_matches_the_paper_sizes():
    from sphereml.models import BlockCNN

    cnn1 = BlockCNN(in_channels=3, width=64, image_size=32)
    assert cnn1.classifier.in_features == 576
    assert sum(p.numel() for p in cnn1.parameters()) == 118_858  # seed 004, Table 7
    cnn2 = BlockCNN(in_channels=3, width=128, image_size=32)
    assert sum(p.numel() for p in cnn2.parameters()) == 458_890
    assert BlockCNN(width=8)(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="too small for 4 blocks"):
        BlockCNN(width=8, image_size=4, padding=0)
    with pytest.raises(ValueError, match=r"padding must be an integer in \[0, 2\]"):
        BlockCNN(width=8, padding=3)
    with pytest.raises(ValueError, match="width must be an integer >= 1"):
        BlockCNN(width=True)


def test_resnet18_shapes_and_size():
    from sphereml.models import resnet18

    net = resnet18()
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert 11.1e6 < sum(p.numel() for p in net.parameters()) < 11.2e6
    assert sum(isinstance(m, nn.Conv2d) for m in net.modules()) == 20


def test_sphere_factories():
    from sphereml.layers.sphereconv import SphereConv2d, SphereLinear

    net = models.spherenet(9, angular="sigmoid", k=0.3, widths=(4, 6, 8), in_channels=1, image_size=28,
                           feature_dim=16, sphere_fc=True)
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 9 and all(isinstance(m, SphereConv2d) and m.angular == "sigmoid" for m in convs)
    assert isinstance(net.feature, SphereLinear)
    assert net(torch.randn(2, 1, 28, 28)).shape == (2, 16)
    assert type(models.spherenet(3, widths=(4, 6, 8), feature_dim=16).feature) is nn.Linear
    plain = models.plain_cnn(18, in_channels=3, image_size=32)
    assert sum(isinstance(m, nn.Conv2d) for m in plain.modules()) == 18
    assert sum(isinstance(m, nn.BatchNorm2d) for m in plain.modules()) == 18
    assert plain.feature.out_features == 256
    with pytest.raises(ValueError, match="multiple of 3"):
        models.plain_cnn(10)
    with pytest.raises(ValueError, match="multiple of 3"):
        models.plain_cnn(True)
    v1, v2 = models.sphere_resnet(32), models.sphere_resnet(32, sphere_shortcut=False)
    assert sum(isinstance(m, nn.Conv2d) for m in v1.modules()) == 1 + 30 + 2
    assert all(isinstance(m, SphereConv2d) for m in v1.modules() if isinstance(m, nn.Conv2d))
    shortcuts = [b.shortcut[0] for b in v2.stages if isinstance(b.shortcut, nn.Sequential)]
    assert len(shortcuts) == 2 and not any(isinstance(m, SphereConv2d) for m in shortcuts)
    assert v1(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="6n \\+ 2"):
        models.resnet(30)
    assert [len(models.resnet(d).stages) for d in (20, 32)] == [9, 15]


def test_classifier_loss_is_cross_entropy_for_a_plain_head():
    torch.manual_seed(0)
    model = Classifier(MLP(6, 4, hidden=(8,)), 3)
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
    loss, logits = model.loss_and_logits(x, y)
    torch.testing.assert_close(logits, model(x))
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(model(x), y))



def test_scs_net_is_rohrer100k_and_swaps_operators():
    from sphereml.layers.scs import MaxAbsPool2d, SharpenedCosineSimilarity2d

    net = Classifier(models.scs_net(), 10, bias=True)
    assert 113_000 < sum(p.numel() for p in net.parameters()) < 115_000  # about the paper's "100K"
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    layers = list(net.backbone.body)
    assert sum(isinstance(m, SharpenedCosineSimilarity2d) for m in layers) == 3
    assert sum(isinstance(m, MaxAbsPool2d) for m in layers) == 3 and not any(isinstance(m, nn.ReLU) for m in layers)
    conv = models.scs_net((8, 16), in_channels=1, image_size=28, conv_layer="conv", act_layer="relu",
                          pool_layer="maxpool")
    assert conv.feature_dim == 16 * 7 * 7 and conv(torch.randn(2, 1, 28, 28)).shape == (2, 16 * 7 * 7)
    assert sum(isinstance(m, nn.Conv2d) and not isinstance(m, SharpenedCosineSimilarity2d) for m in conv.modules()) == 2
    fixed = models.scs_net((4,), in_channels=1, image_size=8, learnable=False, p=1.5)
    assert fixed.body[0].p == 1.5 and not fixed.body[0].learnable


def test_resnet18_takes_sharpened_cosine_layers():
    from functools import partial

    from sphereml.layers.scs import SharpenedCosineSimilarity2d

    net = models.resnet18(conv_layer=partial(SharpenedCosineSimilarity2d, learnable=True), act_layer="identity")
    scs = [m for m in net.modules() if isinstance(m, SharpenedCosineSimilarity2d)]
    assert len(scs) == 20  # every convolution, the 1x1 shortcuts included
    out = net(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


def test_opt_cnn_builds_fc6_with_or_without_its_norm_and_activation():
    """Table F.1's CNN-6: fc6 is a conv as large as the last map; the authors' code puts neither BatchNorm nor
    ReLU after it (``plain_fc6``), so its features can be negative and scale with its weights."""
    torch.manual_seed(0)
    ours, plain = models.opt_cnn(6, width=8), models.opt_cnn(6, width=8, plain_fc6=True)
    assert [type(m).__name__ for m in ours.feature] == ["Unflatten", "Conv2d", "BatchNorm2d", "ReLU", "Flatten"]
    assert [type(m).__name__ for m in plain.feature] == ["Unflatten", "Conv2d", "Flatten"]
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("feature.2")})
    x = torch.randn(4, 3, 32, 32)
    features = plain(x)
    assert features.shape == (4, 8) and (features < 0).any()
    with torch.no_grad():
        plain.feature[1].weight.mul_(2.0)
        plain.feature[1].bias.mul_(2.0)
    assert torch.allclose(plain(x), 2 * features, atol=1e-5)
