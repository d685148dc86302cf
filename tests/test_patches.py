"""Patch norms and cosines by convolution: the offset q, its gradient, output sizes and padding checks."""

import pytest
import torch
import torch.nn.functional as F

from sphereml.patches import check_padding, explicit_padding, output_size, pair, patch_cosine2d

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
