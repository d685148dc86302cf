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
stacked state is first copied into the models; a callback that acts on the weights alike for every seed (weight
projection, ``stacked``) acts on the stack. A regulariser bound to the first model is evaluated with each seed's
weights (the stacked step swaps them into the model's layers). A list of regularisers, one bound to each model, keeps
each seed's own state (CoMHE's projections): each seed's ``before_step`` runs on its own weights; then, when every one
may be batched (:func:`batches_seeds`) and they differ in nothing but that state, the first is evaluated in the
batched step with each seed's weights and state (``seed_state``), else each on its seed's weights, one after
another. Per-epoch validation evaluates each model in turn. What it leaves out is what would couple or serialise the
seeds: other callbacks, gradient hooks (weighted gradients), checkpoints, and random layers (dropout draws its noise
per seed, but not from ``fit``'s stream). Every operation needs a batching rule: PyTorch's layers and losses have
them, and so have our hand-written backward passes, written in the form ``torch.func`` batches (``setup_context``,
``generate_vmap_rule``): the margin heads' weight-normalised product, the patch layers' (SphereConv, SCS, the
decoupled operators), the angular functions' and MHE's batched energy. The fused Triton kernels of a GPU
(``SPHEREML_FUSED=1``: the patch epilogue and kernels' normalisation, the margin cross-entropy) have none, and a
network that reaches one is refused by name.
"""

from __future__ import annotations

import inspect
import time
from contextlib import nullcontext
from functools import partial
from typing import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils.data import Dataset

from ._checks import integer, real_number
from ._step_records import StepRecords
from .train import (History, LossFn, StepState, Tracker, batches, default_loss, evaluate,
                    make_optimizer, on_device, penalty_of, resolve_device)

__all__ = ["fit_seeds", "can_train_together", "batches_seeds", "stack_state", "unstack_state", "stacked_callbacks",
           "has_gradient_hooks", "elementwise_optimizer", "same_optimizer"]

OPTIMIZERS = ("sgd", "adam")
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam)  # their step updates each element from its own gradient


def same_optimizer(a, b) -> bool:
    """Whether two optimisers as :func:`~sphereml.train.fit` takes them are the same: equal names, or partials of
    one class with equal settings (a partial compares by identity)."""
    if isinstance(a, partial) and isinstance(b, partial):
        return a.func is b.func and a.args == b.args and a.keywords == b.keywords
    return a is b or (isinstance(a, str) and a == b)


def elementwise_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` (as :func:`~sphereml.train.fit` takes it) updates every element on its own, so that one
    optimiser over the stacked seeds is one per seed: ``"sgd"``, ``"adam"``, or SGD or Adam with its settings
    bound by ``functools.partial`` (no positional argument, no parameter groups).  Any other function may build
    groups from one model's parameters, or mix elements (OPT's orthogonal gradient descent)."""
    if isinstance(optimizer, str):
        return optimizer in OPTIMIZERS
    return isinstance(optimizer, partial) and optimizer.func in ELEMENTWISE and not optimizer.args


def has_gradient_hooks(models: Sequence[nn.Module]) -> bool:
    """Whether a parameter of one of ``models`` has a gradient hook (e.g. weighted gradients, eq. 4.18): the stacked
    copies :func:`fit_seeds` trains would not carry it."""
    return any(p._backward_hooks for model in models for p in model.parameters())


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
    """``loss_fn(model, x, y)`` and the regulariser's penalty as a module's forward, so that ``functional_call`` can
    swap the model's state: a regulariser bound to the model's layers then reads the seed's weights, and its seed
    state, when given (one regulariser per seed), is swapped in too."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, regularizer):
        super().__init__()
        self.model, self.loss_fn, self.regularizer = model, loss_fn, regularizer

    def forward(self, x: Tensor, y: Tensor, seed_state: list[Tensor]):
        loss, logits = self.loss_fn(self.model, x, y)
        if self.regularizer is None:
            return loss, logits, loss.new_zeros(())
        swapped = self.regularizer.seed_state_as(seed_state) if seed_state else nullcontext()
        with swapped:
            return loss, logits, penalty_of(self.regularizer)


def _stacked_step(objective: _Objective, has_logits: list) -> Callable:
    """``(params, buffers, x, y, seed_state) -> (loss, logits, penalty)`` per seed, the seeds along the first
    dimension (``seed_state``: the stacked :meth:`~sphereml.regularizers.Regularizer.seed_state` of one regulariser
    per seed, or empty)."""

    def one_seed(params, buffers, x, y, seed_state):
        state = {f"model.{name}": value for name, value in (*params.items(), *buffers.items())}
        loss, logits, penalty = functional_call(objective, state, (x, y, seed_state), strict=True)
        has_logits[:] = [logits is not None]  # known when the function is traced, before any result is read
        return loss, (loss.new_zeros(0) if logits is None else logits), penalty

    return vmap(one_seed, randomness="different")


def fit_seeds(models: Sequence[nn.Module], train_data: Dataset, *, seeds: Sequence[int], epochs: int,
              batch_size: int = 128, lr: float = 1e-3, optimizer: str | partial = "adam", weight_decay: float = 0.0,
              momentum: float = 0.9, scheduler: Callable | None = None, loss_fn: LossFn | None = None,
              regularizer: Callable[[], Tensor] | Sequence | None = None, callbacks: Sequence[Sequence] | None = None,
              val_data: Dataset | None = None, device: str | torch.device = "auto") -> list[History]:
    """Train ``models[i]`` as ``fit(models[i], train_data, seed=seeds[i], ...)`` would, all in one batched step
    (Note [fit_seeds is fit, seed by seed]).

    Args:
        models: networks of one architecture (their own initial weights), trained in place on ``device``.
        train_data (Dataset): as for :func:`~sphereml.train.fit` (a TensorDataset, or one with ``device_batches``).
        seeds: one per model: its data order, as ``fit``'s ``seed``.
        epochs, batch_size, lr, weight_decay, momentum, scheduler, loss_fn, device: as for ``fit``.
        regularizer: as for ``fit``, either one bound to ``models[0]`` that may be batched (:func:`batches_seeds`:
            e.g. ``MHE(models[0])``), whose penalty is evaluated with each seed's weights in the batched step and
            whose ``before_step`` runs once per step for all seeds; or a list with one per model, each bound to its
            model (its own state, e.g. CoMHE's projections seeded by the run), ``before_step`` run on its seed's
            weights, then evaluated in the batched step as the first one with each seed's weights and
            ``seed_state()`` when all may be batched with equal ``penalty_settings``, else one after another.
        optimizer: ``"sgd"``, ``"adam"``, or ``functools.partial(torch.optim.SGD or Adam, **settings)``
            (element-wise updates, so one optimiser serves every seed: :func:`elementwise_optimizer`).
        callbacks: one list per model, called as ``fit`` calls them (:func:`stacked_callbacks`).  Trackers
            (:class:`~sphereml.train.Tracker`): at a step where one of them records, every model is first given its
            current weights and buffers (one copy per tensor), so a tracker may read or evaluate its model; its
            state's optimiser is the stacked one.  A callback with a ``stacked`` method, alike in every list,
            runs once per step on the stacked parameters (``stacked(step, models[0], params)``).
        val_data (Dataset, optional): as for ``fit``: each model evaluated after each epoch (``val_loss``,
            ``val_acc``), given its seed's weights first.

    Returns:
        One :class:`~sphereml.train.History` per model: its steps' losses and, per epoch, train_loss, train_acc (when
        the loss gives logits), reg (the mean penalty), val_loss and val_acc (with ``val_data``) and the epoch's
        seconds (shared by the seeds).

    Raises:
        ValueError: no model, a number of seeds that is not the number of models, models of different
            architectures, an optimiser other than ``"sgd"`` or ``"adam"``, a regulariser bound to other layers than
            ``models[0]``'s, whose state follows the weights or that may not be batched, a list of regularisers that
            is not one bound to each model, callbacks it cannot run as ``fit`` does, or a bad size or rate.
    """
    _check_same_architecture(models)
    if has_gradient_hooks(models):
        raise ValueError("a parameter has a gradient hook (weighted gradients?): fit_seeds trains stacked copies, "
                         "which would not carry it; train the seeds with fit")
    one_each = isinstance(regularizer, (list, tuple))
    _check_bound(regularizer, models)
    if len(models) != len(seeds):
        raise ValueError(f"fit_seeds needs one seed per model, got {len(models)} models and {len(seeds)} seeds")
    for seed in seeds:
        integer("seed", seed, at_least=0)
    integer("epochs", epochs, at_least=0)
    integer("batch_size", batch_size, at_least=1)
    real_number("lr", lr, above=0.0)
    if not elementwise_optimizer(optimizer):  # another function's update may mix elements, and so seeds
        raise ValueError(f"optimizer must be one of {OPTIMIZERS} or a functools.partial of SGD or Adam (element-wise, "
                         f"so one per seed), got {optimizer!r}")
    shared, callbacks = _check_callbacks(callbacks, len(models))
    dev = resolve_device(device)
    for model in models:
        model.to(dev)
    params, buffers = stack_state(models)
    step_count = 0
    trainable = [p for p in params.values() if p.requires_grad]
    opt = make_optimizer(optimizer, trainable, lr, weight_decay, momentum)
    sched = scheduler(opt) if scheduler is not None else None
    has_logits: list = []
    alike = one_each and _alike(regularizer, models)  # one per seed, evaluated as the first with each one's state
    in_step = (regularizer[0] if alike else None) if one_each else regularizer  # else each after the step
    step = _stacked_step(_Objective(models[0], loss_fn or default_loss, in_step), has_logits)
    train_data = on_device(train_data, dev)
    torch.manual_seed(seeds[0])  # random layers draw from here (not fit's streams: Note [fit_seeds is fit, ...])
    histories = [History() for _ in models]
    for epoch in range(epochs):
        t0 = time.perf_counter()
        for model in models:
            model.train()  # as fit: the first model's forward runs, the others' mode follows it
        records = StepRecords(seeds=True)  # read back once per epoch (Note [a step's bookkeeping])
        orders = [torch.Generator().manual_seed(seed * 1_000_003 + epoch) for seed in seeds]  # as fit draws them
        for per_seed in zip(*(batches(train_data, batch_size, True, order) for order in orders)):
            x, y = (torch.stack(parts).to(dev, non_blocking=True) for parts in zip(*per_seed))
            seed_state = []
            if alike:  # each seed's before_step on its own weights, then their states stacked
                _before_steps(regularizer, models, params)
                seed_state = [torch.stack(parts) for parts in zip(*(reg.seed_state() for reg in regularizer))]
            elif hasattr(regularizer, "before_step"):
                regularizer.before_step()  # as fit: per-step state, shared by the seeds as fit's runs share it
            try:
                loss, logits, penalty = step(params, buffers, x, y, seed_state)
            except RuntimeError as error:
                if "setup_context" not in str(error) and "functorch transform" not in str(error):
                    raise
                raise ValueError("fit_seeds cannot batch this step: a layer with a hand-written backward without a "
                                 "vmap rule (a fused kernel of SPHEREML_FUSED=1: the patch epilogue, the kernels' "
                                 "normalisation or the margin cross-entropy), or a gradient taken inside the loss "
                                 "(adversarial training); train its seeds with fit") from error
            opt.zero_grad(set_to_none=True)
            if one_each and not alike:  # zeros from the stacked step, then each seed's own regulariser
                penalty = penalty + _seed_penalties(regularizer, models, params)
            (loss + penalty).sum().backward()  # the seeds do not interact: each slice gets its own gradient
            opt.step()
            records.add(loss, penalty, logits if has_logits[0] else None, y, y.shape[1])
            step_count += 1
            for callback in shared:
                callback.stacked(step_count, models[0], params)
            _call_trackers(callbacks, step_count, epoch, records.losses[-1], models, opt, params, buffers)
        if sched is not None:
            sched.step()
        _record(histories, records, epoch)
        if val_data is not None:
            _validate(histories, models, params, buffers, val_data, max(batch_size, 512), dev, loss_fn)
        for history in histories:
            history.epochs[-1]["seconds"] = time.perf_counter() - t0
    unstack_state(models, params, buffers)
    for model in models:
        model._sphereml_stats_fresh = False  # the weights moved: running statistics lag (sphereml.recalibration)
    return histories


# the settings of fit that fit_seeds takes too: any other (compile, checkpoint, progress) trains seed by seed
_SETTINGS_TAKEN = frozenset(inspect.signature(fit_seeds).parameters) - {
    "models", "train_data", "seeds", "device", "callbacks", "regularizer"}


def can_train_together(models: Sequence[nn.Module], optimizers: Sequence, callbacks=None, regularizers=(),
                       settings: dict | None = None) -> bool:
    """Whether :func:`fit_seeds` can train ``models`` as :func:`~sphereml.train.fit` would one after another, given
    each model's optimiser and callbacks (as ``fit`` takes them), the regularisers (``None`` for none) and ``fit``'s
    other settings (a ``None`` value counts as not given): more than one model, callbacks it can stack
    (:func:`stacked_callbacks`), only settings it takes, no gradient hook, one element-wise optimiser alike for every
    model (:func:`elementwise_optimizer`), regularisers that name their layers and a loss without a gradient inside
    (``inner_gradient``: adversarial training)."""
    given = {name: value for name, value in (settings or {}).items() if value is not None}
    return (len(models) > 1 and stacked_callbacks(callbacks) is not None and set(given) <= _SETTINGS_TAKEN
            and not getattr(given.get("loss_fn"), "inner_gradient", False)
            and not has_gradient_hooks(models) and elementwise_optimizer(optimizers[0])
            and all(same_optimizer(other, optimizers[0]) for other in optimizers[1:])
            and all(hasattr(reg, "layers") for reg in regularizers if reg is not None))


def _check_bound(regularizer, models: Sequence[nn.Module]) -> None:
    """One regulariser bound to the first model (those layers the stacked step swaps), its per-step state
    independent of the weights (one state serves every seed); or one per model, each bound to its model."""
    if isinstance(regularizer, (list, tuple)):
        if len(regularizer) != len(models):
            raise ValueError(f"regularizer needs one per model, got {len(regularizer)} for {len(models)} models")
        for i, (reg, model) in enumerate(zip(regularizer, models)):
            if reg is None or not _bound_to(reg, model):
                raise ValueError(f"regularizer {i} is not bound to models[{i}]")
        return
    if regularizer is not None and not _bound_to(regularizer, models[0]):
        raise ValueError("fit_seeds needs a Regularizer bound to models[0] (its layers are evaluated with each "
                         "seed's weights), or a list with one per model; this one names no layers, or another "
                         "network's")
    if getattr(regularizer, "state_from_weights", False):
        raise ValueError(f"{type(regularizer).__name__}'s before_step reads the weights (angle-fitted or "
                         "adversarial projections), so each seed needs its own: give a list, one per model")
    if regularizer is not None and not batches_seeds(regularizer):
        raise ValueError(f"{type(regularizer).__name__} does not declare batches_seeds (other state, or an energy "
                         "without a batching rule), so it cannot serve every seed: give a list, one per model")


def batches_seeds(regularizer) -> bool:
    """Whether :func:`fit_seeds` may evaluate ``regularizer``'s penalty in the seeds' batched step: its own class
    (not only a parent, which knows nothing of a subclass's state) declares ``batches_seeds``, and it is true for
    this one (:class:`~sphereml.regularizers.Regularizer`)."""
    return "batches_seeds" in vars(type(regularizer)) and bool(regularizer.batches_seeds)


def _bound_to(regularizer, model: nn.Module) -> bool:
    """Whether a regulariser names its layers (``layers``: a :class:`~sphereml.regularizers.Regularizer`), all of
    them layers of ``model``: a bare function could hold any tensors, which the stacked step would not swap."""
    modules = set(model.modules())
    return bool(getattr(regularizer, "layers", None)) and all(layer in modules for layer in regularizer.layers)


class _OnSeedWeights(nn.Module):
    """A regulariser and its model as a module, so that ``functional_call`` can give the model one seed's weights
    while the regulariser runs (its penalty, or its ``before_step``)."""

    def __init__(self, model: nn.Module, regularizer):
        super().__init__()
        self.model, self.regularizer = model, regularizer


class _Penalty(_OnSeedWeights):
    def forward(self) -> Tensor:
        return penalty_of(self.regularizer)


class _BeforeStep(_OnSeedWeights):
    def forward(self) -> None:
        self.regularizer.before_step()  # e.g. CoMHE fitting its projections to these weights


def _before_steps(regularizers, models, params: dict[str, Tensor]) -> None:
    """Each seed's regulariser's ``before_step`` on its slice of the stacked weights (detached), as ``fit`` calls it
    before the step."""
    for i, (regularizer, model) in enumerate(zip(regularizers, models)):
        if hasattr(regularizer, "before_step"):
            detached = {f"model.{name}": value[i].detach() for name, value in params.items()}
            functional_call(_BeforeStep(model, regularizer), detached, (), strict=False)


def _seed_penalties(regularizers, models, params: dict[str, Tensor]) -> Tensor:
    """Tensor[S]: each seed's own regulariser on its slice of the stacked weights (after its ``before_step``), one
    seed after another: for regularisers that are not :func:`_alike`."""
    _before_steps(regularizers, models, params)
    return torch.stack([functional_call(_Penalty(model, regularizer), {f"model.{n}": p[i] for n, p in params.items()},
                                        (), strict=False)
                        for i, (regularizer, model) in enumerate(zip(regularizers, models))])


def _alike(regularizers, models: Sequence[nn.Module]) -> bool:
    """Whether one regulariser per seed can be evaluated as the first one given each seed's weights and seed state:
    each may be (:func:`batches_seeds`), and all have the first one's ``penalty_settings``."""
    return all(map(batches_seeds, regularizers)) and len(
        {reg.penalty_settings(model) for reg, model in zip(regularizers, models)}) == 1


def stacked_callbacks(callbacks) -> list | None:
    """The callbacks :func:`fit_seeds` runs once for the whole stack, or ``None`` where it cannot take ``callbacks``
    (one list per model).  It takes :class:`~sphereml.train.Tracker` objects (each with its own model), and
    callbacks with a ``stacked(step, model, params)`` method (such as
    :class:`~sphereml.layers.decoupled_training.WeightProjection`) that come before any tracker and are equal in
    every model's list: they change the stacked parameters of every seed at once, as ``fit`` calls them."""
    if callbacks is None:
        return []
    per_model = []
    for calls in map(list, callbacks):
        others = [c for c in calls if not isinstance(c, Tracker)]
        if any(not hasattr(c, "stacked") for c in others) or calls[:len(others)] != others:
            return None
        per_model.append(others)
    if any(others != per_model[0] for others in per_model[1:]):
        return None
    return per_model[0] if per_model else []


def _check_callbacks(callbacks, count: int) -> tuple[list, list[list[Tracker]]]:
    """``(callbacks run on the stack, one list of trackers per model)``; anything else is refused by name."""
    if callbacks is None:
        return [], [[] for _ in range(count)]
    if len(callbacks) != count:
        raise ValueError(f"callbacks needs one list per model, got {len(callbacks)} for {count} models")
    shared = stacked_callbacks(callbacks)
    if shared is None:
        raise ValueError("fit_seeds takes Tracker callbacks, and callbacks with a stacked(step, model, params) "
                         "method listed first and alike for every model; got " + repr(list(map(list, callbacks))))
    return shared, [[c for c in calls if isinstance(c, Tracker)] for calls in callbacks]


def _call_trackers(callbacks, step: int, epoch: int, losses: Tensor, models, opt, params, buffers) -> None:
    """The trackers due at ``step``, each with its model holding its seed's current state."""
    if not any(t.due(step) for calls in callbacks for t in calls):
        return
    unstack_state(models, params, buffers)
    for i, (model, calls) in enumerate(zip(models, callbacks)):
        for tracker in calls:
            tracker(StepState(step=step, epoch=epoch, loss_tensor=losses[i], model=model, optimizer=opt))


def _record(histories: list[History], records: StepRecords, epoch: int) -> None:
    """Each seed's epoch record, from its steps' losses and penalties (read back once per epoch, one device sync)."""
    losses, penalties, sizes, correct = records.losses, records.penalties, records.sizes, records.correct()
    both = (torch.stack([torch.stack(losses), torch.stack(penalties)]).double().permute(2, 0, 1).tolist() if losses
            else [[[], []] for _ in histories])  # [seed][loss or penalty][step]
    counts = correct.tolist() if correct is not None else [None] * len(histories)
    seen = max(sum(sizes), 1)
    for history, (steps, regs), right in zip(histories, both, counts):
        history.steps.extend(steps)
        history.epochs.append({
            "epoch": epoch + 1, "train_loss": sum(v * n for v, n in zip(steps, sizes)) / seen,
            "train_acc": right / seen if right is not None else None,
            "reg": sum(v * n for v, n in zip(regs, sizes)) / seen})


def _validate(histories: list[History], models, params, buffers, val_data: Dataset, batch_size: int,
              device: torch.device, loss_fn: LossFn | None) -> None:
    """``fit``'s end-of-epoch evaluation of each model, given its seed's current state first."""
    unstack_state(models, params, buffers)
    for history, model in zip(histories, models):
        val = evaluate(model, val_data, batch_size=batch_size, device=device, loss_fn=loss_fn)
        history.epochs[-1].update(val_loss=val["loss"], val_acc=val["accuracy"])
