"""Compressive minimum hyperspherical energy, CoMHE (thesis Ch. 6, App. E).

MHE struggles in high dimension: random neurons there are already nearly orthogonal (App. E.3), the
energy landscape has many stationary points (§6.3.1) and its gradients are small.  CoMHE maps the neurons
to a low-dimensional sphere first and minimises the energy there (eq. 6.3)::

    E^C_s = sum_{i != j} f_s(|| g(w_i) - g(w_j) ||),   g(w) = P w / ||P w||,   P in R^{k x d}.

Functional core (one concept each; every energy goes through
:func:`~sphereml.energy.hyperspherical_energy`, so every backend serves CoMHE):

* :func:`projected_energies` — the energy of the projected neurons for each of C projections;
  their mean is RP-CoMHE (eq. 6.4), their max the "max" form (eq. 6.5);
* :func:`angle_distortion` — L_P of eq. 6.6 with cosines for angles (as the authors' code), as a pair mean;
* :func:`group_energy` — group CoMHE (eq. 6.9): 0/1 diagonal projections onto channel groups;
* :func:`bilateral_energy` — plain bilateral projection (eqs. E.20-E.22): the neurons projected,
  and random combinations of the neurons, each set regularised on its own sphere.

Module shell: :class:`CoMHE`, a :class:`~sphereml.regularizers.Regularizer` bound to a model once.
The thesis's defaults: k + 1 = 30 projected coordinates (§6.6.1: "projection dimension 30, i.e. k = 29";
``proj_dim`` counts the coordinates),
C = 5 projections, half-space MHE underneath, s = 2, a projection basis shared by the layers of equal
fan-in, projections redrawn every step (the authors' code) and never trained by the data loss.

Note [projection scale]
    g is invariant to the scale of P, so unscaled N(0, 1) entries are used.  Lemma 3's mean
    preservation E<P w1, P w2> = <w1, w2> needs entries of variance 1/k, where k is the number of
    rows of P; the thesis writes 1/n.  Chapter 7 checks both.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._checks import integer, one_of, real_number
from .energy import hyperspherical_energy
from .geometry import normalize
from .regularizers import LAYER_KINDS, Regularizer, network_energy, output_layer, select_layers

__all__ = ["VARIANTS", "projected_energies", "angle_distortion", "group_energy", "bilateral_energy", "CoMHE"]

VARIANTS = ("random", "random_max", "angle", "adversarial", "group", "bilateral")


def _rows(w: Tensor) -> Tensor:
    if not isinstance(w, Tensor) or w.dim() < 2:
        raise ValueError(f"w must be a Tensor[N, ...] with one neuron per row, got {getattr(w, 'shape', w)!r}")
    return w.flatten(1)  # (N, d)


def _check_projections(p: Tensor, d: int) -> Tensor:
    if not isinstance(p, Tensor) or p.dim() != 3 or p.shape[-1] != d:
        raise ValueError(f"p must be a Tensor[C, k, {d}] of projections, got {tuple(getattr(p, 'shape', ()))}")
    return p


def projected_energies(w: Tensor, p: Tensor, s: float = 2.0, half_space: bool = True,
                       backend: str = "auto") -> Tensor:
    """The energy of the neurons projected by each P_c (thesis eqs. 6.3-6.5), as a Tensor[C].

    Args:
        w (Tensor[N, ...]): neurons, one per row (flattened).
        p (Tensor[C, k, d]): C projections to k dimensions.
        s, half_space, backend: passed to :func:`~sphereml.energy.hyperspherical_energy`, which
            normalises the projected rows: g(w) = P w / ||P w|| (half-space adds -g(w)).

    Returns:
        Tensor[C]: pair-mean energies; ``.mean()`` is RP-CoMHE (eq. 6.4), ``.amax()`` its max form (eq. 6.5).
    """
    flat = _rows(w)
    _check_projections(p, flat.shape[1])
    return torch.stack([hyperspherical_energy(flat @ pc.mT, s, half_space=half_space, backend=backend) for pc in p])


def angle_distortion(w: Tensor, p: Tensor) -> Tensor:
    """L_P of eq. 6.6 with cosines for angles (as the authors' code does): the mean over pairs i != j and
    projections of (cos(P w_i, P w_j) - cos(w_i, w_j))^2.  Eq. 6.6 sums over pairs and the authors' code
    takes an unsquared Frobenius norm; the minimiser is the same, only the scale differs."""
    flat = _rows(w)
    _check_projections(p, flat.shape[1])
    if len(flat) < 2:
        raise ValueError(f"w must hold at least 2 neurons to have pairs, got {len(flat)}")
    unit = normalize(flat)
    cos = unit @ unit.mT  # (N, N)
    projected = normalize(flat @ p.mT)  # (C, N, k)
    cos_p = projected @ projected.mT  # (C, N, N)
    n = len(flat)
    off = ~torch.eye(n, dtype=torch.bool, device=flat.device)
    return (cos_p - cos)[:, off].pow(2).mean()


def group_energy(w: Tensor, group_size: int, s: float = 2.0, half_space: bool = True, backend: str = "auto") -> Tensor:
    """Group CoMHE (eq. 6.9): the mean over channel groups of the energy of the neurons restricted to a group.

    P_c keeps the coordinates of ``group_size`` consecutive input channels (a 0/1 diagonal matrix; the groups
    partition the channels).  For a conv weight Tensor[N, C_in, k, k] a channel is C_in's axis; for a linear
    weight Tensor[N, d], one input coordinate.

    Args:
        w (Tensor[N, C_in, ...]): neurons.
        group_size (int): channels per group; must divide C_in (the thesis: 8).
    """
    if not isinstance(w, Tensor) or w.dim() < 2:
        raise ValueError(f"w must be a Tensor[N, C_in, ...], got {getattr(w, 'shape', w)!r}")
    integer("group_size", group_size, at_least=1)
    if w.shape[1] % group_size:
        raise ValueError(f"group_size must divide the {w.shape[1]} input channels, got {group_size}")
    groups = w.unflatten(1, (-1, group_size)).transpose(0, 1)  # (G, N, group_size, ...)
    return torch.stack([hyperspherical_energy(g, s, half_space=half_space, backend=backend) for g in groups]).mean()


def bilateral_energy(w: Tensor, p1: Tensor, p2: Tensor, s: float = 2.0, half_space: bool = True,
                     backend: str = "auto") -> Tensor:
    """Plain bilateral-projection CoMHE (eqs. E.20-E.22) in the rows-are-neurons layout:
    E(rows of W P1^T) + E(rows of P2 W) — the neurons projected to k dimensions, and r random
    combinations of the neurons in the original d dimensions.

    Args:
        w (Tensor[N, ...]): neurons.
        p1 (Tensor[k, d]): the projection of the neurons.
        p2 (Tensor[r, N]): the combinations, r >= 2.
    """
    flat = _rows(w)
    if p1.dim() != 2 or p1.shape[1] != flat.shape[1]:
        raise ValueError(f"p1 must be a Tensor[k, {flat.shape[1]}], got {tuple(p1.shape)}")
    if p2.dim() != 2 or p2.shape[1] != len(flat) or len(p2) < 2:
        raise ValueError(f"p2 must be a Tensor[r >= 2, {len(flat)}], got {tuple(p2.shape)}")
    projected = hyperspherical_energy(flat @ p1.mT, s, half_space=half_space, backend=backend)
    return projected + hyperspherical_energy(p2 @ flat, s, half_space=half_space, backend=backend)


class CoMHE(Regularizer):
    """Compressive MHE on a model's hidden layers, plus full-space MHE on its classifier (thesis §6.3, eq. 5.4).

    ``reg()`` returns lambda_hidden * sum over hidden layers of the layer's compressive energy +
    lambda_output * E_s(classifier).  Each call is one training step: projections are redrawn every
    ``resample_every`` calls from the regulariser's own seeded generator (so a seed reproduces them),
    and they never receive a gradient from the data loss.

    Args:
        model (nn.Module): the network; its layers are selected once, here (the rule of
            :func:`~sphereml.regularizers.select_layers`).
        variant (str): ``"random"`` (RP-CoMHE, eq. 6.4), ``"random_max"`` (eq. 6.5), ``"angle"``
            (AP-CoMHE, eqs. 6.6-6.7), ``"adversarial"`` (eq. 6.8, gradient descent-ascent),
            ``"group"`` (eq. 6.9) or ``"bilateral"`` (eqs. E.20-E.22). Default: ``"random"``.
        proj_dim (int): k, the projected dimension (the thesis: 30). Layers with fan-in d <= k are
            regularised by plain MHE, as the authors do for the first layer.
        num_proj (int): C, projections per layer and step (the thesis: 5 for RP, 1 for AP).
        s (float), half_space (bool): the energy on the projected sphere (the thesis: 2, half space).
        shared_basis (bool): one projection for all layers of equal fan-in (§6.3.6); else one per layer.
        resample_every (int, None or "auto"): redraw the projections every this many calls; None never
            (Table E.4). ``"auto"``: every call, except for ``"angle"`` and ``"adversarial"``, whose fitted
            projections are kept (the authors' AP code never re-initialises). Default: ``"auto"``.
        lambda_hidden, lambda_output (float): weights of the hidden and classifier terms. Default: 1, 1.
        group_size (int): channels per group for ``"group"`` (the thesis: 8).
        ap_lr (float): the relative size of a step on P: ``"angle"`` moves P by ap_lr * ||P|| against
            grad L_P (alternating and unrolled), ``"adversarial"`` by as much along the projected
            energy's gradient (P's scale does not matter to g, so the step is scale-free). Default: 0.1.
        ap_every (int): ``"angle"``: fit P by ``ap_steps`` steps on L_P every this many calls (§6.6.1: 10).
        ap_steps (int): those steps. Default: 1.
        unrolled (bool): ``"angle"``: use P - ap_lr grad_P L_P(W, P), differentiated through W as well
            (the one-step unrolled AP-CoMHE, the thesis's best). Default: True.
        seed (int): seeds the projections. backend (str): energy backend.
    """

    def __init__(self, model: nn.Module, variant: str = "random", proj_dim: int = 30, num_proj: int = 5,
                 s: float = 2.0, half_space: bool = True, shared_basis: bool = True, resample_every="auto",
                 lambda_hidden: float = 1.0, lambda_output: float = 1.0, group_size: int = 8, ap_lr: float = 0.1,
                 ap_every: int = 10, ap_steps: int = 1, unrolled: bool = True, seed: int = 0, backend: str = "auto"):
        self.variant = one_of("variant", variant, VARIANTS)
        self.proj_dim = integer("proj_dim", proj_dim, at_least=1)
        self.num_proj = integer("num_proj", num_proj, at_least=1)
        self.s = real_number("s", s, at_least=0.0)
        self.half_space, self.shared_basis, self.unrolled = bool(half_space), bool(shared_basis), bool(unrolled)
        if resample_every == "auto":
            resample_every = None if self.variant in ("angle", "adversarial") else 1
        self.resample_every = None if resample_every is None else integer("resample_every", resample_every, at_least=1)
        self.lambda_hidden = real_number("lambda_hidden", lambda_hidden, at_least=0.0)
        self.lambda_output = real_number("lambda_output", lambda_output, at_least=0.0)
        self.group_size = integer("group_size", group_size, at_least=1)
        self.ap_lr = real_number("ap_lr", ap_lr, above=0.0)
        self.ap_every = integer("ap_every", ap_every, at_least=1)
        self.ap_steps = integer("ap_steps", ap_steps, at_least=1)
        self.seed, self.backend = integer("seed", seed, at_least=0), backend
        self.generator = torch.Generator().manual_seed(seed)
        self.hidden = [m for m in select_layers(model, LAYER_KINDS, include_output=False) if m.weight.shape[0] >= 2]
        output = output_layer(model)
        self.output = output if output is not None and self.lambda_output > 0 and output.weight.shape[0] >= 2 else None
        self.layers = self.hidden + ([self.output] if self.output is not None else [])
        if not self.layers:
            raise ValueError("the model has no layer with at least 2 neurons to regularise")
        self.calls = 0
        self.projections: dict = {}  # key -> Tensor[C, k, d] (and "combine", i -> Tensor[r, N] for bilateral)

    # ------------------------------------------------------------------ projections
    def compressed(self, layer: nn.Module) -> bool:
        """Whether ``layer`` gets the compressive energy (else plain MHE: its fan-in is at most k, or a
        channel count the groups do not divide)."""
        w = layer.weight
        if self.variant == "group":
            return w.shape[1] % self.group_size == 0 and w.shape[1] > self.group_size
        return w[0].numel() > self.proj_dim

    def key(self, index: int) -> tuple:
        """The projection a hidden layer uses: shared by fan-in, or its own."""
        d = self.hidden[index].weight[0].numel()
        return ("fan_in", d) if self.shared_basis else ("layer", index)

    def _draw(self, *shape: int, like: Tensor) -> Tensor:
        return torch.randn(*shape, generator=self.generator).to(device=like.device, dtype=like.dtype)

    def resample(self) -> None:
        """Draw every projection afresh, in a fixed order (layer order), from the seeded generator."""
        self.projections = {}
        for i, layer in enumerate(self.hidden):
            if not self.compressed(layer) or self.variant == "group":
                continue
            w = layer.weight
            key = self.key(i)
            if key not in self.projections:
                self.projections[key] = self._draw(self.num_proj, self.proj_dim, w[0].numel(), like=w)
            if self.variant == "bilateral":  # r < N combinations, so the second energy compresses too
                r = max(2, min(self.proj_dim, len(w) // 2))
                self.projections[("combine", i)] = self._draw(r, len(w), like=w)

    def _users(self) -> dict:
        """Projection key -> the hidden layers that use it (a shared basis serves several)."""
        users: dict = {}
        for i, layer in enumerate(self.hidden):
            if self.key(i) in self.projections:
                users.setdefault(self.key(i), []).append(layer)
        return users

    def _step(self, p: Tensor, objective, sign: float) -> Tensor:
        """P moved by ap_lr * ||P|| along sign * grad objective(P) (a scale-free step; differentiable)."""
        (grad,) = torch.autograd.grad(objective(p), p, create_graph=torch.is_grad_enabled() and p.requires_grad)
        scale = self.ap_lr * p.detach().norm() / grad.norm().clamp_min(1e-30)
        return p + sign * scale * grad

    def _fit_angle(self) -> None:
        """AP-CoMHE, alternating part: ``ap_steps`` steps on the summed L_P of the layers sharing each P."""
        for key, layers in self._users().items():
            p = self.projections[key]
            for _ in range(self.ap_steps):
                with torch.enable_grad():
                    p = self._step(p.detach().requires_grad_(True),
                                   lambda q: sum(angle_distortion(m.weight.detach(), q) for m in layers), -1.0)
            self.projections[key] = p.detach()

    def _ascend(self) -> None:
        """Adversarial CoMHE: one ascent step of each projection on the summed projected energy of its layers."""
        for key, layers in self._users().items():
            with torch.enable_grad():
                p = self._step(self.projections[key].detach().requires_grad_(True), lambda q: sum(
                    projected_energies(m.weight.detach(), q, self.s, self.half_space, self.backend).mean()
                    for m in layers), 1.0)
            self.projections[key] = p.detach()

    # ------------------------------------------------------------------ energies
    def layer_energy(self, index: int) -> Tensor:
        """The compressive energy of hidden layer ``index`` with the current projections."""
        layer = self.hidden[index]
        w = layer.weight
        if not self.compressed(layer):
            return hyperspherical_energy(w, self.s, half_space=self.half_space, backend=self.backend)
        if self.variant == "group":
            return group_energy(w, self.group_size, self.s, self.half_space, self.backend)
        p = self.projections[self.key(index)]
        if self.variant == "bilateral":
            return bilateral_energy(w, p[0], self.projections[("combine", index)], self.s, self.half_space,
                                    self.backend)
        if self.variant == "angle" and self.unrolled:  # one unrolled step: a second-order path to W through L_P
            with torch.enable_grad():
                p = self._step(p.detach().requires_grad_(True), lambda q: angle_distortion(w, q), -1.0)
        energies = projected_energies(w, p, self.s, self.half_space, self.backend)
        return energies.amax() if self.variant == "random_max" else energies.mean()

    def penalty(self) -> Tensor:
        due = self.resample_every is not None and self.calls % self.resample_every == 0
        if due or (self.calls == 0 and not self.projections):
            self.resample()
        if self.variant == "angle" and self.calls % self.ap_every == 0:
            self._fit_angle()
        if self.variant == "adversarial":
            self._ascend()
        self.calls += 1
        total = self.layers[0].weight.new_zeros(())
        if self.lambda_hidden > 0 and self.hidden:
            total = total + self.lambda_hidden * sum(self.layer_energy(i) for i in range(len(self.hidden)))
        if self.output is not None:  # classifier neurons: full-space MHE (§5.3.4)
            total = total + self.lambda_output * hyperspherical_energy(self.output.weight, self.s, backend=self.backend)
        return total

    def original_energy(self, s: float | None = None, half_space: bool | None = None) -> float:
        """The sum over hidden layers of the unprojected pair-mean energy (default: this regulariser's s and
        space; the thesis plots s = 1 half-space in Figs. 6.1 / E.2 and E_2 of eq. 6.1 in Fig. 6.2)."""
        return network_energy(self.hidden, self.s if s is None else s,
                              self.half_space if half_space is None else half_space)

    def __repr__(self) -> str:
        return (f"CoMHE(variant={self.variant!r}, proj_dim={self.proj_dim}, num_proj={self.num_proj}, s={self.s:g}, "
                f"half_space={self.half_space}, shared_basis={self.shared_basis}, hidden_layers={len(self.hidden)})")
