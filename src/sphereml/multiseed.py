"""Several seeds of one network trained together: one batched step for all of them.

A chapter's verdicts pair networks over seeds, so it trains the same architecture several times, each with its own
initial weights and data order.  On a GPU such small networks are bound by launching kernels, not by arithmetic
(``book/reproducing.md``, "Sizing the gpu profiles"), and training the seeds one after another launches every
kernel once per seed.  :func:`fit_seeds` stacks the seeds' parameters along a new first dimension
(``torch.func.stack_module_state`` style) and runs one step of all of them through ``torch.func.vmap``: each
operation is launched once for the whole stack, as a batched (grouped) kernel.

Note [fit_seeds is fit, seed by seed]
-------------------------------------
The seeds do not interact: the loss of the stack is the sum of the seeds' losses, so each seed's gradient is its own
loss's gradient, and SGD (momentum, weight decay) and Adam update every element independently, so one optimiser over
the stacked tensors is one optimiser per seed.  Seed ``s`` sees the batches ``fit(model, seed=s)`` would draw (the
same generator per epoch), and BatchNorm updates its running statistics in its own slice of the stacked buffers.
So ``fit_seeds(models, data, seeds=[a, b])`` ends where ``fit(models[0], data, seed=a)`` and ``fit(models[1], data,
seed=b)`` end, up to float rounding (``tests/test_multiseed.py`` checks it in float64). Trackers
(:class:`~sphereml.train.Tracker`) see each seed's model as ``fit`` shows it: at a step where one records, the
stacked state is first copied into the models. What it leaves out is what would couple or serialise the seeds:
regularisers, other callbacks, per-epoch validation, checkpoints, and random layers (dropout draws its noise per
seed, but not from ``fit``'s stream). Every operation needs a batching rule: PyTorch's layers and losses have them,
and so have our hand-written backward passes, written in the form ``torch.func`` batches (``setup_context``,
``generate_vmap_rule``): the margin heads' weight-normalised product, the patch layers' (SphereConv, SCS, the
decoupled operators) and the angular functions'. The fused Triton kernels of a GPU (``SPHEREML_FUSED=1``: the patch
epilogue, the margin cross-entropy) have none, and a network that reaches one is refused by name.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils.data import Dataset

from ._checks import integer, real_number
from .train import (History, LossFn, StepState, Tracker, batches, default_loss, make_optimizer, on_device,
                    resolve_device)

__all__ = ["fit_seeds", "stack_state", "unstack_state"]

OPTIMIZERS = ("sgd", "adam")


def _check_same_architecture(models: Sequence[nn.Module]) -> None:
    """Models that differ only in their values: type, configuration (``repr``), parameter and buffer names, shapes,
    dtypes and ``requires_grad``.  Only the first model's forward runs (with every seed's values), so anything else
    that differed would be silently ignored."""
    if not models:
        raise ValueError("fit_seeds needs at least one model")

    def layout(model):
        return (type(model), repr(model), [(n, t.shape, t.dtype, t.requires_grad)
                                           for n, t in (*model.named_parameters(), *model.named_buffers())])

    first = layout(models[0])
    for i, model in enumerate(models[1:], 1):
        if layout(model) != first:
            raise ValueError(f"model {i} is not the architecture of model 0 (type, configuration, or parameter "
                             "names, shapes, dtypes or requires_grad differ)")


def stack_state(models: Sequence[nn.Module]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The models' parameters and buffers stacked along a new first dimension: ``(params, buffers)``, each a dict by
    name.  A parameter is a new leaf that requires grad where the first model's does.

    Raises:
        ValueError: no model, or models that are not one architecture (:func:`fit_seeds`).
    """
    _check_same_architecture(models)
    first = models[0]
    params = {n: torch.stack([m.get_parameter(n).detach() for m in models]).requires_grad_(p.requires_grad)
              for n, p in first.named_parameters()}
    buffers = {n: torch.stack([m.get_buffer(n) for m in models]) for n, _ in first.named_buffers()}
    return params, buffers


def unstack_state(models: Sequence[nn.Module], params: dict[str, Tensor], buffers: dict[str, Tensor]) -> None:
    """Load slice ``i`` of the stacked ``params`` and ``buffers`` into ``models[i]``: through ``load_state_dict``, so
    that a module's host-side copy of a buffer (a margin head's :class:`~sphereml.heads.schedules.LambdaSchedule`
    step) follows; non-persistent buffers are copied."""
    stacked = {**params, **buffers}
    for i, model in enumerate(models):
        persistent = model.state_dict().keys()
        model.load_state_dict({name: value[i] for name, value in stacked.items() if name in persistent})
        with torch.no_grad():
            for name, value in buffers.items():
                if name not in persistent:
                    model.get_buffer(name).copy_(value[i])


class _Objective(nn.Module):
    """``loss_fn(model, x, y)`` as a module's forward, so that ``functional_call`` can swap the model's state."""

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, x: Tensor, y: Tensor):
        return self.loss_fn(self.model, x, y)


def _stacked_step(objective: _Objective, has_logits: list) -> Callable:
    """``(params, buffers, x, y) -> (loss per seed, logits per seed)``, the seeds along the first dimension."""

    def one_seed(params, buffers, x, y):
        state = {f"model.{name}": value for name, value in (*params.items(), *buffers.items())}
        loss, logits = functional_call(objective, state, (x, y), strict=True)
        has_logits[:] = [logits is not None]  # known when the function is traced, before any result is read
        return loss, (loss.new_zeros(0) if logits is None else logits)

    return vmap(one_seed, randomness="different")


def fit_seeds(models: Sequence[nn.Module], train_data: Dataset, *, seeds: Sequence[int], epochs: int,
              batch_size: int = 128, lr: float = 1e-3, optimizer: str = "adam", weight_decay: float = 0.0,
              momentum: float = 0.9, scheduler: Callable | None = None, loss_fn: LossFn | None = None,
              callbacks: Sequence[Sequence[Tracker]] | None = None, device: str | torch.device = "auto"
              ) -> list[History]:
    """Train ``models[i]`` as ``fit(models[i], train_data, seed=seeds[i], ...)`` would, all in one batched step
    (Note [fit_seeds is fit, seed by seed]).

    Args:
        models: networks of one architecture (their own initial weights), trained in place on ``device``.
        train_data (Dataset): as for :func:`~sphereml.train.fit` (a TensorDataset, or one with ``device_batches``).
        seeds: one per model: its data order, as ``fit``'s ``seed``.
        epochs, batch_size, lr, weight_decay, momentum, scheduler, loss_fn, device: as for ``fit``.
        optimizer (str): ``"sgd"`` or ``"adam"`` (element-wise updates, so one optimiser serves every seed).
        callbacks: one list of :class:`~sphereml.train.Tracker` per model, called as ``fit`` calls them.  At a step
            where one of them records, every model is first given its current weights and buffers (one copy per
            tensor), so a tracker may read or evaluate its model; its state's optimiser is the stacked one.

    Returns:
        One :class:`~sphereml.train.History` per model: its steps' losses and, per epoch, train_loss, train_acc (when
        the loss gives logits), reg (0) and the epoch's seconds (shared by the seeds).

    Raises:
        ValueError: no model, a number of seeds that is not the number of models, models of different
            architectures, an optimiser other than ``"sgd"`` or ``"adam"``, or a bad size or rate.
    """
    _check_same_architecture(models)
    if len(models) != len(seeds):
        raise ValueError(f"fit_seeds needs one seed per model, got {len(models)} models and {len(seeds)} seeds")
    for seed in seeds:
        integer("seed", seed, at_least=0)
    integer("epochs", epochs, at_least=0)
    integer("batch_size", batch_size, at_least=1)
    real_number("lr", lr, above=0.0)
    if optimizer not in OPTIMIZERS:  # a callable's update may mix elements, and so seeds
        raise ValueError(f"optimizer must be one of {OPTIMIZERS} (element-wise, so one per seed), got {optimizer!r}")
    callbacks = _check_trackers(callbacks, len(models))
    dev = resolve_device(device)
    for model in models:
        model.to(dev)
    params, buffers = stack_state(models)
    step_count = 0
    trainable = [p for p in params.values() if p.requires_grad]
    opt = make_optimizer(optimizer, trainable, lr, weight_decay, momentum)
    sched = scheduler(opt) if scheduler is not None else None
    has_logits: list = []
    step = _stacked_step(_Objective(models[0], loss_fn or default_loss), has_logits)
    train_data = on_device(train_data, dev)
    torch.manual_seed(seeds[0])  # random layers draw from here (not fit's streams: Note [fit_seeds is fit, ...])
    histories = [History() for _ in models]
    for epoch in range(epochs):
        t0 = time.perf_counter()
        for model in models:
            model.train()  # as fit: the first model's forward runs, the others' mode follows it
        losses, sizes, correct = [], [], torch.zeros(len(models), dtype=torch.long, device=dev)
        orders = [torch.Generator().manual_seed(seed * 1_000_003 + epoch) for seed in seeds]  # as fit draws them
        for per_seed in zip(*(batches(train_data, batch_size, True, order) for order in orders)):
            x, y = (torch.stack(parts).to(dev, non_blocking=True) for parts in zip(*per_seed))
            try:
                loss, logits = step(params, buffers, x, y)
            except RuntimeError as error:
                if "setup_context" not in str(error):
                    raise
                raise ValueError("fit_seeds cannot batch this network: one of its layers has a hand-written "
                                 "backward without a vmap rule (a fused kernel of SPHEREML_FUSED=1: the patch "
                                 "epilogue or the margin cross-entropy); train its seeds with fit") from error
            opt.zero_grad(set_to_none=True)
            loss.sum().backward()  # the seeds do not interact: each slice gets its own loss's gradient
            opt.step()
            losses.append(loss.detach().double())
            sizes.append(y.shape[1])
            if has_logits[0]:
                correct += (logits.argmax(-1) == y).sum(1)
            step_count += 1
            _call_trackers(callbacks, step_count, epoch, losses[-1], models, opt, params, buffers)
        if sched is not None:
            sched.step()
        _record(histories, losses, sizes, correct if has_logits and has_logits[0] else None,
                epoch, time.perf_counter() - t0)
    unstack_state(models, params, buffers)
    for model in models:
        model._sphereml_stats_fresh = False  # the weights moved: running statistics lag (sphereml.recalibration)
    return histories


def _check_trackers(callbacks, count: int) -> list[list[Tracker]]:
    """One list of trackers per model (empty when None); any other callback is refused by name."""
    if callbacks is None:
        return [[] for _ in range(count)]
    if len(callbacks) != count:
        raise ValueError(f"callbacks needs one list per model, got {len(callbacks)} for {count} models")
    for calls in callbacks:
        for call in calls:
            if not isinstance(call, Tracker):
                raise ValueError(f"fit_seeds takes Tracker callbacks only (it knows their steps), got {call!r}")
    return [list(calls) for calls in callbacks]


def _call_trackers(callbacks, step: int, epoch: int, losses: Tensor, models, opt, params, buffers) -> None:
    """The trackers due at ``step``, each with its model holding its seed's current state."""
    if not any(t.due(step) for calls in callbacks for t in calls):
        return
    unstack_state(models, params, buffers)
    for i, (model, calls) in enumerate(zip(models, callbacks)):
        for tracker in calls:
            tracker(StepState(step=step, epoch=epoch, loss_tensor=losses[i], model=model, optimizer=opt))


def _record(histories: list[History], losses: list[Tensor], sizes: list[int], correct: Tensor | None,
            epoch: int, seconds: float) -> None:
    """Each seed's epoch record, from its steps' losses (read back once per epoch, one device sync)."""
    values = torch.stack(losses).T.tolist() if losses else [[] for _ in histories]  # [seed][step]
    counts = correct.tolist() if correct is not None else [None] * len(histories)
    seen = sum(sizes)
    for history, steps, right in zip(histories, values, counts):
        history.steps.extend(steps)
        history.epochs.append({
            "epoch": epoch + 1, "train_loss": sum(v * n for v, n in zip(steps, sizes)) / max(seen, 1),
            "train_acc": right / max(seen, 1) if right is not None else None, "reg": 0.0, "seconds": seconds})
