"""What an epoch of ``fit`` or ``fit_seeds`` records of its steps, read back once per epoch.

Note [a step's bookkeeping]
    On a GPU the host issues every operation of a step, so what a training loop records per step costs as much as a
    layer.  Each step's loss and penalty are kept as the step made them, with its predictions and labels, and the
    rest runs once per epoch: the casts to float64 (the same values), the comparison and the count.  One operation
    a step (the argmax) where there were five (a cast, the argmax, a comparison, a sum and an accumulation; six with
    a penalty to cast), so that a ``fit`` step costs 3 operations more than the bare step (the batch's two gathers
    and the argmax; ``tests/test_train.py``).  A step compiled into CUDA graphs (``fit(compile="reduce-overhead")``)
    returns its loss in the graphs' memory, which its next replay overwrites: there each loss and penalty is copied
    (``copy=True``), as the old cast to float64 copied them.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["StepRecords"]


class StepRecords:
    """The steps of one epoch: ``losses`` and ``penalties`` (detached tensors, as the steps made them, or copies with
    ``copy``), ``sizes`` (samples per step) and the predictions and labels from which :meth:`correct` counts.

    The logits' classes are along dimension 1 (``fit``'s Tensor[B, C, ...]), or 2 with ``seeds``: the stacked steps
    of ``fit_seeds`` (logits Tensor[S, B, C], labels Tensor[S, B]), counted per seed."""

    def __init__(self, seeds: bool = False, copy: bool = False):
        self.seeds, self.copy = seeds, copy
        self.losses: list[Tensor] = []
        self.penalties: list[Tensor] = []
        self.sizes: list[int] = []
        self._predictions: list[Tensor] = []
        self._labels: list[Tensor] = []

    def add(self, loss: Tensor, penalty: Tensor | None, logits: Tensor | None, labels: Tensor, size: int) -> None:
        """One step: its loss, its penalty (None: not recorded), its logits (None: not counted) and labels."""
        self.losses.append(loss.detach().clone() if self.copy else loss.detach())
        if penalty is not None:
            self.penalties.append(penalty.detach().clone() if self.copy else penalty.detach())
        self.sizes.append(size)
        if logits is not None:
            self._predictions.append(logits.argmax(2 if self.seeds else 1))
            self._labels.append(labels)

    def correct(self) -> Tensor | None:
        """The epoch's correct predictions (one count per seed for stacked steps), or None where no step gave
        logits: one comparison and one sum for the whole epoch."""
        if not self._predictions:
            return None
        batch = 1 if self.seeds else 0
        hits = torch.cat(self._predictions, batch).eq(torch.cat(self._labels, batch))
        return hits.flatten(1).sum(1) if self.seeds else hits.sum()

    @staticmethod
    def values(tensors: list[Tensor]) -> list:
        """The steps' values as Python floats (read from float64: the values the steps computed), [] for none."""
        return torch.stack(tensors).double().tolist() if tensors else []
