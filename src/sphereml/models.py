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

__all__ = [
    "LayerType", "get_layer", "ConvNet", "MLP", "Classifier", "ConvAutoencoder",
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
    "identity": nn.Identity,
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
    """Plain CNN: stages of [conv 3x3 -> norm -> act] x ``depth`` then 2x2 max-pool, then a linear feature layer.

    Args:
        in_channels (int): image channels.
        feature_dim (int): size of the output feature (2 or 3 for the visualisation chapters).
        widths (tuple[int]): channels of each stage. Default: (32, 64).
        depth (int): conv layers per stage. Default: 1.
        image_size (int): input height = width, used to size the feature layer. Default: 28.
        conv_layer, linear_layer, act_layer, norm_layer: operator factories (see :func:`get_layer`).
            ``norm_layer`` defaults to ``"identity"`` (no normalisation).
        feature_act (bool): apply ``act_layer`` after the feature layer. Keep False for
            2-D features, or they stay in the first quadrant (thesis App. A.1). Default: False.
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
    ):
        super().__init__()
        if feature_dim < 1 or not widths or depth < 1:
            raise ValueError(
                f"need feature_dim >= 1, non-empty widths and depth >= 1, got {feature_dim}, {widths}, {depth}"
            )
        if image_size % (2 ** len(widths)):
            raise ValueError(f"image_size {image_size} must be divisible by 2**len(widths) = {2 ** len(widths)}")
        conv = get_layer(conv_layer, "conv")
        linear = get_layer(linear_layer, "linear")
        act = get_layer(act_layer, "relu")
        norm = get_layer(norm_layer, "identity")
        layers: list[nn.Module] = []
        channels = in_channels
        for width in widths:
            for _ in range(depth):
                layers += [conv(channels, width, 3, padding=1), norm(width), act()]
                channels = width
            layers.append(nn.MaxPool2d(2))
        self.body = nn.Sequential(*layers)
        side = image_size // 2 ** len(widths)
        self.feature = linear(channels * side * side, feature_dim)
        self.feature_act = act() if feature_act else nn.Identity()
        self.feature_dim = feature_dim

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
    angles to the rows W_j of ``head.weight`` the thesis studies.

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
