"""The chapter runtime: profiles, per-chapter outputs (figures, ``metrics.json``) and claim records.

Profiles (book/reproducing.md):

* ``smoke`` — seconds; exercises every code path (tests and CI);
* ``cpu``   — minutes on two cores, real data; what the rendered book shows;
* ``gpu``   — full Fashion-MNIST, and the sources' CIFAR networks for a few dozen epochs: minutes on one GPU;
* ``paper`` — the ``gpu`` profile with the CIFAR networks trained as the sources print it (:mod:`.recipes`):
  hours; opt-in, never chosen by ``auto``.

``auto`` resolves to ``$SPHEREML_PROFILE`` when set, else ``gpu`` when CUDA is
available, else ``cpu``.  Every chapter opens with::

    ch = Chapter("06_mhe", profile, device, seed, output_dir, params=dict(...))

and then uses ``ch.pick(smoke=…, cpu=…, gpu=…)`` for sizes, ``ch.recipe`` for a source's training set-up,
``ch.fit`` / ``ch.evaluate`` / ``ch.collect`` to train on its device, ``ch.savefig`` for figures, ``ch.record``
for numbers and ``ch.claim`` for each verdict it shows, and ``ch.show_verdicts()`` for its summary.

Note [seeds together]
    A comparison paired over seeds trains one architecture once per seed.  ``ch.fit_seeds`` trains them one
    after another with ``ch.fit`` in the ``smoke`` and ``cpu`` profiles, and in one batched step
    (:func:`~sphereml.multiseed.fit_seeds`) in ``gpu`` and ``paper``, where small networks are bound by kernel
    launches; ``SPHEREML_SEEDS_TOGETHER=0`` or ``1`` overrides.  Both end at the same weights up to float
    rounding (``tests/test_multiseed.py``); on two CPU cores the batched step is slower (grouped convolutions),
    hence the split.  A tiny gpu run (``SPHEREML_GPU_TINY=1``) takes the batched path, so CI runs it.
"""

from __future__ import annotations

import os
import textwrap
import time
import weakref
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from torch.utils.data import TensorDataset

from .. import _io, data, distributed
from . import recipes, viz
from .._checks import integer
from ..multiseed import batches_seeds, can_train_together, fit_seeds
from ..recalibration import has_running_stats, recalibrate, stats_fresh
from ..timing import cpu_model
from ..train import collect_outputs, evaluate, fit, resolve_device, seed_everything
from .report import ClaimCard, VerdictTable, show
from .resume import TrainingCache
from .runs import (FULL_SCALE, PROFILES, REPOSITORY, default_output_dir, is_tiny, published_sources, repo_root,
                   resolve_output_dir, resolve_profile)
from .verdicts import NOT_TESTABLE, verdict_name

__all__ = ["PROFILES", "CLAIM_KINDS", "REPOSITORY", "resolve_profile", "configure_backends", "repo_root",
           "published_sources", "is_tiny", "default_output_dir", "resolve_output_dir", "Chapter"]

CLAIM_KINDS = (  # what a claim is about (thesis Ch. 8's three claims, and the rest)
    "generalisation",  # accuracy on held-out data
    "convergence",  # how fast or whether training goes
    "robustness",  # accuracy under attack or perturbation
    "efficiency",  # time or memory
    "geometry/theory",  # an identity, a bound, a property of the representation or the weights
)
PAGE_WIDTH = 96  # characters of a printed line that fit the book's column
RECALIBRATION_BATCHES = 40  # Chapter.recalibrate_if_stale: at most 40 x 256 training images


def configure_backends(profile: str, device: torch.device) -> dict:
    """The numerics a chapter's run trains with, set for ``profile`` on ``device``; returned for its metrics.

    A ``gpu`` or ``paper`` run on CUDA turns on ``torch.backends.cudnn.benchmark``: its shapes are fixed, so cuDNN
    may time its convolution algorithms once and keep the fastest, which changes results only at float rounding
    (and makes two runs differ there).  TF32 stays off in every chapter, for products (PyTorch's default) and for
    cuDNN's convolutions (whose default is on, so it is turned off here): several chapters check float32
    identities to 1e-5 or finer on their ``gpu`` scale, which TF32's 10-bit mantissa would break, and no GPU run
    has yet shown which chapters' numbers survive it.
    """
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = profile in FULL_SCALE or torch.backends.cudnn.benchmark
    return {"cudnn_benchmark": torch.backends.cudnn.benchmark, "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def _tiny_cifar(num_classes: int, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Random images of CIFAR's shape (3 x 32 x 32, in [0, 1]), labels cycling through the classes: code paths,
    not results."""
    gen = torch.Generator().manual_seed(seed)

    def images(n: int) -> TensorDataset:
        return TensorDataset(torch.rand(n, 3, 32, 32, generator=gen), torch.arange(n) % num_classes)

    return images(32), images(16)


def _check_per_model(models, **lists) -> None:
    """Each of ``lists`` (when given) has one entry per model; otherwise a ValueError that names it."""
    for name, values in lists.items():
        if values is not None and len(values) != len(models):
            raise ValueError(f"{name} needs one entry per model, got {len(values)} for {len(models)} models")


class Chapter:
    """One chapter's run: resolved profile and device, seeding, figure, metrics and claim output.

    Args:
        name (str): the notebook stem, e.g. ``"01_hypersphere"``.
        profile (str): ``auto``, ``smoke``, ``cpu`` or ``gpu``.
        device (str): ``auto``, ``cpu`` or ``cuda``.
        seed (int): seeds Python, NumPy and torch.
        output_dir (str): see :func:`resolve_output_dir`.
        params (dict, optional): the parameters cell, snapshotted into ``metrics.json``.
    """

    def __init__(self, name: str, profile: str = "auto", device: str = "auto", seed: int = 0,
                 output_dir: str = "", params: dict | None = None):
        self.name = name
        distributed.init_from_env()  # under torchrun: one process per GPU, fit shares each batch
        self.profile = resolve_profile(profile)
        # SPHEREML_GPU_TINY=1: the gpu (or paper) profile's code paths at the smoke profile's sizes, with a tiny
        # synthetic CIFAR, so that a CPU proves they execute (tests/test_notebooks.py); the ledger skips such runs
        self.tiny = is_tiny(self.profile)
        self.device = resolve_device(device)
        # Note [seeds together]: the gpu and paper profiles train a comparison's seeds in one batched step
        together = os.environ.get("SPHEREML_SEEDS_TOGETHER", "")
        if together not in ("", "0", "1"):
            raise ValueError(f"SPHEREML_SEEDS_TOGETHER must be 0 or 1, got {together!r}")
        self.seeds_together = together == "1" if together else self.full_scale
        beside = os.environ.get("SPHEREML_RUNS_BESIDE", "0")
        if not beside.isdigit():
            raise ValueError(f"SPHEREML_RUNS_BESIDE must be a whole number, got {beside!r}")
        self.seed = integer("seed", seed, at_least=0)
        seed_everything(seed)
        self._started = time.perf_counter()
        self.output_dir = resolve_output_dir(name, output_dir, self.profile)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics: dict = {
            "chapter": name, "profile": self.profile, "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "seed": self.seed, "params": dict(params or {}),
            "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the vector kernels torch chose (AVX2, AVX512)
            "cpu_model": cpu_model(),  # the processor: CPUs with the same kernels may round differently
            "claims": [], "tiny": self.tiny, "fits": [], "elapsed_seconds": 0.0,
            "seeds_together": self.seeds_together,
            "backends": configure_backends(self.profile, self.device),
            "runs_beside": int(beside),  # other runs on the device at once (gpu_check.sh chapters-at-once)
        }
        self.figures: list[str] = []
        self._trained_on = weakref.WeakKeyDictionary()  # model -> the data ch.fit trained it on
        # SPHEREML_RESUME=<folder>: finished trainings saved there, and restored by a rerun (sphereml.book.resume)
        self._cache = TrainingCache.from_env(name, {
            "chapter": name, "profile": self.profile, "tiny": self.tiny, "device": self.device.type,
            "seed": self.seed, "params": self.metrics["params"], "seeds_together": self.seeds_together,
            "fused": os.environ.get("SPHEREML_FUSED", "0")},
            {"device_name": self.metrics["device_name"], "torch": str(torch.__version__)})
        viz.set_style()
        self.write()

    def resume_description(self) -> dict:
        """What identifies this run in a saved training's key (:mod:`.resume`): not its clock or results."""
        return {"chapter": self.name, "profile": self.profile}

    def pick(self, **by_profile):
        """The value for the active profile, e.g. ``ch.pick(smoke=1, cpu=8, gpu=50)`` (a tiny gpu run: smoke's;
        the ``paper`` profile: ``paper=`` if given, else gpu's)."""
        missing = [p for p in PROFILES if p not in by_profile and p != "paper"]
        unknown = sorted(set(by_profile) - set(PROFILES))
        if missing or unknown:
            raise ValueError(f"pick() needs a value for smoke, cpu and gpu (and may take paper); "
                             f"missing {missing}, unknown {unknown}")
        if self.scale == "paper" and "paper" not in by_profile:
            return by_profile["gpu"]
        return by_profile[self.scale]

    def comparison_seeds(self, count: int = 0, *, cpu: int = 3, gpu: int = 3) -> list[int]:
        """The seeds every trained comparison of the chapter pairs: ``count`` consecutive seeds from the chapter's
        ``seed``, or the profile's number when ``count`` is 0 — two in ``smoke`` (and a tiny run), enough to
        exercise the pairing, and ``cpu`` or ``gpu`` in those profiles (three unless the chapter asks for more; the
        ``paper`` profile takes ``gpu``'s).  More seeds narrow a verdict's noise: its seed term is the 95 %
        half-width of the mean paired difference, 2.48 times the differences' s.d. with three seeds and 1.24
        times with five (:func:`~sphereml.book.verdicts.compare_over_seeds`)."""
        count = integer("num_seeds", count, at_least=0)
        if count == 1:
            raise ValueError("num_seeds must be 0 (the profile's number) or at least 2: one seed has no spread to "
                             "pair")
        default = self.pick(smoke=2, cpu=integer("cpu", cpu, at_least=2), gpu=integer("gpu", gpu, at_least=2))
        self.metrics["params"]["num_seeds"] = 0 if count == default else count  # a setting of the run (0: default)
        return list(range(self.seed, self.seed + (count or default)))

    @property
    def full_scale(self) -> bool:
        """True in the ``gpu`` and ``paper`` profiles, which train the sources' CIFAR networks."""
        return self.profile in FULL_SCALE

    @property
    def scale(self) -> str:
        """The profile whose sizes this run uses: the profile itself, ``"smoke"`` in a tiny gpu or paper run.
        Checks that need a run long enough to decide (``if ch.scale != "smoke": assert ...``) ask this, not the
        profile."""
        return "smoke" if self.tiny else self.profile

    def gpu_size(self, full, tiny):
        """A size in a section only the gpu and paper profiles run (a CIFAR network's widths): ``full``, or
        ``tiny`` in a tiny run (``SPHEREML_GPU_TINY=1``), which only proves the code executes."""
        return tiny if self.tiny else full

    def recipe(self, train_data, section: str = "cifar", **gpu) -> dict:
        """:meth:`fit`'s keyword arguments for one of the sources' trainings (a CIFAR section).

        The ``gpu`` profile trains with ``gpu`` (the chapter's shortened set-up: epochs, batch_size, lr,
        optimizer, scheduler, ...); the ``paper`` profile with the source's own, ``recipes.PAPER[name][section]``
        (:class:`~sphereml.book.recipes.Recipe`); a tiny run with either for one epoch.  Either way :meth:`fit`
        records the training under ``section``, which ``python -m sphereml.book estimate`` scales.
        """
        paper = recipes.recipe_for(self.name, section)  # a section without one is a mistake in any profile
        settings = paper.fit_kwargs(len(train_data)) if self.profile == "paper" else dict(gpu)
        if self.tiny:
            settings["epochs"] = 1
        return {**settings, "recipe": section}

    def runs(self, section: str = "cifar") -> int:
        """Seeds per number of a source's training: the recipe's ``runs`` in the ``paper`` profile (as many as the
        source averages), one in the others and in a tiny run."""
        runs = recipes.recipe_for(self.name, section).runs
        return runs if self.profile == "paper" and not self.tiny else 1

    # ---------------------------------------------------------------- training on the chapter's device
    def fit(self, model, train_data, recipe: str | None = None, **kwargs):
        """:func:`~sphereml.train.fit` on this chapter's device and seed, without a progress bar.  The training
        data are remembered, so that :meth:`evaluate` can recalibrate the model's running statistics; the
        metrics list each training (``fits``: its :meth:`recipe` section or None, epochs, images, seconds)."""
        kwargs = {"device": self.device, "seed": self.seed, "progress": False, **kwargs}
        self._trained_on[model] = train_data

        def train():
            history = fit(model, train_data, **kwargs)
            seconds = sum(epoch.get("seconds", 0.0) for epoch in history.epochs)
            self.metrics["fits"].append({"recipe": recipe, "epochs": kwargs["epochs"], "n_train": len(train_data),
                                         "seconds": round(seconds, 3)})
            return [history]

        return self._trained([model], train_data, [kwargs["seed"]], [list(kwargs.get("callbacks", ()))],
                             [kwargs.get("regularizer")], {"recipe": recipe, **kwargs}, train)[0]

    def _trained(self, models, train_data, seeds, callbacks, regularizers, settings, train) -> list:
        """``train()``'s histories, or, in a resumed run (``SPHEREML_RESUME``), those of the same training saved by
        an earlier run, its weights, callbacks, regularisers and random state restored (:mod:`.resume`)."""
        if self._cache is None:
            histories = train()
            self.write()
            return histories
        path, key = self._cache.next_key(models, train_data, seeds, settings)
        restored = self._cache.restore(path, key, models, callbacks, regularizers, self.device)
        if restored is not None:
            histories, fits = restored
            self.metrics["fits"].extend(fits)
            self.metrics["restored"] = self._cache.summary()
        else:
            known = len(self.metrics["fits"])
            histories = train()
            self._cache.save(path, key, models, histories, self.metrics["fits"][known:], callbacks, regularizers)
        self.write()
        return histories

    @staticmethod
    def seeded(make, seeds) -> list:
        """One network per seed, each ``make()`` called just after ``torch.manual_seed(seed)``: the initial weights
        that :meth:`fit_seeds` pairs with ``seeds``."""
        models = []
        for seed in seeds:
            torch.manual_seed(seed)
            models.append(make())
        return models

    def fit_seeds(self, models, train_data, seeds, recipe: str | None = None, callbacks=None, make_regularizer=None,
                  regularizers=None, optimizers=None, **kwargs):
        """``models[i]`` trained as ``fit(models[i], seed=seeds[i])`` would be: with :meth:`fit`, one after
        another, unless :attr:`seeds_together`, then all seeds in one batched step
        (:func:`~sphereml.multiseed.fit_seeds`: every layer but the fused kernels of ``SPHEREML_FUSED=1``; Note
        [fit_seeds is fit, seed by seed]).

        ``callbacks``: one list per model.  ``make_regularizer``: a function of a model that returns its
        regulariser, alike for every seed (e.g. ``partial(MHE, s=2.0)``): the first model's serves every seed in
        the batched step, or each model gets its own where the regulariser's state follows the weights (CoMHE's
        angle-fitted or adversarial projections).  ``regularizers``: one per model instead, each bound to its model
        (e.g. projections seeded by the run).  ``optimizers``: one per model instead of ``optimizer`` (e.g. each
        bound to its model's rotations).  Trackers, a weight projection and regularisers go along; other callbacks,
        gradient hooks (weighted gradients), optimisers that are not one element-wise SGD or Adam for every model
        (:func:`~sphereml.multiseed.elementwise_optimizer`), or a setting of ``fit`` that ``fit_seeds`` does not
        take (a checkpoint, ``compile``) train the models one after another.  The metrics list one training per
        model, each with an equal share of the time when together; :meth:`evaluate` recalibrates each model as after
        :meth:`fit`."""
        _check_per_model(models, seeds=seeds, callbacks=callbacks, regularizers=regularizers, optimizers=optimizers)
        for for_every_seed, each in ((make_regularizer, regularizers), (kwargs.get("optimizer"), optimizers)):
            if for_every_seed is not None and each is not None:
                raise ValueError("give make_regularizer or optimizer (alike for every seed), or regularizers or "
                                 "optimizers (one per model), not both")
        if "regularizer" in kwargs:
            raise ValueError("a regulariser is bound to one network: give make_regularizer or regularizers")
        optimizers = optimizers or [kwargs.pop("optimizer", "adam")] * len(models)
        callbacks = callbacks or [[] for _ in models]
        shared = make_regularizer(models[0]) if make_regularizer else None
        regularizers = regularizers or [None] * len(models)
        together = self.seeds_together and can_train_together(models, optimizers, callbacks, [shared, *regularizers],
                                                              kwargs)
        if shared is not None and (not together or shared.state_from_weights or not batches_seeds(shared)):
            regularizers, shared = [shared] + [make_regularizer(m) for m in models[1:]], None  # one per model
        if not together:
            return [self.fit(model, train_data, recipe, seed=seed, callbacks=list(calls), regularizer=reg,
                             optimizer=optimizer, **kwargs)
                    for model, seed, calls, reg, optimizer in zip(models, seeds, callbacks, regularizers, optimizers)]
        if shared is None and any(reg is not None for reg in regularizers):
            shared = regularizers  # each seed its own
        return self._fit_together(models, train_data, seeds, recipe, callbacks, shared, optimizers[0], kwargs)

    def _fit_together(self, models, train_data, seeds, recipe, callbacks, regularizer, optimizer, settings):
        """:meth:`fit_seeds` with the seeds in one batched step: ``regularizer`` one for every seed, a list of one
        per model, or None."""
        self._trained_on.update({model: train_data for model in models})  # as fit: trackers' evaluations recalibrate
        settings = {**settings, "optimizer": optimizer, "regularizer": regularizer}
        settings = {key: value for key, value in settings.items() if value is not None}

        def train():
            histories = fit_seeds(models, train_data, seeds=seeds, device=self.device, callbacks=callbacks,
                                  **settings)
            for history in histories:
                seconds = sum(epoch["seconds"] for epoch in history.epochs) / len(models)
                self.metrics["fits"].append({"recipe": recipe, "epochs": settings["epochs"],
                                             "n_train": len(train_data), "seconds": round(seconds, 3),
                                             "together": len(models)})
            return histories

        regularizers = regularizer if isinstance(regularizer, list) else [regularizer]
        return self._trained(models, train_data, seeds, callbacks, regularizers,
                             {"recipe": recipe, "callbacks": callbacks, **settings}, train)

    def recalibrate_if_stale(self, model) -> None:
        """The book's one rule for networks with running statistics (BatchNorm): before an evaluation, re-estimate
        them from the data the model was trained on (:func:`~sphereml.recalibration.recalibrate`, at most
        ``RECALIBRATION_BATCHES`` batches), unless that was done since the model's last :meth:`fit`."""
        if model in self._trained_on and has_running_stats(model) and not stats_fresh(model):
            recalibrate(model, self._trained_on[model], device=self.device, max_batches=RECALIBRATION_BATCHES)

    def evaluate(self, model, data, recalibrate: bool = True, **kwargs) -> dict:
        """:func:`~sphereml.train.evaluate` on this chapter's device, after :meth:`recalibrate_if_stale` (unless
        ``recalibrate=False``, e.g. to show what stale statistics do)."""
        if recalibrate:
            self.recalibrate_if_stale(model)
        return evaluate(model, data, **{"device": self.device, **kwargs})

    def collect(self, fn, data, **kwargs):
        """:func:`~sphereml.train.collect_outputs` on this chapter's device: (outputs, labels) on the CPU; a
        bound method of a trained model (``model.features``) sees recalibrated statistics too."""
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            self.recalibrate_if_stale(owner)
        return collect_outputs(fn, data, **{"device": self.device, **kwargs})

    def cifar(self, num_classes: int = 10):
        """(train, test) CIFAR-10/100 for a ``gpu`` section, or None when the archive is not here.

        A local archive is used (see :func:`~sphereml.data.find_cifar`); without one a download is
        tried.  Where neither works (no internet, ``$SPHEREML_NO_DOWNLOAD``), the chapter prints where
        to put the archive and records the skip instead of failing: its other results stand.  A corrupt
        archive still raises :class:`~sphereml.data.DataError`.  A tiny gpu run gets 32 random training and
        16 test images of CIFAR's shape instead.
        """
        if self.tiny:
            return _tiny_cifar(num_classes, self.seed)
        if data.find_cifar(num_classes) is None:
            try:
                data.load_cifar(num_classes, "train", download=True)
            except (data.DataError, RuntimeError) as err:
                archive, reason = f"cifar-{num_classes}-python.tar.gz", str(err).splitlines()[0][:80]
                print("\n".join(textwrap.wrap(
                    f"CIFAR-{num_classes} skipped: {archive} is not on this machine and could not be downloaded "
                    f"({reason}). Put the official archive in $SPHEREML_DATA/cifar-{num_classes}/ or "
                    f"~/.cache/sphereml/cifar-{num_classes}/ and rerun this chapter.", PAGE_WIDTH)))
                self.record(**{f"cifar{num_classes}_skipped": True})
                return None
        return data.load_cifar(num_classes, "train"), data.load_cifar(num_classes, "test")

    # ---------------------------------------------------------------- outputs
    def savefig(self, fig, name: str, show: bool = True) -> None:
        """Save ``fig`` as ``<output_dir>/<name>.png``, list it in the metrics, and show it (rank 0 only).

        The metrics also keep the figure's smallest text and its height on a phone
        (:func:`sphereml.book.viz.smallest_text`), which the tests hold to :data:`~sphereml.book.viz.LEGIBLE_PX`.

        In the book the figure is glued under ``name`` and appears where the chapter's ``{glue:figure}``
        directive gives it its number and caption (:func:`sphereml.book.viz.save_and_show`).
        """
        if not distributed.is_main_process():
            plt.close(fig)
            return
        fig.canvas.draw()  # lay the figure out as it will be saved, then measure its smallest text
        self.metrics.setdefault("figure_text", {})[name] = viz.smallest_text(fig)
        path = viz.save_and_show(fig, self.output_dir / f"{name}.png", show=show, glue_as=name)
        self.figures.append(path.name)
        self.metrics["figures"] = sorted(set(self.figures))
        self.write()

    @staticmethod
    def say(text: str) -> None:
        """Print a sentence of results, wrapped to the width of the book's column (``PAGE_WIDTH``)."""
        print(textwrap.fill(text, PAGE_WIDTH))

    def record(self, **values) -> None:
        """Add results to the metrics and rewrite ``metrics.json``."""
        self.metrics.update(values)
        self.write()

    def claim(self, id: str, statement: str, source: str, ours, holds, paper=None, *, kind: str,
              unit: str | None = None) -> None:
        """Show one verdict beside the numbers behind it (a :class:`~sphereml.book.report.ClaimCard`), and store it
        as a record in ``metrics.json``.

        Args:
            id (str): a short stable identifier, unique within the chapter (e.g. ``"afs-asoftmax"``).
            statement (str): the claim in words, as the seed makes it (or as we test it).
            source (str): where the seed makes it (e.g. ``"thesis Table 2.3"``).
            ours: our value(s) that decide it (a number, or a dict of named numbers).
            holds: the verdict from :mod:`sphereml.book.verdicts`: True (holds), False (does not hold), None (not
                distinguishable) or ``verdicts.NOT_TESTABLE``.
            paper: the seed's value(s), if it gives any.
            kind (str): what the claim is about, one of :data:`CLAIM_KINDS` (the conclusion groups by it).
            unit (str, optional): the scale of ``ours`` (e.g. ``"test accuracy, fraction"``), shown before it.
        """
        if kind not in CLAIM_KINDS:
            raise ValueError(f"kind must be one of {CLAIM_KINDS}, got {kind!r}")
        try:
            verdict = verdict_name(holds)
        except ValueError:
            raise ValueError(f"holds must be True, False, None or {NOT_TESTABLE!r}, got {holds!r}") from None
        record = {"id": id, "statement": statement, "source": source, "paper": paper, "ours": ours,
                  "profile": self.profile, "verdict": verdict, "kind": kind} | ({"unit": unit} if unit else {})
        self.metrics["claims"] = [c for c in self.metrics["claims"] if c["id"] != id] + [record]
        self.write()
        show(ClaimCard(record))

    def show_verdicts(self) -> None:
        """Show every claim recorded so far as one table (verdict, claim, source, kind): a chapter's summary."""
        show(VerdictTable(self.metrics["claims"]))

    def write(self) -> Path:
        """Rewrite ``metrics.json`` (rank 0 only: every rank holds the same results)."""
        path = self.output_dir / "metrics.json"
        self.metrics["elapsed_seconds"] = round(time.perf_counter() - self._started, 1)
        return _io.write_json(self.metrics, path) if distributed.is_main_process() else path
