"""The rotation of an OPT layer, V -> V R^T (thesis eq. 7.1), and a model's rotations evaluated together.

:class:`OrthogonalRotation` is the parametrisation that :mod:`sphereml.regularizers.opt` registers on a layer's
weight; :func:`orthogonal_blocks` is its map from the learnt raw matrices to the orthogonal blocks of R.  On a GPU
that map, not the layer's product, is what an OPT training step pays for, which is why a model evaluates it for
all its layers at once (:func:`group_rotations`).

Note [rotations evaluated together]
    Gram-Schmidt by Cholesky (:func:`~sphereml.regularizers.orthogonalizers.cholesky_qr`, the GPU's form) costs a
    layer about 43 operations forward and backward, each a launch on a GPU (~25 µs) on small matrices: evaluated
    layer by layer, OPT's CNN-6 (Table F.1, width 64) took 379 operations per training step against a plain step's
    78, and its CNN-9 532 against 102.  A network has few distinct layer sizes (CNN-6 and CNN-9: d = 27, 576 and
    1024), and every map is batched over its leading dimension.  So :func:`group_rotations` hooks the smallest
    module that holds every OPT layer: before each of its forwards, the raw blocks of the layers that share a
    method and a block size are concatenated, the map is evaluated once on them, and each layer is handed its slice
    (``OrthogonalRotation.handed``); after the forward (errors included) the slices are dropped.  The gradient flows
    back through the concatenation to each layer's raw matrix.  An interrupt (KeyboardInterrupt) skips the release;
    the next forward hands over new blocks, and until then a layer used on its own takes its slice only if it was
    made from its current raw matrix (the same tensor, its version counter unchanged) with a gradient where one is
    wanted.  Changes that bypass the version counter (``.data``, fused optimisers) between an interrupted forward
    and such a use would go unseen.
    CNN-6 now takes 231 operations and CNN-9 270, three evaluations each (189 and 228 with the LQ backward written
    out, Note [the LQ backward]; counted on the CPU with the GPU's maps, ``tests/test_step_cost.py``).  What that
    buys in time is smaller for the factorisations: on an H200 the maps alone of CNN-6's rotations, forward and
    backward, took 8.6 ms layer by layer and 7.6 ms batched by shape (Cholesky-QR with autograd's backward; Cayley
    12.6 and 11.5 ms, ``exp_map`` 65.8 and 27.7 ms; ``benchmarks/results/logs/gpu-check-4-h200.txt``), so cuSOLVER's
    kernels, not their launches, set most of it.  A layer called on its own, or a weight read outside the model's
    forward, evaluates its own blocks: the same map on fewer matrices.  Every OPT layer under a hooked module is
    evaluated, whether its forward uses it or not.  Activation checkpointing around OPT layers needs
    :func:`ungroup_rotations` (its recomputation would evaluate the blocks that the forward was handed).  On the
    CPU, LAPACK factorises matrix by matrix either way (five SGD steps of a CNN-6 with each method ended on the same
    weights to the bit, 2026-12-05).
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from . import orthogonalizers as orth
from .._checks import integer, one_of, real_number

__all__ = ["METHODS", "ORTHOGONAL_BY_CONSTRUCTION", "CONDITIONED_STARTS", "orthogonal_blocks", "conditioned_start",
           "OrthogonalRotation", "rotation_module", "opt_layers", "group_rotations", "ungroup_rotations",
           "groups_of_equal_size", "concatenated_groups"]

METHODS = ("gs", "mgs", "householder", "lowdin", "cayley", "matrix_exp", "ogd", "or", "upt")
ORTHOGONAL_BY_CONSTRUCTION = ("gs", "mgs", "householder", "lowdin", "cayley", "matrix_exp")


def orthogonal_blocks(raw: Tensor, method: str, unrolled: bool = False) -> Tensor:
    """The orthogonal blocks R made from the learnt ``raw`` (Tensor[..., m, m]) by ``method`` (one of :data:`METHODS`,
    described in :mod:`sphereml.regularizers.opt`); ``ogd``, ``or`` and ``upt`` return ``raw`` itself.

    ``unrolled``: the loops of the thesis's Gram-Schmidt / Householder algorithms instead of one factorisation.
    """
    if method in ("gs", "mgs"):  # classic and modified Gram-Schmidt are one map: one QR unless unrolled
        return orth.gram_schmidt(raw, modified=method == "mgs") if unrolled else orth.qr_orthogonalize(raw)
    if method == "householder":
        return orth.householder(raw) if unrolled else orth.qr_orthogonalize(raw, rows=False)
    if method == "lowdin":
        return orth.lowdin(raw)
    if method == "cayley":
        return orth.cayley(orth.skew(raw))
    if method == "matrix_exp":
        return orth.exp_map(orth.skew(raw))
    one_of("method", method, METHODS)
    return raw  # ogd, or, upt


#: The scale-free maps that can start from a well-conditioned raw matrix (``orthogonal_start``).
CONDITIONED_STARTS = ("gs", "mgs", "householder", "lowdin")


def conditioned_start(raw: Tensor, method: str) -> Tensor:
    """A well-conditioned raw matrix with the rotation ``raw`` (Tensor[..., m, m]) maps to by ``method`` (one of
    :data:`CONDITIONED_STARTS`): r R, r the draw's root-mean-square row norm; for ``lowdin`` r R diag(s), with s
    spread evenly over [1/2, 3/2] and scaled to a root mean square of 1, whose polar factor is still R (Note [the
    raw matrix's conditioning])."""
    one_of("method", method, CONDITIONED_STARTS)
    start = orthogonal_blocks(raw, method) * raw.norm(dim=-1).pow(2).mean(-1).sqrt()[..., None, None]
    if method == "lowdin":
        spread = torch.linspace(0.5, 1.5, raw.shape[-1], dtype=raw.dtype, device=raw.device)
        start = start * (spread / spread.pow(2).mean().sqrt())
    return start


class OrthogonalRotation(nn.Module):
    """The parametrisation V -> V R^T of a weight with ``dim`` inputs per neuron (thesis eq. 7.1).

    Args:
        dim (int): d, the length of a flattened neuron (``in_features`` or C_in * k * k).
        method (str): one of :data:`METHODS` (:mod:`sphereml.regularizers.opt`). Default: ``"gs"``.
        blocks (int): k, the number of diagonal blocks of R (PE-OPT, eqs. F.33-F.34); must divide d.
            Block i rotates the contiguous coordinates i d/k .. (i+1) d/k - 1 of each neuron: for a
            conv kernel flattened as (C_in, k, k), a group of input channels. Default: 1.
        shared (bool): one block shared by all k (R_s, d^2/k^2 parameters); else k independent
            blocks (R_u, d^2/k). Default: False.
        subset (int, optional): S-OPT: rotate only this many randomly drawn coordinates (R of that
            size, started at the identity); see :func:`~sphereml.regularizers.opt.resample`. Default: None (all d).
        unrolled (bool): ``gs`` / ``mgs`` / ``householder``: the unrolled loops instead of one QR. Default: False.
        generator (torch.Generator, optional): draws the initial raw matrix and the subset.
        raw_std (float or "unit"): standard deviation of the initial raw entries; ``"unit"``: 1 / sqrt(m)
            for blocks of m = d / k rows, so that each raw row starts near unit norm. Default: 1 (the thesis).
        orthogonal_start (bool): ``gs``, ``mgs``, ``householder``, ``lowdin``: start the raw matrix at the
            rotation its Gaussian draw maps to, times the draw's root-mean-square row norm r (about raw_std sqrt(m));
            for ``lowdin`` with singular values spread evenly, the largest three times the smallest, at a root mean
            square of r (:func:`conditioned_start`, Note [the raw matrix's conditioning]). Default: False (the
            thesis's Gaussian raw matrix).

    The raw matrix starts as the thesis's N(0, 1) draw (App. F.3); ``ogd`` at the identity (the
    authors' code); ``or`` and ``upt`` at a random orthogonal matrix, so every method starts from a
    rotation of V; S-OPT at the identity.  ``gs``, ``mgs``, ``householder`` and ``lowdin`` give the
    same R for c U as for U (c > 0), so the gradient with respect to U scales as 1 / c and an SGD step
    turns R about lr / c^2 as fast: ``raw_std`` is an effective learning rate of the rotation.

    Note [the raw matrix's conditioning]
        The scale is not the only rate.  A square Gaussian raw matrix with rows of norm r is ill-conditioned (its
        smallest singular value is about r / m, an orthogonal one's r), and the derivatives of the QR and polar
        maps grow with the inverse of the raw matrix's singular values: a step on the raw matrix turns R far more
        than lr / r^2 in the directions its small singular values govern.  Started at r times the same rotation
        (``orthogonal_start``) the QR map is as well conditioned as it can be, and R turns at about lr / r^2.
        Measured on chapter 7's CNN-9 (16/32/64 channels, rows of norm r = the neurons' mean length), one SGD step
        at rate 0.1 turned a hidden neuron by 23.2 degrees on average from the Gaussian raw matrices, 1.9 from the
        same rotations started orthogonal, and 1.6 in the plain network (2026-12-06).  Löwdin's polar map cannot
        start at an orthogonal raw matrix (its SVD's and eigendecomposition's gradients divide by differences of
        singular values), so it starts at R diag(s), s spread evenly from s_min to 3 s_min at a root mean square of
        r: the same rotation R, a condition number of 3, and a derivative bounded by 1 / s_min.  Chapter 9's MLP
        (rate 0.01) and CNN-6 (rate 0.1), one SGD step, seeds 0-2: a hidden neuron turned by 6.0 and 21.7 degrees
        (GS) and 2.7 and 12.3 (Löwdin) from Gaussian raw matrices with unit rows; 0.041 and 2.07 (GS), 0.028 and
        1.28 (Löwdin) from the conditioned start; 0.069 and 1.65 (GS) from the thesis's N(0, 1) draw, whose scale
        slows it by about m as its conditioning speeds it up; 0.023 and 0.84 in the plain networks (2026-12-06).
    """

    def __init__(self, dim: int, method: str = "gs", blocks: int = 1, shared: bool = False,
                 subset: int | None = None, unrolled: bool = False, generator: torch.Generator | None = None,
                 raw_std: float | str = 1.0, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, orthogonal_start: bool = False):
        super().__init__()
        self.dim = integer("dim", dim, at_least=1)
        self.method = one_of("method", method, METHODS)
        self.blocks = integer("blocks", blocks, at_least=1, at_most=dim)
        if dim % blocks:
            raise ValueError(f"blocks must divide the neuron dimension {dim}, got {blocks}")
        self.shared, self.unrolled = bool(shared), bool(unrolled)
        self.subset = None if subset is None else integer("subset", subset, at_least=1, at_most=dim)
        if orthogonal_start and method not in CONDITIONED_STARTS:
            raise ValueError(f"orthogonal_start needs a method of {CONDITIONED_STARTS}, got {method!r}")
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
            elif orthogonal_start:
                raw = conditioned_start(raw, method)
        self.raw = nn.Parameter(raw)  # (count, m, m)
        self.handed: tuple | None = None  # (blocks, raw, raw's version) handed over by a model's forward
        if self.subset is not None:
            self.register_buffer("dims", self.draw_subset(generator))

    def draw_subset(self, generator: torch.Generator | None = None) -> Tensor:
        """A sorted random subset of ``subset`` of the d coordinates (S-OPT)."""
        return torch.randperm(self.dim, generator=generator)[:self.subset].sort().values.to(self.raw.device)

    def blocks_of_r(self) -> Tensor:
        """The orthogonal blocks, Tensor[count, m, m] (one when shared or S-OPT): handed over by the model's forward
        (Note [rotations evaluated together]) or evaluated here."""
        handed = self.handed_over()
        return handed if handed is not None else orthogonal_blocks(self.raw, self.method, self.unrolled)

    def handed_over(self) -> Tensor | None:
        """The blocks a model's forward handed over, if they were made from the current ``raw`` (the same tensor, not
        changed in place since) with a gradient wherever one is wanted now; else None (Note [rotations evaluated
        together])."""
        handed = getattr(self, "handed", None)  # a module pickled before the attribute existed has none
        if handed is None:
            return None
        blocks, raw, version = handed
        if raw is not self.raw:
            return None
        if torch.compiler.is_compiling():  # blocks made in this trace carry no version; eager ones are refused
            return blocks if version is None else None
        if version is None or _version(raw) != version:
            return None
        if torch.is_grad_enabled() and raw.requires_grad and not blocks.requires_grad:  # made under no_grad
            return None
        return blocks

    def __getstate__(self):
        """Copies and pickles never carry handed-over blocks (a non-leaf tensor, which ``deepcopy`` refuses)."""
        return {**super().__getstate__(), "handed": None}

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


def groups_of_equal_size(tensors: list[Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` (Tensor[..., m, m] each) grouped by m, dtype and device, so that each group can be
    concatenated along its first dimension: in order of first appearance."""
    groups = defaultdict(list)
    for i, t in enumerate(tensors):
        groups[(t.shape[-1], t.dtype, t.device)].append(i)
    return list(groups.values())


def concatenated_groups(tensors: list[Tensor]) -> list[tuple[list[int], Tensor]]:
    """:func:`groups_of_equal_size` with each group's tensors concatenated along the first dimension (a group of one
    is the tensor itself): ``(indices, Tensor[total, m, m])`` per group."""
    return [(group, torch.cat([tensors[i] for i in group]) if len(group) > 1 else tensors[group[0]])
            for group in groups_of_equal_size(tensors)]


def group_rotations(model: nn.Module) -> nn.Module:
    """Evaluate the rotations of ``model``'s OPT layers together at each forward: one call of the map per method and
    block size (Note [rotations evaluated together]).  The hooks go on the smallest module that holds every OPT layer
    (a ``Classifier``'s backbone, which ``Classifier.loss_and_logits``, the path :func:`~sphereml.train.fit` trains
    through, calls without calling the classifier).  Returns ``model``; calling it again changes nothing.
    :func:`~sphereml.regularizers.opt.overparameterize_model` calls it; call it yourself after OPT-ing layers one by
    one, and :func:`ungroup_rotations` before wrapping OPT layers in activation checkpointing."""
    layers = {id(layer) for layer in opt_layers(model)}
    paths = [name.split(".")[:-1] for name, m in model.named_modules() if id(m) in layers]  # each layer's parent
    if not paths:
        return model
    scope = model.get_submodule(".".join(os.path.commonprefix(paths)))  # commonprefix compares lists item by item
    if not any(hook is _evaluate_together for hook in scope._forward_pre_hooks.values()):
        scope.register_forward_pre_hook(_evaluate_together)
        scope.register_forward_hook(_release, always_call=True)
    return model


def ungroup_rotations(model: nn.Module) -> nn.Module:
    """Remove :func:`group_rotations`' hooks from ``model`` and its modules: each layer evaluates its own rotation
    again.  Activation checkpointing (``torch.utils.checkpoint``) around OPT layers needs this, since its
    recomputation evaluates a layer's rotation inside the checkpointed region, where the forward was handed it."""
    for module in model.modules():
        for hooks, ours in ((module._forward_pre_hooks, _evaluate_together), (module._forward_hooks, _release)):
            for key in [key for key, hook in hooks.items() if hook is ours]:
                del hooks[key]
                module._forward_hooks_always_called.pop(key, None)
    return model


def _version(t: Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place change); None for inference tensors, which keep none, and
    while compiling, where a hand-over never outlives its graph."""
    return None if torch.compiler.is_compiling() or t.is_inference() else t._version


def _rotations(scope: nn.Module) -> list[OrthogonalRotation]:
    return [m for m in scope.modules() if isinstance(m, OrthogonalRotation)]


def _evaluate_together(scope: nn.Module, args) -> None:
    """Forward pre-hook: hand each rotation under ``scope`` its blocks, evaluated with those of the same method and
    size from the current raw matrices."""
    by_method = defaultdict(list)
    for rot in _rotations(scope):
        if rot.method in ORTHOGONAL_BY_CONSTRUCTION:
            by_method[(rot.method, rot.unrolled)].append(rot)
    for (method, unrolled), rots in by_method.items():
        for group, raw in concatenated_groups([rot.raw for rot in rots]):
            blocks = orthogonal_blocks(raw, method, unrolled)
            for i, r in zip(group, blocks.split([len(rots[i].raw) for i in group])):
                rots[i].handed = (r, rots[i].raw, _version(rots[i].raw))


def _release(scope: nn.Module, args, output) -> None:
    """Forward hook, called after errors too: the handed-over blocks are dropped (the next step's raw differs).  An
    interrupt (KeyboardInterrupt) skips it: the next forward of ``scope`` hands over new blocks, and a layer used
    outside it before then refuses blocks made from another raw (:meth:`OrthogonalRotation.handed_over`)."""
    for rot in _rotations(scope):
        rot.handed = None
