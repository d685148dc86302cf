"""Convolutional similarity (the paper's §3-§5): lemmas, the main identity, counterexamples, methods."""

import numpy as np
import pytest
import torch

from sphereml.regularizers import convsim
from sphereml.regularizers.convsim import (autocorrelation, conv_similarity, convolve, cross_correlate,
    feature_map_similarity, feature_maps, kernel_correlation, pair_similarity)

F64 = torch.float64


def _rand(*shape, seed=0, low=-1.0, high=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g, dtype=F64) * (high - low) + low


def _brute_pair_loss(weight, pad):
    """Eq. 17/19 literally: loops over kernel pairs and channel pairs, 1-D or 2-D, numpy correlations."""
    s, c = weight.shape[:2]
    total = 0.0
    for i in range(s):
        for j in range(i + 1, s):
            for c1 in range(c):
                for c2 in range(c):
                    full = kernel_correlation(weight[i, c1], weight[j, c2])
                    n = weight.shape[-1]
                    centre = [slice(n - 1 - pad, n + pad)] * (weight.dim() - 2)
                    total += float(full[tuple(centre)].pow(2).sum())
    return total


# ---------------------------------------------------------------- conventions

def test_conventions_against_numpy():
    x, k = _rand(12), _rand(4, seed=1)
    xn, kn = x.numpy(), k.numpy()
    torch.testing.assert_close(cross_correlate(x, k, "full"), torch.from_numpy(np.correlate(xn, kn, "full")))
    torch.testing.assert_close(convolve(x, k, "full"), torch.from_numpy(np.convolve(xn, kn, "full")))
    torch.testing.assert_close(cross_correlate(x, k, "valid"), torch.from_numpy(np.correlate(xn, kn, "valid")))
    assert cross_correlate(x, _rand(5), "same").shape == (12,)
    kc = kernel_correlation(k, x[:4])
    brute = [sum(float(k[i] * x[i + n]) for i in range(4) if 0 <= i + n < 4) for n in range(-3, 4)]
    torch.testing.assert_close(kc, torch.tensor(brute, dtype=F64))
    auto = autocorrelation(x, 3)
    torch.testing.assert_close(auto, torch.tensor([sum(float(x[i] * x[i + n]) for i in range(12) if 0 <= i + n < 12)
                                                   for n in range(-3, 4)], dtype=F64))


# ---------------------------------------------------------------- lemmas and the main identity

@pytest.mark.parametrize("n", [3, 5, 9])
def test_main_identity_eq14_1d(n):
    x, k1, k2 = _rand(64, low=0.0), _rand(n, seed=1), _rand(n, seed=2)
    f1, f2 = cross_correlate(x, k1, "full"), cross_correlate(x, k2, "full")
    rhs = (kernel_correlation(k1, k2) * autocorrelation(x, n - 1)).sum()
    torch.testing.assert_close((f1 * f2).sum(), rhs)


def test_main_identity_2d_and_multichannel():
    x, w = _rand(3, 10, 10, low=0.0), _rand(2, 3, 3, 3, seed=1)
    f = feature_maps(w, x, "full")
    lhs = (f[0] * f[1]).sum()
    rhs = sum((kernel_correlation(w[0, c1], w[1, c2]) * cross_correlate(x[c2][None], x[c1][None], 2)).sum()
              for c1 in range(3) for c2 in range(3))
    torch.testing.assert_close(lhs, rhs)


def test_lemma_4_1_padding_sums_vanish():
    n, k1, k2 = 5, _rand(5, seed=1), _rand(5, seed=2)
    r = autocorrelation(_rand(30, low=0.0), n - 1)  # index n2 + N - 1

    def k2_at(i):
        return float(k2[i]) if 0 <= i < n else 0.0
    a = sum(float(k1[n1]) * k2_at(n1 + n2) * float(r[n2 + n - 1]) for n1 in range(1, n) for n2 in range(n - n1, n))
    b = sum(float(k1[n1]) * k2_at(n1 + n2) * float(r[n2 + n - 1])
            for n1 in range(0, n - 1) for n2 in range(1 - n, -n1))
    assert a == 0.0 and b == 0.0


def test_lemma_4_2_commutativity_and_reversal():
    k1, k2 = _rand(6, seed=1), _rand(6, seed=2)
    torch.testing.assert_close(kernel_correlation(k2, k1), kernel_correlation(k1, k2).flip(0))
    forward, backward = kernel_correlation(k1, k2).pow(2).sum(), kernel_correlation(k2, k1).pow(2).sum()
    assert float(forward) == pytest.approx(float(backward))


def test_lemma_4_3_full_convolution_same_inner_product():
    x, k1, k2 = _rand(40, low=0.0), _rand(5, seed=1), _rand(5, seed=2)
    cc = (cross_correlate(x, k1) * cross_correlate(x, k2)).sum()
    cv = (convolve(x, k1) * convolve(x, k2)).sum()
    torch.testing.assert_close(cc, cv)


def test_cauchy_schwarz_bound_and_zero_loss_gives_orthogonal_maps():
    x = _rand(50, low=0.0)
    k1, k2 = _rand(4, seed=1), _rand(4, seed=2)
    inner = float((cross_correlate(x, k1) * cross_correlate(x, k2)).sum())
    bound = float(kernel_correlation(k1, k2).norm() * autocorrelation(x, 3).norm())
    assert abs(inner) <= bound + 1e-9
    # L_CS = 0 needs at most one non-zero kernel: then every feature-map inner product vanishes
    w = torch.zeros(3, 2, 4, dtype=F64)
    w[1] = _rand(2, 4, seed=3)
    assert float(conv_similarity(w)) == 0.0
    for seed in range(3):
        sim = feature_map_similarity(w, _rand(2, 20, seed=seed))
        assert float(sim.fill_diagonal_(0).abs().max()) == 0.0


def test_haar_counterexample_and_orthogonal_kernels():
    haar = torch.tensor([[[1.0, 1.0]], [[1.0, -1.0]]], dtype=F64)
    assert float(conv_similarity(haar, method="direct")) == pytest.approx(2.0)
    for seed in range(5):
        x = _rand(1, 17, seed=seed)
        assert abs(float(feature_map_similarity(haar, x)[0, 1])) < 1e-12  # orthogonal for every input (full)
    assert abs(float(feature_map_similarity(haar, torch.tensor([[1.0, 2.0, 0.5]], dtype=F64), "valid")[0, 1])) > 0.1
    shift = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=F64)  # orthogonal kernels
    x = _rand(1, 30, low=0.0)
    inner = float(feature_map_similarity(shift, x)[0, 1])
    assert inner == pytest.approx(float((x[0, :-1] * x[0, 1:]).sum()))  # eq. 23: the lag-1 autocorrelation
    assert inner > 1.0


# ---------------------------------------------------------------- the loss: formulas, methods, modes

@pytest.mark.parametrize("shape", [(4, 3, 5), (3, 2, 3, 3), (5, 1, 4, 4)])
@pytest.mark.parametrize("mode", ["full", "same", "valid", 1])
def test_direct_loss_matches_brute_force(shape, mode):
    w = _rand(*shape)
    n = shape[-1]
    if mode == "same" and n % 2 == 0:
        with pytest.raises(ValueError, match="odd kernel"):
            conv_similarity(w, mode)
        return
    pad = convsim.padding_for(mode, n)
    assert float(conv_similarity(w, mode, "direct")) == pytest.approx(_brute_pair_loss(w, pad), rel=1e-10)


def test_valid_mode_is_channel_pair_kernel_orthogonality():
    w = _rand(4, 3, 3, 3)
    flat = w.flatten(2)  # (S, C, k*k)
    inner = torch.einsum("iap,jbp->ijab", flat, flat).pow(2).sum((2, 3))
    torch.testing.assert_close(conv_similarity(w, "valid"), inner.triu(1).sum())


@pytest.mark.parametrize("shape", [(6, 3, 5), (5, 4, 3, 3), (3, 2, 2, 2, 2)])
def test_fft_equals_direct(shape):
    w = _rand(*shape, seed=4)
    torch.testing.assert_close(conv_similarity(w, method="fft"), conv_similarity(w, method="direct"))
    torch.testing.assert_close(conv_similarity(w, method="fft", normalized=True),
                               conv_similarity(w, method="direct", normalized=True))


def test_direct_blocks_cover_every_pair():
    w = _rand(7, 3, 3, 3, seed=5)
    full = convsim._pair_matrix_direct(w, 2, budget=10**9).triu(1).sum()
    tiny = convsim._pair_matrix_direct(w, 2, budget=1).triu(1).sum()
    torch.testing.assert_close(full, tiny)


def test_pair_matrix_symmetric_and_ordered_sum_is_twice():
    w = _rand(5, 2, 3)
    cs = pair_similarity(w)
    torch.testing.assert_close(cs, cs.T)
    ordered = cs.sum() - cs.diagonal().sum()
    torch.testing.assert_close(ordered, 2 * conv_similarity(w))


def test_homogeneity_norm_shrinkage_and_1x1():
    w = _rand(4, 3, 3, 3)
    torch.testing.assert_close(conv_similarity(2.0 * w), 16 * conv_similarity(w))
    torch.testing.assert_close(conv_similarity(2.0 * w, normalized=True), conv_similarity(w, normalized=True))
    scaled = w.clone()
    scaled[0] *= 3
    torch.testing.assert_close(pair_similarity(scaled)[0, 1], 9 * pair_similarity(w)[0, 1])
    wg = w.clone().requires_grad_(True)
    loss = conv_similarity(wg)
    (grad,) = torch.autograd.grad(loss, wg)
    torch.testing.assert_close((grad * w).sum(), 4 * loss.detach())  # Euler: <grad, K> = 4 L
    one = _rand(3, 4, 1, 1)
    norms = one.flatten(1).pow(2).sum(1)
    torch.testing.assert_close(pair_similarity(one), norms[:, None] * norms[None, :])


def test_not_convex():
    def cs(t):
        return conv_similarity(torch.stack([1 + t, 1 - t]).view(2, 1, 1))
    t = torch.tensor(1e-3, dtype=F64)
    second = (cs(t) - 2 * cs(torch.tensor(0.0, dtype=F64)) + cs(-t)) / t**2
    assert float(second) == pytest.approx(-4.0, abs=1e-4)


def test_gradients_finite_including_zero_kernels():
    for method in ("direct", "fft"):
        for normalized in (False, True):
            w = _rand(3, 2, 3, 3).requires_grad_(True)
            with torch.no_grad():
                w[1] = 0
            conv_similarity(w, method=method, normalized=normalized).backward()
            assert bool(torch.isfinite(w.grad).all())


def test_gradcheck():
    w = _rand(3, 2, 3).requires_grad_(True)
    for method in ("direct", "fft"):
        assert torch.autograd.gradcheck(lambda t, m=method: conv_similarity(t, method=m, normalized=True), (w,))
    assert torch.autograd.gradcheck(lambda t: conv_similarity(t, "same"), (w,))


def test_feature_map_similarity_cosines_and_batches():
    w, x = _rand(4, 3, 3, 3), _rand(2, 3, 8, 8, low=0.0)
    sim = feature_map_similarity(w, x, "same", normalized=True)
    assert sim.shape == (2, 4, 4)
    torch.testing.assert_close(sim.diagonal(dim1=1, dim2=2), torch.ones(2, 4, dtype=F64))
    torch.testing.assert_close(feature_map_similarity(w, x[0]), feature_map_similarity(w, x)[0])


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("call,message", [
    (lambda: conv_similarity(torch.randn(3, 3)), r"weight must be Tensor\[S, C, \*k\]"),
    (lambda: conv_similarity(torch.randn(2, 2, 3, 3, 3, 3)), "1, 2 or 3 spatial dimensions"),
    (lambda: conv_similarity(torch.randn(2, 2, 3), mode="circular"), "mode must be one of"),
    (lambda: conv_similarity(torch.randn(2, 2, 3), method="magic"), "method must be one of"),
    (lambda: conv_similarity(torch.randn(2, 2, 3), mode="valid", method="fft"), "full-lag loss only"),
    (lambda: conv_similarity(torch.randn(2, 2, 4), mode="same"), "odd kernel size"),
    (lambda: conv_similarity(torch.randn(2, 2, 3, 5)), "same size along every spatial axis"),
    (lambda: conv_similarity(torch.ones(2, 2, 3, dtype=torch.long)), "floating-point"),
    (lambda: conv_similarity(torch.randn(2, 2, 3), mode=5), r"padding must be in \[0, 2\]"),
    (lambda: cross_correlate(torch.randn(2, 5, 5), torch.randn(3, 3, 3)), "same C"),
    (lambda: kernel_correlation(torch.randn(3), torch.randn(4)), "same shape"),
    (lambda: autocorrelation(torch.randn(5), -1), "max_lag must be an integer >= 0"),
])
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_truncated_modes_are_a_heuristic_not_a_guarantee():
    """Valid-mode L_CS can vanish while the valid-padding feature maps are far from orthogonal."""
    w = torch.tensor([[[1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]]], dtype=F64)
    assert float(conv_similarity(w, "valid")) == 0.0
    x = torch.ones(1, 8, dtype=F64)
    f1, f2 = cross_correlate(x, w[0], "valid"), cross_correlate(x, w[1], "valid")
    assert float((f1 * f2).sum()) == 6.0
    assert float(conv_similarity(w, "full")) > 0.0  # the paper's full-lag loss sees the overlap


def test_eq_17_counts_every_pair_twice_eq_19_once():
    """The paper's eq. 17 sums over ordered pairs j != i and calls eq. 19 (j > i) a simplification; it is half."""
    w = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    ordered = sum(kernel_correlation(w[i, c1], w[j, c2]).pow(2).sum()
                  for i in range(4) for j in range(4) if j != i for c1 in range(2) for c2 in range(2))
    torch.testing.assert_close(ordered, 2 * conv_similarity(w, method="direct"))
