"""The fused Triton energy kernels against the dense reference: compiled on a GPU, interpreted on CPU tensors.

Triton reads TRITON_INTERPRET when it is imported and when a kernel is decorated, so the
flag is set here, before this module imports Triton (only on machines without CUDA).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="the Triton kernel tests need the triton package")

from sphereml.energy import hyperspherical_energy as E  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _w(n, d, seed):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("s", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("shape", [(5, 3), (70, 19), (130, 40)])
def test_triton_kernel_matches_dense(s, shape):
    w = _w(*shape, seed=shape[0]).to(DEVICE)
    w[1] = w[0]  # a duplicate
    for half in (False, True):
        a, b = w.double().requires_grad_(True), w.clone().requires_grad_(True)
        va, vb = E(a, s=s, half_space=half, backend="dense"), E(b, s=s, half_space=half, backend="triton")
        va.backward()
        vb.backward()
        torch.testing.assert_close(vb.double(), va.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.grad.double(), a.grad, rtol=1e-3, atol=1e-4 * float(a.grad.abs().max()))
