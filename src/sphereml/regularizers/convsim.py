"""Convolutional similarity: feature-map orthogonality from the kernels alone (the convolutional-similarity paper).

Pure tensor math on kernels: nothing here walks a model (the per-model sums and the iterative
initialisation live in :mod:`sphereml.regularizers`).

Conventions (paper §3).  For sequences, the cross-correlation is
(X ⊛ K)[i] = sum_n K[n] X[i + n] and the convolution (X * K)[i] = sum_n K[n] X[i - n];
PyTorch's ``conv1d``/``conv2d`` compute the cross-correlation.  With padding P of a length-N
kernel: P = N - 1 is *full*, P = (N - 1) / 2 *same* (odd N), P = 0 *valid*.  For two kernels
the *kernel cross-correlation* is (K1 ⊛ K2)[n] = sum_i K1[i] K2[i + n], n in [1 - N, N - 1].

The main identity (paper eq. 14): for full padding, the feature maps F_j = X ⊛ K_j satisfy
``<F_1, F_2> = <K1 ⊛ K2, (X ⊛ X)[1 - N, N - 1]>``, so a zero kernel cross-correlation makes the
feature maps orthogonal for *every* input.  The convolutional-similarity loss (eq. 20) of a
layer with kernels K_0..K_{S-1} of C channels each is

``L_CS = sum_{i<j} sum_{c1, c2} ||K_i[c1] ⊛ K_j[c2]||^2`` (full kernel cross-correlation).

Note [convsim through power spectra]
    By Parseval, ``||a ⊛ b||^2 = (1/L^d) sum_w abs(DFT(a)(w))^2 abs(DFT(b)(w))^2`` for DFTs of
    length L >= 2N - 1 per axis (no wrap-around).  Summing over channel pairs factorises:
    ``sum_{c1,c2} ||K_i[c1] ⊛ K_j[c2]||^2 = (1/L^d) <P_i, P_j>`` with the kernel power spectrum
    ``P_i = sum_c abs(DFT(K_i[c]))^2``, and
    ``sum_{i<j} <P_i, P_j> = (||sum_i P_i||^2 - sum_i ||P_i||^2) / 2``.
    The cost is S C FFTs of size L^d, against S^2 C^2 kernel correlations for the direct form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import integer, one_of

__all__ = [
    "padding_for", "cross_correlate", "convolve", "kernel_correlation", "autocorrelation",
    "feature_maps", "feature_map_similarity", "conv_similarity", "pair_similarity",
]

MODES = ("full", "same", "valid")
METHODS = ("auto", "direct", "fft")
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def padding_for(mode: str | int, kernel_size: int) -> int:
    """Padding P of a named mode for a kernel of size N: full N - 1, same (N - 1) / 2, valid 0; ints pass through."""
    if isinstance(mode, int) and not isinstance(mode, bool):
        if not 0 <= mode <= kernel_size - 1:
            raise ValueError(f"padding must be in [0, {kernel_size - 1}] for kernel size {kernel_size}, got {mode}")
        return mode
    if mode == "full":
        return kernel_size - 1
    if mode == "valid":
        return 0
    if mode == "same":
        if kernel_size % 2 == 0:
            raise ValueError(f"'same' padding needs an odd kernel size, got {kernel_size}")
        return (kernel_size - 1) // 2
    raise ValueError(f"mode must be one of {MODES} or an integer padding, got {mode!r}")


def _spatial_dims(kernel: Tensor, lead: int) -> int:
    d = kernel.dim() - lead
    if d not in _CONV:
        raise ValueError(f"kernels must have 1, 2 or 3 spatial dimensions after {lead} leading ones, "
                         f"got shape {tuple(kernel.shape)}")
    return d


def _square_kernel_size(kernel: Tensor, d: int) -> int:
    sizes = set(kernel.shape[-d:])
    if len(sizes) != 1:
        raise ValueError(f"kernels must have the same size along every spatial axis, got {tuple(kernel.shape[-d:])}")
    return sizes.pop()


def cross_correlate(x: Tensor, kernel: Tensor, mode: str | int = "full") -> Tensor:
    """(X ⊛ K) of one C-channel input with one C-channel kernel, summed over channels (one conv output map).

    Args:
        x (``Tensor[C, *spatial]``): input with 1 to 3 spatial axes; a plain vector Tensor[M] is one channel.
        kernel (``Tensor[C, *k]``): kernel with the same channels (Tensor[N] for a vector input).
        mode: ``"full"``, ``"same"``, ``"valid"`` or an integer padding P (eq. 25).

    Returns:
        ``Tensor[*out]``, out = M + 2P - N + 1 per axis.
    """
    if x.dim() == 1 and kernel.dim() == 1:
        x, kernel = x[None], kernel[None]
    if x.dim() != kernel.dim() or x.shape[0] != kernel.shape[0]:
        raise ValueError(f"x and kernel need the layout [C, *spatial] with the same C, "
                         f"got {tuple(x.shape)} and {tuple(kernel.shape)}")
    d = _spatial_dims(kernel, 1)
    pad = padding_for(mode, _square_kernel_size(kernel, d))
    return _CONV[d](x[None], kernel[None], padding=pad)[0, 0]


def convolve(x: Tensor, kernel: Tensor, mode: str | int = "full") -> Tensor:
    """(X * K): the true convolution, i.e. cross-correlation with the kernel reversed on every spatial axis."""
    spatial = tuple(range(-max(kernel.dim() - 1, 1), 0))
    return cross_correlate(x, kernel.flip(spatial), mode)


def kernel_correlation(k1: Tensor, k2: Tensor) -> Tensor:
    """(K1 ⊛ K2)[n] = sum_i K1[i] K2[i + n] for n in [1 - N, N - 1] per axis (paper eq. 6).

    Args:
        k1, k2 (``Tensor[*k]``): single-channel kernels of the same shape, 1 to 3 axes.

    Returns:
        Tensor[2N - 1, ...]; index n + N - 1 holds lag n.
    """
    if k1.shape != k2.shape:
        raise ValueError(f"kernels must have the same shape, got {tuple(k1.shape)} and {tuple(k2.shape)}")
    return cross_correlate(k2[None], k1[None], "full")


def autocorrelation(x: Tensor, max_lag: int) -> Tensor:
    """(X ⊛ X)[n] = sum_i X[i] X[i + n] for ``abs(n) <= max_lag`` per axis (single-channel X)."""
    d = _spatial_dims(x, 0)
    integer("max_lag", max_lag, at_least=0)
    return _CONV[d](F.pad(x, (max_lag,) * 2 * d)[None, None], x[None, None])[0, 0]


def _check_weight(weight: Tensor) -> int:
    if weight.dim() < 3:
        raise ValueError(f"weight must be Tensor[S, C, *k] with 1 to 3 spatial axes, got shape {tuple(weight.shape)}")
    d = _spatial_dims(weight, 2)
    if not torch.is_floating_point(weight):
        raise ValueError(f"weight must be a floating-point tensor, got {weight.dtype}")
    return d


def feature_maps(weight: Tensor, x: Tensor, mode: str | int = "full") -> Tensor:
    """The S feature maps F_s = sum_c X[c] ⊛ K_s[c] of a bias-free conv layer.

    Args:
        weight (``Tensor[S, C, *k]``): the layer's kernels.
        x (``Tensor[C, *spatial]`` or ``Tensor[B, C, *spatial]``): input(s).
        mode: padding, as in :func:`cross_correlate`.

    Returns:
        ``Tensor[S, *out]`` (or ``Tensor[B, S, *out]`` for a batch).
    """
    d = _check_weight(weight)
    single = x.dim() == d + 1
    batch = x[None] if single else x
    out = _CONV[d](batch, weight, padding=padding_for(mode, _square_kernel_size(weight, d)))
    return out[0] if single else out


def feature_map_similarity(weight: Tensor, x: Tensor, mode: str | int = "full", normalized: bool = False,
                           eps: float = 1e-12) -> Tensor:
    """Inner products <F_i, F_j> (or cosines with ``normalized=True``) of a layer's feature maps for input ``x``.

    Returns:
        Tensor[S, S] (or Tensor[B, S, S] for a batch of inputs).
    """
    flat = feature_maps(weight, x, mode).flatten(-(weight.dim() - 2))  # (..., S, positions)
    if normalized:
        flat = flat / torch.linalg.vector_norm(flat, dim=-1, keepdim=True).clamp_min(eps)
    return flat @ flat.transpose(-1, -2)


def _pair_matrix_direct(weight: Tensor, pad: int, budget: int = 2**25) -> Tensor:
    """CS[i, j] = sum_{c1,c2} ||K_i[c1] ⊛ K_j[c2]||^2 over lags |n| <= pad, by convolving the kernels with each other.

    Only blocks with j >= i are computed (the lower triangle is left zero); blocks are
    sized so that no intermediate holds more than ``budget`` values.
    """
    d = weight.dim() - 2
    s, c = weight.shape[0], weight.shape[1]
    lags = (2 * pad + 1) ** d
    per_pair = c * c * lags
    bj = max(1, min(s, budget // per_pair))
    bi = max(1, min(s, budget // (per_pair * bj)))
    out = weight.new_zeros(s, s)
    for i0 in range(0, s, bi):
        rows = weight[i0:i0 + bi].reshape(-1, 1, *weight.shape[2:])  # (bi*C, 1, *k)
        for j0 in range(i0 - i0 % bj, s, bj):  # blocks that reach j >= i0
            cols = weight[j0:j0 + bj].reshape(-1, 1, *weight.shape[2:])  # (bj*C, 1, *k)
            corr = _CONV[d](rows, cols, padding=pad)  # (bi*C, bj*C, *lags): lag n at index n + pad
            block = corr.pow(2).reshape(len(rows) // c, c, len(cols) // c, c, -1).sum((1, 3, 4))
            out[i0:i0 + bi, j0:j0 + bj] = block
    return out


def _power_spectra(weight: Tensor) -> Tensor:
    """P_i(w) = sum_c |DFT_L(K_i[c])(w)|^2, L = 2N - 1 per axis: Tensor[S, L^d].

    See Note [convsim through power spectra].
    """
    d = weight.dim() - 2
    size = 2 * weight.shape[-1] - 1
    spectrum = torch.fft.fftn(weight, s=(size,) * d, dim=tuple(range(-d, 0)))
    return spectrum.abs().pow(2).sum(1).flatten(1)


def _kernel_scales(weight: Tensor, normalized: bool, eps: float) -> Tensor | None:
    if not normalized:
        return None
    return torch.linalg.vector_norm(weight.flatten(1), dim=1).clamp_min(eps)  # ||K_i|| over all channels


def pair_similarity(weight: Tensor, mode: str | int = "full", normalized: bool = False,
                    eps: float = 1e-12) -> Tensor:
    """The matrix CS[i, j] = sum_{c1,c2} ||K_i[c1] ⊛ K_j[c2]||^2 (lags of ``mode``), symmetric, Tensor[S, S].

    The diagonal holds each kernel's similarity with itself (not part of L_CS).  With
    ``normalized=True`` each entry is divided by ||K_i||^2 ||K_j||^2.  Computed directly.
    """
    d = _check_weight(weight)
    pad = padding_for(mode, _square_kernel_size(weight, d))
    upper = _pair_matrix_direct(weight, pad).triu()
    cs = upper + upper.triu(1).T
    scales = _kernel_scales(weight, normalized, eps)
    if scales is not None:
        cs = cs / (scales[:, None] * scales[None, :]).pow(2)
    return cs


def conv_similarity(weight: Tensor, mode: str | int = "full", method: str = "auto", normalized: bool = False,
                    eps: float = 1e-12) -> Tensor:
    """The convolutional-similarity loss L_CS of one layer (paper eqs. 17, 19, 20).

    L_CS = sum_{i<j} sum_{c1,c2} sum_n (K_i[c1] ⊛ K_j[c2])[n]^2, every channel of K_i against
    every channel of K_j, over the lags n kept by ``mode``: ``abs(n) <= N - 1`` for ``"full"``
    (the paper's loss), ``abs(n) <= (N - 1) / 2`` for ``"same"``, n = 0 for ``"valid"`` (which is the
    squared-inner-product kernel orthogonality over all channel pairs); an integer P keeps ``abs(n) <= P``.

    Only ``"full"`` is the paper's loss, for every padding of the layer (§5, eqs. 33-35: the feature maps
    of a padded convolution are sub-windows of the full ones, so their orthogonality needs all lags).
    The truncated modes are our heuristic, not a guarantee: K1 = [1, 0, 0], K2 = [0, 1, 0] give 0 in
    ``"valid"`` mode while their valid-padding feature maps on x = ones(8) have inner product 6.

    Args:
        weight (``Tensor[S, C, *k]``): conv weight with 1 to 3 equal spatial sizes.
        mode: lags kept, see above. Default: ``"full"``.
        method: ``"direct"`` (kernels convolved with each other, the reference), ``"fft"``
            (power spectra, Note [convsim through power spectra]; full mode only) or
            ``"auto"`` (fft for full mode, else direct).
        normalized (bool): divide kernel K_i by ||K_i|| first, so the loss measures direction
            only (it is otherwise homogeneous of degree 4 in the weight). Default: False.

    Returns:
        0-dim Tensor, differentiable with respect to ``weight``.
    """
    d = _check_weight(weight)
    one_of("method", method, METHODS)
    n = _square_kernel_size(weight, d)
    pad = padding_for(mode, n)
    if method == "fft" and pad != n - 1:
        raise ValueError("method='fft' computes the full-lag loss only; use mode='full' or method='direct'")
    scales = _kernel_scales(weight, normalized, eps)
    if scales is not None:
        weight = weight / scales.view(-1, *([1] * (weight.dim() - 1)))
    if method == "direct" or pad != n - 1:
        return _pair_matrix_direct(weight, pad).triu(1).sum()
    spectra = _power_spectra(weight)  # (S, L^d)
    total = spectra.sum(0)
    return (total.pow(2).sum() - spectra.pow(2).sum()) / (2 * spectra.shape[1])
