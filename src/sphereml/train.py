"""Training and evaluation: ``fit`` / ``evaluate`` with seeding, device choice, history and checkpoints.

Design (nanoGPT's ``train.py`` in spirit, short and explicit):

* **Repeatable.** ``fit`` seeds torch's generator at the start and draws each epoch's
  data order from a generator seeded by ``(seed, epoch)``; two CPU runs with the
  same arguments give bit-identical weights.
* **Resumable.** With ``checkpoint=path`` the model, optimiser, scheduler, history,
  epoch and RNG state are written atomically after every epoch; starting the same
  run again continues from the last finished epoch and ends where an uninterrupted
  run would have ended.
* **One loss path.** The default loss is the model's own ``loss_and_logits(x, y)`` when it has
  one (a :class:`~sphereml.models.Classifier`: cross-entropy, or its margin head's loss), else
  cross-entropy of ``model(x)``; ``evaluate`` reports the same loss.
* **Data parallel.** Under ``torchrun`` (a ``torch.distributed`` process group, gloo on CPU, NCCL on
  GPU) the same call trains on every rank, Note [data parallel fit] in :mod:`sphereml.distributed`.
* **Hookable.** ``regularizer()`` (a :class:`~sphereml.regularizers.Regularizer` bound to the
  model) is added to every step's loss, and ``callbacks`` run after every optimiser step
  (:class:`Tracker` records a value every few steps).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from . import _io, distributed
from ._checks import integer, real_number
from ._step_records import StepRecords

__all__ = [
    "seed_everything", "resolve_device", "fit", "evaluate", "collect_outputs",
    "History", "StepState", "Tracker", "default_loss", "num_steps", "on_device", "batches", "make_optimizer",
    "penalty_of",
]

DEVICES = ("auto", "cpu", "cuda")


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) generators."""
    integer("seed", seed, at_least=0)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` -> CUDA when available (``cuda:LOCAL_RANK`` under torchrun), else CPU; ``"cuda"`` without
    CUDA raises RuntimeError."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str) or device.split(":")[0] not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES} (or 'cuda:N'), got {device!r}")
    if device == "auto":
        return distributed.local_device()  # under torchrun: this process's GPU
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"device={device!r} was requested but CUDA is not available "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use device='cpu' or 'auto'"
        )
    return torch.device(device)


@dataclass
class History:
    """Per-epoch records (``epochs``: list of dicts) and per-step training losses (``steps``)."""

    epochs: list[dict] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)

    def __getitem__(self, key: str) -> list:
        """Column ``key`` over epochs, e.g. ``history["val_acc"]``."""
        return [e.get(key) for e in self.epochs]

    @property
    def diverged(self) -> bool:
        """Whether training ended on a loss that is not finite (the last epoch's mean training loss, nan or inf)."""
        return bool(self.epochs) and not math.isfinite(self.epochs[-1]["train_loss"])

    def to_dict(self) -> dict:
        return {"epochs": self.epochs, "steps": self.steps}


@dataclass
class StepState:
    """What a per-step callback sees after each optimiser step; ``loss`` (a float) reads the step's loss from the
    device only when a callback asks for it, so training on a GPU does not wait for every step's result."""

    step: int
    epoch: int
    loss_tensor: Tensor
    model: nn.Module
    optimizer: torch.optim.Optimizer

    @property
    def loss(self) -> float:
        return float(self.loss_tensor)


class Tracker:
    """A callback that records ``(step, fn(state))`` every ``every`` steps (and at step 1 unless told not to):
    after ``fit(..., callbacks=[tracker])`` ``tracker.steps`` and ``tracker.values`` hold the curve.

    ``start``: a value measured before training, recorded as step 0 (``fn`` needs a step's state, so the
    caller measures it), so that a curve, or a growth "at the end over the start", begins before the first
    optimiser step has moved anything."""

    def __init__(self, fn: Callable[[StepState], float], every: int, include_first: bool = True, start=None):
        self.fn, self.every = fn, integer("every", every, at_least=1)
        self.include_first = bool(include_first)
        self.points: list[tuple[int, float]] = [] if start is None else [(0, start)]

    def due(self, step: int) -> bool:
        """Whether the tracker records at optimiser step ``step`` (counted from 1)."""
        return (self.include_first and step == 1) or step % self.every == 0

    def __call__(self, state: StepState) -> None:
        if self.due(state.step):
            self.points.append((state.step, self.fn(state)))

    def state_dict(self) -> dict:
        """The curve recorded so far (a resumed chapter run restores it: :mod:`sphereml.book.resume`)."""
        return {"points": list(self.points)}

    def load_state_dict(self, state: dict) -> None:
        self.points = [tuple(point) for point in state["points"]]

    @property
    def steps(self) -> list[int]:
        return [p[0] for p in self.points]

    @property
    def values(self) -> list[float]:
        return [p[1] for p in self.points]


def num_steps(data, epochs: int, batch_size: int = 128) -> int:
    """Optimiser steps of ``fit`` over ``data`` (a dataset or its size) for ``epochs`` epochs."""
    n = data if isinstance(data, int) and not isinstance(data, bool) else len(data)
    return integer("epochs", epochs, at_least=0) * math.ceil(n / integer("batch_size", batch_size, at_least=1))


LossFn = Callable[[nn.Module, Tensor, Tensor], "tuple[Tensor, Tensor | None]"]


def default_loss(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """``model.loss_and_logits(x, y)`` when the model has it (margin heads included), else softmax
    cross-entropy of ``model(x)``; returns (loss, logits)."""
    own = getattr(model, "loss_and_logits", None)
    if own is not None:
        return own(x, y)
    logits = model(x)
    return F.cross_entropy(logits, y), logits


_ON_DEVICE: "weakref.WeakKeyDictionary[TensorDataset, dict]" = weakref.WeakKeyDictionary()


def on_device(data: Dataset, device: str | torch.device) -> Dataset:
    """``data`` with its tensors on ``device``: a TensorDataset is copied there once and the copy kept while
    ``data`` lives (every later call returns it), so training and evaluation index batches on the device and
    copy nothing from the host per batch.  So is a dataset with a ``to_device`` method (an augmenting one such as
    :class:`~sphereml.data.RandomCropFlip`).  Other datasets, and tensors already there, are returned as they are.
    (A TensorDataset changed in place after its first copy keeps the old copy.)"""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" are one device: one copy
        dev = torch.device("cuda", torch.cuda.current_device())
    movable = hasattr(data, "to_device")  # an augmenting dataset of ``images`` and ``labels``
    if not (isinstance(data, TensorDataset) or movable):
        return data
    if all(t.device == dev for t in ((data.images, data.labels) if movable else data.tensors)):
        return data
    copies = _ON_DEVICE.setdefault(data, {})
    if dev not in copies:
        copies[dev] = data.to_device(dev) if movable else TensorDataset(*(t.to(dev) for t in data.tensors))
    return copies[dev]


def batches(data: Dataset, batch_size: int, shuffle: bool = False,
            generator: torch.Generator | None = None) -> Iterator:
    """Tuples of tensors, ``batch_size`` samples each (the last may be smaller), in order or shuffled by ``generator``
    (a TensorDataset is indexed directly, where its tensors are: much faster than a DataLoader for in-memory data;
    the order is drawn on the CPU, so a seed gives the same batches on every device, and moved once; a dataset with
    a ``device_batches`` method, such as :class:`~sphereml.data.RandomCropFlip`, makes its own)."""
    if hasattr(data, "device_batches"):
        yield from data.device_batches(batch_size, shuffle, generator)
    elif isinstance(data, TensorDataset):  # fast path: index the tensors directly
        n = len(data)
        order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
        orders = {t.device: order.to(t.device) for t in data.tensors}  # one copy per device the tensors are on
        for start in range(0, n, batch_size):
            yield tuple(t[orders[t.device][start:start + batch_size]] for t in data.tensors)
    else:
        yield from DataLoader(data, batch_size=batch_size, shuffle=shuffle, generator=generator)


def make_optimizer(optimizer, params, lr: float, weight_decay: float, momentum: float):
    """``"sgd"`` (with ``momentum``), ``"adam"`` or ``callable(params)``: the optimiser :func:`fit` builds.  On CUDA
    the named ones are fused (``fused=True``: the same update up to rounding in a few launches, where Adam's default
    issues 90 operations a step for a narrow CNN-9, counted on the CPU); the CPU keeps PyTorch's default."""
    if callable(optimizer):
        return optimizer(params)
    params = list(params)
    fused = True if params and all(isinstance(p, Tensor) and p.is_cuda for p in params) else None  # None: default
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, fused=fused)
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, fused=fused)
    raise ValueError(f"optimizer must be 'sgd', 'adam' or a callable, got {optimizer!r}")


def _fingerprint(model: nn.Module, config: dict) -> str:
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    return json.dumps({"model": type(model).__name__, "shapes": shapes, **config}, sort_keys=True, default=str)


def _to_device(batch, device):
    return tuple(t.to(device, non_blocking=True) for t in batch)


def _world(model: nn.Module) -> tuple[int, int] | None:
    """(rank, world size) when ``fit`` must share the work (Note [data parallel fit]), else None."""
    if not distributed.is_distributed() or isinstance(model, nn.parallel.DistributedDataParallel):
        return None  # alone, or the caller's DDP averages the gradients
    return distributed.rank(), distributed.world_size()


def fit(model: nn.Module, train_data: Dataset, *, epochs: int, batch_size: int = 128, lr: float = 1e-3,
        optimizer: str | Callable = "adam", weight_decay: float = 0.0, momentum: float = 0.9,
        scheduler: Callable | None = None, loss_fn: LossFn | None = None,
        regularizer: Callable[[], Tensor] | None = None, callbacks: Iterable[Callable[[StepState], None]] = (),
        val_data: Dataset | None = None, device: str | torch.device = "auto", seed: int = 0,
        checkpoint: str | os.PathLike | None = None, progress: bool = True, compile: bool | str = False,
) -> History:
    """Train ``model`` for ``epochs`` epochs and return its :class:`History`.

    Args:
        model (nn.Module): trained in place (moved to ``device``).
        train_data (Dataset): a TensorDataset (fast path) or any map-style dataset of (x, y).
        epochs (int): total number of epochs (a resumed run trains only the missing ones).
        optimizer: ``"adam"``, ``"sgd"`` (with ``momentum``) or ``callable(params) -> Optimizer``.
        scheduler (callable, optional): ``callable(optimizer) -> LRScheduler``, stepped once per epoch.
        loss_fn (callable, optional): ``loss_fn(model, x, y) -> (loss, logits | None)``;
            default: :func:`default_loss` (the model's own ``loss_and_logits``, margin heads included).
        regularizer (callable, optional): ``regularizer() -> Tensor`` added to each step's loss: a
            :class:`~sphereml.regularizers.Regularizer` bound to ``model``.
        callbacks: functions called with a :class:`StepState` after every optimiser step.
        val_data (Dataset, optional): evaluated after each epoch (``val_loss``, ``val_acc``).
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (see :func:`resolve_device`).
        seed (int): seeds the data order and torch's generator. Default: 0.
        checkpoint (path, optional): save after every epoch and resume from it when present.
        progress (bool): show a tqdm progress bar (on stderr). Default: True.
        compile (bool or str): ``torch.compile`` each step's loss and penalty: ``True``, or a mode such as
            ``"reduce-overhead"`` (CUDA graphs; not for OPT's Löwdin map on a GPU, :data:`~sphereml.launches.
            CAPTURE_UNSAFE`).  A regulariser's ``before_step`` runs eagerly before it.
            The first steps pay the compilation: worth it for long GPU runs. Default: False.

    Returns:
        History with one dict per epoch: epoch, train_loss, train_acc, reg, val_loss, val_acc, seconds.
    """
    integer("epochs", epochs, at_least=0)
    integer("batch_size", batch_size, at_least=1)
    real_number("lr", lr, above=0.0)
    integer("seed", seed, at_least=0)
    dev = resolve_device(device)
    loss_fn = loss_fn or default_loss
    callbacks = list(callbacks)
    model.to(dev)
    torch.manual_seed(seed)
    world = _world(model)
    if world is not None:
        distributed.broadcast_from_rank0(model, parameters=True)  # every rank starts from rank 0's weights
    trainable = [p for p in model.parameters() if p.requires_grad]
    step_objective = _step_objective(model, loss_fn, regularizer, compile)
    opt = make_optimizer(optimizer, trainable, lr, weight_decay, momentum)
    sched = scheduler(opt) if scheduler is not None else None
    history = History()
    start_epoch = 0
    ckpt_path = Path(checkpoint) if checkpoint is not None else None
    config = {"batch_size": batch_size, "lr": lr, "optimizer": getattr(optimizer, "__name__", str(optimizer)),
              "weight_decay": weight_decay, "momentum": momentum, "seed": seed}
    fingerprint = _fingerprint(model, config)
    if ckpt_path is not None and ckpt_path.exists():
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)  # RNG states must stay on the CPU
        if state["fingerprint"] != fingerprint:
            raise ValueError(
                f"checkpoint {ckpt_path} was written by a different run (model or hyperparameters differ); "
                "delete it or choose another path"
            )
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if sched is not None and state["scheduler"] is not None:
            sched.load_state_dict(state["scheduler"])
        history = History(**state["history"])
        start_epoch = state["epoch"]
        if state.get("regularizer") is not None and hasattr(regularizer, "load_state_dict"):
            regularizer.load_state_dict(state["regularizer"])
        torch.set_rng_state(state["torch_rng"])
        if dev.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], dev)

    from tqdm import tqdm

    model._sphereml_stats_fresh = False  # the weights move: running statistics lag (sphereml.recalibration)
    train_data = on_device(train_data, dev)
    bar = tqdm(range(start_epoch, epochs), disable=not progress, desc="fit", leave=False)
    step = len(history.steps)
    for epoch in bar:
        model.train()
        t0 = time.perf_counter()
        order = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        records = StepRecords(copy=dev.type == "cuda" and compile in CUDA_GRAPH_MODES)  # Note [a step's bookkeeping]
        for batch in batches(train_data, batch_size, True, order):
            total = len(batch[0])
            if world is not None:  # Note [data parallel fit]: this rank's share of the global batch
                batch = tuple(t[world[0]::world[1]] for t in batch)
            x, y = _to_device(batch, dev)
            if hasattr(regularizer, "before_step"):
                regularizer.before_step()  # per-step state (CoMHE's projections), outside any compiled graph
            if len(y):
                loss, logits, reg = step_objective(x, y)
            else:  # more ranks than samples left in the last batch
                loss, logits, reg = x.new_zeros(()), None, penalty_of(regularizer)
            if world is None:
                objective = loss if reg is None else loss + reg
            else:
                objective = loss * (len(y) / total) + (0.0 if reg is None else reg / world[1])
            opt.zero_grad(set_to_none=True)
            if objective.requires_grad:  # a rank with an empty share and no regulariser has nothing to differentiate
                objective.backward()
            if world is not None:
                distributed.sum_gradients(trainable)
            opt.step()
            if world is not None:
                distributed.broadcast_from_rank0(model)
            step += 1
            records.add(loss, reg, logits, y, len(y))
            for cb in callbacks:
                cb(StepState(step=step, epoch=epoch, loss_tensor=records.losses[-1], model=model, optimizer=opt))
        if sched is not None:
            sched.step()
        correct, losses, sizes = records.correct(), records.losses, records.sizes
        counted = correct is not None  # whether the loss gave logits to count correct predictions with
        if world is not None:  # the whole batches' losses and counts, summed over the ranks
            losses, sizes, correct = distributed.merge_batch_records(losses, sizes, correct if counted else
                                                                     torch.zeros((), dtype=torch.long, device=dev))
        loss_values, reg_values = StepRecords.values(losses), StepRecords.values(records.penalties)
        history.steps.extend(loss_values)
        seen = sum(sizes)
        total_loss = sum(v * n for v, n in zip(loss_values, sizes))
        total_reg = sum(v * n for v, n in zip(reg_values, sizes))
        record = {"epoch": epoch + 1, "train_loss": total_loss / max(seen, 1),
                  "train_acc": int(correct) / max(seen, 1) if counted else None,
                  "reg": total_reg / max(seen, 1)}
        if val_data is not None:
            val = evaluate(model, val_data, batch_size=max(batch_size, 512), device=dev, loss_fn=loss_fn)
            record.update(val_loss=val["loss"], val_acc=val["accuracy"])
        record["seconds"] = time.perf_counter() - t0
        history.epochs.append(record)
        bar.set_postfix(loss=f"{record['train_loss']:.3f}")
        if ckpt_path is not None and distributed.is_main_process():
            _io.save_torch({
                "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict() if sched is not None else None,
                "history": history.to_dict(), "epoch": epoch + 1, "torch_rng": torch.get_rng_state(),
                "regularizer": regularizer.state_dict() if hasattr(regularizer, "state_dict") else None,
                "cuda_rng": torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None,
                "fingerprint": fingerprint,
            }, ckpt_path)
        if ckpt_path is not None:
            distributed.barrier()  # the checkpoint is complete before any rank could resume from it
    bar.close()
    return history


def penalty_of(regularizer) -> Tensor | None:
    """A Regularizer's weighted penalty (its state stepped apart, by ``before_step``), a callable's value, or None."""
    if regularizer is None:
        return None
    return regularizer.weighted_penalty() if hasattr(regularizer, "weighted_penalty") else regularizer()


COMPILE_MODES = (False, True, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # those whose outputs live in CUDA graphs' memory


def _step_objective(model: nn.Module, loss_fn: LossFn, regularizer, compile) -> Callable:
    """``(x, y) -> (loss, logits, penalty or None)`` of one step, compiled when asked (see :func:`fit`)."""
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")

    def objective(x: Tensor, y: Tensor):
        return (*loss_fn(model, x, y), penalty_of(regularizer))

    return objective if compile is False else torch.compile(objective, mode=None if compile in (True, "default")
                                                            else compile)


@torch.no_grad()
def collect_outputs(fn: Callable[[Tensor], Tensor], data: Dataset, batch_size: int = 512,
                    device: str | torch.device = "auto") -> tuple[Tensor, Tensor]:
    """Apply ``fn`` (e.g. ``model.features``) to every input in order; returns (outputs, labels) on the CPU."""
    dev = resolve_device(device)
    outs, labels = [], []
    for batch in batches(on_device(data, dev), batch_size, False, None):
        x, y = _to_device(batch, dev)
        outs.append(fn(x))
        labels.append(y)
    return torch.cat(outs).cpu(), torch.cat(labels).cpu()  # one copy to the host


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, *, batch_size: int = 512, device: str | torch.device = "auto",
             loss_fn: LossFn | None = None) -> dict:
    """Mean loss and accuracy of ``model`` on ``data`` (eval mode; the previous mode is restored).

    The loss is ``loss_fn``'s (default :func:`default_loss`: a margin head reports its own margin loss);
    the accuracy is the arg-max of the logits it returns.
    """
    dev = resolve_device(device)
    loss_fn = loss_fn or default_loss
    was_training = model.training
    model.eval()
    total_loss = torch.zeros((), dtype=torch.float64, device=dev)  # summed on the device, read once at the end
    correct = torch.zeros((), dtype=torch.long, device=dev)
    seen, logits = 0, None
    for batch in batches(on_device(data, dev), batch_size, False, None):
        x, y = _to_device(batch, dev)
        loss, logits = loss_fn(model, x, y)
        total_loss += loss.detach().double() * len(y)
        if logits is not None:
            correct += (logits.argmax(1) == y).sum()
        seen += len(y)
    model.train(was_training)
    accuracy = int(correct) / max(seen, 1) if logits is not None else None
    return {"loss": float(total_loss) / max(seen, 1), "accuracy": accuracy}
