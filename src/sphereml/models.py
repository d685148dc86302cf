"""Small networks for the book, built from operator factories.

Every network takes ``conv_layer``, ``linear_layer``, ``act_layer`` and
``norm_layer`` arguments (a class, a ``functools.partial`` or a registered name),
so a chapter swaps SphereConv, decoupled or SCS operators into the same network by
changing one argument (thesis App. B networks follow the same pattern).

A network maps images to a ``feature_dim``-dimensional feature; a
:class:`Classifier` adds the last linear layer (or a margin head) on top, so the
features and the classifier weights the thesis plots are both reachable.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import integer
from .layers.scs import MaxAbsPool2d, SharpenedCosineSimilarity2d
from .layers.sphereconv import SphereConv2d, SphereLinear

__all__ = [
    "LayerType", "get_layer", "ConvNet", "MLP", "Classifier", "ConvAutoencoder", "BlockCNN",
    "ResNet", "resnet18", "plain_cnn", "spherenet", "resnet", "sphere_resnet", "scs_net", "opt_cnn",
]

LayerType = Union[str, Callable[..., nn.Module], None]

_REGISTRY: dict[str, Callable[..., nn.Module]] = {
    "conv": nn.Conv2d,
    "linear": nn.Linear,
    "relu": partial(nn.ReLU, inplace=True),
    "prelu": nn.PReLU,
    "gelu": nn.GELU,
    "batchnorm": nn.BatchNorm2d,
    "batchnorm1d": nn.BatchNorm1d,
    "leakyrelu": partial(nn.LeakyReLU, 0.2),
    "identity": nn.Identity,
    "scs": SharpenedCosineSimilarity2d,
    "maxpool": nn.MaxPool2d,
    "maxabspool": MaxAbsPool2d,
}


def get_layer(layer: LayerType, default: str) -> Callable[..., nn.Module]:
    """Resolve a layer constructor from a registered name, a callable, or None (the default name)."""
    if layer is None:
        layer = default
    if isinstance(layer, str):
        if layer not in _REGISTRY:
            raise ValueError(f"unknown layer name {layer!r}; choose from {sorted(_REGISTRY)}")
        return _REGISTRY[layer]
    if callable(layer):
        return layer
    raise ValueError(f"layer must be a name, a callable or None, got {layer!r}")


class ConvNet(nn.Module):
    """Plain CNN: stages of [conv 3x3 -> norm -> act] x ``depth`` then a 2x2 pool, then a linear feature layer.

    Args:
        in_channels (int): image channels.
        feature_dim (int or None): size of the output feature (2 or 3 for the visualisation chapters);
            None: no feature layer, the flattened last stage is the feature (as in Rohrer's SCS nets).
        widths (tuple[int]): channels of each stage. Default: (32, 64).
        depth (int): conv layers per stage. Default: 1.
        image_size (int): input height = width, used to size the feature layer. Default: 28.
        conv_layer, linear_layer, act_layer, norm_layer: operator factories (see :func:`get_layer`).
            ``norm_layer`` defaults to ``"identity"`` (no normalisation).
        feature_act (bool): apply ``act_layer`` after the feature layer. Keep False for
            2-D features, or they stay in the first quadrant (thesis App. A.1). Default: False.
        pool_layer: the 2x2 pooling after each stage, ``"maxpool"`` (default) or ``"maxabspool"``
            (:class:`~sphereml.layers.scs.MaxAbsPool2d`), called with the kernel size 2.
    """

    def __init__(
        self,
        in_channels: int = 1,
        feature_dim: int = 64,
        widths: tuple[int, ...] = (32, 64),
        depth: int = 1,
        image_size: int = 28,
        conv_layer: LayerType = None,
        linear_layer: LayerType = None,
        act_layer: LayerType = None,
        norm_layer: LayerType = None,
        feature_act: bool = False,
        pool_layer: LayerType = None,
    ):
        super().__init__()
        if feature_dim is not None:
            integer("feature_dim", feature_dim, at_least=1)
        integer("depth", depth, at_least=1)
        if not widths:
            raise ValueError(f"widths must name at least one stage, got {widths!r}")
        if image_size < 2 ** len(widths):
            raise ValueError(f"image_size {image_size} is too small for {len(widths)} 2x2 poolings")
        conv = get_layer(conv_layer, "conv")
        linear = get_layer(linear_layer, "linear")
        act = get_layer(act_layer, "relu")
        norm = get_layer(norm_layer, "identity")
        pool = get_layer(pool_layer, "maxpool")
        layers: list[nn.Module] = []
        channels = in_channels
        for width in widths:
            for _ in range(depth):
                layers += [conv(channels, width, 3, padding=1), norm(width), act()]
                channels = width
            layers.append(pool(2))
        self.body = nn.Sequential(*layers)
        side = image_size // 2 ** len(widths)  # each pool floors: 28 -> 14 -> 7 -> 3
        flat = channels * side * side
        self.feature = linear(flat, feature_dim) if feature_dim is not None else nn.Identity()
        self.feature_act = act() if feature_act and feature_dim is not None else nn.Identity()
        self.feature_dim = feature_dim if feature_dim is not None else flat

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(x)  # (B, C, H', W')
        return self.feature_act(self.feature(h.flatten(1)))  # (B, feature_dim)


class MLP(nn.Module):
    """Multi-layer perceptron on flattened inputs: [linear -> act] x len(hidden) -> linear feature layer."""

    def __init__(
        self,
        in_features: int,
        feature_dim: int,
        hidden: tuple[int, ...] = (256,),
        linear_layer: LayerType = None,
        act_layer: LayerType = None,
    ):
        super().__init__()
        linear = get_layer(linear_layer, "linear")
        act = get_layer(act_layer, "relu")
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [linear(width, h), act()]
            width = h
        layers.append(linear(width, feature_dim))
        self.net = nn.Sequential(*layers)
        self.feature_dim = feature_dim

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # (B, feature_dim)


class Classifier(nn.Module):
    """A feature network followed by a classifier head.

    ``forward`` returns logits; :meth:`features` the penultimate features x whose
    angles to the rows W_j of ``head.weight`` the thesis studies; :meth:`loss_and_logits`
    is the one training loss, whatever the head (what :func:`~sphereml.train.fit` and
    :func:`~sphereml.train.evaluate` call).

    Args:
        backbone (nn.Module): maps inputs to Tensor[B, feature_dim]; must expose ``feature_dim``.
        num_classes (int): number of classes C.
        head (nn.Module, optional): maps features to logits; defaults to
            ``nn.Linear(feature_dim, num_classes, bias=bias)``.
        bias (bool): bias of the default head. Default: True.
    """

    def __init__(self, backbone: nn.Module, num_classes: int, head: nn.Module | None = None, bias: bool = True):
        super().__init__()
        self.backbone = backbone
        self.head = head if head is not None else nn.Linear(backbone.feature_dim, num_classes, bias=bias)

    def features(self, x: Tensor) -> Tensor:
        return self.backbone(x)  # (B, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))  # (B, C)

    def loss_and_logits(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """(mean training loss, logits) of a batch.

        A head with its own loss (the margin heads of :mod:`sphereml.heads.margins`: it has a
        ``loss_and_logits(features, labels)`` method) gives its margin loss and its margin-free
        logits, detached; any other head gives softmax cross-entropy of its logits.
        """
        features = self.backbone(x)  # (B, d)
        head_loss = getattr(self.head, "loss_and_logits", None)
        if head_loss is not None:
            return head_loss(features, y)
        logits = self.head(features)  # (B, C)
        return F.cross_entropy(logits, y), logits


class ConvAutoencoder(nn.Module):
    """Convolutional autoencoder for 28x28 images (thesis Fig. 1.1 experiment).

    encoder: conv(in -> c1, 4, stride 2) -> act -> ``code_conv`` (c1 -> c2, 4, stride 2) -> act
    decoder: deconv(c2 -> c1) -> act -> deconv(c1 -> in) -> sigmoid

    ``code_conv`` is the layer "before the latent space" whose inner products the
    chapter replaces by angles or norms at inference time.
    """

    def __init__(self, in_channels: int = 1, channels: tuple[int, int] = (16, 32)):
        super().__init__()
        c1, c2 = channels
        self.stem = nn.Sequential(nn.Conv2d(in_channels, c1, 4, stride=2, padding=1), nn.ReLU())
        self.code_conv = nn.Conv2d(c1, c2, 4, stride=2, padding=1)
        self.decoder = nn.Sequential(
            nn.ReLU(),
            nn.ConvTranspose2d(c2, c1, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.ConvTranspose2d(c1, in_channels, 4, stride=2, padding=1),
            nn.Sigmoid(),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.code_conv(self.stem(x)))  # (B, in, H, W)

    def decode(self, code: Tensor) -> Tensor:
        """Decoder applied to a code Tensor[B, c2, H/4, W/4] (the output of ``code_conv``)."""
        return self.decoder(code)

    def code_parts(self, x: Tensor, eps: float = 1e-8) -> dict[str, Tensor]:
        """Split ``code_conv``'s pre-bias output w_j . x_p = ||w_j|| ||x_p|| cos(theta_jp) (thesis Fig. 1.1).

        x_p is the receptive-field patch at position p (all input channels), so
        ||x_p|| comes from a convolution of the squared input with a ones kernel.

        Returns:
            dict with ``inner`` (w . x), ``cos`` (cos theta), ``magnitude`` (||w|| ||x_p||),
            all Tensor[B, c2, H', W'], and ``bias`` Tensor[1, c2, 1, 1].
        """
        conv = self.code_conv
        h = self.stem(x)  # (B, c1, H/2, W/2)
        inner = F.conv2d(h, conv.weight, None, conv.stride, conv.padding)  # (B, c2, H', W')
        ones = torch.ones_like(conv.weight[:1])  # (1, c1, k, k)
        patch_norm = F.conv2d(h * h, ones, None, conv.stride, conv.padding).clamp_min(0).sqrt()  # (B, 1, H', W')
        w_norm = conv.weight.flatten(1).norm(dim=1).view(1, -1, 1, 1)  # (1, c2, 1, 1)
        magnitude = w_norm * patch_norm  # (B, c2, H', W')
        cos = (inner / magnitude.clamp_min(eps)).clamp(-1.0, 1.0)
        bias = conv.bias.view(1, -1, 1, 1) if conv.bias is not None else torch.zeros_like(w_norm)
        return {"inner": inner, "cos": cos, "magnitude": magnitude, "bias": bias}


class BlockCNN(nn.Module):
    """``blocks`` x [conv 3x3 (padding 2) -> norm -> act -> max-pool 2], then a linear classifier.

    The CNN1 (width 64) and CNN2 (width 128) of the convolutional-similarity paper
    (its Table 7) with BatchNorm and LeakyReLU(0.2).  Its caption gives the conv arguments as
    (in, out, kernel, padding) with padding 2 — the *full* cross-correlation of a 3x3 kernel
    that the paper's theory assumes, and the value that makes its Linear(576, 10) fit 32x32
    inputs (32 -> 34 -> 17 -> 19 -> 9 -> 11 -> 5 -> 7 -> 3).  28x28 inputs also end at 3x3.

    ``forward`` returns logits; :meth:`features` the flattened input of the classifier.
    """

    def __init__(self, in_channels: int = 1, width: int = 64, num_classes: int = 10, image_size: int = 28,
                 blocks: int = 4, padding: int = 2, conv_layer: LayerType = None, act_layer: LayerType = "leakyrelu",
                 norm_layer: LayerType = "batchnorm"):
        super().__init__()
        integer("width", width, at_least=1)
        integer("blocks", blocks, at_least=1)
        integer("padding", padding, at_least=0, at_most=2)
        conv, act, norm = get_layer(conv_layer, "conv"), get_layer(act_layer, "relu"), get_layer(norm_layer, "identity")
        layers: list[nn.Module] = []
        channels, side = in_channels, image_size
        for _ in range(blocks):
            layers += [conv(channels, width, 3, padding=padding), norm(width), act(), nn.MaxPool2d(2)]
            channels, side = width, (side + 2 * padding - 2) // 2
        if side < 1:
            raise ValueError(f"image_size {image_size} is too small for {blocks} blocks with padding {padding}")
        self.body = nn.Sequential(*layers)
        self.classifier = nn.Linear(width * side * side, num_classes)
        self.feature_dim = width * side * side

    def features(self, x: Tensor) -> Tensor:
        return self.body(x).flatten(1)  # (B, width * side^2)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))  # (B, num_classes)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, conv, norm, act, shortcut_conv=None):
        super().__init__()
        self.conv1, self.bn1 = conv(cin, cout, 3, stride=stride, padding=1, bias=False), norm(cout)
        self.conv2, self.bn2 = conv(cout, cout, 3, padding=1, bias=False), norm(cout)
        self.act = act()
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            shortcut_conv = shortcut_conv or conv
            self.shortcut = nn.Sequential(shortcut_conv(cin, cout, 1, stride=stride, bias=False), norm(cout))

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.bn1(self.conv1(x)))
        return self.act(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    """Residual network of basic blocks for small images (3x3 stem, no stem pooling), He et al.'s CIFAR layout.

    Args:
        blocks (tuple[int]): basic blocks per stage; (2, 2, 2, 2) is ResNet-18.
        widths (tuple[int]): channels per stage; stages after the first halve the resolution.
        conv_layer, norm_layer, act_layer: operator factories (see :func:`get_layer`).
        shortcut_layer: the 1x1 projection of shortcuts that change shape; ``conv_layer`` when None.
    """

    def __init__(self, blocks: tuple[int, ...] = (2, 2, 2, 2), widths: tuple[int, ...] = (64, 128, 256, 512),
                 in_channels: int = 3, num_classes: int = 10, conv_layer: LayerType = None,
                 norm_layer: LayerType = "batchnorm", act_layer: LayerType = None, shortcut_layer: LayerType = None):
        super().__init__()
        if len(blocks) != len(widths) or not blocks or min(blocks) < 1:
            raise ValueError(f"blocks and widths need the same non-zero length, got {blocks} and {widths}")
        conv, norm, act = get_layer(conv_layer, "conv"), get_layer(norm_layer, "identity"), get_layer(act_layer, "relu")
        shortcut = get_layer(shortcut_layer, "conv") if shortcut_layer is not None else conv
        self.stem = nn.Sequential(conv(in_channels, widths[0], 3, padding=1, bias=False), norm(widths[0]), act())
        stages, cin = [], widths[0]
        for i, (n, width) in enumerate(zip(blocks, widths)):
            for j in range(n):
                stages.append(_BasicBlock(cin, width, 2 if i > 0 and j == 0 else 1, conv, norm, act, shortcut))
                cin = width
        self.stages = nn.Sequential(*stages)
        self.classifier = nn.Linear(cin, num_classes)
        self.feature_dim = cin

    def features(self, x: Tensor) -> Tensor:
        return self.stages(self.stem(x)).mean((2, 3))  # global average pool: (B, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


def resnet18(in_channels: int = 3, num_classes: int = 10, widths: tuple[int, ...] = (64, 128, 256, 512),
             **kwargs) -> ResNet:
    """ResNet-18 in its CIFAR form (11.2M parameters for 10 classes at the default widths)."""
    return ResNet((2, 2, 2, 2), widths, in_channels, num_classes, **kwargs)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sphere_layers(angular: str, k: float, learnable_k: bool) -> dict:
    options = {"angular": angular, "k": k, "learnable_k": learnable_k}
    return {"conv_layer": partial(SphereConv2d, **options), "linear_layer": partial(SphereLinear, **options)}


def plain_cnn(depth: int = 9, widths: tuple[int, int, int] = (64, 96, 128), in_channels: int = 3,
              image_size: int = 32, feature_dim: int = 256, conv_layer: LayerType = None,
              linear_layer: LayerType = None, norm_layer: LayerType = "batchnorm",
              act_layer: LayerType = "relu", feature_act: bool = True) -> ConvNet:
    """CNN-N of thesis Table B.1: three stages of depth / 3 [3x3 conv -> norm -> act], each ending in a
    2x2 max-pool, then a fully connected layer of ``feature_dim`` (256) units with the activation.

    ``depth`` counts the conv layers (CNN-3, 9, 18, 45, 60, 69: 1, 3, 6, 15, 20, 23 per stage).
    Wrap it in a :class:`Classifier` to add the softmax (or a margin) head; ``feature_act=False`` drops
    the activation after the feature layer, as App. A.1 does for angular-margin heads (a ReLU there
    leaves them non-negative features only).
    """
    if not _is_int(depth) or depth < 3 or depth % 3:
        raise ValueError(f"depth must be a positive multiple of 3 (CNN-3, CNN-9, ...), got {depth!r}")
    if len(widths) != 3:
        raise ValueError(f"widths must give the three stages' channels, got {widths!r}")
    return ConvNet(in_channels, feature_dim, tuple(widths), depth // 3, image_size, conv_layer, linear_layer,
                   act_layer, norm_layer, feature_act=feature_act)


def spherenet(depth: int = 9, angular: str = "cosine", k: float = 0.5, learnable_k: bool = False,
              sphere_fc: bool = False, **kwargs) -> ConvNet:
    """SphereNet-N (thesis §3.4, Table B.1): :func:`plain_cnn` with every conv a
    :class:`~sphereml.layers.sphereconv.SphereConv2d` with the same angular function.

    The thesis does not say whether the 256-unit fully connected layer is a SphereConv too;
    ``sphere_fc=True`` makes it a :class:`~sphereml.layers.sphereconv.SphereLinear` (its outputs, and so
    the features, are then bounded by 1 per unit; chapter 3 measures both).  Other keyword
    arguments go to :func:`plain_cnn`.
    """
    layers = _sphere_layers(angular, k, learnable_k)
    if not sphere_fc:
        layers.pop("linear_layer")
    return plain_cnn(depth, **layers, **kwargs)


def resnet(depth: int = 32, widths: tuple[int, int, int] = (64, 96, 128), in_channels: int = 3,
           num_classes: int = 10, **kwargs) -> ResNet:
    """ResNet-N of thesis Table B.2: a 3x3 stem, then three stages of (depth - 2) / 6 basic blocks.

    ``widths`` (64, 96, 128) is the ablation ResNet-32; (96, 192, 384) the one of Table 3.4.
    Other keyword arguments (``conv_layer``, ``norm_layer``, ``act_layer``, ``shortcut_layer``) go
    to :class:`ResNet`.
    """
    if not _is_int(depth) or depth < 8 or (depth - 2) % 6:
        raise ValueError(f"depth must be 6n + 2 with n >= 1 (ResNet-8, 14, 20, 32, ...), got {depth!r}")
    if len(widths) != 3:
        raise ValueError(f"widths must give the three stages' channels, got {widths!r}")
    n = (depth - 2) // 6
    return ResNet((n, n, n), tuple(widths), in_channels, num_classes, **kwargs)


def sphere_resnet(depth: int = 32, angular: str = "cosine", k: float = 0.5, learnable_k: bool = False,
                  sphere_shortcut: bool = True, **kwargs) -> ResNet:
    """SphereResNet-N: :func:`resnet` with SphereConv in every conv layer.

    ``sphere_shortcut=False`` keeps ordinary 1x1 convolutions in the projection shortcuts (the
    "v2" of thesis §3.4.6; "v1" uses SphereConv there too).
    """
    conv = _sphere_layers(angular, k, learnable_k)["conv_layer"]
    return resnet(depth, conv_layer=conv, shortcut_layer=None if sphere_shortcut else "conv", **kwargs)


def scs_net(widths: tuple[int, ...] = (32, 64, 128), in_channels: int = 3, image_size: int = 32, p: float = 2.0,
            q: float = 1e-3, learnable: bool = True, act_layer: LayerType = "identity",
            pool_layer: LayerType = "maxabspool", conv_layer: LayerType = None) -> ConvNet:
    """A Rohrer-style SCS network (the SCS paper's "Rohrer100K", Sec. 3.1): one 3x3 sharpened-cosine layer
    per stage, each followed by a 2x2 max-abs pool, no normalisation and no activation, and the flattened
    last stage as the feature (wrap it in a :class:`Classifier` for the linear classifier).

    (32, 64, 128) on 32x32 CIFAR images gives about 114K parameters with the classifier (the gallery file the
    paper most likely used; the paper gives no layer list).  ``conv_layer="conv"`` (or any other operator)
    builds the matching baseline with the same shape; ``act_layer`` and ``pool_layer`` give the paper's
    {ReLU, none} x {MaxPool, MaxAbsPool} grid.
    """
    conv = conv_layer if conv_layer is not None else partial(SharpenedCosineSimilarity2d, p=p, q=q, learnable=learnable)
    return ConvNet(in_channels, None, tuple(widths), 1, image_size, conv_layer=conv, act_layer=act_layer,
                   pool_layer=pool_layer)


def opt_cnn(depth: int = 6, width: int = 64, in_channels: int = 3, image_size: int = 32,
            norm_layer: LayerType = "batchnorm", act_layer: LayerType = "relu", plain_fc6: bool = False) -> ConvNet:
    """CNN-6 / CNN-9 of the OPT chapter (thesis Table F.1): three stages of depth / 3 [3x3 conv(width) ->
    norm -> act] with a 2x2 max-pool after each, then "fc6": a valid conv of ``width`` filters as large as
    the last map (4x4 at 32 px, fan-in 1024) -> norm -> act, or, with ``plain_fc6``, alone (as the authors'
    code builds it).  Features: ``width``; add a :class:`Classifier`.
    """
    if depth not in (6, 9):
        raise ValueError(f"depth must be 6 or 9 (Table F.1), got {depth!r}")
    net = ConvNet(in_channels, None, (width,) * 3, depth // 3, image_size, norm_layer=norm_layer, act_layer=act_layer)
    side = image_size // 8
    tail = [] if plain_fc6 else [get_layer(norm_layer, "identity")(width), get_layer(act_layer, "relu")()]
    net.feature = nn.Sequential(nn.Unflatten(1, (width, side, side)), nn.Conv2d(width, width, side), *tail,
                                nn.Flatten())
    net.feature_dim = width
    return net
