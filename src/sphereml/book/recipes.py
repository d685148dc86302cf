"""The sources' own training set-ups, as data: what the ``paper`` profile trains with.

A chapter's ``gpu`` profile trains its CIFAR networks for a few dozen epochs; the ``paper`` profile trains them as
the source prints it — optimiser, learning rate and its schedule, batch size and length — so that a reader with
the hours to spare can compare with the tables digit for digit.  Each :class:`Recipe` names where its numbers are
printed and what the source leaves open (and what we chose there).  A recipe's ``runs`` is how many runs the source
averages (OPT's App. F.3: ten); the other tables report single runs (no error bars), and the ``paper`` profile trains
as many seeds per row (:meth:`~sphereml.book.chapter.Chapter.runs`).

:meth:`~sphereml.book.chapter.Chapter.recipe` turns a recipe into :func:`~sphereml.train.fit`'s keyword arguments,
and ``python -m sphereml.book estimate NAME`` scales a measured ``gpu`` run to it (:func:`paper_estimate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Recipe", "PAPER", "recipe_for", "full_gpu_run", "run_seconds", "paper_estimate"]


@dataclass(frozen=True)
class Recipe:
    """One training set-up as a source prints it.

    Args:
        source (str): where the numbers are printed (e.g. ``"thesis §2.2.7"``).
        optimizer (str): ``"sgd"`` or ``"adam"``.
        lr (float): the initial (for ``one_cycle``: the largest) learning rate.
        batch_size (int): images per step.
        iterations (int): the run's length in steps; or give ``epochs``.
        epochs (int): the run's length in epochs; or give ``iterations``.
        milestones (tuple[int]): the learning rate is multiplied by ``gamma`` at these steps (with ``iterations``)
            or epochs (with ``epochs``).
        gamma (float): the factor at each milestone. Default: 0.1.
        momentum (float): SGD's momentum. Default: 0.
        weight_decay (float): L2 weight decay. Default: 0.
        one_cycle (bool): a one-cycle schedule peaking at ``lr`` instead of milestones, stepped once per epoch as
            :func:`~sphereml.train.fit` steps every scheduler (a coarser form of a per-step schedule). Default: False.
        runs (int): how many runs the source averages per number. Default: 1.
        open (str): what the source leaves open, and what we chose.
    """

    source: str
    optimizer: str
    lr: float
    batch_size: int
    iterations: int | None = None
    epochs: int | None = None
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    one_cycle: bool = False
    runs: int = 1
    open: str = ""

    def __post_init__(self):
        if (self.iterations is None) == (self.epochs is None):
            raise ValueError(f"{self.source}: give the length as iterations or as epochs, not both or neither")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be 'sgd' or 'adam', got {self.optimizer!r}")
        length = self.iterations if self.iterations is not None else self.epochs
        if list(self.milestones) != sorted(self.milestones) or any(not 0 < m < length for m in self.milestones):
            raise ValueError(f"milestones must increase inside the run (0, {length}), got {self.milestones}")
        if self.one_cycle and self.milestones:
            raise ValueError("a one-cycle schedule has no milestones")
        if self.runs < 1:
            raise ValueError(f"runs must be at least 1, got {self.runs}")

    def steps_per_epoch(self, n_train: int) -> int:
        """Steps of one epoch over ``n_train`` images (the last batch may be partial)."""
        return math.ceil(n_train / self.batch_size)

    def num_epochs(self, n_train: int) -> int:
        """The run's length in epochs: ``epochs``, or ``iterations`` rounded up to whole epochs."""
        if self.epochs is not None:
            return self.epochs
        return math.ceil(self.iterations / self.steps_per_epoch(n_train))

    def milestone_epochs(self, n_train: int) -> list[int]:
        """The milestones in epochs (:func:`~sphereml.train.fit` steps its scheduler once per epoch): an
        iteration milestone becomes the nearest epoch boundary."""
        if self.epochs is not None:
            return list(self.milestones)
        return [max(1, round(m / self.steps_per_epoch(n_train))) for m in self.milestones]

    def fit_kwargs(self, n_train: int) -> dict:
        """:func:`~sphereml.train.fit`'s keyword arguments for a training set of ``n_train`` images."""
        epochs, milestones = self.num_epochs(n_train), self.milestone_epochs(n_train)
        lr, gamma, one_cycle = self.lr, self.gamma, self.one_cycle

        def scheduler(optimizer):
            if one_cycle:
                return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=epochs)
            return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma)

        return {"epochs": epochs, "batch_size": self.batch_size, "lr": lr, "optimizer": self.optimizer,
                "momentum": self.momentum, "weight_decay": self.weight_decay, "scheduler": scheduler}


_SGD_01 = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}
_SPHERENET = Recipe("thesis §3.4.1", "adam", 1e-3, 128, iterations=64_000, milestones=(34_000, 54_000))
_AUTHORS_75K = {"iterations": 75_000, "milestones": (30_000, 50_000, 65_000)}

PAPER: dict[str, dict[str, Recipe]] = {  # chapter -> section -> the source's set-up
    "02_large_margin": {"cifar": Recipe(
        "thesis §2.2.7", batch_size=256, weight_decay=5e-4, iterations=18_000, milestones=(12_000, 15_000),
        **_SGD_01)},
    "03_spherenet": {"cifar": _SPHERENET},
    "04_decoupled": {"cifar": Recipe(
        "thesis §4.6 and App. C.2 (Adam, lr 1e-3, batch 128); length and schedule from the released code "
        "(wy1iu/DCNets, dcnet_cifar100/*/train_resnet.py)", "adam", 1e-3, 128,
        iterations=42_500, milestones=(20_000, 30_000, 37_500),
        open="the thesis divides the learning rate by 10 'when the error plateaus' and does not give the length; "
             "the released ResNet-32 code trains 42,500 iterations, dividing at 20k, 30k and 37.5k")},
    "05_sharpened_cosine": {
        "rohrer100k": Recipe("SCS paper App. A (optimiser, schedule) and §4 (800 epochs for gallery networks)",
                             "adam", 0.01, 128, epochs=800, one_cycle=True,
                             open="the batch size is not reported; we use 128"),
        "resnet18": Recipe("SCS paper App. A (optimiser, schedule) and §4 (200 epochs for the others)",
                           "adam", 0.01, 128, epochs=200, one_cycle=True,
                           open="the batch size is not reported; we use 128"),
    },
    "06_mhe": {"cifar": Recipe(
        "thesis App. D.1 (momentum: §5.5)", batch_size=128, weight_decay=1e-4, iterations=42_500,
        milestones=(20_000, 30_000, 37_500), **_SGD_01)},
    "07_comhe": {"cifar": Recipe(
        "thesis App. E.1 (batch 128, lr 0.1, weight decay 1e-4) and §6.6 (SGD, momentum 0.9); length and schedule "
        "from the authors' code", batch_size=128, weight_decay=1e-4, **_AUTHORS_75K, **_SGD_01,
        open="the thesis divides the rate 'when saturated', by a factor it does not give; the authors' code by 10 "
             "at 30k, 50k and 65k of 75k steps (with weight decay 5e-4, where we keep the thesis's 1e-4)")},
    "08_convsim": {
        "cnn": Recipe("ConvSim paper §6.2 (Table 8)", "sgd", 0.01, 512, epochs=100,
                      open="momentum is not stated; §7 implies plain SGD"),
        "resnet18": Recipe("ConvSim paper §6.4 (Fig. 7: lr 0.01, batch 64)", "sgd", 0.01, 64, epochs=50,
                           open="momentum is not stated; §7 implies plain SGD"),
    },
    "09_opt": {"cifar": Recipe(
        "thesis App. F.3 (SGD, momentum 0.9, batch 128, lr 0.1, weight decay 5e-4, 10 runs); length and schedule "
        "from the authors' code", batch_size=128, weight_decay=5e-4, **_AUTHORS_75K, **_SGD_01, runs=10,
        open="the thesis divides the rate 'when saturated'; the authors' code at 30k, 50k and 65k of 75k steps")},
}


def recipe_for(chapter: str, section: str = "cifar") -> Recipe:
    """The source's set-up for one section of a chapter (``KeyError`` naming the known ones otherwise)."""
    sections = PAPER.get(chapter)
    if sections is None:
        raise KeyError(f"{chapter} has no paper recipe; chapters with one: {sorted(PAPER)}")
    if section not in sections:
        raise KeyError(f"{chapter} has no paper recipe {section!r}; it has {sorted(sections)}")
    return sections[section]


def full_gpu_run(metrics: dict) -> bool:
    """A run that can time the ``paper`` profile: a ``gpu`` run, not a tiny one, that had the device to itself."""
    return metrics.get("profile") == "gpu" and not metrics.get("tiny") and not metrics.get("runs_beside")


def run_seconds(metrics: dict) -> float:
    """A run's time: its clock, plus the trainings a resumed run restored from an earlier one."""
    measured = float(metrics.get("elapsed_seconds", sum(f["seconds"] for f in metrics.get("fits", []))))
    return measured + metrics.get("restored", {}).get("seconds", 0.0)


def paper_estimate(metrics: dict) -> dict:
    """What the ``paper`` profile of a chapter would take, from a measured ``gpu`` run's ``metrics.json``.

    The run's trainings with a recipe (:meth:`~sphereml.book.chapter.Chapter.recipe`) are scaled by the images
    the source's recipe trains on against those the run trained on (time per image assumed independent of the
    batch size), times the recipe's ``runs``; everything else (the Fashion-MNIST sections, evaluations, figures) is
    taken as measured.

    Returns:
        dict: ``device_name``, ``measured_s``, ``estimated_s`` and ``rows``, one dict per recipe training with
        ``section``, ``epochs``, ``seconds``, ``paper_epochs``, ``runs`` and ``estimated_s``.

    Raises:
        ValueError: the run is not a full ``gpu`` run, it shared the device with other runs (``runs_beside``),
            or it trained nothing with a recipe.
    """
    if metrics.get("profile") != "gpu" or metrics.get("tiny"):
        kind = "a tiny gpu run" if metrics.get("tiny") else f"a {metrics.get('profile')!r} run"
        raise ValueError(f"the estimate scales a full gpu run; this is {kind}")
    if metrics.get("runs_beside"):  # gpu_check.sh chapters-at-once: its clock is a shared device's
        raise ValueError(f"the estimate scales a run that had the device to itself; this one ran beside "
                         f"{metrics['runs_beside']} other(s) (SPHEREML_RUNS_BESIDE)")
    fits = [f for f in metrics.get("fits", []) if f.get("recipe")]
    if not fits:
        raise ValueError("this gpu run trained nothing with a source's recipe (were the CIFAR archives missing? "
                         "see the run's *_skipped entries)")
    rows = []
    for fit in fits:
        recipe = recipe_for(metrics["chapter"], fit["recipe"])
        epochs = recipe.num_epochs(fit["n_train"])
        scale = recipe.runs * epochs / max(fit["epochs"], 1)  # the gpu profile trains each row once
        rows.append({"section": fit["recipe"], "epochs": fit["epochs"], "seconds": fit["seconds"],
                     "paper_epochs": epochs, "runs": recipe.runs, "estimated_s": fit["seconds"] * scale})
    measured = run_seconds(metrics)
    scaled = sum(r["estimated_s"] - r["seconds"] for r in rows)
    return {"device_name": metrics.get("device_name", "an unnamed device"), "measured_s": measured,
            "estimated_s": measured + scaled, "rows": rows}
