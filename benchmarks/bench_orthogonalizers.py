"""The orthogonalisers of OPT alone: forward + backward of every rotation of the OPT chapter's CNN-6.

CNN-6 (thesis Table F.1, width 64) over-parameterises seven layers with d x d rotations, d = 27, 576 (five
times) and 1024; one candidate maps all seven raw matrices (one call per layer, as
:mod:`sphereml.regularizers.opt` does) and back-propagates a fixed linear function of the results.  The
baseline is the QR path of ``gs`` and ``householder``.  Beside the library's maps, two ways to the same
Gram-Schmidt rows that the library does not use (Cholesky-QR in float64, once and twice: Q = L^-1 U with
L L^T = U U^T) show what a GPU would gain from them; ``benchmarks/results/logs/gpu-check-4-h200.txt`` holds a
first H200 run of the same maps.
"""

from __future__ import annotations

import sys

import torch

from sphereml.regularizers import orthogonalizers as orth

from .harness import compare, smoke_or

DIMS = (27, 576, 576, 576, 576, 576, 1024)  # CNN-6, width 64: conv1 (3 x 3 x 3), conv2-6 (64 x 3 x 3), fc (1024)


def cholesky_qr(u: torch.Tensor, passes: int = 1) -> torch.Tensor:
    """Rows of U orthonormalised as Gram-Schmidt would (positive diagonal), by Cholesky of U U^T in float64."""
    q = u.to(torch.float64)
    for _ in range(passes):
        lower = torch.linalg.cholesky_ex(q @ q.mT)[0]
        q = torch.linalg.solve_triangular(lower, q, upper=False)
    return q.to(u.dtype)


MAPS = {
    "qr (gs, householder)": orth.qr_orthogonalize,
    "lowdin (svd)": orth.lowdin_svd,
    "lowdin (eigh, float64)": orth.lowdin_eigh,
    "cayley": lambda u: orth.cayley(orth.skew(u)),
    "matrix_exp": lambda u: orth.exp_map(orth.skew(u)),
    "cholesky-qr f64 (unused)": cholesky_qr,
    "cholesky-qr2 f64 (unused)": lambda u: cholesky_qr(u, 2),
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
