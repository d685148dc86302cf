"""Weights packed into the zero-padded blocks of the batched energy (Note [batched energy] in :mod:`.batched`).

A regulariser hands the batched energy a list of weights of many shapes; the energy wants float64 blocks
Tensor[L, N, D], one point set per layer, zero rows and columns padding the smaller ones (a zero row is no
point; a zero column changes no product).  How the weights are grouped into blocks depends on the device:

Note [blocks by device]
    On a CPU each fan-in d makes its own block, Tensor[L, N, d]: padding would cost arithmetic, and launches are
    cheap.  On an accelerator the fan-ins share blocks, padded to the widest of them (:func:`column_groups`, within
    :data:`~sphereml.energy.batched.ACCELERATOR_COLUMN_WASTE` times the weights' own Gram arithmetic), because there
    each block's Gram product and its padding are launches that cost more host time than the padding's float64
    arithmetic costs the device: the thesis's CNN-9 (64/128/256) has eleven weights of six fan-ins, which make two
    blocks (widths 4096 and 576) and two Gram products each way instead of six, for 3.3 GFLOP per product instead of
    1.7.  A GPU slow in float64 (most consumer cards) wants a smaller bound, or None: one block per fan-in, as on a
    CPU.
    Either way :class:`WeightPacking` builds every block from one concatenation of all the weights, one cast and one
    gather, and its backward is one concatenation, one gather and one cast, whatever the number of layers and blocks
    (it replaces a packing of about six operations per fan-in, forward and backward together).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .._autograd import Function

__all__ = ["column_groups", "WeightPacking", "DeviceCache"]


class DeviceCache:
    """A constant made on the CPU and copied to each device once (a copy per step would block the host)."""

    def __init__(self, value: Tensor | None):
        self.value = value
        self._copies: dict = {}

    def get(self, device: torch.device) -> Tensor | None:
        if self.value is None:
            return None
        device = torch.device(device)
        if device not in self._copies:
            self._copies[device] = self.value.to(device)
        return self._copies[device]


def _fan_in(shape: torch.Size) -> int:
    return shape[1:].numel()


def column_groups(shapes: Sequence[torch.Size], waste: float | None = None) -> list[list[int]]:
    """The weights (one neuron per row) of each block: lists of indices into ``shapes``.

    ``waste`` None: one block per fan-in, in order of first appearance, each in the weights' order.  Otherwise the
    fan-ins are taken widest first, and one joins the current block while the block's Gram product (layers x
    rows^2 x width multiply-adds) stays within ``waste`` times those of its weights alone (the sum of n^2 d):
    the padding's extra arithmetic against the launches it saves (Note [blocks by device]).
    """
    shapes = [torch.Size(shape) for shape in shapes]
    by_width: dict[int, list[int]] = {}
    for index, shape in enumerate(shapes):
        by_width.setdefault(_fan_in(shape), []).append(index)
    if waste is None:
        return list(by_width.values())
    blocks: list[list[int]] = []
    width = work = 0
    for fan_in, members in sorted(by_width.items(), key=lambda item: -item[0]):
        own = sum(shapes[i][0] ** 2 * fan_in for i in members)
        joined = blocks[-1] + members if blocks else members
        if blocks and len(joined) * max(shapes[i][0] for i in joined) ** 2 * width <= waste * (work + own):
            blocks[-1], work = joined, work + own
        else:
            blocks.append(list(members))
            width, work = fan_in, own
    return blocks


class _GatherBlocks(Function):
    """The blocks' entries gathered from the concatenation by one index; the backward gathers back by the inverse
    index: every entry of the concatenation lands in exactly one place of one block (the padding reads the zero at
    its end), so no gradient needs adding up, and the backward is exact and deterministic (a concatenation of the
    blocks' gradients and one gather)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(flat: Tensor, index: Tensor, inverse: Tensor, shapes: tuple) -> tuple[Tensor, ...]:
        gathered = flat.index_select(0, index)
        sizes = [a * b * c for a, b, c in shapes]
        return tuple(part.view(shape) for part, shape in zip(gathered.split(sizes), shapes))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def backward(ctx, *grads: Tensor):
        (inverse,) = ctx.saved_tensors
        return torch.cat([g.reshape(-1) for g in grads]).index_select(0, inverse), None, None, None


class WeightPacking:
    """Weights of any shapes gathered into zero-padded blocks Tensor[L, N, D] (Note [blocks by device]).

    Forward: one concatenation of every weight, one cast, one gather; backward: one concatenation, one gather, one
    cast, whatever the number of weights and blocks.

    Args:
        shapes (sequence of torch.Size): the weights' shapes, Tensor[n, ...] with one neuron per row.
        blocks (list of lists of int): the weights of each block, as :func:`column_groups` gives them.
    """

    def __init__(self, shapes: Sequence[torch.Size], blocks: Sequence[Sequence[int]]):
        self.shapes = [torch.Size(shape) for shape in shapes]
        self.order = [i for members in blocks for i in members]  # the concatenation's order: block by block
        if sorted(self.order) != list(range(len(self.shapes))):
            raise ValueError(f"blocks must hold every weight once, got {blocks} for {len(self.shapes)} weights")
        start, starts = 0, {}
        for i in self.order:
            starts[i] = start
            start += self.shapes[i].numel()
        zero = start  # the concatenation's last entry: a zero, which the padding reads
        self.block_shapes = [(len(members), max(self.shapes[i][0] for i in members),
                              max(_fan_in(self.shapes[i]) for i in members)) for members in blocks]
        index = torch.full((sum(a * b * c for a, b, c in self.block_shapes),), zero, dtype=torch.int64)
        inverse = torch.zeros(zero + 1, dtype=torch.int64)  # the zero's gradient is never used: any place will do
        offset = 0
        for members, (layers, rows, width) in zip(blocks, self.block_shapes):
            block = index[offset:offset + layers * rows * width].view(layers, rows, width)
            for k, i in enumerate(members):
                n, d = self.shapes[i][0], _fan_in(self.shapes[i])
                block[k, :n, :d] = torch.arange(starts[i], starts[i] + n * d).view(n, d)
                places = offset + k * rows * width + torch.arange(n)[:, None] * width + torch.arange(d)
                inverse[starts[i]:starts[i] + n * d] = places.flatten()
            offset += layers * rows * width
        small = torch.int32 if len(index) < 2**31 else torch.int64
        self._index, self._inverse = DeviceCache(index.to(small)), DeviceCache(inverse.to(small))
        self._zeros: dict = {}  # (device, dtype) -> Tensor[1] of zero: made once, not a launch per call

    def prepare(self, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        """Put the constants on ``device`` once (outside ``torch.compile``; the first call does it otherwise)."""
        self._index.get(device)
        self._inverse.get(device)
        self._zero(torch.device(device), dtype)

    def _zero(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        if (device, dtype) not in self._zeros:
            self._zeros[device, dtype] = torch.zeros(1, dtype=dtype, device=device)
        return self._zeros[device, dtype]

    def __call__(self, weights: Sequence[Tensor], dtype: torch.dtype = torch.float64) -> list[Tensor]:
        """The blocks, Tensor[L, N, D] each, of ``dtype``."""
        if [w.shape for w in weights] != self.shapes:
            raise ValueError(f"weights must have the shapes {self.shapes}, got {[tuple(w.shape) for w in weights]}")
        device = weights[0].device
        flat = torch.cat([*(weights[i].reshape(-1) for i in self.order), self._zero(device, weights[0].dtype)])
        return list(_GatherBlocks.apply(flat.to(dtype), self._index.get(device), self._inverse.get(device),
                                        tuple(self.block_shapes)))
