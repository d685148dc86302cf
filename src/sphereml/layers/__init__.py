"""Hyperspherical layers: convolutions that look at the angle between a kernel and each receptive field.

* :mod:`~sphereml.layers.patches` — every receptive field's norm and its cosine to every kernel, by convolution.
* :mod:`~sphereml.layers.patch_norms` — every receptive field's norm with one pass over the input each way.
* :mod:`~sphereml.layers.window_sums` — on a GPU those norms' box sum and its adjoint as one Triton kernel each way.
* :mod:`~sphereml.layers.unit_kernels` — the kernels on the unit sphere, one Triton kernel each way on the fused path.
* :mod:`~sphereml.layers.patch_epilogue` — the patch layers' division, g(theta) or sharpening in one kernel each
  way (an opt-in on CUDA).
* :mod:`~sphereml.layers.sphereconv` — SphereConv2d, SphereLinear, SphereNorm and the unfold reference (thesis
  Ch. 3).
* :mod:`~sphereml.layers.scs` — sharpened cosine similarity, max-abs pooling and the unfold reference (the SCS
  paper).
* :mod:`~sphereml.layers.magnitudes` — the decoupled operators' magnitude functions h(||x||) (thesis eqs. 4.4-4.10),
  which the fused epilogue's kernels also evaluate.
* :mod:`~sphereml.layers.decoupled` — decoupled operators h(||w||, ||x||) g(theta) and their unfold reference
  (thesis Ch. 4).
* :mod:`~sphereml.layers.decoupled_training` — weight projection, weighted gradients, pretrained initialisation.

The layers themselves are importable from here (``from sphereml.layers import SphereConv2d``).
"""

from . import (decoupled, decoupled_training, magnitudes, patch_epilogue, patch_norms, patches, scs, sphereconv,
               unit_kernels, window_sums)
from .decoupled import DecoupledConv2d, DecoupledLinear, decoupled_conv2d
from .patches import patch_cosine2d
from .scs import MaxAbsPool2d, SharpenedCosineSimilarity2d, scs_conv2d
from .sphereconv import SphereConv2d, SphereLinear, SphereNorm, sphere_conv2d

__all__ = [
    "patches", "patch_norms", "window_sums", "unit_kernels", "patch_epilogue", "sphereconv", "scs", "magnitudes",
    "decoupled", "decoupled_training",
    "SphereConv2d", "SphereLinear", "SphereNorm", "sphere_conv2d", "SharpenedCosineSimilarity2d", "MaxAbsPool2d",
    "scs_conv2d", "DecoupledConv2d", "DecoupledLinear", "decoupled_conv2d", "patch_cosine2d",
]
