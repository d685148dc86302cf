"""sphereml: deep representation learning on the hypersphere — the library behind the book.

Laid out by what a project of one's own imports (as torchvision's ``ops`` and ``models``), one concept per
module:

* :mod:`~sphereml.geometry` — normalisation, cosines and safe angles, pair angles, the most collinear pair, sphere
  sampling.
* :mod:`~sphereml.angular` — angular activations g(theta), stable arccos, their fused autograd nodes.
* :mod:`~sphereml.layers` — hyperspherical layers (thesis Ch. 3-4, the SCS paper):
  :mod:`~sphereml.layers.patches` (receptive-field norms and cosines by convolution),
  :mod:`~sphereml.layers.patch_norms` (those norms with one pass over the input each way),
  :mod:`~sphereml.layers.window_sums` (their box sums, one Triton kernel each way on a GPU),
  :mod:`~sphereml.layers.unit_kernels` (the kernels on the unit sphere, one Triton kernel each way when fused),
  :mod:`~sphereml.layers.patch_epilogue` (the division and g(theta) in one kernel each way),
  :mod:`~sphereml.layers.sphereconv` (SphereConv2d, SphereLinear, SphereNorm),
  :mod:`~sphereml.layers.scs` (sharpened cosine similarity, max-abs pooling),
  :mod:`~sphereml.layers.magnitudes` (the decoupled operators' magnitude functions h(||x||)),
  :mod:`~sphereml.layers.decoupled` (decoupled operators h(||w||, ||x||) g(theta)),
  :mod:`~sphereml.layers.decoupled_training` (weight projection, weighted gradients, pretrained start, kernel
  scaling, a radius per channel).
* :mod:`~sphereml.heads` — margin heads (thesis Ch. 2): :mod:`~sphereml.heads.margins` (normalised, L-, A-,
  GA-, W-Softmax, CosFace, ArcFace), :mod:`~sphereml.heads.margin_ce` (the B x C part: logits and the
  cross-entropy with a margin target in two passes), :mod:`~sphereml.heads.margin_tail` (the fused heads' B
  target logits, loss and derivatives in one operator), :mod:`~sphereml.heads.fused_head` (a whole fused head as
  one autograd node), :mod:`~sphereml.heads.targets` (the target functions
  psi: cos(m theta) by Chebyshev polynomials, A-Softmax's psi_m, ArcFace's cos(theta + m)),
  :mod:`~sphereml.heads.schedules` (the lambda schedule).
* :mod:`~sphereml.energy` — hyperspherical energy with dense, tiled and Triton backends, sharded over ranks,
  and many layers at once without device synchronisation (``energy.batched``, the weights packed by
  ``energy.packing``).
* :mod:`~sphereml.regularizers` — regularisers bound to a model's layers once (orthonormality, orthogonality,
  convolutional similarity, MHE), and beside them :mod:`~sphereml.regularizers.comhe` (compressive MHE:
  random, angle-preserving, adversarial, group, bilateral projections),
  :mod:`~sphereml.regularizers.comhe_functional` (CoMHE's projected, group and bilateral energies, L_P),
  :mod:`~sphereml.regularizers.comhe_options` (CoMHE's variants and options),
  :mod:`~sphereml.regularizers.convsim` (convolutional similarity of kernels, pure tensor math),
  :mod:`~sphereml.regularizers.orthogonalizers` (Gram-Schmidt, Householder, Löwdin, Cayley, exp; the Cayley
  SGD step), :mod:`~sphereml.regularizers.rotations` (an OPT layer's rotation; a model's rotations evaluated
  together) and :mod:`~sphereml.regularizers.opt` (orthogonal over-parameterised layers, refinement, OGD).
* :mod:`~sphereml.models` — the book's networks, built from operator factories; ``Classifier``.
* :mod:`~sphereml.initialisation` — He initialisation, the thesis's starting point (``he_init_``).
* :mod:`~sphereml.constraints` — neurons held at their starting lengths between steps (``HoldNorms``).
* :mod:`~sphereml.turning` — how far neurons turn, the effective learning rate across parametrisations
  (``TurnTracker``).
* :mod:`~sphereml.data` — Fashion-MNIST, digits, CIFAR-10/100, synthetic sphere data.
* :mod:`~sphereml.train` — ``fit`` / ``evaluate``: seeding, devices, history, checkpoints, callbacks.
* :mod:`~sphereml.multiseed` — ``fit_seeds``: several seeds of one network trained in one batched step.
* :mod:`~sphereml.recalibration` — running statistics re-estimated before an evaluation (the book's rule).
* :mod:`~sphereml.distributed` — ``torchrun`` support: process group, data-parallel gradient sums.
* :mod:`~sphereml.metrics` — accuracy, angular hardness and Fisher score, verification.
* :mod:`~sphereml.attacks` — FGSM and PGD in the L-infinity ball, accuracy under white- and black-box
  attack, adversarial training.
* :mod:`~sphereml.timing` — round-robin timing with ratios to a baseline.
* :mod:`~sphereml.launches` — operations per step counted and host reads refused, on the CPU.
* :mod:`~sphereml.book` — the book's machinery (verdicts, plotting, the chapter runtime, claim reports, the
  ledger, the conclusion, the errata, the papermill runner), loaded on first use (``sphereml.book`` or
  ``from sphereml.book.chapter import Chapter``), so that ``import sphereml`` brings none of it.
"""

import importlib

from . import (angular, attacks, constraints, data, distributed, energy, geometry, heads, initialisation, launches,
               layers, metrics, models, recalibration, regularizers, timing, train, turning)
from .geometry import angle_matrix, cosine_matrix, normalize, safe_angle, sample_sphere
from .train import evaluate, fit, resolve_device, seed_everything

__version__ = "0.1.0"

BOOK_MODULES = ("book",)  # loaded on first use

__all__ = [
    "angular", "attacks", "constraints", "data", "distributed", "energy", "geometry", "heads", "initialisation",
    "launches", "layers", "metrics", "models", "recalibration", "regularizers", "timing", "train", "turning",
    "normalize", "cosine_matrix", "safe_angle", "angle_matrix", "sample_sphere",
    "fit", "evaluate", "resolve_device", "seed_everything", "__version__",
]


def __getattr__(name: str):
    """``sphereml.book``, imported when first asked for (PEP 562)."""
    if name in BOOK_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(BOOK_MODULES))
