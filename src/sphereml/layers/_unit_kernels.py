"""The Triton kernels of :mod:`sphereml.layers.unit_kernels` (imported on first use, like the epilogue's).

Layout: W (Tensor[R, D], the R kernels of a layer flattened to rows of D = C_in / groups x k_h x k_w contiguous
values, float32 or half).  Each program owns BR rows and walks over their D values in BD-wide slices, twice: once
to reduce, once to write.  A layer's kernels are a few thousand values per row at most, so the second walk reads
what the first left in the cache.

* ``forward_kernel``: n = ||w|| with the squares summed in float64 (no overflow or underflow for any float32 or
  half row, so no scale is needed), inv = 1 / max(n, eps) and active = [n >= eps] (1 or 0) per row, both float32,
  and the unit rows u = w inv in W's dtype: the w_hat of thesis eq. 3.1.
* ``backward_kernel``: from dL/du, t = sum_j dL/du_j u_j (float32) per row, then
  dL/dw = inv (dL/du - active t u): the projection onto the sphere's tangent space, left out where the norm is
  floored (there u = w / eps is linear in w).
"""

import triton
import triton.language as tl

from ..energy.triton_backend import interpreting

__all__ = ["BLOCKS", "forward_kernel", "backward_kernel"]

# (rows, columns, warps): small under the interpreter, as the margin heads' norm kernel on a GPU (not yet run there)
BLOCKS = (4, 16, 4) if interpreting() else (8, 128, 4)


@triton.jit
def _rows(R, D, BR: tl.constexpr):
    """(rows, their mask, each row's first element) of this program's BR rows."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    return rows, rows < R, rows[:, None].to(tl.int64) * D


@triton.jit
def _slice(base, rmask, k0, D, BD: tl.constexpr):
    """(offsets, mask) of the columns k0 .. k0 + BD of the program's rows."""
    cols = k0 + tl.arange(0, BD)
    return base + cols[None, :], rmask[:, None] & (cols[None, :] < D)


@triton.jit
def forward_kernel(W, U_OUT, INV_OUT, ACTIVE_OUT, R, D, eps, BR: tl.constexpr, BD: tl.constexpr):
    """u = w / max(||w||, eps), inv and active for rows program * BR.. (see the module docstring)."""
    rows, rmask, base = _rows(R, D, BR)
    acc = tl.zeros((BR,), tl.float64)
    for k0 in range(0, D, BD):
        offsets, mask = _slice(base, rmask, k0, D, BD)
        w = tl.load(W + offsets, mask=mask, other=0.0).to(tl.float64)
        acc += tl.sum(w * w, axis=1)
    norm = tl.sqrt(acc)
    inv = (1.0 / tl.maximum(norm, eps, propagate_nan=tl.PropagateNan.ALL)).to(tl.float32)  # NaN rows stay NaN
    for k0 in range(0, D, BD):
        offsets, mask = _slice(base, rmask, k0, D, BD)
        w = tl.load(W + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(U_OUT + offsets, (w * inv[:, None]).to(U_OUT.dtype.element_ty), mask=mask)
    tl.store(INV_OUT + rows, inv, mask=rmask)
    tl.store(ACTIVE_OUT + rows, tl.where(norm >= eps, 1.0, 0.0).to(tl.float32), mask=rmask)


@triton.jit
def backward_kernel(G, U, INV, ACTIVE, GW_OUT, R, D, BR: tl.constexpr, BD: tl.constexpr):
    """dL/dw = inv (dL/du - active (dL/du . u) u) for rows program * BR.. (see the module docstring)."""
    rows, rmask, base = _rows(R, D, BR)
    dot = tl.zeros((BR,), tl.float32)
    for k0 in range(0, D, BD):
        offsets, mask = _slice(base, rmask, k0, D, BD)
        g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(g * tl.load(U + offsets, mask=mask, other=0.0).to(tl.float32), axis=1)
    inv = tl.load(INV + rows, mask=rmask, other=0.0)
    along = dot * tl.load(ACTIVE + rows, mask=rmask, other=0.0)
    for k0 in range(0, D, BD):
        offsets, mask = _slice(base, rmask, k0, D, BD)
        g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(GW_OUT + offsets, ((g - u * along[:, None]) * inv[:, None]).to(GW_OUT.dtype.element_ty), mask=mask)
