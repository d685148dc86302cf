"""One SGD training step of the OPT chapter's CNN-6 (thesis Table F.1) with each OPT method, against the plain network.

Same network, same batch, same run: CNN-6 (64 channels, 32x32x3 input, 100 classes, BatchNorm) with every
conv layer and fc6 over-parameterised (seven d x d rotations, d = 27, 576 x 5, 1024), the classifier plain.
``gs (unrolled)`` is the thesis's Algorithm 1 loop (m sequential steps per layer) beside the one-QR path.
Goal (issue 17): ``cayley`` and ``gs`` at most 1.5x the plain step.
"""

from __future__ import annotations

import sys

import torch

from sphereml import models
from sphereml.regularizers import opt

from .harness import SMOKE, compare, training_step

METHODS = ("gs", "householder", "lowdin", "cayley", "matrix_exp", "ogd", "or", "gs (unrolled)")


def _network(method: str | None, device: torch.device, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    net = models.Classifier(models.opt_cnn(6, width=width), 100)
    if method is not None:
        name, unrolled = method.split(" ")[0], method.endswith("(unrolled)")
        opt.overparameterize_model(net, name, unrolled=unrolled)
    return net.to(device)


def _step(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    make_optimizer, regularizer = opt.training_parts(net, lr=0.1)  # OGD's Cayley steps, OR's penalty, else SGD
    return training_step(net, x, y, make_optimizer(net.parameters()), regularizer)


def run(device: torch.device, batch: int = 128, width: int = 64, repeats: int = 5,
        methods: tuple[str, ...] | None = None) -> dict:
    """``methods`` default: all; on CUDA all but ``gs (unrolled)`` (about 1.5 million launches a step)."""
    if methods is None:
        methods = tuple(m for m in METHODS if device.type != "cuda" or "unrolled" not in m)
    if SMOKE:
        batch, width, methods = 2, 8, methods[:3]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 100, (batch,), generator=g).to(device)
    candidates = {"plain CNN-6": _step(_network(None, device, width), x, y)}
    for method in methods:
        candidates[method] = _step(_network(method, device, width), x, y)
    print(f"--- OPT training step, CNN-6 width {width}, batch {batch}, 32x32x3, 100 classes")
    return compare(f"opt_train_step_cnn6_w{width}_b{batch}", candidates, baseline="plain CNN-6", device=device,
                   repeats=repeats, extra={"batch": batch, "width": width, "network": "CNN-6 (Table F.1)"}, count=True)


if __name__ == "__main__":
    from sphereml.train import resolve_device

    run(resolve_device("auto"), **({"batch": 8, "width": 8, "repeats": 1} if "--smoke" in sys.argv else {}))
