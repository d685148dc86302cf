"""Orthogonal over-parameterised training, OPT (thesis Ch. 7, App. F).

A layer's neurons are the rows of its flattened weight W (Tensor[n, d]).  OPT fixes them at a
random V and learns one orthogonal R per layer that rotates them all together, w_i = R v_i
(eq. 7.1), so W = V R^T.  A joint rotation keeps every pairwise angle, hence the hyperspherical
energy of the neurons, exactly as initialised (eq. 7.2)::

    layer = nn.Conv2d(64, 64, 3, padding=1)
    orthogonal_overparameterize(layer, method="gs")   # layer.weight is now V R^T
    layer.parametrizations.weight.original            # V: a buffer, never trained
    layer.parametrizations.weight[0].raw              # the learnt matrix that R is made from

The parametrisation is :class:`~sphereml.regularizers.rotations.OrthogonalRotation` (``torch.nn.utils.parametrize``),
so ``layer.weight`` stays the effective weight and the layer works wherever a plain one does; a model's rotations
of one size are evaluated together (:func:`~sphereml.regularizers.rotations.group_rotations`; activation
checkpointing needs :func:`~sphereml.regularizers.rotations.ungroup_rotations` first).
Methods (how R is made from the learnt ``raw``; :mod:`sphereml.regularizers.orthogonalizers`):

* ``gs`` / ``mgs`` — Gram-Schmidt on the rows of raw (classic / modified: the same map);
* ``householder`` — Householder QR of raw (stable reflections);
* ``lowdin`` — the polar factor of raw (Löwdin's symmetric orthogonalisation);
* ``cayley`` / ``matrix_exp`` — Cayley transform / exponential of the skew part of raw;
* ``ogd`` — raw *is* R, kept orthogonal by :class:`OrthogonalSGD` (eqs. 7.5-7.6);
* ``or`` — raw is R, unconstrained, pulled towards orthogonality by :class:`OrthogonalRelaxation`
  (eq. 7.7); ``upt`` — raw is R with no constraint at all (the ablation of Table 7.1).

``gs``, ``mgs`` and ``householder`` run through one QR factorisation; ``unrolled=True`` runs the loops of
the thesis's algorithms instead (the same map in exact arithmetic, m sequential steps: the reference).
Variants: block-diagonal R with ``blocks=k`` (PE-OPT, eqs. F.33-F.34: ``shared=True`` for R_s, else R_u),
a random subset of the d coordinates rotated at a time (S-OPT, ``subset=``; :class:`Resampler` merges and
redraws it), unit-norm neurons (``normalize=True``, §7.3.7) and energy-minimised V (``refine=``, §7.3.7).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from . import orthogonalizers as orth
from .._checks import integer, one_of, real_number
from ..energy import hyperspherical_energy
from ..geometry import normalize as unit_rows
from . import Regularizer, select_layers
from .rotations import (CONDITIONED_STARTS, METHODS, ORTHOGONAL_BY_CONSTRUCTION, OrthogonalRotation,
                        concatenated_groups, group_rotations, groups_of_equal_size, opt_layers, rotation_module,
                        ungroup_rotations)

__all__ = [
    "METHODS", "ORTHOGONAL_BY_CONSTRUCTION", "CONDITIONED_STARTS", "OrthogonalRotation", "orthogonal_overparameterize",
    "overparameterize_model", "group_rotations", "ungroup_rotations", "rotation_module", "opt_layers",
    "rotation_rates", "fixed_neurons", "merge", "resample", "Resampler", "refine_neurons", "OrthogonalRelaxation",
    "OrthogonalSGD", "ogd_optimizer", "training_parts",
]

REFINEMENTS = (None, "mhe", "hs_mhe")
SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def orthogonal_overparameterize(module: nn.Module, method: str = "gs", *, blocks: int = 1, shared: bool = False,
                                subset: int | None = None, normalize: bool = False, refine: str | None = None,
                                refine_steps: int = 5000, unrolled: bool = False,
                                generator: torch.Generator | None = None, raw_std: float | str = 1.0,
                                orthogonal_start: bool = False) -> nn.Module:
    """Make ``module.weight`` the fixed neurons V (its current value) rotated by a learnt orthogonal R.

    Args:
        module (nn.Linear or nn.Conv1d/2d/3d): changed in place and returned; its bias stays a plain
            parameter.  Initialise its weight first (the thesis: Kaiming or Xavier normal).
        method, blocks, shared, subset, unrolled, generator, raw_std, orthogonal_start: see
            :class:`~sphereml.regularizers.rotations.OrthogonalRotation`.
        normalize (bool): scale every neuron of V to unit norm first (§7.3.7, Table 7.7). Default: False.
        refine (str, optional): ``"mhe"`` or ``"hs_mhe"``: minimise V's (half-space) energy first
            (:func:`refine_neurons`, §7.3.7, Table 7.6). Default: None.
        refine_steps (int): gradient steps of the refinement (at :func:`refine_neurons`' default rate).
            Default: 5000 (the thesis).

    Returns:
        ``module``, whose ``parametrizations.weight.original`` is V (a buffer).
    """
    if not isinstance(module, SUPPORTED):
        raise ValueError(f"module must be one of {[c.__name__ for c in SUPPORTED]}, got {type(module).__name__}")
    if parametrize.is_parametrized(module, "weight"):
        raise ValueError(f"{type(module).__name__}.weight is already parametrised")
    one_of("refine", refine, REFINEMENTS)
    v = module.weight.detach().clone()
    rotation = OrthogonalRotation(v[0].numel(), method, blocks, shared, subset, unrolled, generator, raw_std,
                                  dtype=v.dtype, device=v.device, orthogonal_start=orthogonal_start)
    if normalize:
        v = unit_rows(v.flatten(1)).reshape(v.shape)
    if refine is not None:
        v = refine_neurons(v, integer("refine_steps", refine_steps, at_least=1), half_space=refine == "hs_mhe")
    parametrize.register_parametrization(module, "weight", rotation, unsafe=True)
    plist = module.parametrizations.weight
    del plist.original  # the trainable Parameter becomes a buffer: V is never trained nor decayed
    plist.register_buffer("original", v)
    return module


def overparameterize_model(model: nn.Module, method: str = "gs", include_output: bool = False,
                           **kwargs) -> list[nn.Module]:
    """OPT on every conv and linear layer of ``model`` but the classifier (thesis §7.3.1); returns them.

    Layers follow :func:`~sphereml.regularizers.select_layers`; keyword arguments go to
    :func:`orthogonal_overparameterize` (one ``generator`` draws every layer in order).  The layers' rotations are
    evaluated together at each forward of ``model`` (:func:`~sphereml.regularizers.rotations.group_rotations`).
    """
    layers = select_layers(model, include_output=include_output)
    for layer in layers:
        orthogonal_overparameterize(layer, method, **kwargs)
    group_rotations(model)
    return layers


def rotation_rates(model: nn.Module) -> list[Tensor]:
    """Per OPT layer of ``model`` (after a backward pass), each raw block's relative gradient ||dL/dU|| / ||U||
    (Frobenius), Tensor[blocks]: the relative size of an SGD step, so how fast each rotation turns for a
    scale-free map (``gs``, ``householder``, ``lowdin``; :class:`~sphereml.regularizers.rotations.OrthogonalRotation`).
    A shared PE-OPT block sums its k copies' gradients, so it turns faster than an independent one from the same
    start."""
    raws = [rotation_module(m).raw for m in opt_layers(model)]
    if any(raw.grad is None for raw in raws):
        raise ValueError("rotation_rates needs the gradients of a backward pass through every OPT layer")
    return [raw.grad.flatten(1).norm(dim=1) / raw.detach().flatten(1).norm(dim=1) for raw in raws]


def fixed_neurons(module: nn.Module) -> Tensor:
    """V of an OPT layer (the buffer, in the weight's shape)."""
    rotation_module(module)
    return module.parametrizations.weight.original


def merge(module: nn.Module) -> nn.Module:
    """Replace the parametrisation by a plain weight R V (inference costs nothing extra, §7.3.1)."""
    rotation_module(module)
    weight = module.weight.detach().clone()
    parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
    del module.weight
    module.weight = nn.Parameter(weight)
    return module


@torch.no_grad()
def resample(module: nn.Module, generator: torch.Generator | None = None) -> None:
    """S-OPT: fold the current rotation into V, restart R at the identity and draw a new subset."""
    rot = rotation_module(module)
    if rot.subset is None:
        raise ValueError("resample needs an S-OPT layer (orthogonal_overparameterize(..., subset=m))")
    module.parametrizations.weight.original.copy_(module.weight)
    rot.raw.copy_(torch.eye(rot.subset, dtype=rot.raw.dtype, device=rot.raw.device).expand_as(rot.raw))
    rot.dims.copy_(rot.draw_subset(generator))


class Resampler:
    """A ``fit`` callback: every ``every`` steps, :func:`resample` each S-OPT layer of ``model`` (an episode
    of the authors' S-OPT) and clear the optimiser's state (momentum) of their raw matrices."""

    def __init__(self, model: nn.Module, every: int, generator: torch.Generator | None = None):
        self.layers = [m for m in opt_layers(model) if rotation_module(m).subset is not None]
        if not self.layers:
            raise ValueError("the model has no S-OPT layer (orthogonal_overparameterize(..., subset=m))")
        self.every, self.generator = integer("every", every, at_least=1), generator
        self.episodes = 0

    def __call__(self, state) -> None:
        if state.step % self.every == 0:
            for layer in self.layers:
                resample(layer, self.generator)
                state.optimizer.state.pop(rotation_module(layer).raw, None)
            self.episodes += 1

    def state_dict(self) -> dict:
        """The episodes so far and the generator's state (a resumed chapter run restores them)."""
        return {"episodes": self.episodes,
                "generator": self.generator.get_state() if self.generator is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.episodes = state["episodes"]
        if self.generator is not None:
            self.generator.set_state(state["generator"])


def refine_neurons(v: Tensor, steps: int = 5000, lr: float = 0.01, s: float = 2.0, half_space: bool = True) -> Tensor:
    """V with its (half-space) energy lowered by ``steps`` of projected gradient descent, norms kept (§7.3.7).

    Each step moves the unit directions along -lr * N * grad E (E is a pair mean, so N * grad is
    the per-neuron force) and projects them back to the sphere; every neuron keeps its norm.  The
    thesis runs gradient descent for 5k iterations (§7.5.3) and gives no learning rate.
    """
    steps = integer("steps", steps, at_least=0)
    lr = real_number("lr", lr, above=0.0)
    flat = v.detach().flatten(1)
    norms = flat.norm(dim=1, keepdim=True)
    x = unit_rows(flat).clone().requires_grad_(True)
    for _ in range(steps):
        (grad,) = torch.autograd.grad(hyperspherical_energy(x, s, half_space=half_space), x)
        with torch.no_grad():
            x.copy_(unit_rows(x - lr * len(x) * grad))
    return (x.detach() * norms).reshape(v.shape)


class OrthogonalRelaxation(Regularizer):
    """beta * sum over the ``or`` layers of ||R^T R - I||_F (eq. 7.7; the authors' code: beta 0.1, unsquared).

    ``squared=True`` gives the squared norm that eq. 7.7 prints.
    """

    batches_seeds = True
    setting_names = ("beta", "squared")

    def __init__(self, model: nn.Module, beta: float = 0.1, squared: bool = False):
        self.beta = real_number("beta", beta, at_least=0.0)
        self.squared = bool(squared)
        self.layers = [m for m in opt_layers(model) if rotation_module(m).method == "or"]
        if not self.layers:
            raise ValueError("the model has no OPT layer with method='or'")

    def penalty(self) -> Tensor:
        """One product per block size: the raw blocks of same-sized layers concatenated."""
        total = 0.0
        for _, r in concatenated_groups([rotation_module(layer).raw for layer in self.layers]):  # (blocks, m, m)
            gap = torch.linalg.matrix_norm(r.mT @ r - torch.eye(r.shape[-1], dtype=r.dtype, device=r.device))
            total = total + (gap.pow(2) if self.squared else gap).sum()
        return total


class OrthogonalSGD(torch.optim.Optimizer):
    """SGD with momentum whose ``orthogonal=True`` groups move on the Cayley curve (thesis §7.3.5).

    An orthogonal group holds square matrices (or batches of them) that start orthogonal; each step
    builds the momentum m <- mu m - grad (a descent direction, Note [the sign of eq. 7.5] in
    :mod:`sphereml.regularizers.orthogonalizers`), moves along it with
    :func:`~sphereml.regularizers.orthogonalizers.cayley_sgd_step` and keeps the projected direction as the new
    momentum (the authors' ``opt_ogd``).  Other groups take the usual SGD step with momentum and
    weight decay (``torch.optim.SGD`` conventions, no dampening).

    Args:
        params: parameters or groups; a group may set ``orthogonal``, ``lr``, ``momentum``, ``weight_decay``.
        lr (float): step length. momentum (float): mu in [0, 1). weight_decay (float): plain groups only.
        iterations (int or None): fixed-point rounds of the Cayley step (None: its closed form,
            orthogonal to rounding; the rounds leave a drift that grows with the step). Default: 2.
    """

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 iterations: int | None = 2):
        defaults = {"lr": real_number("lr", lr, above=0.0),
                    "momentum": real_number("momentum", momentum, at_least=0.0, below=1.0),
                    "weight_decay": real_number("weight_decay", weight_decay, at_least=0.0),
                    "iterations": iterations if iterations is None else integer("iterations", iterations, at_least=1),
                    "orthogonal": False}
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["orthogonal"]:
                for p in group["params"]:
                    orth.check_square(p, "an orthogonal parameter")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["orthogonal"]:
                self._cayley_steps(params, group)
                continue
            if params:  # SGD with momentum, one launch per operation for the whole group
                grads = [p.grad for p in params]
                if group["weight_decay"]:
                    grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
                bufs = self._momenta(params)
                torch._foreach_mul_(bufs, group["momentum"])
                torch._foreach_add_(bufs, grads)
                torch._foreach_add_(params, bufs, alpha=-group["lr"])
        return loss

    def _momenta(self, params: list[Tensor]) -> list[Tensor]:
        """Each parameter's momentum buffer, zeros at the first step."""
        for p in params:
            if "momentum" not in self.state[p]:
                self.state[p]["momentum"] = torch.zeros_like(p)
        return [self.state[p]["momentum"] for p in params]

    def _cayley_steps(self, params: list[Tensor], group: dict) -> None:
        """The Cayley step of an orthogonal group's matrices, one call per matrix size (as the rotations are
        evaluated: Note [rotations evaluated together] in :mod:`~sphereml.regularizers.rotations`)."""
        for indices in groups_of_equal_size(params):
            ps = [params[i] for i in indices]
            bufs = self._momenta(ps)
            direction = _matrices(bufs).mul_(group["momentum"]).sub_(_matrices([p.grad for p in ps]))
            new, tangent = orth.cayley_sgd_step(_matrices(ps), direction, group["lr"], group["iterations"])
            sizes = [p.numel() // p.shape[-1] ** 2 for p in ps]
            torch._foreach_copy_(ps, [t.view_as(p) for t, p in zip(new.split(sizes), ps)])
            torch._foreach_copy_(bufs, [t.view_as(b) for t, b in zip(tangent.split(sizes), bufs)])


def _matrices(tensors: list[Tensor]) -> Tensor:
    """Tensors of m x m matrices (Tensor[..., m, m] each) concatenated into one Tensor[total, m, m]."""
    m = tensors[0].shape[-1]
    return torch.cat([t.reshape(-1, m, m) for t in tensors])


def ogd_optimizer(model: nn.Module, lr: float = 0.1, rotation_lr: float = 0.02, momentum: float = 0.9,
                  weight_decay: float = 0.0, iterations: int | None = 2) -> OrthogonalSGD:
    """:class:`OrthogonalSGD` for ``model``: the raw R of its ``ogd`` layers on the Cayley curve at
    ``rotation_lr`` (the authors' 0.02) with no weight decay, every other trainable parameter plain SGD."""
    rotations = [rotation_module(m).raw for m in opt_layers(model) if rotation_module(m).method == "ogd"]
    if not rotations:
        raise ValueError("the model has no OPT layer with method='ogd'")
    ids = {id(p) for p in rotations}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    groups = [{"params": rotations, "orthogonal": True, "lr": rotation_lr, "weight_decay": 0.0}]
    groups += [{"params": rest}] if rest else []
    return OrthogonalSGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay, iterations=iterations)


def training_parts(model: nn.Module, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                   rotation_lr: float | None = None, beta: float = 0.1):
    """What a model's OPT layers train with: ``(make_optimizer, regularizer)``.

    ``ogd`` layers need :func:`ogd_optimizer` (rotations at ``rotation_lr``, by default lr / 5: the authors'
    0.02 at lr 0.1), ``or`` layers the penalty :class:`OrthogonalRelaxation` (weight ``beta``); otherwise plain SGD
    with momentum and no regulariser.  ``make_optimizer(params)`` builds the optimizer, as
    :func:`~sphereml.train.fit` takes it (``optimizer=make_optimizer``); ``regularizer`` is None or the penalty.
    """
    methods = {rotation_module(m).method for m in opt_layers(model)}
    if "ogd" in methods:
        rate = lr / 5 if rotation_lr is None else real_number("rotation_lr", rotation_lr, above=0.0)

        def make_optimizer(params):  # the rotations and the rest of the model, in their own groups
            return ogd_optimizer(model, lr=lr, rotation_lr=rate, momentum=momentum, weight_decay=weight_decay)
    else:  # element-wise: seeds can train together (sphereml.multiseed.elementwise_optimizer)
        make_optimizer = partial(torch.optim.SGD, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return make_optimizer, (OrthogonalRelaxation(model, beta=beta) if "or" in methods else None)
