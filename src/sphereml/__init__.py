"""sphereml: deep representation learning on the hypersphere — the library behind the book.

Modules (one concept each): :mod:`~sphereml.geometry`, :mod:`~sphereml.data`,
:mod:`~sphereml.models`, :mod:`~sphereml.train`, :mod:`~sphereml.metrics`,
:mod:`~sphereml.margins`, :mod:`~sphereml.sphereconv`, :mod:`~sphereml.energy`, :mod:`~sphereml.convsim`,
:mod:`~sphereml.regularizers`,
:mod:`~sphereml.viz`, :mod:`~sphereml.book`.
"""

from . import book, convsim, data, energy, geometry, margins, metrics, models, regularizers, sphereconv, train
from .geometry import angle_matrix, cosine_matrix, normalize, safe_angle, sample_sphere
from .train import evaluate, fit, resolve_device, seed_everything

__version__ = "0.1.0"

__all__ = [
    "book", "convsim", "data", "energy", "geometry", "margins", "metrics", "models", "regularizers", "sphereconv",
    "train",
    "normalize", "cosine_matrix", "safe_angle", "angle_matrix", "sample_sphere",
    "fit", "evaluate", "resolve_device", "seed_everything", "__version__",
]
