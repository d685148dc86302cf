"""Adversarial attacks in the L-infinity ball: FGSM and PGD, accuracy under attack (white-box, or black-box
transferred from a substitute model), and FGSM adversarial training.

FGSM (Goodfellow et al., 2015) takes one step of size eps along the sign of the input gradient of the
loss; PGD (Madry et al., 2018) takes ``steps`` steps of ``step_size`` from a random start in the ball,
projecting back onto the ball (and the valid pixel range) after each.  Both maximise the softmax
cross-entropy of ``model(x)`` (the margin-free logits of a :class:`~sphereml.models.Classifier`).
The decoupled-networks chapter (thesis App. C: eps = 8/255, step 2/255, 20 steps) and the sharpened
cosine chapter (an eps sweep, as the paper's Sec. 4.5) use them.  The model's parameters get no
gradient, and its train / eval mode is left as it was found (attack in eval mode).

Black-box transfer (thesis App. C.1.3): the adversarial examples are computed on a substitute
(``source``) network of the same architecture trained separately, and the target network is
evaluated on them.  Adversarial training (:func:`adversarial_loss`) minimises Goodfellow et al.'s
(1 - w) L(x) + w L(x_adv) with w = 1/2, the examples made on the fly by the model being trained;
the thesis (App. C.1.2) names FGSM examples at eps = 8 but not the objective, so w is our choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from ._checks import integer, one_of, real_number
from .train import batches, on_device

__all__ = ["ATTACKS", "fgsm", "pgd", "robust_accuracy", "attack_table", "adversarial_loss"]

ATTACKS = ("fgsm", "pgd")


def _input_gradient(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    x = x.detach().requires_grad_(True)
    loss = F.cross_entropy(model(x), y)
    (grad,) = torch.autograd.grad(loss, x)
    return grad


def _project(x_adv: Tensor, x: Tensor, eps: float, bounds: tuple[float, float]) -> Tensor:
    """Back into the L-infinity ball of radius eps around x and into the pixel range."""
    return torch.min(torch.max(x_adv, x - eps), x + eps).clamp_(*bounds)


def fgsm(model: nn.Module, x: Tensor, y: Tensor, eps: float, bounds: tuple[float, float] = (0.0, 1.0)) -> Tensor:
    """x + eps sign(grad_x loss), clipped to ``bounds``: the fast gradient sign method.

    Args:
        model (nn.Module): maps Tensor[B, ...] to logits Tensor[B, C].
        x (Tensor[B, ...]), y (Tensor[B], int64): clean inputs and labels.
        eps (float): radius of the L-infinity ball, >= 0.
        bounds (tuple): valid input range. Default: (0, 1).

    Returns:
        Tensor like ``x`` (detached).
    """
    eps = real_number("eps", eps, at_least=0.0)
    return _project(x + eps * _input_gradient(model, x, y).sign(), x, eps, bounds).detach()


def pgd(model: nn.Module, x: Tensor, y: Tensor, eps: float, step_size: float | None = None, steps: int = 10,
        random_start: bool = True, bounds: tuple[float, float] = (0.0, 1.0),
        generator: torch.Generator | None = None) -> Tensor:
    """Projected gradient descent on the loss, in the L-infinity ball of radius ``eps``.

    Args:
        model, x, y, eps, bounds: as in :func:`fgsm`.
        step_size (float, optional): size of each signed step. Default: eps / 4.
        steps (int): number of steps >= 1. Default: 10.
        random_start (bool): start from a uniform point of the ball. Default: True.
        generator (torch.Generator, optional): source of the random start (on the CPU).

    Returns:
        Tensor like ``x`` (detached).
    """
    eps = real_number("eps", eps, at_least=0.0)
    step_size = eps / 4 if step_size is None else real_number("step_size", step_size, at_least=0.0)
    integer("steps", steps, at_least=1)
    x = x.detach()
    x_adv = x.clone()
    if random_start and eps > 0:
        noise = torch.rand(x.shape, generator=generator, dtype=x.dtype).to(x.device) * (2 * eps) - eps
        x_adv = _project(x + noise, x, eps, bounds)
    for _ in range(steps):
        x_adv = _project(x_adv + step_size * _input_gradient(model, x_adv, y).sign(), x, eps, bounds)
    return x_adv.detach()


def _attack(attack: str, model: nn.Module, x: Tensor, y: Tensor, eps: float, generator, **kwargs) -> Tensor:
    if attack == "fgsm":
        return fgsm(model, x, y, eps, **kwargs)
    return pgd(model, x, y, eps, generator=generator, **kwargs)


def robust_accuracy(model: nn.Module, data: Dataset, eps_values, attack: str = "pgd", batch_size: int = 256,
                    device: str | torch.device = "cpu", seed: int = 0, source: nn.Module | None = None,
                    **attack_kwargs) -> dict[float, float]:
    """Accuracy of ``model`` on ``data`` attacked at each radius in ``eps_values`` (eps = 0: clean accuracy).

    The model is attacked and evaluated in eval mode (its previous mode is restored); PGD's random
    starts are seeded by ``seed``.  Extra keyword arguments go to the attack (``steps``, ``step_size``).
    With ``source`` (a substitute network) the attack is black-box: the examples are made on ``source``
    (also in eval mode) and ``model`` is evaluated on them.

    Returns:
        {eps: accuracy} in the order of ``eps_values``.
    """
    one_of("attack", attack, ATTACKS)
    integer("batch_size", batch_size, at_least=1)
    dev = torch.device(device)
    attacked = model if source is None else source
    modes = [(m, m.training) for m in (model, attacked)]
    model.eval()
    attacked.eval()
    generator = torch.Generator().manual_seed(seed)
    correct = {float(eps): torch.zeros((), dtype=torch.long, device=dev) for eps in eps_values}  # read at the end
    seen = 0
    for batch in batches(on_device(data, dev), batch_size):
        x, y = (t.to(dev) for t in batch)
        for eps in correct:
            x_eval = x if eps == 0 else _attack(attack, attacked, x, y, eps, generator, **attack_kwargs)
            with torch.no_grad():
                correct[eps] += (model(x_eval).argmax(1) == y).sum()
        seen += len(y)
    for module, mode in reversed(modes):
        module.train(mode)
    return {eps: int(c) / max(seen, 1) for eps, c in correct.items()}


def attack_table(model: nn.Module, data: Dataset, eps: float, source: nn.Module | None = None, bim_steps: int = 20,
                 bim_step: float | None = None, **kwargs) -> dict[str, float]:
    """The accuracies of thesis Tables 4.7-4.8 for one network: clean ("none"), white-box "FGSM" and "BIM",
    and, with a substitute ``source``, the transferred "black FGSM" and "black BIM" (App. C.1.2-C.1.3).

    BIM is :func:`pgd` without a random start: ``bim_steps`` signed steps of ``bim_step`` (default eps / 4, the
    thesis's 2/255 at eps = 8/255).  Keyword arguments go to :func:`robust_accuracy` (``device``,
    ``batch_size``).
    """
    bim = dict(steps=bim_steps, step_size=bim_step, random_start=False)
    white = robust_accuracy(model, data, [0.0, eps], "fgsm", **kwargs)
    table = {"none": white[0.0], "FGSM": white[float(eps)],
             "BIM": robust_accuracy(model, data, [eps], "pgd", **bim, **kwargs)[float(eps)]}
    if source is not None:
        table["black FGSM"] = robust_accuracy(model, data, [eps], "fgsm", source=source, **kwargs)[float(eps)]
        table["black BIM"] = robust_accuracy(model, data, [eps], "pgd", source=source, **bim, **kwargs)[float(eps)]
    return table


def adversarial_loss(eps: float, attack: str = "fgsm", weight: float = 0.5, seed: int = 0, **attack_kwargs):
    """A ``loss_fn`` for :func:`~sphereml.train.fit` that trains on adversarial examples (App. C.1.3).

    Each step the examples are made by ``attack`` on the model being trained, in its training mode, and the
    loss is (1 - weight) CE(model(x), y) + weight CE(model(x_adv), y); the clean logits are returned (for
    the running training accuracy).

    Args:
        eps (float): radius of the L-infinity ball, >= 0 (App. C: 8/255).
        attack (str): ``"fgsm"`` (the thesis's choice) or ``"pgd"``.
        weight (float): the adversarial share of the loss, in [0, 1]. Default: 0.5.
        seed (int): seeds PGD's random starts.
        **attack_kwargs: go to the attack (``steps``, ``step_size``).

    Returns:
        callable(model, x, y) -> (loss, logits), marked ``inner_gradient = True``: it differentiates the model
        inside the loss, which :func:`~sphereml.multiseed.fit_seeds`' batched step cannot.
    """
    eps = real_number("eps", eps, at_least=0.0)
    one_of("attack", attack, ATTACKS)
    weight = real_number("weight", weight, at_least=0.0, at_most=1.0)
    generator = torch.Generator().manual_seed(integer("seed", seed, at_least=0))

    def loss_fn(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        x_adv = _attack(attack, model, x, y, eps, generator, **attack_kwargs)
        logits = model(x)
        loss = (1.0 - weight) * F.cross_entropy(logits, y) + weight * F.cross_entropy(model(x_adv), y)
        return loss, logits

    loss_fn.inner_gradient = True
    return loss_fn
