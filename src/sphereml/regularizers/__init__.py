"""Weight regularisers added to a task loss, each bound to a model's layers once.

The protocol (every regulariser follows it)::

    reg = MHE(model, s=2.0)          # picks its layers here, once
    penalty = reg()                  # a 0-dim Tensor: the weighted penalty of the current weights
    fit(model, data, epochs=3, regularizer=reg)   # adds reg() to every step's loss

Which layers a regulariser sees is decided by one rule, :func:`select_layers`:

* *kinds*: ``"conv"`` is every ``nn.Conv1d`` / ``Conv2d`` / ``Conv3d`` (SphereConv included),
  ``"linear"`` every ``nn.Linear`` (SphereLinear included) and the model's margin head;
* *the output layer* is ``model.head`` when it has a ``weight`` (a
  :class:`~sphereml.models.Classifier`), else the last ``nn.Linear`` in module order; each
  regulariser says whether it includes it.

Regularisers:

* :class:`Orthonormality` — beta * sum ||W W^T - I||_F^2 over the flattened kernels (thesis §3.2.4;
  the baseline of the MHE chapter and the "kernel orthogonality" of the convolutional-similarity paper).
* :class:`Orthogonality` — beta * sum ||W W^T - diag(W W^T)||_F^2: orthogonal but not unit kernels, the
  decoupled networks' replacement for weight decay (thesis §4.5, App. C.1).
* :class:`ConvSimilarity` — beta * sum over conv layers of L_CS (convolutional-similarity paper, Algorithm 2);
  :func:`model_similarity` and :func:`iterative_initialization` (its Algorithm 1) walk the same layers.
* :class:`MHE` — minimum hyperspherical energy on hidden and output layers (thesis eq. 5.4).

Beside them, in this package:

* :mod:`~sphereml.regularizers.comhe` — compressive MHE (:class:`~sphereml.regularizers.comhe.CoMHE`, a kind of
  MHE): random, angle-preserving, adversarial, group and bilateral projections (thesis Ch. 6).
* :mod:`~sphereml.regularizers.comhe_functional` — CoMHE's functional core: projected, group and bilateral
  energies, the angle distortion L_P.
* :mod:`~sphereml.regularizers.comhe_options` — CoMHE's variants and options (projections, their steps).
* :mod:`~sphereml.regularizers.convsim` — convolutional similarity of kernels (pure tensor math).
* :mod:`~sphereml.regularizers.orthogonalizers` — Gram-Schmidt, Householder, Löwdin, Cayley, exp; the Cayley
  SGD step.
* :mod:`~sphereml.regularizers.rotations` — the rotation parametrisation of an OPT layer, and a model's rotations
  evaluated together, one call per method and block size.
* :mod:`~sphereml.regularizers.opt` — orthogonal over-parameterised training (OPT, PE-OPT, S-OPT), refinement,
  OGD (thesis Ch. 7).
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import integer, one_of, real_number
from ..energy import BACKENDS, BATCHED_MAX, METRICS, hyperspherical_energy
from ..energy.batched import LayerEnergies
from .convsim import conv_similarity

__all__ = [
    "LAYER_KINDS", "output_layer", "select_layers", "Regularizer", "orthonormality_penalty", "Orthonormality",
    "orthogonality_penalty", "Orthogonality",
    "ConvSimilarity", "model_similarity", "iterative_initialization", "feature_map_cosines", "MHE",
]

LAYER_KINDS = ("conv", "linear")
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def output_layer(model: nn.Module) -> nn.Module | None:
    """The classifier layer: ``model.head`` when it has a weight, else the last ``nn.Linear`` (or None)."""
    head = getattr(model, "head", None)
    if head is not None and isinstance(getattr(head, "weight", None), Tensor):
        return head
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def select_layers(model: nn.Module, kinds: tuple[str, ...] = LAYER_KINDS,
                  include_output: bool = True) -> list[nn.Module]:
    """The layers of ``model`` a regulariser acts on, in module order (see the module docstring).

    Args:
        model (nn.Module): the network.
        kinds (tuple[str]): any of ``"conv"`` and ``"linear"``. Default: both.
        include_output (bool): keep the output layer (:func:`output_layer`) when its kind is selected.
            Default: True.

    Returns:
        list of modules, each with a ``weight`` Tensor[S, ...] (one neuron per row).
    """
    kinds = tuple(one_of("kind", kind, LAYER_KINDS) for kind in kinds)
    output = output_layer(model)
    chosen = []
    for module in model.modules():
        is_conv = isinstance(module, _CONV)
        is_linear = isinstance(module, nn.Linear) or (module is output and not is_conv)
        if (is_conv and "conv" in kinds) or (is_linear and "linear" in kinds):
            if include_output or module is not output:
                chosen.append(module)
    return chosen


class Regularizer:
    """Base class: ``__init__(model, ...)`` selects ``self.layers`` once; ``__call__()`` returns the penalty.

    Subclasses implement :meth:`penalty` (the unweighted sum) and set ``self.beta`` (its weight; a regulariser's
    weights are ``beta`` throughout the package, ``beta_hidden`` and ``beta_output`` for MHE's two terms).  A
    regulariser with state that changes from step to step (CoMHE's projections) updates it in
    :meth:`before_step`, so that :meth:`penalty` is a pure function of the weights that
    ``torch.compile(fullgraph=True)`` can trace; ``__call__`` runs both, and
    :func:`~sphereml.train.fit` with ``compile=`` calls :meth:`before_step` eagerly and compiles the rest.
    """

    beta: float = 1.0
    layers: list[nn.Module]
    state_from_weights: bool = False  # whether before_step reads the weights (then each seed needs its own state)
    # whether sphereml.multiseed.fit_seeds may evaluate the penalty in the seeds' batched step: it reads nothing but
    # its layers' weights, the settings named in setting_names and seed_state(), through operations with batching
    # rules.  Only a class's own declaration counts (a subclass may add state): see multiseed.batches_seeds
    batches_seeds: bool = False
    setting_names: tuple[str, ...] = ("beta",)  # what, besides the layers, makes the penalty (penalty_settings)

    def _bind(self, model: nn.Module, kinds: tuple[str, ...], include_output: bool) -> None:
        self.layers = select_layers(model, kinds, include_output)
        if not self.layers:
            raise ValueError(f"the model has no layer of kind {kinds} for {type(self).__name__}")

    def penalty(self) -> Tensor:
        raise NotImplementedError

    def before_step(self) -> None:
        """Update per-step state (nothing here); called once per training step, before :meth:`penalty`."""

    def seed_state(self) -> list[Tensor]:
        """The tensors besides the weights that :meth:`penalty` reads and that differ from seed to seed (CoMHE's
        projections, drawn from each run's generator): none here."""
        return []

    @contextmanager
    def seed_state_as(self, state: list[Tensor]):
        """Inside the block, :meth:`penalty` reads ``state`` (as :meth:`seed_state` gives it) instead of its own."""
        yield

    def penalty_settings(self, model: nn.Module) -> tuple:
        """What makes :meth:`penalty` besides the layers' weights and :meth:`seed_state`: the class, the settings
        named in ``setting_names`` (as ``repr`` gives them; an option record's seed left out, as seeds make seed
        states) and where the layers sit in ``model``.  Two regularisers of a class that declares ``batches_seeds``
        with equal settings compute the same penalty from the same weights and seed state."""
        names = {module: name for name, module in model.named_modules()}
        settings = []
        for key in self.setting_names:
            value = getattr(self, key)
            if dataclasses.is_dataclass(value) and any(field.name == "seed" for field in dataclasses.fields(value)):
                value = dataclasses.replace(value, seed=0)
            settings.append((key, repr(value)))
        return type(self), tuple(settings), tuple(names.get(layer) for layer in self.layers)

    def weighted_penalty(self) -> Tensor:
        """beta times :meth:`penalty`: what is added to the loss (no state update)."""
        return self.beta * self.penalty()

    def __call__(self) -> Tensor:
        self.before_step()
        return self.weighted_penalty()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(beta={self.beta:g}, layers={len(self.layers)})"


def orthonormality_penalty(weight: Tensor) -> Tensor:
    """||W W^T - I||_F^2 with one row per output unit (a conv kernel flattened over C x k x k).

    Zero exactly when the rows are orthonormal; needs at most as many rows as columns to
    be reachable (otherwise its minimum is positive).
    """
    if weight.dim() < 2:
        raise ValueError(f"weight must have an output axis and at least one input axis, got {tuple(weight.shape)}")
    rows = weight.flatten(1)  # (S, C*k*k)
    gram = rows @ rows.T  # (S, S)
    return (gram - torch.eye(len(rows), dtype=gram.dtype, device=gram.device)).pow(2).sum()


def orthogonality_penalty(weight: Tensor) -> Tensor:
    """||W W^T - diag(W W^T)||_F^2 (thesis §4.5): the squared inner products of distinct flattened kernels.

    Zero exactly when the rows are mutually orthogonal, whatever their norms (unlike
    :func:`orthonormality_penalty`), so it leaves the kernel norms to the decoupled operators.
    """
    if weight.dim() < 2:
        raise ValueError(f"weight must have an output axis and at least one input axis, got {tuple(weight.shape)}")
    rows = weight.flatten(1)  # (S, C*k*k)
    gram = rows @ rows.T  # (S, S)
    return gram.pow(2).sum() - gram.diagonal().pow(2).sum()


class Orthonormality(Regularizer):
    """beta * sum over layers of :func:`orthonormality_penalty`.

    Args:
        model (nn.Module): the network; its layers are selected once, here.
        beta (float): weight of the penalty. Default: 1e-3.
        include_linear (bool): add every linear layer, the output layer included, to the conv
            layers. Default: False.
    """

    batches_seeds = True

    def __init__(self, model: nn.Module, beta: float = 1e-3, include_linear: bool = False):
        self.beta = real_number("beta", beta, at_least=0.0)
        self._bind(model, ("conv", "linear") if include_linear else ("conv",), include_output=True)

    def penalty(self) -> Tensor:
        return sum(orthonormality_penalty(m.weight) for m in self.layers)


class Orthogonality(Orthonormality):
    """beta * sum over layers of :func:`orthogonality_penalty` (the decoupled networks' regulariser, §4.5);
    arguments as :class:`Orthonormality`.  The thesis gives no beta; the default is 1e-3."""

    batches_seeds = True

    def penalty(self) -> Tensor:
        return sum(orthogonality_penalty(m.weight) for m in self.layers)


def _layers_similarity(layers: list[nn.Module], mode: str | int, method: str, normalized: bool) -> Tensor:
    return sum(conv_similarity(m.weight, mode, method, normalized) for m in layers)


class ConvSimilarity(Regularizer):
    """beta * sum over every conv layer of :func:`~sphereml.regularizers.convsim.conv_similarity` (Algorithm 2 of
    the paper).

    Args:
        model (nn.Module): the network; its conv layers are selected once, here.
        beta (float): weight of the penalty (the paper uses 1e-3). Default: 1e-3.
        mode, method, normalized: passed to :func:`~sphereml.regularizers.convsim.conv_similarity`.
    """

    batches_seeds = True
    setting_names = ("beta", "mode", "method", "normalized")

    def __init__(self, model: nn.Module, beta: float = 1e-3, mode: str | int = "full", method: str = "auto",
                 normalized: bool = False):
        self.beta = real_number("beta", beta, at_least=0.0)
        self.mode, self.method, self.normalized = mode, method, normalized
        self._bind(model, ("conv",), include_output=True)

    def penalty(self) -> Tensor:
        """The unweighted sum of L_CS over the conv layers."""
        return _layers_similarity(self.layers, self.mode, self.method, self.normalized)


def model_similarity(model: nn.Module, mode: str | int = "full", method: str = "auto",
                     normalized: bool = False) -> Tensor:
    """The sum of :func:`~sphereml.regularizers.convsim.conv_similarity` over every conv layer of ``model`` (the
    paper's sum)."""
    return ConvSimilarity(model, 1.0, mode, method, normalized).penalty()


def iterative_initialization(model: nn.Module, steps: int, lr: float = 1e-3, betas=(0.9, 0.999),
                             mode: str | int = "full", normalized: bool = False) -> dict[str, list[float]]:
    """Minimise the summed L_CS of every conv layer with Adam before training (the paper's Algorithm 1).

    Only conv weights change.  Returns the history of the loss and of the total squared kernel
    norm sum_layers ||W||^2, which the paper does not track: L_CS is homogeneous of degree 4,
    so gradient descent on it also shrinks the kernels (see the chapter).

    Args:
        model (nn.Module): trained in place.
        steps (int): number of Adam steps I >= 0 (the paper uses 500 for its CNNs, 200 for ResNet-18).
        lr (float), betas: Adam settings (paper: 1e-3 and (0.5, 0.999) for ResNet-18).
    """
    integer("steps", steps, at_least=0)
    reg = ConvSimilarity(model, 1.0, mode, "auto", normalized)
    weights = [m.weight for m in reg.layers]
    opt = torch.optim.Adam(weights, lr=lr, betas=betas)
    history: dict[str, list[float]] = {"loss": [], "squared_norm": []}

    def tracked_loss() -> Tensor:
        loss = reg.penalty()
        history["loss"].append(float(loss.detach()))
        history["squared_norm"].append(float(sum(w.detach().pow(2).sum() for w in weights)))
        return loss

    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        tracked_loss().backward()
        opt.step()
    with torch.no_grad():
        tracked_loss()  # the state after the last step
    return history


def feature_map_cosines(model: nn.Module, inputs: Tensor) -> Tensor:
    """The feature-map similarity that convolutional similarity aims to lower, measured in a network: for each
    input, the mean absolute cosine between the bias-free maps X ⊛ K_i and X ⊛ K_j (i != j) of every conv layer with
    at least two kernels, X the layer's input, averaged over those layers; Tensor[B].

    Measured on a copy of ``model`` in training mode, so BatchNorm normalises with the batch's own statistics
    (a network just initialised, or shrunk by :func:`iterative_initialization`, passes tiny activations on in
    eval mode, and the conv biases would dominate every later map); ``model`` itself is left as it was.
    """
    probe = copy.deepcopy(model).train()
    per_layer = []

    def record(layer, args, _output):
        if layer.padding_mode != "zeros":
            raise ValueError(f"feature_map_cosines needs zero padding, got padding_mode={layer.padding_mode!r}")
        conv = getattr(F, f"conv{layer.weight.dim() - 2}d")
        maps = conv(args[0], layer.weight, None, layer.stride, layer.padding, layer.dilation, layer.groups)
        unit = maps.flatten(2) / maps.flatten(2).norm(dim=2, keepdim=True).clamp_min(1e-12)
        cos = (unit @ unit.transpose(1, 2)).abs()
        kernels = cos.shape[1]
        per_layer.append((cos.sum((1, 2)) - cos.diagonal(dim1=1, dim2=2).sum(1)) / (kernels * (kernels - 1)))

    layers = [m for m in select_layers(probe, ("conv",)) if m.weight.shape[0] > 1]
    if not layers:
        raise ValueError("feature_map_cosines needs a conv layer with at least two kernels")
    hooks = [layer.register_forward_hook(record) for layer in layers]
    try:
        with torch.no_grad():
            probe(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(per_layer).mean(0)


class MHE(Regularizer):
    """Minimum hyperspherical energy regulariser (thesis eq. 5.4):

        beta_hidden * sum_hidden E_s(layer) + beta_output * E_s(classifier),

    each E_s the pair mean of :func:`~sphereml.energy.hyperspherical_energy` over the layer's
    neurons (a conv kernel flattened over C x k x k is one neuron).  Hidden layers are every
    conv and linear layer but the output layer (:func:`select_layers`); the output layer always
    uses the full-space energy (§5.3.4), ``half_space`` applies to hidden layers.  Layers with
    fewer than 2 neurons are skipped.

    Every layer with at most :data:`~sphereml.energy.BATCHED_MAX` neurons is evaluated in one batched,
    sync-free call (:class:`~sphereml.energy.batched.LayerEnergies`, Note [batched energy]); larger
    layers, or an explicit ``backend``, go through :func:`~sphereml.energy.hyperspherical_energy` one
    layer at a time.

    Args:
        model (nn.Module): the network; its layers are selected once, here.
        s, metric, backend: passed to :func:`~sphereml.energy.hyperspherical_energy`.
        half_space (bool): half-space MHE in hidden layers. Default: False.
        beta_hidden, beta_output (float): the weights lambda_h and lambda_o of eq. 5.4 (named ``beta_*`` as every
            regulariser's weight is; the thesis's defaults: 10 for full-space and
            1 for half-space hidden MHE, 1 for the output layer; App. D.1). Default: 1 and 1.
    """

    setting_names = ("s", "half_space", "metric", "beta_hidden", "beta_output", "backend")

    @property
    def batches_seeds(self) -> bool:
        """Every energy goes through the batched evaluation (an explicit backend, or a layer above BATCHED_MAX, goes
        through :func:`~sphereml.energy.hyperspherical_energy`, which has no batching rule)."""
        return not self._single

    def __init__(self, model: nn.Module, s: float = 2.0, half_space: bool = False, metric: str = "euclidean",
                 beta_hidden: float = 1.0, beta_output: float = 1.0, backend: str = "auto"):
        self.beta_hidden = real_number("beta_hidden", beta_hidden, at_least=0.0)
        self.beta_output = real_number("beta_output", beta_output, at_least=0.0)
        self.metric = one_of("metric", metric, METRICS)
        self.s = real_number("s", s, at_least=0.0)
        self.half_space, self.backend = bool(half_space), one_of("backend", backend, BACKENDS)
        output = output_layer(model)
        self.hidden = [m for m in select_layers(model, LAYER_KINDS, include_output=False) if m.weight.shape[0] >= 2]
        use_output = output is not None and self.beta_output > 0 and output.weight.shape[0] >= 2
        self.output = output if use_output else None
        self.layers = self.hidden + ([self.output] if self.output is not None else [])
        if not self.layers:
            raise ValueError("the model has no layer with at least 2 neurons to regularise")
        self._bind_energies()

    def _terms(self) -> list[tuple[nn.Module, bool, float]]:
        """(layer, half space, coefficient) of every energy in the penalty."""
        terms = [(m, self.half_space, self.beta_hidden) for m in self.hidden]
        if self.output is not None:
            terms.append((self.output, False, self.beta_output))  # classifier neurons: full space (§5.3.4)
        return terms

    def _bind_energies(self) -> None:
        """Split the terms into those of the batched evaluation and the rest (per layer)."""
        terms = self._terms()
        batched = self.backend in ("auto", "batched")
        self._batched = [t for t in terms if batched and t[0].weight.shape[0] <= BATCHED_MAX]
        self._single = [t for t in terms if t not in self._batched]
        self._engine = None
        if self._batched:
            self._engine = LayerEnergies([m.weight.shape for m, _, _ in self._batched], self.s, self.metric,
                                         [half for _, half, _ in self._batched],
                                         coefficients=[c for _, _, c in self._batched])

    def _energy(self, layer: nn.Module, half_space: bool) -> Tensor:
        backend = "auto" if self.backend == "batched" else self.backend
        return hyperspherical_energy(layer.weight, self.s, self.metric, half_space, backend=backend)

    def energies(self) -> dict[str, Tensor]:
        """The hidden-layer energies (a list in module order) and the output energy."""
        out = {"hidden": [self._energy(m, self.half_space) for m in self.hidden]}
        if self.output is not None:
            out["output"] = self._energy(self.output, False)  # classifier neurons: full space (§5.3.4)
        return out

    def mean_hidden_energy(self) -> float:
        """The mean of the hidden-layer energies, as a number (no graph): a yardstick during training."""
        with torch.no_grad():
            hidden = [float(self._energy(m, self.half_space)) for m in self.hidden]
        return sum(hidden) / max(len(hidden), 1)

    def before_step(self) -> None:
        """Put the batched evaluation's constants on the weights' device (once), outside any compiled graph."""
        if self._engine is not None:
            self._engine.prepare(self.layers[0].weight.device, self.layers[0].weight.dtype)

    def _batched_weights(self) -> list[Tensor]:
        """The weights of the layers in the batched evaluation, in its order."""
        return [m.weight for m, _, _ in self._batched]

    def penalty(self) -> Tensor:
        batched = self._engine.total(self._batched_weights()) if self._engine is not None else None
        return self._single_penalty(batched)

    def _single_penalty(self, batched: Tensor | None) -> Tensor:
        """The penalty from the batched layers' weighted total (or None): plus the layers evaluated one by one."""
        weight = self.layers[0].weight
        total = batched.to(weight.dtype) if batched is not None else weight.new_zeros(())
        for layer, half, coefficient in self._single:
            if coefficient > 0:
                total = total + coefficient * self._energy(layer, half)
        return total

    def __repr__(self) -> str:
        return (f"MHE(s={self.s:g}, metric={self.metric!r}, half_space={self.half_space}, "
                f"beta_hidden={self.beta_hidden:g}, beta_output={self.beta_output:g}, "
                f"hidden_layers={len(self.hidden)}, output={self.output is not None})")
