"""The orthogonalisers of OPT alone: forward + backward of every rotation of the OPT chapter's CNN-6.

CNN-6 (thesis Table F.1, width 64) over-parameterises seven layers with d x d rotations, d = 27, 576 (five
times) and 1024; one candidate maps all seven raw matrices (one call per layer, as
:mod:`sphereml.regularizers.opt` does) and back-propagates a fixed linear function of the results.  The
baseline is the Householder QR (LAPACK's, cuSOLVER's) that ``gs`` and ``householder`` take on the CPU; off the
CPU they take the Cholesky form in float64 (Note [Gram-Schmidt on a GPU]) and ``lowdin`` the eigendecomposition
(Note [Löwdin on a GPU]).  ``benchmarks/results/logs/gpu-check-4-h200.txt`` holds the H200 run that chose both.
"""

from __future__ import annotations

import sys

import torch

from sphereml.regularizers import orthogonalizers as orth

from .harness import compare, smoke_or

DIMS = (27, 576, 576, 576, 576, 576, 1024)  # CNN-6, width 64: conv1 (3 x 3 x 3), conv2-6 (64 x 3 x 3), fc (1024)


MAPS = {
    "qr (gs, householder)": orth.qr_lapack,
    "cholesky-qr f64 (gs off the cpu)": orth.cholesky_qr,
    "lowdin (svd)": orth.lowdin_svd,
    "lowdin (eigh, float64)": orth.lowdin_eigh,
    "cayley": lambda u: orth.cayley(orth.skew(u)),
    "matrix_exp": lambda u: orth.exp_map(orth.skew(u)),
}


def _step(fn, raws: list[torch.Tensor], weights: list[torch.Tensor]):
    def step():
        loss = sum((fn(raw) * w).sum() for raw, w in zip(raws, weights))
        loss.backward()
        for raw in raws:
            raw.grad = None
    return step


def run(device: torch.device, dims: tuple[int, ...] | None = None, repeats: int = 10) -> dict:
    dims = dims or smoke_or(DIMS, (4, 8, 8, 12))
    g = torch.Generator().manual_seed(0)
    raws = [torch.randn(1, d, d, generator=g).to(device).requires_grad_(True) for d in dims]
    weights = [torch.randn(1, d, d, generator=g).to(device) for d in dims]
    candidates = {label: _step(fn, raws, weights) for label, fn in MAPS.items()}
    with torch.no_grad():
        errors = {label: max(float(orth.orthogonality_error(fn(raw)[0].double())) for raw in raws)
                  for label, fn in MAPS.items()}
    print(f"--- OPT's rotations alone, forward + backward, d = {', '.join(map(str, dims))}, float32")
    result = compare("orthogonalizers_fwd_bwd", candidates, baseline="qr (gs, householder)", device=device,
                     repeats=repeats, extra={"dims": list(dims), "orthogonality_error": errors}, count=True)
    for label, error in errors.items():
        print(f"{'orthogonalizers_fwd_bwd':30s} {label:32s} max |R^T R - I| {error:.1e}")
    return result


if __name__ == "__main__":
    from sphereml.train import resolve_device

    run(resolve_device("auto"), **({"dims": (4, 8), "repeats": 1} if "--smoke" in sys.argv else {}))
