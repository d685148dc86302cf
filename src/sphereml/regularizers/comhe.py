r"""Compressive minimum hyperspherical energy, CoMHE (thesis Ch. 6, App. E).

MHE struggles in high dimension: random neurons there are already nearly orthogonal (App. E.3), the
energy landscape has many stationary points (§6.3.1) and its gradients are small.  CoMHE maps the neurons
to a low-dimensional sphere first and minimises the energy there (eq. 6.3):

.. math::

    E^C_s = \sum_{i \ne j} f_s\big(\lVert g(w_i) - g(w_j) \rVert\big), \qquad
    g(w) = \frac{P w}{\lVert P w \rVert}, \qquad P \in \mathbb{R}^{k \times d}.

Functional core (:mod:`~sphereml.regularizers.comhe_functional`, the readable references): :func:`projected_energies`
(their mean is RP-CoMHE, eq. 6.4, their max eq. 6.5), :func:`angle_distortion` (L_P of eq. 6.6) and its
closed-form gradient :func:`angle_distortion_grad`, :func:`group_energy` (eq. 6.9) and
:func:`bilateral_energy` (eqs. E.20-E.22).

The regulariser: :class:`CoMHE`, a kind of :class:`~sphereml.regularizers.MHE` whose hidden layers are
compressed.  The thesis's defaults: k + 1 = 30 projected coordinates (§6.6.1: "projection dimension 30,
i.e. k = 29"; ``proj_dim`` counts the coordinates), C = 5 projections, half-space MHE underneath, s = 2, a
projection basis shared by the layers of equal fan-in, projections redrawn every step (the authors' code)
and never trained by the data loss.

Note [CoMHE without host work]
    A step of the regulariser is one batched evaluation (Note [batched energy] in
    :mod:`~sphereml.energy.batched`): the layers of equal fan-in are packed into one Tensor[L, N, d], all
    their C projections are one batched product, channel groups are a reshape, every projected set
    joins one evaluation of the energy, and the penalty is one weighted sum of the energies it returns (the max
    form, eq. 6.5, takes each layer's maximum first).  Projections are drawn on the weights' device, from the
    regulariser's own seeded generator there, all in one draw; drawing them and fitting or ascending P
    (angle-preserving, adversarial) happen in :meth:`CoMHE.before_step`, outside the penalty, so the
    penalty is a pure function of the weights that compiles as one graph.  The unrolled angle-preserving
    step needs grad_P L_P as a function of W: it is written in closed form
    (:func:`angle_distortion_grad`), so the penalty is differentiated once, never with ``create_graph``, and
    the step's backward in W is written out too (:func:`unrolled_projection`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import Tensor, nn

from .._checks import one_of
from .comhe_functional import (angle_distortion, angle_distortion_grad, bilateral_energy, group_energy, project,
    projected_energies, projection_step, unrolled_projection)
from ..energy import BATCHED_MAX, hyperspherical_energy, layer_energy
from ..energy.batched import PointSets, SetEnergies, pair_weights
from ..energy.packing import DeviceCache, WeightPacking
from . import MHE
from .comhe_options import VARIANTS, CoMHEOptions

# The functional core lives in sphereml.regularizers.comhe_functional; its public functions are listed here too, where
# the regulariser's users look for them.
__all__ = ["VARIANTS", "CoMHEOptions", "CoMHE", "projected_energies", "angle_distortion", "angle_distortion_grad",
           "unrolled_projection", "group_energy", "bilateral_energy"]

class _Group:
    """Compressed hidden layers packed together: equal fan-in (or, for "group", equal neuron shape)."""

    def __init__(self, layers: list[int], sizes: list[int], fan_in: int, neuron_shape: torch.Size):
        self.layers, self.sizes, self.fan_in = layers, sizes, fan_in
        self.neuron_shape = neuron_shape
        self.rows = max(sizes)


class CoMHE(MHE):
    """Compressive MHE on a model's hidden layers, plus full-space MHE on its classifier (thesis §6.3, eq. 5.4).

    ``reg()`` returns beta_hidden * sum over hidden layers of the layer's compressive energy +
    beta_output * E_s(classifier).  Each call is one training step (:meth:`before_step`, then the
    penalty): projections are redrawn every ``resample_every`` calls from the regulariser's own seeded
    generator on the weights' device (so a seed reproduces them on a device), and they never receive a
    gradient from the data loss.  Note [CoMHE without host work] says how a step is batched.

    Args:
        model (nn.Module): the network; its layers are selected once, here (the rule of
            :func:`~sphereml.regularizers.select_layers`).
        variant (str): ``"random"`` (RP-CoMHE, eq. 6.4), ``"random_max"`` (eq. 6.5), ``"angle"``
            (AP-CoMHE, eqs. 6.6-6.7), ``"adversarial"`` (eq. 6.8, gradient descent-ascent),
            ``"group"`` (eq. 6.9) or ``"bilateral"`` (eqs. E.20-E.22). Default: ``"random"``.
        s (float), half_space (bool): the energy on the projected sphere (the thesis: 2, half space).
        beta_hidden, beta_output (float): weights of the hidden and classifier terms. Default: 1, 1.
        backend (str): energy backend of layers too large to batch. Default: ``"auto"``.
        options (CoMHEOptions, optional): how the projections are drawn and moved (the thesis's defaults).
        **fields: any field of :class:`CoMHEOptions`, replacing that of ``options``
            (``CoMHE(net, variant="angle", num_proj=1)``).
    """

    def __init__(self, model: nn.Module, variant: str = "random", s: float = 2.0, half_space: bool = True,
                 beta_hidden: float = 1.0, beta_output: float = 1.0, backend: str = "auto",
                 options: CoMHEOptions | None = None, **fields):
        self.variant = one_of("variant", variant, VARIANTS)
        self.options = replace(options or CoMHEOptions(), **fields)
        self.resample_every = self.options.resample_every  # "auto" resolved for the variant:
        if self.resample_every == "auto":  # the authors' AP code never re-initialises a fitted projection
            self.resample_every = None if self.variant in ("angle", "adversarial") else 1
        self.calls = 0
        self.state_from_weights = self.variant in ("angle", "adversarial")  # P fitted to, or ascended on, the weights
        self._generator: torch.Generator | None = None
        self._drawn: list[Tensor] | None = None  # per compressed group: P (and the combinations for bilateral)
        self._shares: dict = {}  # (group, device, dtype) -> the pair weights of L_P
        super().__init__(model, s, half_space, "euclidean", beta_hidden, beta_output, backend)

    # ------------------------------------------------------------------ layers and blocks
    def compressed(self, layer: nn.Module) -> bool:
        """Whether ``layer`` gets the compressive energy (else plain MHE: its fan-in is at most k, or a
        channel count the groups do not divide)."""
        w = layer.weight
        if len(w) > BATCHED_MAX:
            return False
        if self.variant == "group":
            channels = self.neuron_shape(layer)[0]
            return channels % self.options.group_size == 0 and channels > self.options.group_size
        return w[0].numel() > self.options.proj_dim

    def neuron_shape(self, layer: nn.Module) -> torch.Size:
        """A hidden layer's neuron as (input channels, coordinates per channel), the axes G-CoMHE groups (eq. 6.9):
        a conv's (C_in, k, k); a linear layer that follows a conv layer, which reads that layer's C maps flattened,
        (C, d / C), a channel's positions kept together as a conv over the whole map keeps them (the authors'
        CNN-9 computes that layer as a 4 x 4 convolution); any other linear layer (d,), its inputs the channels."""
        w = layer.weight
        if w.dim() > 2:
            return w.shape[1:]
        position = next(i for i, m in enumerate(self.hidden) if m is layer)
        before = self.hidden[position - 1].weight if position > 0 else None
        if before is not None and before.dim() > 2 and w.shape[1] % before.shape[0] == 0:
            return torch.Size((before.shape[0], w.shape[1] // before.shape[0]))
        return w.shape[1:]

    def key(self, index: int) -> tuple:
        """The projection a hidden layer uses: shared by fan-in, or its own."""
        d = self.hidden[index].weight[0].numel()
        return ("fan_in", d) if self.options.shared_basis else ("layer", index)

    def _terms(self) -> list[tuple[nn.Module, bool, float]]:
        """MHE's terms for the layers CoMHE leaves uncompressed (and the classifier)."""
        return [t for t in super()._terms() if not (t[0] in self.hidden and self.compressed(t[0]))]

    def _bind_energies(self) -> None:
        super()._bind_energies()
        by_shape: dict = {}
        for i, layer in enumerate(self.hidden):
            if self.compressed(layer):
                w = layer.weight
                by_shape.setdefault(self.neuron_shape(layer) if self.variant == "group" else w[0].numel(), []).append(i)
        self.groups = [_Group(members, [self.hidden[i].weight.shape[0] for i in members],
                              self.hidden[members[0]].weight[0].numel(), self.neuron_shape(self.hidden[members[0]]))
                       for members in by_shape.values()]
        blocks, coefficients = [], []
        for group in self.groups:
            for copies, sizes in self._sets(group):
                blocks.append(PointSets(max(sizes), tuple(n for n in sizes for _ in range(copies)),
                                        (self.half_space,) * (copies * len(sizes))))
                coefficients += [self.beta_hidden / copies] * (copies * len(sizes))
        self._compressed = SetEnergies(blocks, self.s) if blocks else None
        # each compressed set's share of the penalty: beta_hidden times a mean over the layer's projections (eq. 6.4)
        # or channel groups (eq. 6.9), or beta_hidden for each of bilateral's two energies (eq. E.22); not for the max
        self._set_coefficients = DeviceCache(torch.tensor(coefficients, dtype=torch.float64))
        # every group's weights as its Tensor[L, N, d], in one concatenation and one gather
        members, start = [], 0
        for group in self.groups:
            members.append(list(range(start, start + len(group.layers))))
            start += len(group.layers)
        self._packing = WeightPacking([self.hidden[i].weight.shape for group in self.groups for i in group.layers],
                                      members) if self.groups else None
        self._joints: dict = {}  # MHE's plan on a device -> the penalty's one evaluation there (:meth:`_joint`)

    def _joint(self, device: torch.device) -> tuple[SetEnergies, DeviceCache]:
        """The penalty's one evaluation on ``device`` and each of its sets' coefficients: MHE's batched layers (the
        classifier, uncompressed layers) in their blocks there (Note [blocks by device]) with MHE's coefficients, then
        the compressed sets with theirs (alone when MHE has no layer)."""
        if self._engine is None:
            return self._compressed, self._set_coefficients
        plan = self._engine.plan(device)
        if plan not in self._joints:
            self._joints[plan] = (SetEnergies([*plan.engine.blocks, *self._compressed.blocks], self.s),
                                  DeviceCache(torch.cat([plan.coefficients.value, self._set_coefficients.value])))
        return self._joints[plan]

    def _sets(self, group: _Group) -> list[tuple[int, list[int]]]:
        """The blocks of point sets a group makes: (sets per layer, points per set of each layer)."""
        if self.variant == "group":
            return [(group.neuron_shape[0] // self.options.group_size, group.sizes)]
        if self.variant == "bilateral":
            return [(1, group.sizes), (1, [self._combinations(n) for n in group.sizes])]
        return [(self.options.num_proj, group.sizes)]

    def _combinations(self, n: int) -> int:
        return max(2, min(self.options.proj_dim, n // 2))  # r < N combinations, so the second energy compresses too

    # ------------------------------------------------------------------ projections (outside the penalty)
    def _generator_on(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.options.seed)
        return self._generator

    def resample(self) -> None:
        """Draw every projection afresh, in one draw on the weights' device from the seeded generator."""
        if self.variant == "group" or not self.groups:
            self._drawn = []
            return
        w, opts = self.layers[0].weight, self.options
        shapes = []
        for group in self.groups:
            projection = (1 if self.variant == "bilateral" else opts.num_proj, opts.proj_dim, group.fan_in)
            shapes.append(projection if opts.shared_basis else (len(group.layers), *projection))
            if self.variant == "bilateral":
                shapes.append((len(group.layers), max(map(self._combinations, group.sizes)), group.rows))
        numbers = [torch.Size(shape).numel() for shape in shapes]
        draw = torch.randn(sum(numbers), generator=self._generator_on(w.device), device=w.device, dtype=w.dtype)
        parts = [part.view(shape) for part, shape in zip(draw.to(torch.float64).split(numbers), shapes)]
        if self.variant == "bilateral":  # zero the combinations' padding: rows beyond r, columns beyond n
            for g, group in enumerate(self.groups):
                mask = torch.zeros_like(parts[2 * g + 1])
                for l, n in enumerate(group.sizes):
                    mask[l, :self._combinations(n), :n] = 1.0
                parts[2 * g + 1] = parts[2 * g + 1] * mask
        self._drawn = parts

    @property
    def projections(self) -> dict:
        """The current projections by :meth:`key` (Tensor[C, k, d]), and ("combine", i) -> Tensor[r, N] for
        bilateral: copies, in the weights' dtype, of what :meth:`resample` drew (kept in float64)."""
        out: dict = {}
        if not self._drawn:
            return out
        dtype = self.layers[0].weight.dtype
        for g, group in enumerate(self.groups):
            p = self._drawn[2 * g if self.variant == "bilateral" else g].to(dtype)
            for l, i in enumerate(group.layers):
                out[self.key(i)] = p if self.options.shared_basis else p[l]
                if self.variant == "bilateral":
                    n = group.sizes[l]
                    out[("combine", i)] = self._drawn[2 * g + 1][l, :self._combinations(n), :n].to(dtype)
        return out

    def _share(self, group: _Group, device: torch.device) -> Tensor:
        """Pair weights of L_P for a group: 1 / (C n (n - 1)) on real pairs i != j (Tensor[L, N, N])."""
        minus, _ = pair_weights(PointSets(group.rows, tuple(group.sizes), (False,) * len(group.sizes)),
                                "pair_mean", device)
        return minus / self.options.num_proj

    def _step(self, p: Tensor, grad: Tensor, sign: float) -> Tensor:
        """Each P_l (Tensor[L, C, k, d]) moved along sign * grad_l: by ap_lr * ||P_l|| (a scale-free step), or by
        ap_lr * grad_l (``ap_step="plain"``)."""
        return projection_step(p, grad, sign * self.options.ap_lr, self.options.ap_step != "plain")

    def _fit_angle(self) -> None:
        """AP-CoMHE, alternating part: ``ap_steps`` steps on the summed L_P of the layers sharing each P."""
        with torch.no_grad():
            for g, (group, x) in enumerate(zip(self.groups, self._pack(detach=True, dtype=self._dtype))):
                share = self._share_cache(g, group, x.device)
                p = self._drawn[g].to(self._dtype)
                for _ in range(self.options.ap_steps):
                    grad = angle_distortion_grad(x, p, share)  # (L, C, k, d)
                    if self.options.shared_basis:
                        p = self._step(p.unsqueeze(0), grad.sum(0, keepdim=True), -1.0)[0]
                    else:
                        p = self._step(p, grad, -1.0)
                self._drawn[g] = p.to(torch.float64)

    def _ascend(self) -> None:
        """Adversarial CoMHE: one ascent step of each projection on the summed projected energy of its layers."""
        with torch.enable_grad():
            ps = [p.detach().requires_grad_(True) for p in self._drawn]
            energies = self._compressed([self._projected(group, x, p)
                                         for group, x, p in zip(self.groups, self._pack(detach=True), ps)])
            objective = sum(e.sum() for e in energies) / self.options.num_proj
            grads = torch.autograd.grad(objective, ps)
        with torch.no_grad():
            for g, grad in enumerate(grads):
                p = self._drawn[g]
                self._drawn[g] = self._step(p.unsqueeze(0), grad.unsqueeze(0), 1.0)[0] if p.dim() == 3 \
                    else self._step(p, grad, 1.0)

    def before_step(self) -> None:
        """Redraw the projections when due, fit (``"angle"``) or ascend (``"adversarial"``) them; count the call."""
        super().before_step()
        device = self.layers[0].weight.device
        if self._compressed is not None:  # the constants of the penalty (and of the ascent), on the device once
            joint, coefficients = self._joint(device)
            joint.prepare(device)
            coefficients.get(device)
            if self.variant == "adversarial":
                self._compressed.prepare(device)
        if self._packing is not None:
            self._packing.prepare(device, self._dtype)
        for g, group in enumerate(self.groups):
            if self.variant == "angle":
                self._share_cache(g, group, device)
        due = self.resample_every is not None and self.calls % self.resample_every == 0
        if due or self._drawn is None:
            self.resample()
        if self.variant == "angle" and self.calls % self.options.ap_every == 0 and self.groups:
            self._fit_angle()
        if self.variant == "adversarial" and self.groups:
            self._ascend()
        self.calls += 1

    batches_seeds = MHE.batches_seeds  # declared again: only a class's own declaration counts
    setting_names = MHE.setting_names + ("variant", "options")

    def seed_state(self) -> list[Tensor]:
        """The projections (and bilateral's combinations) as drawn, fitted or ascended: what two runs' CoMHE
        regularisers of one network hold apart."""
        return list(self._drawn or [])

    @contextmanager
    def seed_state_as(self, state: list[Tensor]):
        """Inside the block, the penalty projects with ``state`` (another seed's projections); its own afterwards."""
        own, self._drawn = self._drawn, list(state)
        try:
            yield
        finally:
            self._drawn = own

    # ------------------------------------------------------------------ the penalty (pure, batched)
    def _pack(self, detach: bool = False, dtype: torch.dtype = torch.float64) -> list[Tensor]:
        """Each group's weights as one Tensor[L, N, d] of ``dtype`` (zero rows padding its smaller layers)."""
        weights = [self.hidden[i].weight for group in self.groups for i in group.layers]
        return self._packing([w.detach() for w in weights] if detach else weights, dtype)

    @staticmethod
    def _projected(group: _Group, x: Tensor, p: Tensor) -> Tensor:
        """The projected sets of a group as Tensor[L * C, N, k] (layer-major)."""
        return project(x, p).flatten(0, 1)

    def _blocks(self, g: int, group: _Group, x: Tensor, low: Tensor | None) -> list[Tensor]:
        """The point sets of group ``g`` from its packed weights ``x`` (float64; ``low``: in the weights' dtype, for
        the unrolled step)."""
        if self.variant == "group":  # channel groups of a (C_in, k, k) neuron are consecutive coordinates
            groups = group.neuron_shape[0] // self.options.group_size
            return [x.unflatten(2, (groups, -1)).transpose(1, 2).flatten(0, 1)]  # (L * G, N, group_size * k * k)
        p = self._drawn[2 * g if self.variant == "bilateral" else g]
        if self.variant == "bilateral":
            return [self._projected(group, x, p), self._drawn[2 * g + 1] @ x]  # (L, N, k), (L, r, d)
        if self.variant == "angle" and self.options.unrolled:  # one unrolled step, a function of W (eq. 6.7)
            p = self._unrolled(g, low, p)
        return [self._projected(group, x, p)]

    @property
    def _dtype(self) -> torch.dtype:
        """The weights' dtype: L_P (smooth in the cosines, no close-pair cancellation) is computed in it."""
        return self.layers[0].weight.dtype

    def _unrolled(self, g: int, x: Tensor, p: Tensor) -> Tensor:
        """P - step * grad_P L_P(W, P) per layer (Tensor[L, C, k, d], float64), a function of W (eq. 6.7); ``x``:
        group ``g``'s packed weights in their dtype."""
        p = p.to(self._dtype)
        share = self._share_cache(g, self.groups[g], x.device)
        return unrolled_projection(x, p, share, self.options.ap_lr, self.options.ap_step != "plain").to(torch.float64)

    def _share_cache(self, g: int, group: _Group, device: torch.device) -> Tensor:
        key = (g, device, self._dtype)
        if key not in self._shares:
            self._shares[key] = self._share(group, device).to(self._dtype)
        return self._shares[key]

    def penalty(self) -> Tensor:
        """beta_hidden * sum of the hidden layers' compressive energies + beta_output * E_s(classifier)."""
        if self._drawn is None:
            self.resample()
        if self._compressed is None or self.beta_hidden == 0:
            return super().penalty()  # the uncompressed layers and the classifier
        packed = self._pack()
        unrolled = self.variant == "angle" and self.options.unrolled
        low = self._pack(dtype=self._dtype) if unrolled else [None] * len(packed)
        points = [block for g, group in enumerate(self.groups) for block in self._blocks(g, group, packed[g], low[g])]
        joint, coefficients = self._joint(points[0].device)
        mhe = self._engine.pack(self._batched_weights()) if self._engine is not None else []
        if self.variant != "random_max":  # every energy enters linearly: one weighted sum
            energies = joint.joined([*mhe, *points])  # one evaluation of every set: MHE's blocks first
            return self._single_penalty((energies * coefficients.get(energies.device)).sum())
        energies = joint([*mhe, *points])
        total = self._single_penalty(self._engine.weighted_total(energies[:len(mhe)]) if mhe else None)
        per_layer = [sets.view(len(group.layers), -1).amax(1) for group, sets in zip(self.groups, energies[len(mhe):])]
        hidden = torch.cat(per_layer).sum() if len(per_layer) > 1 else per_layer[0].sum()
        return total + (self.beta_hidden * hidden).to(total.dtype)

    # ------------------------------------------------------------------ analysis
    def layer_energy(self, index: int) -> Tensor:
        """The compressive energy of hidden layer ``index`` with the current projections, by the functional
        references (one layer at a time: for analysis and tests; the penalty computes all layers batched)."""
        if self._drawn is None:
            self.resample()
        layer = self.hidden[index]
        w = layer.weight
        if not self.compressed(layer):
            return hyperspherical_energy(w, self.s, half_space=self.half_space, backend=self.backend)
        if self.variant == "group":
            return group_energy(w.reshape(len(w), *self.neuron_shape(layer)), self.options.group_size, self.s,
                                self.half_space, self.backend)
        p = self.projections[self.key(index)]
        if self.variant == "bilateral":
            return bilateral_energy(w, p[0], self.projections[("combine", index)], self.s, self.half_space,
                                    self.backend)
        if self.variant == "angle" and self.options.unrolled:
            x, p64 = w.flatten(1).to(torch.float64)[None], p.to(torch.float64)[None]
            n = len(w)
            share = pair_weights(PointSets(n, (n,), (False,)), "pair_mean", w.device)[0] / self.options.num_proj
            p = self._step(p64, angle_distortion_grad(x, p64, share), -1.0)[0].to(w.dtype)
        energies = projected_energies(w, p, self.s, self.half_space, self.backend)
        return energies.amax() if self.variant == "random_max" else energies.mean()

    def original_energy(self, s: float | None = None, half_space: bool | None = None) -> float:
        """The sum over hidden layers of the unprojected pair-mean energy (default: this regulariser's s and
        space; the thesis plots s = 1 half-space in Figs. 6.1 / E.2 and E_2 of eq. 6.1 in Fig. 6.2)."""
        if not self.hidden:
            return 0.0
        return layer_energy(self.hidden, self.s if s is None else s,
                            self.half_space if half_space is None else half_space)

    def state_dict(self) -> dict:
        """What a checkpoint needs to continue the same projections: calls, generator state, projections."""
        return {"calls": self.calls, "generator": None if self._generator is None else self._generator.get_state(),
                "drawn": None if self._drawn is None else [p.detach().cpu() for p in self._drawn]}

    def load_state_dict(self, state: dict) -> None:
        device = self.layers[0].weight.device
        self.calls = state["calls"]
        if state["generator"] is not None:
            self._generator_on(device).set_state(state["generator"])
        self._drawn = None if state["drawn"] is None else [p.to(device) for p in state["drawn"]]

    def __repr__(self) -> str:
        return (f"CoMHE(variant={self.variant!r}, s={self.s:g}, half_space={self.half_space}, "
                f"beta_hidden={self.beta_hidden:g}, beta_output={self.beta_output:g}, {self.options}, "
                f"hidden_layers={len(self.hidden)})")
