"""sphereml: deep representation learning on the hypersphere — the library behind the book.

One concept per module:

* :mod:`~sphereml.geometry` — normalisation, cosines and safe angles, sphere sampling, cos(m theta), psi_m.
* :mod:`~sphereml.angular` — angular activations g(theta), stable arccos, their fused autograd nodes.
* :mod:`~sphereml.margins` — margin heads: normalised, L-, A-, GA-, W-Softmax, CosFace, ArcFace.
* :mod:`~sphereml.margin_ce` — the heads' B x C part: class logits and the cross-entropy with a margin target,
  fused into two passes (Triton on CUDA).
* :mod:`~sphereml.schedules` — the lambda schedule that phases a multiplicative margin in.
* :mod:`~sphereml.patches` — every receptive field's norm and its cosine to every kernel, by convolution.
* :mod:`~sphereml.patch_epilogue` — the patch layers' division, g(theta) or sharpening in one kernel each way.
* :mod:`~sphereml.sphereconv` — SphereConv2d, SphereLinear, SphereNorm and the unfold reference.
* :mod:`~sphereml.decoupled` — decoupled operators h(||w||, ||x||) g(theta) and their unfold reference.
* :mod:`~sphereml.decoupled_training` — weight projection, weighted gradients, pretrained initialisation.
* :mod:`~sphereml.scs` — sharpened cosine similarity, max-abs pooling and the unfold reference.
* :mod:`~sphereml.energy` — hyperspherical energy with dense, tiled and Triton backends, sharded over ranks,
  and many layers at once without device synchronisation (``energy.batched``).
* :mod:`~sphereml.convsim` — convolutional similarity of kernels (pure tensor math).
* :mod:`~sphereml.regularizers` — regularisers bound to a model's layers once: orthonormality,
  orthogonality, convolutional similarity, MHE.
* :mod:`~sphereml.comhe` — compressive MHE: random, angle-preserving, adversarial, group, bilateral projections.
* :mod:`~sphereml.comhe_functional` — CoMHE's functional core: projected, group and bilateral energies, L_P.
* :mod:`~sphereml.orthogonalizers` — Gram-Schmidt, Householder, Löwdin, Cayley, exp; the Cayley SGD step.
* :mod:`~sphereml.opt` — orthogonal over-parameterised layers (OPT, PE-OPT, S-OPT), refinement, OGD.
* :mod:`~sphereml.models` — the book's networks, built from operator factories; ``Classifier``.
* :mod:`~sphereml.data` — Fashion-MNIST, digits, CIFAR-10/100, synthetic sphere data.
* :mod:`~sphereml.train` — ``fit`` / ``evaluate``: seeding, devices, history, checkpoints, callbacks.
* :mod:`~sphereml.recalibration` — running statistics re-estimated before an evaluation (the book's rule).
* :mod:`~sphereml.distributed` — ``torchrun`` support: process group, data-parallel gradient sums.
* :mod:`~sphereml.metrics` — accuracy, angular hardness and Fisher score, verification.
* :mod:`~sphereml.attacks` — FGSM and PGD in the L-infinity ball, accuracy under white- and black-box
  attack, adversarial training.
* :mod:`~sphereml.timing` — round-robin timing with ratios to a baseline.
* :mod:`~sphereml.launches` — operations per step counted and host reads refused, on the CPU.

The book's machinery, loaded on first use (``sphereml.chapter`` or ``from sphereml.chapter import Chapter``), so
that ``import sphereml`` in a project of one's own brings no plotting, no chapter runtime and no papermill:

* :mod:`~sphereml.verdicts` — verdicts that know their noise: paired comparisons over seeds.
* :mod:`~sphereml.viz` — the book's plotting style and helpers.
* :mod:`~sphereml.chapter` — the chapter runtime: profiles, figures, metrics, claim records.
* :mod:`~sphereml.report` — claims as a reader sees them: verdict badges, claim cards, verdict tables.
* :mod:`~sphereml.ledger` — the claims ledger: every chapter's claim records gathered into one page.
* ``sphereml.conclusion`` — chapter 10's reading of the ledger and the benchmarks.
* ``sphereml.errata`` — the errata page as data: entries by source and kind.
* ``sphereml.book`` — the papermill runner (``python -m sphereml.book``).
"""

import importlib

from . import (angular, attacks, comhe, comhe_functional, convsim, data, decoupled, decoupled_training, distributed,
               energy, geometry, launches, margin_ce, margins, metrics, models, opt, orthogonalizers, patch_epilogue,
               patches, recalibration, regularizers, schedules, scs, sphereconv, timing, train)
from .geometry import angle_matrix, cosine_matrix, normalize, safe_angle, sample_sphere
from .train import evaluate, fit, resolve_device, seed_everything

__version__ = "0.1.0"

BOOK_MODULES = ("book", "chapter", "conclusion", "errata", "ledger", "report", "verdicts", "viz")

__all__ = [
    "angular", "attacks", "comhe", "comhe_functional", "convsim", "data", "decoupled", "decoupled_training",
    "distributed", "energy", "geometry", "launches", "margin_ce", "margins", "metrics", "models", "opt",
    "orthogonalizers", "patch_epilogue", "patches", "recalibration", "regularizers", "schedules", "scs", "sphereconv",
    "timing", "train",
    "normalize", "cosine_matrix", "safe_angle", "angle_matrix", "sample_sphere",
    "fit", "evaluate", "resolve_device", "seed_everything", "__version__",
]


def __getattr__(name: str):
    """``sphereml.chapter`` and the other book modules, imported when first asked for (PEP 562)."""
    if name in BOOK_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(BOOK_MODULES))
