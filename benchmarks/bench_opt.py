"""One SGD training step of the OPT chapter's CNN-6 (thesis Table F.1) with each OPT method, against the plain network.

Same network, same batch, same run: CNN-6 (64 channels, 32x32x3 input, 100 classes, BatchNorm) with every
conv layer and fc6 over-parameterised (seven d x d rotations, d = 27, 576 x 5, 1024), the classifier plain.
The rotations of one size are evaluated together (Note [rotations evaluated together] in
:mod:`sphereml.regularizers.rotations`); ``gs (layer by layer)`` evaluates each layer's own, as before that note,
and ``gs (unrolled)`` is the thesis's Algorithm 1 loop (m sequential steps per layer) beside the one-QR path.
Goals on a GPU (issue 27): ``gs`` and ``cayley`` at most 1.3x the plain step, ``householder`` 1.5x.  On CUDA the
candidates of ``COMPILED`` also run with the loss compiled (``torch.compile(mode="reduce-overhead")``, CUDA graphs
where the step allows them), as ``fit(compile="reduce-overhead")`` trains.
"""

from __future__ import annotations

import sys

import torch

from sphereml import models
from sphereml.regularizers import opt, select_layers

from .harness import SMOKE, compare, compiling, first_call, training_step

COMPILED = ("plain CNN-6", "gs", "householder", "cayley")  # on CUDA, also timed compiled
METHODS = ("gs", "householder", "lowdin", "cayley", "matrix_exp", "ogd", "or", "gs (layer by layer)", "gs (unrolled)")


def _network(method: str | None, device: torch.device, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    net = models.Classifier(models.opt_cnn(6, width=width), 100)
    if method is not None and method.endswith("(layer by layer)"):
        for layer in select_layers(net, include_output=False):  # without the model's hooks: one map per layer
            opt.orthogonal_overparameterize(layer, method.split(" ")[0])
    elif method is not None:
        name, unrolled = method.split(" ")[0], method.endswith("(unrolled)")
        opt.overparameterize_model(net, name, unrolled=unrolled)
    return net.to(device)


def _step(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, compile: bool | str = False):
    make_optimizer, regularizer = opt.training_parts(net, lr=0.1)  # OGD's Cayley steps, OR's penalty, else SGD
    return training_step(net, x, y, make_optimizer(net.parameters()), regularizer, compile)


def run(device: torch.device, batch: int = 128, width: int = 64, repeats: int = 5,
        methods: tuple[str, ...] | None = None, compiled: bool | None = None) -> dict:
    """``methods`` default: all; on CUDA all but ``gs (unrolled)`` (about 1.5 million launches a step).
    ``compiled`` (default: on CUDA, unless SPHEREML_BENCH_COMPILE=0): also the candidates of ``COMPILED``
    compiled (the compilation is paid before the timing)."""
    if methods is None:
        methods = tuple(m for m in METHODS if device.type != "cuda" or "unrolled" not in m)
    if SMOKE:
        batch, width, methods = 2, 8, methods[:3]
    compiled = compiling(device) if compiled is None else compiled
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 100, (batch,), generator=g).to(device)
    candidates = {}
    for method in ("plain CNN-6",) + tuple(methods):
        for compile in (False, "reduce-overhead") if compiled and method in COMPILED else (False,):
            label = method + (" (compiled)" if compile else "")
            step = _step(_network(None if method == "plain CNN-6" else method, device, width), x, y, compile)
            if first_call("opt", label, step):
                candidates[label] = step
    print(f"--- OPT training step, CNN-6 width {width}, batch {batch}, 32x32x3, 100 classes")
    return compare(f"opt_train_step_cnn6_w{width}_b{batch}", candidates, baseline="plain CNN-6", device=device,
                   repeats=repeats, extra={"batch": batch, "width": width, "network": "CNN-6 (Table F.1)"}, count=True)


if __name__ == "__main__":
    from sphereml.train import resolve_device

    run(resolve_device("auto"), **({"batch": 8, "width": 8, "repeats": 1} if "--smoke" in sys.argv else {}))
