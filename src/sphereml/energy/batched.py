"""Many point sets' energies in one evaluation, with no host synchronisation: the engine of the regularisers.

MHE, CoMHE and the measurements of chapters 6, 7 and 9 need the energy of every layer of a network at
once, often at every training step.  Calling :func:`~sphereml.energy.hyperspherical_energy` once per
layer (or per projection, or per channel group) costs tens of kernel launches and a few device
synchronisations each (Note [close pairs] gathers close pairs with ``nonzero``); on a GPU that, not the
arithmetic, is the time.  This module evaluates any number of point sets with a number of operations
that depends only on how many distinct *shapes* they have.

Note [batched energy]
    (1) *Gram matrices in float64.*  Sets of equal dimension d are stacked into one Tensor[B, N, d] (a set with n <
    N points is padded with zero rows; on an accelerator sets of several dimensions share a block, padded with zero
    columns too, Note [blocks by device] in :mod:`~sphereml.energy.packing`) and one batched product gives their
    Gram matrices G = X X^T, in float64 whatever the input dtype.  Normalisation comes after the product and costs
    nothing extra: cos_ij = g_ij / (n_i n_j) with n_i = max(sqrt(g_ii), 1e-12), the floor of
    :func:`~sphereml.geometry.normalize`.  In float64 the Gram estimate of a squared distance, r^2 = S_i + S_j - 2
    cos_ij (S_i = 1, or 0 for a zero row), carries an absolute error of a few units of 2^-53 instead of float32's
    2^-24, so a pair at the floor r^2 = eps = 1e-7 is resolved to about 1e-8 relative: close pairs need no
    recomputation from differences, hence no ``nonzero``. The products of float32 entries are exact in float64, and
    float64 squares neither overflow nor underflow for entries between 1e-150 and 1e150, so no max-abs rescaling is
    needed either. For float64 input the Gram estimate is less exact than the differences of
    :mod:`~sphereml.energy.dense` (r^2 to about 1e-15 absolute rather than relative): within 1e-12 relative of it
    unless two neurons are closer than about 2 degrees (r^2 < 1e-3).
    (2) *Half space without doubling.*  The virtual neurons -w_j of §5.3.4 are never built: the pair
    (w_i, -w_j) has r^2 = S_i + S_j + 2 cos_ij, from the same Gram matrix, and contributes with (i, i)
    included (the pair of a neuron and its own negative).  The 2n (2n - 1) ordered pairs of the 2n
    points are 2 n (n - 1) of each sign plus 2 n antipodal ones.
    (3) *One weighted sum.*  Gram matrices of equal size N are concatenated, and one chain of
    element-wise operations evaluates every pair; a constant Tensor[B, N, N] gives each pair its share
    of its set's energy (1 / (n (n - 1)) for a pair mean; 0 on the diagonal and on padding), so a
    set's energy is one weighted sum and no boolean mask or data-dependent shape appears.
    Floors (Note [energy floor]) act as in every backend: r^2 >= eps, and for the angular metric
    theta = arccos(cos) with the cosine clamped to ``|cos| <= 1 - eps/2``; in float64 the arccos of a close
    pair loses no more than the Gram estimate does, so it needs no arcsine branch either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .._autograd import Function
from .._checks import one_of, real_number
from ..launches import on_accelerator  # Note [blocks by device]; tests make it say True
from .gram import gram_energies
from .kernels import METRICS
from .packing import DeviceCache, WeightPacking, column_groups

__all__ = ["REDUCTIONS", "MERGE_WASTE", "ACCELERATOR_MERGE_WASTE", "ACCELERATOR_COLUMN_WASTE", "MERGE_MAX", "buckets",
           "PointSets", "pair_weights", "SetEnergies", "LayerEnergies", "on_accelerator"]

REDUCTIONS = ("pair_mean", "pair_sum")


@dataclass(frozen=True)
class PointSets:
    """The static description of a block of point sets, Tensor[B, N, d] (Note [batched energy]).

    Attributes:
        rows (int): N, the padded number of points per set.
        sizes (tuple[int]): n_b <= N, the real points of each of the B sets (rows n_b .. N-1 are zero).
        half_space (tuple[bool]): per set, whether the virtual neurons -w_j join it (§5.3.4).
    """

    rows: int
    sizes: tuple[int, ...]
    half_space: tuple[bool, ...]

    def __post_init__(self):
        if len(self.sizes) != len(self.half_space):
            raise ValueError(f"sizes and half_space must have one entry per set, got {len(self.sizes)} "
                             f"and {len(self.half_space)}")
        for n, half in zip(self.sizes, self.half_space):
            if not 1 <= n <= self.rows or (n < 2 and not half):
                raise ValueError(f"every set needs 2 <= n <= {self.rows} points (1 in half space), got {n}")


def pair_weights(sets: PointSets, reduction: str, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Each pair's share of its set's energy (float64): Tensor[B, N, N] for the pairs (w_i, w_j), i != j, and
    Tensor[B, N, N] for the pairs (w_i, -w_j) of the half-space sets (zero for full-space sets)."""
    shares, plus_shares = [], []
    for n, half in zip(sets.sizes, sets.half_space):
        points = 2 * n if half else n
        share = 1.0 / (points * (points - 1)) if reduction == "pair_mean" else 1.0
        copies = 2.0 if half else 1.0  # (w_i, w_j) and (-w_i, -w_j); (w_i, -w_j) and (-w_i, w_j)
        shares.append(copies * share)
        plus_shares.append(copies * share if half else 0.0)
    index = torch.arange(sets.rows, device=device)
    real = index < torch.tensor(sets.sizes, device=device)[:, None]  # (B, N): rows that are points
    pairs = (real[:, :, None] & real[:, None, :]).to(torch.float64)  # (B, N, N)
    distinct = (index[:, None] != index[None, :]).to(torch.float64)  # (N, N): i != j
    share_of = torch.tensor(shares, dtype=torch.float64, device=device)[:, None, None]
    plus_of = torch.tensor(plus_shares, dtype=torch.float64, device=device)[:, None, None]
    return share_of * pairs * distinct, plus_of * pairs


class SetEnergies:
    """The energies of blocks of point sets (:class:`PointSets`), each call one batched evaluation.

    Every block gets its Gram matrices from one batched product; blocks are then gathered into
    *buckets* evaluated together, a block's Gram matrices zero-padded to its bucket's size N
    (:func:`buckets`: as few buckets as keep the padded pairs within ``MERGE_WASTE`` times the real
    ones, ``ACCELERATOR_MERGE_WASTE`` on a GPU; on a CPU, where copying is dear and launches cheap, a block
    above ``MERGE_MAX`` pairs stays alone).  Built once from the static shapes; buckets and pair weights are
    made once per device (:meth:`prepare`).

    Args:
        blocks (sequence of PointSets): the blocks, in the order :meth:`__call__` receives them.
        s (float), metric (str), eps (float): as :func:`~sphereml.energy.hyperspherical_energy`.
        reduction (str): ``"pair_mean"`` (eq. 5.4's mean over ordered pairs) or ``"pair_sum"`` (eq. 5.1's
            sum). Default: ``"pair_mean"``.
    """

    def __init__(self, blocks: Sequence[PointSets], s: float = 2.0, metric: str = "euclidean", eps: float = 1e-7,
                 reduction: str = "pair_mean"):
        self.blocks = tuple(blocks)
        if not self.blocks:
            raise ValueError("blocks must describe at least one block of point sets")
        self.s = real_number("s", s, at_least=0.0)
        self.metric = one_of("metric", metric, METRICS)
        self.eps = real_number("eps", eps, above=0.0, below=1.0)
        self.reduction = one_of("reduction", reduction, REDUCTIONS)
        self._weights: dict = {}  # device -> (buckets, one (minus, plus or None) per bucket)

    def prepare(self, device: torch.device) -> tuple[list, list[tuple[Tensor, Tensor | None]]]:
        """The buckets and pair weights for ``device`` (made there once; call it outside ``torch.compile``)."""
        device = torch.device(device)
        if device not in self._weights:
            cpu = not on_accelerator(device)
            groups = buckets([(block.rows, len(block.sizes)) for block in self.blocks],
                             MERGE_WASTE if cpu else ACCELERATOR_MERGE_WASTE, MERGE_MAX if cpu else float("inf"))
            weights = []
            for rows, members in groups:
                parts = [pair_weights(_padded(self.blocks[i], rows), self.reduction, device) for i in members]
                minus = torch.cat([m for m, _ in parts])
                half = any(any(self.blocks[i].half_space) for i in members)
                plus = torch.cat([p for _, p in parts]) if half else None
                weights.append((minus, plus))
            self._weights[device] = groups, weights
        return self._weights[device]

    def __call__(self, points: Sequence[Tensor]) -> list[Tensor]:
        """Energies of every set.

        Args:
            points (sequence of Tensor[B, N, d]): one float64 tensor per block, as described by ``blocks``
                (zero rows beyond each set's size).

        Returns:
            list of Tensor[B] (float64), one per block.
        """
        return self._split(self._evaluate(points))

    def joined(self, points: Sequence[Tensor]) -> Tensor:
        """Every set's energy as one Tensor[sum of B] (float64), blocks in order: :meth:`__call__` concatenated, or,
        when one bucket holds every block in order, that bucket's energies themselves (no split, no concatenation:
        an operation fewer each way)."""
        evaluated = self._evaluate(points)
        if len(evaluated) == 1 and evaluated[0][0] == list(range(len(self.blocks))):
            return evaluated[0][1]
        return torch.cat(self._split(evaluated))

    def _split(self, evaluated: list[tuple[list[int], Tensor]]) -> list[Tensor]:
        """Each block's energies, in block order, from :meth:`_evaluate`'s buckets."""
        out: list[Tensor | None] = [None] * len(self.blocks)
        for members, energies in evaluated:
            for i, part in zip(members, energies.split([len(self.blocks[i].sizes) for i in members])):
                out[i] = part
        return out

    def _evaluate(self, points: Sequence[Tensor]) -> list[tuple[list[int], Tensor]]:
        """(block indices, their sets' energies) of each bucket."""
        if len(points) != len(self.blocks):
            raise ValueError(f"expected {len(self.blocks)} blocks of points, got {len(points)}")
        groups, weights = self.prepare(points[0].device)
        out = []
        for (minus, plus), (rows, members) in zip(weights, groups):
            grams = [_pad_square(_SymmetricGram.apply(points[i]), rows) for i in members]  # (B_i, N, N) each
            out.append((members, gram_energies(grams[0] if len(grams) == 1 else torch.cat(grams), minus, plus, self.s,
                                               self.metric, self.eps)))
        return out


MERGE_WASTE = 1.5  # buckets() on a CPU: at most this many padded pairs per real pair, summed over the blocks

# buckets() on an accelerator, where a bucket's ~25 launches (forward and backward, ~150 us) outweigh the padding's
# element-wise passes (~30 passes over 8-byte pairs: ~0.1 us per thousand pairs at 3 TB/s) for every network here;
# an estimate from those figures, not a timing
ACCELERATOR_MERGE_WASTE = 4.0


# packing.column_groups() on an accelerator: a block shared by several fan-ins does at most this many times its
# weights' own Gram arithmetic (None: one block per fan-in, as on a CPU).  An estimate, not a timing: each block
# merged saves about four launches (~80 us of an H200 host's time in the eager steps of 2026-11-27), and 1 GFLOP of
# float64 products takes ~30 us on its tensor cores
ACCELERATOR_COLUMN_WASTE = 3.0


MERGE_MAX = 2**22  # buckets(): a block with more pairs than this (32 MiB of float64) is evaluated alone


def buckets(blocks: Sequence[tuple[int, int]], waste: float = MERGE_WASTE,
            largest: float = MERGE_MAX) -> list[tuple[int, list[int]]]:
    """Group blocks (rows N, sets B) into buckets of one size each: a list of (bucket size, block indices).

    Sizes are taken largest first; a block joins the current (larger) bucket while the padded pairs
    of everything assigned so far stay within ``waste`` times the real pairs, else it opens a bucket
    of its own size.  Fewer buckets mean fewer operations per step (one chain of element-wise
    operations each); the bound keeps the padding's extra arithmetic small on a CPU.  A block of more
    than ``largest`` pairs stays alone: copying it into a bucket would cost more than the launches saved.
    """
    out: list[tuple[int, list[int]]] = []
    real = padded = 0
    current = None  # the bucket that smaller blocks may join
    for index in sorted(range(len(blocks)), key=lambda i: -blocks[i][0]):
        rows, sets = blocks[index]
        pairs = sets * rows * rows
        if pairs > largest:
            out.append((rows, [index]))
            continue
        real += pairs
        if current is not None and padded + sets * current[0] ** 2 <= waste * real:
            padded += sets * current[0] ** 2
            current[1].append(index)
        else:
            padded += pairs
            current = (rows, [index])
            out.append(current)
    return [(rows, sorted(members)) for rows, members in out]


def _padded(sets: PointSets, rows: int) -> PointSets:
    return PointSets(rows, sets.sizes, sets.half_space)


def _pad_square(gram: Tensor, rows: int) -> Tensor:
    """Tensor[B, n, n] zero-padded to Tensor[B, rows, rows] (padding rows are zero points)."""
    extra = rows - gram.shape[-1]
    return torch.nn.functional.pad(gram, (0, extra, 0, extra)) if extra else gram


class _SymmetricGram(Function):
    """G = X X^T for each set of Tensor[B, N, d], whose gradient Gbar is symmetric: every energy here is a sum over
    unordered pairs with symmetric weights (:func:`pair_weights`), so dL/dX = (Gbar + Gbar^T) X = 2 Gbar X, one
    batched product (autograd's backward of ``X @ X.mT`` makes two and adds them)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(points: Tensor) -> Tensor:
        return points @ points.mT

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (points,) = ctx.saved_tensors
        return torch.baddbmm(points, grad, points, beta=0.0, alpha=2.0)  # beta = 0: the first argument is unread


class LayerEnergies:
    """The energy of each of a fixed list of weights (one neuron per row), in one sync-free evaluation.

    The weights are packed into zero-padded float64 blocks Tensor[L, N, D] (:mod:`~sphereml.energy.packing`: on a
    CPU one block per fan-in, on an accelerator fan-ins sharing blocks, Note [blocks by device]) and evaluated by
    one :class:`SetEnergies`.  This is what MHE evaluates at every step and what the chapters measure on trained
    networks.

    Args:
        shapes (sequence of torch.Size): the weights' shapes (Tensor[n >= 2, ...]; n >= 1 in half space).
        s, metric, eps, reduction: as :class:`SetEnergies`.
        half_space (bool or sequence of bool): per weight, or one for all. Default: False.
        coefficients (sequence of float, optional): c_l of :meth:`total`. Default: all 1.
    """

    def __init__(self, shapes: Sequence[torch.Size], s: float = 2.0, metric: str = "euclidean",
                 half_space: bool | Sequence[bool] = False, eps: float = 1e-7, reduction: str = "pair_mean",
                 coefficients: Sequence[float] | None = None):
        shapes = [torch.Size(shape) for shape in shapes]
        if not shapes or any(len(shape) < 2 for shape in shapes):
            raise ValueError(f"shapes must list weights Tensor[n, ...] with one neuron per row, got {shapes}")
        halves = [half_space] * len(shapes) if isinstance(half_space, bool) else [bool(h) for h in half_space]
        if len(halves) != len(shapes):
            raise ValueError(f"half_space must be a bool or one per weight, got {len(halves)} for {len(shapes)}")
        coefficients = [1.0] * len(shapes) if coefficients is None else [float(c) for c in coefficients]
        if len(coefficients) != len(shapes):
            raise ValueError(f"coefficients must give one number per weight ({len(shapes)}), got {len(coefficients)}")
        self.shapes, self.half_space, self.coefficients = shapes, halves, coefficients
        self.options = dict(s=s, metric=metric, eps=eps, reduction=reduction)
        self._plans: dict[bool, _Plan] = {}  # on an accelerator? -> how the weights are packed and evaluated
        self.plan(torch.device("cpu"))  # checks the options
        if torch.accelerator.is_available() or on_accelerator(torch.device("cpu")):
            self.plan(torch.device("meta"))  # made here, not at a first call that torch.compile may be tracing

    def plan(self, device: torch.device) -> "_Plan":
        """How the weights are packed and evaluated on ``device`` (Note [blocks by device]), made once per kind: at
        construction for the CPU, and for an accelerator when the machine has one."""
        accelerator = on_accelerator(device)
        if accelerator not in self._plans:
            waste = ACCELERATOR_COLUMN_WASTE if accelerator else None
            self._plans[accelerator] = _Plan(self, column_groups(self.shapes, waste))
        return self._plans[accelerator]

    def _plan_for(self, weights: Sequence[Tensor]) -> "_Plan":
        if len(weights) != len(self.shapes):
            raise ValueError(f"weights must have the shapes {self.shapes}, got {[tuple(w.shape) for w in weights]}")
        return self.plan(weights[0].device)

    def blocks(self, device: torch.device) -> tuple[PointSets, ...]:
        """The blocks of point sets that :meth:`pack` makes on ``device``."""
        return self.plan(device).engine.blocks

    def pack(self, weights: Sequence[Tensor]) -> list[Tensor]:
        """The weights as the float64 blocks Tensor[L, N, D] of :meth:`blocks` on their device."""
        return self._plan_for(weights).packing(weights)

    def prepare(self, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        """Move the constants for weights of ``dtype`` to ``device`` once (outside ``torch.compile``; :meth:`__call__`
        does it otherwise)."""
        plan = self.plan(device)
        plan.engine.prepare(device)
        plan.packing.prepare(device, dtype)
        plan.order.get(device)
        plan.coefficients.get(device)

    def __call__(self, weights: Sequence[Tensor]) -> Tensor:
        """Tensor[L] (float64): the energy of each weight, in the order of ``shapes``."""
        plan = self._plan_for(weights)
        energies = plan.engine.joined(plan.packing(weights))  # (L,) in packed order
        order = plan.order.get(energies.device)
        return energies.index_select(0, order) if order is not None else energies

    def total(self, weights: Sequence[Tensor]) -> Tensor:
        """sum_l c_l E_l with the ``coefficients`` given at construction, as a 0-dim float64 Tensor."""
        plan = self._plan_for(weights)
        return self.weighted_total(plan.engine.joined(plan.packing(weights)))

    def weighted_total(self, energies: Tensor | Sequence[Tensor]) -> Tensor:
        """:meth:`total` from the energies of :meth:`pack`'s blocks (one Tensor[L] in packed order, or one per block),
        evaluated elsewhere (a :class:`SetEnergies` whose first blocks are :meth:`blocks`: one evaluation for these
        weights and other sets)."""
        energies = energies if isinstance(energies, Tensor) else torch.cat(list(energies))
        return (energies * self.plan(energies.device).coefficients.get(energies.device)).sum()


class _Plan:
    """How a :class:`LayerEnergies` packs and evaluates its weights on one kind of device, given the weights of each
    block (``members``): their :class:`~sphereml.energy.packing.WeightPacking`, the :class:`SetEnergies` of the
    blocks, the permutation from the packed order back to the weights' (None when they agree) and the coefficients in
    packed order."""

    def __init__(self, layers: LayerEnergies, members: list[list[int]]):
        shapes, halves = layers.shapes, layers.half_space
        blocks = [PointSets(max(shapes[i][0] for i in block), tuple(shapes[i][0] for i in block),
                            tuple(halves[i] for i in block)) for block in members]
        self.engine = SetEnergies(blocks, **layers.options)
        self.packing = WeightPacking(shapes, members)
        order = self.packing.order
        self.order = DeviceCache(None if order == sorted(order) else torch.tensor(order).argsort())
        self.coefficients = DeviceCache(torch.tensor([layers.coefficients[i] for i in order], dtype=torch.float64))
