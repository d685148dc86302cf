"""Running statistics re-estimated before an evaluation: the book's one evaluation rule for networks that
keep them (BatchNorm; a decoupled layer's running E{||x||}, :mod:`~sphereml.layers.decoupled`).

Running averages are collected while the weights move, so they lag the network; :func:`recalibrate`
re-estimates them with the weights frozen, :func:`recalibrated` does so for the length of a ``with`` block
(a curve point in the middle of training) and puts the run's own statistics back.  :func:`stats_fresh`
says whether a model was recalibrated since its last :func:`~sphereml.train.fit`; :class:`BiasCorrectedAverage`
keeps the statistics during training as the released DCNets code does, for comparison.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.utils.data import Dataset

from ._checks import integer, real_number
from .train import batches, on_device, resolve_device

__all__ = ["recalibrate", "recalibrated", "has_running_stats", "stats_fresh", "BiasCorrectedAverage"]


@torch.no_grad()
def recalibrate(model: nn.Module, data: Dataset, *, batch_size: int = 256, max_batches: int | None = None,
                device: str | torch.device = "auto") -> int:
    """Re-estimate every running statistic of ``model`` from ``data`` before an evaluation; returns how many modules.

    BatchNorm's running mean and variance (and a decoupled layer's running E{||x||}) are exponential averages
    collected while the weights were still moving, so they lag the current network and eval-mode accuracy is
    misleading.  Every module with ``reset_running_stats`` is reset and made cumulative (``momentum = None``),
    the batches of ``data`` (in order, the first ``max_batches``) run through the model in training mode
    without gradients, and momentum and mode are put back.  The parameters are untouched.
    """
    integer("batch_size", batch_size, at_least=1)
    if max_batches is not None:
        integer("max_batches", max_batches, at_least=1)
    dev = resolve_device(device)
    modules = _with_running_stats(model)
    momenta = [m.momentum for m in modules]
    was_training = model.training
    for m in modules:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    try:
        for i, batch in enumerate(batches(on_device(data, dev), batch_size, False, None)):
            if max_batches is not None and i >= max_batches:
                break
            model(batch[0].to(dev, non_blocking=True))
    finally:  # momentum and mode back even when a batch fails
        for m, momentum in zip(modules, momenta):
            m.momentum = momentum
        model.train(was_training)
    model._sphereml_stats_fresh = True  # until the next fit (see stats_fresh)
    return len(modules)


@contextlib.contextmanager
def recalibrated(model: nn.Module, data: Dataset, **kwargs) -> Iterator[nn.Module]:
    """``with recalibrated(model, data): ...`` -- inside the block ``model`` has running statistics re-estimated
    from ``data`` (:func:`recalibrate`, ``kwargs`` as there); after it, the statistics it had before are back.

    For evaluations in the middle of training (a convergence curve): the network is measured as the book's
    evaluation rule measures it, and training goes on with the running averages it would have had anyway.
    """
    modules = _with_running_stats(model)
    saved = [{name: b.clone() for name, b in m.named_buffers(recurse=False)} for m in modules]
    fresh = getattr(model, "_sphereml_stats_fresh", None)
    try:
        recalibrate(model, data, **kwargs)
        yield model
    finally:
        with torch.no_grad():
            for m, buffers in zip(modules, saved):
                for name, value in buffers.items():
                    getattr(m, name).copy_(value)
        if fresh is None:
            model.__dict__.pop("_sphereml_stats_fresh", None)
        else:
            model._sphereml_stats_fresh = fresh


def has_running_stats(model: nn.Module) -> bool:
    """Whether ``model`` keeps running statistics (BatchNorm, a decoupled layer's running norm)."""
    return bool(_with_running_stats(model))


def _with_running_stats(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if callable(getattr(m, "reset_running_stats", None)) and hasattr(m, "momentum")]


def stats_fresh(model: nn.Module) -> bool:
    """Whether ``model``'s running statistics were recalibrated (:func:`recalibrate`) after its last :func:`fit`."""
    return bool(getattr(model, "_sphereml_stats_fresh", False))


class BiasCorrectedAverage:
    """A :func:`~sphereml.train.fit` callback that keeps every running statistic as a bias-corrected exponential
    moving average of the batch statistics (TensorFlow's ``ExponentialMovingAverage``, which the released
    DCNets code evaluates with) instead of PyTorch's fixed-momentum average.

    After step t the next batch gets the weight (1 - decay) / (1 - decay^(t+1)), so after T batches a running
    statistic is sum_t (1 - decay) decay^(T-t) b_t / (1 - decay^T): no bias towards the initial value.  The
    weights training uses are untouched (training normalises by batch statistics).  The running statistics are
    reset here; construct it just before :func:`~sphereml.train.fit`.  Under
    :func:`~sphereml.multiseed.fit_seeds` it runs once per step for every seed (:meth:`stacked`): the seeds share
    their step count, so one weight serves them all.
    """

    def __init__(self, model: nn.Module, decay: float = 0.999):
        self.decay = real_number("decay", decay, above=0.0, below=1.0)
        self.modules = _with_running_stats(model)
        for m in self.modules:
            m.reset_running_stats()
            m.momentum = 1.0  # the first batch's statistics, where the corrected average starts

    def __call__(self, state) -> None:
        self._set_weight(self.modules, state.step)

    def state_dict(self) -> dict:
        """The averaging weight each module was left with (a resumed chapter run restores it)."""
        return {"momentum": [m.momentum for m in self.modules]}

    def load_state_dict(self, state: dict) -> None:
        for m, momentum in zip(self.modules, state["momentum"]):
            m.momentum = momentum

    def _set_weight(self, modules: list[nn.Module], step: int) -> None:
        weight = (1 - self.decay) / (1 - self.decay ** (step + 1))
        for m in modules:
            m.momentum = weight

    def stacked(self, step: int, model: nn.Module, params) -> None:
        """:meth:`__call__` for the stacked seeds of :func:`~sphereml.multiseed.fit_seeds`, whose batched step runs
        ``model``'s modules (the first seed's) with every seed's state: their momentum is every seed's."""
        self._set_weight(_with_running_stats(model), step)

    def __eq__(self, other) -> bool:  # alike for every seed: fit_seeds runs one of them on the stack
        return type(other) is BiasCorrectedAverage and self.decay == other.decay

    def __hash__(self) -> int:
        return hash(("BiasCorrectedAverage", self.decay))
