"""Patch norms and cosines by convolution: the offset q, its gradient, output sizes and padding checks."""

import pytest
import torch
import torch.nn.functional as F

from sphereml.layers.patches import check_padding, explicit_padding, output_size, pair, patch_cosine2d

F64 = torch.float64


def test_patch_cosine_with_offset_matches_unfold_and_q_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 6, 5, generator=g, dtype=F64)
    w = torch.randn(4, 3, 3, 3, generator=g, dtype=F64)
    q = torch.tensor(0.4, dtype=F64, requires_grad=True)
    patches = F.unfold(x, 3, padding=1)  # (B, 27, L)
    ref = torch.einsum("od,bdl->bol", w.flatten(1), patches)
    ref = ref / ((patches.norm(dim=1)[:, None] + 0.4) * w.flatten(1).norm(dim=1)[None, :, None])
    torch.testing.assert_close(patch_cosine2d(x, w, padding=1, q=q).flatten(2), ref)
    assert torch.autograd.gradcheck(lambda qq, xx: patch_cosine2d(xx, w, padding=1, q=qq),
                                    (q, x.clone().requires_grad_(True)))
    torch.testing.assert_close(patch_cosine2d(x, w, q=0.0), patch_cosine2d(x, w))


def test_sizes_and_padding_checks():
    assert output_size((9, 8), (3, 2), (1, 2), (2, 1), (2, 1)) == list(F.conv2d(
        torch.zeros(1, 1, 9, 8), torch.zeros(1, 1, 3, 2), stride=(1, 2), padding=(2, 1), dilation=(2, 1)).shape[2:])
    assert pair(3, "k", 1) == (3, 3) and pair((1, 2), "k", 1) == (1, 2) and check_padding("same") == "same"
    x, pad = explicit_padding(torch.zeros(1, 1, 5, 5), "same", (4, 4), (1, 1), (1, 1))
    assert x.shape == (1, 1, 8, 8) and pad == (0, 0)
    with pytest.raises(ValueError, match="padding must be 'valid', 'same'"):
        check_padding("full")
    with pytest.raises(ValueError, match=r"padding='same' needs stride 1"):
        explicit_padding(torch.zeros(1, 1, 5, 5), "same", (3, 3), (2, 2), (1, 1))
    with pytest.raises(ValueError, match="k must be an integer >= 1 or a pair"):
        pair((1, True), "k", 1)


def test_unit_kernels_match_normalize_with_their_hand_written_backward():
    """The kernels' normalisation in patch_cosine2d against autograd through geometry.normalize, with a zero
    kernel and one below the floor (where the gradient is g / eps, no projection)."""
    from sphereml.geometry import normalize
    from sphereml.layers.unit_kernels import _UnitKernels

    w = torch.randn(5, 3, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    w[1], w[2] = 0.0, 1e-9
    g = torch.randn_like(w)
    a, b = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ours, ref = _UnitKernels.apply(a, 1e-6)[0], normalize(b.flatten(1), eps=1e-6).view_as(b)
    (ours * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(ours, ref, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda v: _UnitKernels.apply(v, 1e-6)[0], (w[3:].clone().requires_grad_(True),))


def test_patch_cosine_operation_budget():
    """Forward + backward (with the loss's sum) in 44 aten operations, about one GPU launch each: 53 with
    autograd through geometry.normalize for the kernels."""
    from sphereml.launches import count_ops

    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    w = torch.randn(6, 4, 3, 3, requires_grad=True)
    assert count_ops(lambda: patch_cosine2d(x, w, padding=1).sum().backward()).total <= 44
