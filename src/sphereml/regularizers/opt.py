"""Orthogonal over-parameterised training, OPT (thesis Ch. 7, App. F).

A layer's neurons are the rows of its flattened weight W (Tensor[n, d]).  OPT fixes them at a
random V and learns one orthogonal R per layer that rotates them all together, w_i = R v_i
(eq. 7.1), so W = V R^T.  A joint rotation keeps every pairwise angle, hence the hyperspherical
energy of the neurons, exactly as initialised (eq. 7.2)::

    layer = nn.Conv2d(64, 64, 3, padding=1)
    orthogonal_overparameterize(layer, method="gs")   # layer.weight is now V R^T
    layer.parametrizations.weight.original            # V: a buffer, never trained
    layer.parametrizations.weight[0].raw              # the learnt matrix that R is made from

The parametrisation is :class:`OrthogonalRotation` (``torch.nn.utils.parametrize``), so
``layer.weight`` stays the effective weight and the layer works wherever a plain one does.
Methods (how R is made from the learnt ``raw``; :mod:`sphereml.regularizers.orthogonalizers`):

* ``gs`` / ``mgs`` — Gram-Schmidt on the rows of raw (classic / modified: the same map);
* ``householder`` — Householder QR of raw (stable reflections);
* ``lowdin`` — the polar factor of raw (Löwdin's symmetric orthogonalisation);
* ``cayley`` / ``matrix_exp`` — Cayley transform / exponential of the skew part of raw;
* ``ogd`` — raw *is* R, kept orthogonal by :class:`OrthogonalSGD` (eqs. 7.5-7.6);
* ``or`` — raw is R, unconstrained, pulled towards orthogonality by :class:`OrthogonalRelaxation`
  (eq. 7.7); ``upt`` — raw is R with no constraint at all (the ablation of Table 7.1).

``gs``, ``mgs`` and ``householder`` run through one LAPACK QR call; ``unrolled=True`` runs the loops of
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

__all__ = [
    "METHODS", "ORTHOGONAL_BY_CONSTRUCTION", "OrthogonalRotation", "orthogonal_overparameterize",
    "overparameterize_model", "rotation_module", "opt_layers", "rotation_rates", "fixed_neurons", "merge",
    "resample", "Resampler", "refine_neurons", "OrthogonalRelaxation", "OrthogonalSGD", "ogd_optimizer",
    "training_parts",
]

METHODS = ("gs", "mgs", "householder", "lowdin", "cayley", "matrix_exp", "ogd", "or", "upt")
ORTHOGONAL_BY_CONSTRUCTION = ("gs", "mgs", "householder", "lowdin", "cayley", "matrix_exp")
REFINEMENTS = (None, "mhe", "hs_mhe")
SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class OrthogonalRotation(nn.Module):
    """The parametrisation V -> V R^T of a weight with ``dim`` inputs per neuron (thesis eq. 7.1).

    Args:
        dim (int): d, the length of a flattened neuron (``in_features`` or C_in * k * k).
        method (str): one of :data:`METHODS` (module docstring). Default: ``"gs"``.
        blocks (int): k, the number of diagonal blocks of R (PE-OPT, eqs. F.33-F.34); must divide d.
            Block i rotates the contiguous coordinates i d/k .. (i+1) d/k - 1 of each neuron: for a
            conv kernel flattened as (C_in, k, k), a group of input channels. Default: 1.
        shared (bool): one block shared by all k (R_s, d^2/k^2 parameters); else k independent
            blocks (R_u, d^2/k). Default: False.
        subset (int, optional): S-OPT: rotate only this many randomly drawn coordinates (R of that
            size, started at the identity); see :func:`resample`. Default: None (all d).
        unrolled (bool): ``gs`` / ``mgs`` / ``householder``: the unrolled loops instead of one QR. Default: False.
        generator (torch.Generator, optional): draws the initial raw matrix and the subset.
        raw_std (float or "unit"): standard deviation of the initial raw entries; ``"unit"``: 1 / sqrt(m)
            for blocks of m = d / k rows, so that each raw row starts near unit norm. Default: 1 (the thesis).

    The raw matrix starts as the thesis's N(0, 1) draw (App. F.3); ``ogd`` at the identity (the
    authors' code); ``or`` and ``upt`` at a random orthogonal matrix, so every method starts from a
    rotation of V; S-OPT at the identity.  ``gs``, ``mgs``, ``householder`` and ``lowdin`` give the
    same R for c U as for U (c > 0), so the gradient with respect to U scales as 1 / c and an SGD step
    turns R about lr / c^2 as fast: ``raw_std`` is an effective learning rate of the rotation.
    """

    def __init__(self, dim: int, method: str = "gs", blocks: int = 1, shared: bool = False,
                 subset: int | None = None, unrolled: bool = False, generator: torch.Generator | None = None,
                 raw_std: float | str = 1.0, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.dim = integer("dim", dim, at_least=1)
        self.method = one_of("method", method, METHODS)
        self.blocks = integer("blocks", blocks, at_least=1, at_most=dim)
        if dim % blocks:
            raise ValueError(f"blocks must divide the neuron dimension {dim}, got {blocks}")
        self.shared, self.unrolled = bool(shared), bool(unrolled)
        self.subset = None if subset is None else integer("subset", subset, at_least=1, at_most=dim)
        if self.subset is not None and (blocks > 1 or method == "lowdin"):
            raise ValueError("subset (S-OPT) rotates one block and needs a method other than 'lowdin' "
                             "(the SVD's gradient is undefined at its identity start)")
        size = self.subset or dim // blocks
        count = 1 if (shared or self.subset) else blocks
        kw = {"dtype": dtype, "device": device}
        if self.subset is not None or method == "ogd":
            raw = torch.eye(size, **kw).repeat(count, 1, 1)
        else:
            raw = torch.randn(count, size, size, generator=generator, **kw)
            raw = raw * (size**-0.5 if raw_std == "unit" else real_number("raw_std", raw_std, above=0.0))
            if method in ("or", "upt"):
                raw = orth.qr_orthogonalize(raw)
        self.raw = nn.Parameter(raw)  # (count, m, m)
        if self.subset is not None:
            self.register_buffer("dims", self.draw_subset(generator))

    def draw_subset(self, generator: torch.Generator | None = None) -> Tensor:
        """A sorted random subset of ``subset`` of the d coordinates (S-OPT)."""
        return torch.randperm(self.dim, generator=generator)[:self.subset].sort().values.to(self.raw.device)

    def blocks_of_r(self) -> Tensor:
        """The orthogonal blocks, Tensor[count, m, m] (one when shared or S-OPT)."""
        raw, method = self.raw, self.method
        if method in ("gs", "mgs"):  # classic and modified Gram-Schmidt are one map: one QR unless unrolled
            if self.unrolled:
                return orth.gram_schmidt(raw, modified=method == "mgs")
            return orth.qr_orthogonalize(raw)
        if method == "householder":
            return orth.householder(raw) if self.unrolled else orth.qr_orthogonalize(raw, rows=False)
        if method == "lowdin":
            return orth.lowdin(raw)
        if method == "cayley":
            return orth.cayley(orth.skew(raw))
        if method == "matrix_exp":
            return orth.exp_map(orth.skew(raw))
        return raw  # ogd, or, upt

    def rotation(self) -> Tensor:
        """R as one Tensor[d, d] (block-diagonal, or the identity with the S-OPT block): for analysis."""
        blocks = self.blocks_of_r()
        if self.subset is not None:
            r = torch.eye(self.dim, dtype=blocks.dtype, device=blocks.device)
            r[self.dims[:, None], self.dims[None, :]] = blocks[0]
            return r
        return torch.block_diag(*blocks.expand(self.blocks, -1, -1))

    def forward(self, v: Tensor) -> Tensor:
        flat = v.flatten(1)  # (n, d): one neuron per row
        r = self.blocks_of_r()
        if self.subset is not None:
            out = flat.index_copy(1, self.dims, flat[:, self.dims] @ r[0].mT)
        else:
            parts = flat.unflatten(1, (self.blocks, -1)).transpose(0, 1)  # (k, n, d/k)
            out = (parts @ r.expand(self.blocks, -1, -1).mT).transpose(0, 1)  # w_i = R v_i per block
        return out.reshape(v.shape)

    def extra_repr(self) -> str:
        extra = f", subset={self.subset}" if self.subset else ""
        return f"dim={self.dim}, method={self.method!r}, blocks={self.blocks}, shared={self.shared}{extra}"


def orthogonal_overparameterize(module: nn.Module, method: str = "gs", *, blocks: int = 1, shared: bool = False,
                                subset: int | None = None, normalize: bool = False, refine: str | None = None,
                                refine_steps: int = 5000, unrolled: bool = False,
                                generator: torch.Generator | None = None, raw_std: float | str = 1.0) -> nn.Module:
    """Make ``module.weight`` the fixed neurons V (its current value) rotated by a learnt orthogonal R.

    Args:
        module (nn.Linear or nn.Conv1d/2d/3d): changed in place and returned; its bias stays a plain
            parameter.  Initialise its weight first (the thesis: Kaiming or Xavier normal).
        method, blocks, shared, subset, unrolled, generator, raw_std: see :class:`OrthogonalRotation`.
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
                                  dtype=v.dtype, device=v.device)
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
    :func:`orthogonal_overparameterize` (one ``generator`` draws every layer in order).
    """
    layers = select_layers(model, include_output=include_output)
    for layer in layers:
        orthogonal_overparameterize(layer, method, **kwargs)
    return layers


def rotation_module(module: nn.Module) -> OrthogonalRotation:
    """The :class:`OrthogonalRotation` of an OPT layer (ValueError for any other module)."""
    if parametrize.is_parametrized(module, "weight"):
        for p in module.parametrizations.weight:
            if isinstance(p, OrthogonalRotation):
                return p
    raise ValueError(f"{type(module).__name__} has no OPT parametrisation on its weight")


def opt_layers(model: nn.Module) -> list[nn.Module]:
    """The OPT layers of ``model``, in module order."""
    return [m for m in model.modules() if parametrize.is_parametrized(m, "weight")
            and any(isinstance(p, OrthogonalRotation) for p in m.parametrizations.weight)]


def rotation_rates(model: nn.Module) -> list[Tensor]:
    """Per OPT layer of ``model`` (after a backward pass), each raw block's relative gradient ||dL/dU|| / ||U||
    (Frobenius), Tensor[blocks]: the relative size of an SGD step, so how fast each rotation turns for a
    scale-free map (``gs``, ``householder``, ``lowdin``; :class:`OrthogonalRotation`).  A shared PE-OPT block
    sums its k copies' gradients, so it turns faster than an independent one from the same start."""
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
        total = 0.0
        for layer in self.layers:
            r = rotation_module(layer).raw
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
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                if group["orthogonal"]:
                    buf.mul_(group["momentum"]).sub_(p.grad)
                    new, tangent = orth.cayley_sgd_step(p, buf, group["lr"], group["iterations"])
                    p.copy_(new)
                    buf.copy_(tangent)
                else:
                    grad = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad
                    buf.mul_(group["momentum"]).add_(grad)
                    p.sub_(buf, alpha=group["lr"])
        return loss


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
