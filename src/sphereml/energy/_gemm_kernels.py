"""The Triton kernels of :mod:`sphereml.energy.gemm_backend` (imported on first use).

Layout: one block of b rows i = row0 ... row0 + b - 1 of the points Q (Tensor[M, D], float32, rows ``stride_q``
apart) against all M points.  G (Tensor[b, M], float32, rows ``stride_g`` apart) holds the Gram block
g_ij = q_i . q_j, written by a cuBLAS product before ``pair_kernel`` runs; SQ = ||q_j||^2.  The (b, M) block is cut
into (BM, BN) tiles, ``tiles`` of them along M; both kernels take the same BM and BN, so a tile means the same
pairs in each (a 1-D grid: no 65,535 limit on the number of column tiles).

* ``pair_kernel``: program = one tile.  r^2 = ||q_i||^2 + ||q_j||^2 - 2 g_ij; the pair values f(r^2) summed per
  row into VALS[i, tile] (Tensor[b, tiles]); with ``WITH_GRAD`` also D = df/dg of the far pairs written over G
  in place (the input of the second cuBLAS product, (D Q)_i), their row sums into DSUM[i, tile], and into
  FLAGS[row tile, tile] (Tensor[b / BM, tiles], int32) whether the tile has a close pair.
* ``close_gradient_kernel``: program = (row tile, BDO-wide slice of the coordinates).  It scans the flags of its
  row tile and, for a flagged tile only, adds sum_j D_ij (q_j - q_i) of its close pairs from explicit
  coordinate differences to GRAD[i, slice] (the rows' gradient, already holding the far pairs' part).

Close pairs (Note [close pairs] in :mod:`~sphereml.energy.kernels`) are decided here by the *exact* r^2.  A tile
whose Gram estimate puts some pair below twice the threshold (a candidate; the estimate's error is far below
that margin in every matmul precision) recomputes r^2 of all its pairs from coordinate differences
(``exact_r2_tile``), and its close pairs are those whose exact r^2 is below ``CLOSE_R2`` (||q_i||^2 + ||q_j||^2) / 2.
Both kernels apply this rule to numbers computed by the same inlined ``exact_r2_tile`` on the same tile (the same
sums in the same order, compiled with the same settings), so they agree on every pair: a close pair is left out
of the product D Q and enters once, through its explicit difference.  The far pairs of a candidate tile take
the exact r^2 too.  Arithmetic is float32;
nothing is accumulated across programs (every program writes its own outputs), so the result is deterministic.
"""

import triton
import triton.language as tl

from ._triton_kernels import add_close_gradient, exact_r2_tile, riesz
from .triton_backend import interpreting

__all__ = ["PAIR_BLOCKS", "CLOSE_BLOCKS", "pair_kernel", "close_gradient_kernel"]

# (BM, BN, warps) of both kernels' tiles, and the close-gradient kernel's (BDO, warps): small under the
# interpreter (several tiles and d-slices in the tests).  On a GPU the pair kernel is bound by memory, so it wants
# many programs resident per multiprocessor: compiled for sm_90a here (``python -m benchmarks.bench_energy
# --compile-check``, Triton 3.9, ptxas -v), 32 x 128 tiles with 4 warps took 255 registers (64 x 128 with 8 warps
# spilled), 16 x 64 with 4 warps 96, 8 x 128 with 4 warps 64-72 without spills (8 values per thread; 32 without the
# gradient); the close-gradient kernel 56-64 with d-slices of 64 (one pipeline stage each, as launched).
PAIR_BLOCKS = (16, 32, 4) if interpreting() else (8, 128, 4)
CLOSE_BLOCKS = (16, 4, 4) if interpreting() else (64, 512, 4)  # (largest BDO, FB flags scanned at once, warps)


@triton.jit
def _tile(Q, SQ, first, rmask, col0, M, D, stride_q, gram, close_r2, EXACT: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr):
    """(r^2, pairs kept, close pairs as int32) of the tile of rows first ... first + BM - 1 (``rmask``: those of the
    block) and columns col0 ... col0 + BN - 1.  ``EXACT``: r^2 from coordinate differences for the whole tile
    (``gram`` unused); otherwise from ``gram``, or exactly for a candidate tile (module docstring)."""
    rows = first + tl.arange(0, BM)
    cols = col0 + tl.arange(0, BN)
    cmask = cols < M
    sq_r = tl.load(SQ + rows, mask=rmask, other=0.0)
    sq_c = tl.load(SQ + cols, mask=cmask, other=0.0)
    norms = sq_r[:, None] + sq_c[None, :]
    keep = rmask[:, None] & cmask[None, :] & (rows[:, None] != cols[None, :])
    if EXACT:
        r2 = exact_r2_tile(Q, first, col0, rmask, cmask, D, stride_q, BM, BN)
        close = (keep & (2.0 * r2 < close_r2 * norms)).to(tl.int32)
    else:
        r2 = norms - 2.0 * gram
        close = tl.zeros((BM, BN), dtype=tl.int32)
        if tl.sum((keep & (r2 < close_r2 * norms)).to(tl.int32)) > 0:  # a candidate: below twice the threshold
            r2 = exact_r2_tile(Q, first, col0, rmask, cmask, D, stride_q, BM, BN)  # every pair's, at no extra cost
            close = (keep & (2.0 * r2 < close_r2 * norms)).to(tl.int32)
    return r2, keep, close


@triton.jit(do_not_specialize=["row0", "b"])  # one compilation for every block, the ragged last one included
def pair_kernel(G, Q, SQ, VALS, DSUM, FLAGS, row0, b, M, D, stride_q, stride_g, tiles, s, eps, close_r2,
                POWER: tl.constexpr, WITH_GRAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Row sums of f over one tile into VALS; with WITH_GRAD the far pairs' D over G, their row sums into DSUM,
    and the tile's close-pair flag into FLAGS (POWER as in ``riesz``)."""
    pid = tl.program_id(0)
    row_tile, col_tile = pid // tiles, pid % tiles
    local = row_tile * BM + tl.arange(0, BM)
    rmask = local < b
    cols = col_tile * BN + tl.arange(0, BN)
    offsets = tl.cast(local, tl.int64)[:, None] * stride_g + cols[None, :]
    mask = rmask[:, None] & (cols < M)[None, :]
    gram = tl.load(G + offsets, mask=mask, other=0.0)
    r2, keep, close = _tile(Q, SQ, row0 + row_tile * BM, rmask, col_tile * BN, M, D, stride_q, gram, close_r2, False,
                            BM, BN)
    val, deriv = riesz(r2, s, eps, POWER)
    partial = tl.cast(local, tl.int64) * tiles + col_tile
    tl.store(VALS + partial, tl.sum(tl.where(keep, val, 0.0), axis=1), mask=rmask)
    if WITH_GRAD:
        far = tl.where(keep & (close == 0), deriv, 0.0)
        tl.store(G + offsets, far, mask=mask)
        tl.store(DSUM + partial, tl.sum(far, axis=1), mask=rmask)
        tl.store(FLAGS + pid, tl.max(close, axis=None))  # pid = row_tile * tiles + col_tile


@triton.jit(do_not_specialize=["row0", "b"])
def close_gradient_kernel(Q, SQ, FLAGS, GRAD, row0, b, M, D, stride_q, stride_grad, tiles, s, eps, close_r2,
                          POWER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BDO: tl.constexpr,
                          FB: tl.constexpr):
    """GRAD[i, slice] += sum_j D_ij (q_j - q_i)[slice] over the close pairs of the flagged tiles of BM rows.

    The flags are scanned FB at a time (one vector load and a maximum), and one by one only in a chunk that
    holds a flag: at M = 2^20 a row tile has 8,192 column tiles, almost all without a close pair."""
    row_tile, d0 = tl.program_id(0), tl.program_id(1) * BDO
    local = row_tile * BM + tl.arange(0, BM)
    rmask = local < b
    dims = d0 + tl.arange(0, BDO)
    acc = tl.zeros((BM, BDO), dtype=tl.float32)
    flags = FLAGS + tl.cast(row_tile, tl.int64) * tiles
    for chunk in range(0, tiles, FB):
        if tl.max(tl.load(flags + chunk + tl.arange(0, FB), mask=chunk + tl.arange(0, FB) < tiles, other=0)) != 0:
            for col_tile in range(chunk, tl.minimum(chunk + FB, tiles)):
                if tl.load(flags + col_tile) != 0:
                    col0 = col_tile * BN
                    r2, _, close = _tile(Q, SQ, row0 + row_tile * BM, rmask, col0, M, D, stride_q, 0.0, close_r2, True,
                                         BM, BN)
                    _, deriv = riesz(r2, s, eps, POWER)
                    acc = add_close_gradient(acc, tl.where(close != 0, deriv, 0.0), Q, row0 + row_tile * BM, col0,
                                             rmask, col0 + tl.arange(0, BN) < M, dims, d0, D, stride_q, BM, BN, BDO)
    offsets = tl.cast(local, tl.int64)[:, None] * stride_grad + dims[None, :]
    inside = rmask[:, None] & (dims < D)[None, :]
    tl.store(GRAD + offsets, tl.load(GRAD + offsets, mask=inside, other=0.0) + acc, mask=inside)
