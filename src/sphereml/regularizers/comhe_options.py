"""The options of :class:`~sphereml.regularizers.comhe.CoMHE` (thesis Ch. 6, App. E): the variants, and how the
projections are drawn and moved."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import integer, one_of, real_number

__all__ = ["VARIANTS", "CoMHEOptions"]

#: The projections of CoMHE: random (RP, its mean or max), angle-preserving, adversarial, group, bilateral.
VARIANTS = ("random", "random_max", "angle", "adversarial", "group", "bilateral")


@dataclass(frozen=True)
class CoMHEOptions:
    """How :class:`~sphereml.regularizers.comhe.CoMHE` draws its projections and how the angle-preserving and
    adversarial variants move them.

    The thesis's defaults: k = 30 projected coordinates (§6.6.1 says "projection dimension 30, i.e. k = 29";
    ``proj_dim`` counts the coordinates), C = 5 projections, one basis shared by the layers of equal fan-in,
    projections redrawn every step (the authors' code).

    Attributes:
        proj_dim (int): k, the projected dimension. Layers with fan-in d <= k are regularised by plain MHE, as
            the authors do for the first layer. Default: 30.
        num_proj (int): C, projections per layer and step (the thesis: 5 for RP, 1 for AP). Default: 5.
        shared_basis (bool): one projection for all layers of equal fan-in (§6.3.6); else one per layer.
        resample_every (int, None or "auto"): redraw the projections every this many calls; None never
            (Table E.4). ``"auto"``: every call, except for ``"angle"`` and ``"adversarial"``, whose fitted
            projections are kept (the authors' AP code never re-initialises). Default: ``"auto"``.
        group_size (int): channels per group for ``"group"`` (the thesis: 8).
        ap_lr (float): the size of a step on P: with ``ap_step="relative"``, ``"angle"`` moves P by
            ap_lr * ||P|| against grad L_P (alternating and unrolled; unrolled, the step's size is a constant to
            autograd, eq. 6.7's eta) and ``"adversarial"`` by as much along the projected energy's gradient (P's
            scale does not matter to g, so the step is scale-free); with
            ``"plain"``, P - ap_lr * grad (the authors' code, which uses the network's learning rate).
            Default: 0.1.
        ap_step (str): ``"relative"`` or ``"plain"``, see ``ap_lr``. Default: ``"relative"``.
        ap_every (int): ``"angle"``: fit P by ``ap_steps`` steps on L_P every this many calls (§6.6.1: 10).
        ap_steps (int): those steps. Default: 1.
        unrolled (bool): ``"angle"``: use P - ap_lr grad_P L_P(W, P), differentiated through W as well
            (the one-step unrolled AP-CoMHE, the thesis's best). Default: True.
        seed (int): seeds the projections. Default: 0.
    """

    proj_dim: int = 30
    num_proj: int = 5
    shared_basis: bool = True
    resample_every: int | str | None = "auto"
    group_size: int = 8
    ap_lr: float = 0.1
    ap_step: str = "relative"
    ap_every: int = 10
    ap_steps: int = 1
    unrolled: bool = True
    seed: int = 0

    def __post_init__(self):
        integer("proj_dim", self.proj_dim, at_least=1)
        integer("num_proj", self.num_proj, at_least=1)
        if self.resample_every not in ("auto", None):
            integer("resample_every", self.resample_every, at_least=1)
        integer("group_size", self.group_size, at_least=1)
        object.__setattr__(self, "ap_lr", real_number("ap_lr", self.ap_lr, above=0.0))
        one_of("ap_step", self.ap_step, ("relative", "plain"))
        integer("ap_every", self.ap_every, at_least=1)
        integer("ap_steps", self.ap_steps, at_least=1)
        integer("seed", self.seed, at_least=0)
        object.__setattr__(self, "shared_basis", bool(self.shared_basis))
        object.__setattr__(self, "unrolled", bool(self.unrolled))
