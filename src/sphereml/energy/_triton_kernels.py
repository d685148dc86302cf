"""The Triton kernels of :mod:`sphereml.energy.triton_backend` (imported on first use).

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted
(``TRITON_INTERPRET=1``), and jitted helpers must be module globals, hence this module.  The
autotuning configurations are chosen here for the same reason: a small Hopper-friendly set on a
GPU, exactly one configuration under the interpreter (multi-config autotuning needs a driver).

Layout: Q (Tensor[M, D], float32, contiguous rows of ``stride`` elements), SQ = ||q_i||^2.  The
first row of a tile is addressed with an int64 offset (row * stride exceeds 2^31 for M = 2^20
and D > 2048); offsets inside a tile (at most 128 * stride) are int32, which keeps the pointer
tensors out of the register file.  Accumulation is float32; the pair values are summed per row
and added up in float64 by the launcher.

The configurations were checked by compiling every one for sm_90 on a CPU (``triton.compile``
with a ``GPUTarget``; Triton 3.9) and reading ``ptxas -v``: the forward uses 64 x 64 tiles with
8 warps (no spills, or 112 bytes with 3 stages in IEEE; 4 warps or 128 x 128 tiles spill), the
tensor-core backward 64 rows by 16 or 32 columns and d-slices of 128 or 256 (TF32: 0 to 124
bytes of spills, TF32x3: 0 to 612; autotuning weighs them against recomputing the Gram tiles
d / BDO times), and the IEEE backward 16 columns (with 64 columns a 64 x 64 x 128 FMA product
unrolls into 25 kB of spills and 16 s of compile per configuration).  Each configuration's time alone
(N = 32768, d = 512, s = 2) is in benchmarks/results/energy_triton_configs-cuda.json: the three forward
configurations are within a few per cent of each other; autotuning the IEEE backward over BDO = 64 and 128
did not finish within the run's 45-s limit where BDO = 128 alone took under 2 s, so BDO = 64 is dropped.
"""

import os

import triton
import triton.language as tl

from .triton_backend import interpreting

__all__ = ["TUNING_KEY", "forward_kernel", "backward_kernel"]


def _config(warps, stages, **blocks):
    return triton.Config(blocks, num_warps=warps, num_stages=stages)


if interpreting():
    FORWARD_CONFIGS = [_config(4, 1, BLOCK=64, BD=32)]
    BACKWARD_CONFIGS = [_config(4, 1, BM=64, BN=64, BD=32, BDO=32)]  # d-slices of 32: several, some ragged
    IEEE_BACKWARD_CONFIGS = []
else:
    FORWARD_CONFIGS = [_config(8, 3, BLOCK=64, BD=32), _config(8, 2, BLOCK=64, BD=32), _config(4, 3, BLOCK=32, BD=32)]
    BACKWARD_CONFIGS = [_config(8, 2, BM=64, BN=16, BD=32, BDO=256), _config(8, 2, BM=64, BN=16, BD=32, BDO=128),
                        _config(8, 2, BM=64, BN=32, BD=32, BDO=256), _config(8, 2, BM=64, BN=32, BD=32, BDO=128)]
    # no BDO = 64 for IEEE: see the module docstring (benchmarks/results/energy_triton_configs-cuda.json)
    IEEE_BACKWARD_CONFIGS = [_config(8, 2, BM=64, BN=16, BD=32, BDO=128)]
    if os.environ.get("SPHEREML_TRITON_AUTOTUNE", "1") == "0":  # quick GPU test runs: one configuration each
        FORWARD_CONFIGS, BACKWARD_CONFIGS, IEEE_BACKWARD_CONFIGS = (FORWARD_CONFIGS[:1], BACKWARD_CONFIGS[:1],
                                                                    IEEE_BACKWARD_CONFIGS[:1])
    # diagnostics: pin one configuration by its index (SPHEREML_TRITON_FORWARD_CONFIG=i, ..._BACKWARD_CONFIG=j,
    # ..._IEEE_BACKWARD_CONFIG=k), as benchmarks/gpu_diagnose.py does to time each one alone
    for _name in ("FORWARD", "BACKWARD", "IEEE_BACKWARD"):
        if os.environ.get(f"SPHEREML_TRITON_{_name}_CONFIG"):
            _chosen = globals()[f"{_name}_CONFIGS"][int(os.environ[f"SPHEREML_TRITON_{_name}_CONFIG"])]
            globals()[f"{_name}_CONFIGS"] = [_chosen]
_IEEE = {id(c) for c in IEEE_BACKWARD_CONFIGS}


def _backward_configs(configs, named_args, **kwargs):
    """Autotuning prune: the IEEE set for ``PRECISION="ieee"``, the tensor-core set otherwise; no
    d-slice wider than the next power of two of d (at least one configuration is kept)."""
    precision = kwargs.get("PRECISION", named_args.get("PRECISION"))
    d = named_args.get("D", kwargs.get("D"))
    mine = [c for c in configs if (id(c) in _IEEE) == (precision == "ieee")] or list(configs)
    narrow = [c for c in mine if c.kwargs["BDO"] <= max(16, triton.next_power_of_2(int(d)))]
    return narrow or [min(mine, key=lambda c: c.kwargs["BDO"])]


# Every program writes its own rows (forward: one partial sum per row; backward: one (rows, d-slice)
# block of the gradient), nothing is accumulated across programs or launches, so no output needs
# reset_to_zero.  The key buckets M (see triton_backend.TUNE_CAP).
TUNING_KEY = ["M_KEY", "D", "POWER", "PRECISION"]


@triton.jit
def gram_tile(Q, row0, col0, rmask, cmask, D, stride, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
              PRECISION: tl.constexpr):
    """q_i . q_j for the (BM, BN) tile at rows row0.., columns col0.., with ``tl.dot`` at ``PRECISION``."""
    r_base = Q + tl.cast(row0, tl.int64) * stride
    c_base = Q + tl.cast(col0, tl.int64) * stride
    r_offs = tl.arange(0, BM)[:, None] * stride
    c_offs = tl.arange(0, BN)[:, None] * stride
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, D, BD):
        ks = k + tl.arange(0, BD)
        kmask = ks < D
        a = tl.load(r_base + (r_offs + ks[None, :]), mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(c_base + (c_offs + ks[None, :]), mask=cmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc


@triton.jit
def exact_r2_tile(Q, row0, col0, rmask, cmask, D, stride, BM: tl.constexpr, BN: tl.constexpr):
    """||q_i - q_j||^2 for a (BM, BN) tile from coordinate differences (Note [close pairs]): the slow path."""
    r_ptr = (Q + tl.cast(row0, tl.int64) * stride) + tl.arange(0, BM) * stride
    c_ptr = (Q + tl.cast(col0, tl.int64) * stride) + tl.arange(0, BN) * stride
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, D):
        a = tl.load(r_ptr + k, mask=rmask, other=0.0)
        b = tl.load(c_ptr + k, mask=cmask, other=0.0)
        diff = a[:, None] - b[None, :]
        acc += diff * diff
    return acc


@triton.jit
def riesz(r2, s, eps, POWER: tl.constexpr):
    """f(r^2) and D = df/dg = -2 df/dr^2, floored at eps with zero derivative (Note [energy floor]).

    POWER: 0 (s = 0, log), 1 and 2 (fast paths for s = 1, 2), -1 (any other s > 0).
    """
    above = r2 > eps
    r2 = tl.where(above, r2, eps)
    if POWER == 0:
        val = -0.5 * tl.log(r2)
        deriv = 1.0 / r2
    elif POWER == 1:
        val = tl.rsqrt(r2)
        deriv = val / r2
    elif POWER == 2:
        val = 1.0 / r2
        deriv = 2.0 * val * val
    else:
        val = tl.exp2(-0.5 * s * tl.log2(r2))
        deriv = s * val / r2
    return val, tl.where(above, deriv, 0.0)


@triton.jit
def pair_tile(Q, SQ, rows, rmask, sq_r, row0, col0, M, D, stride, s, eps, close_r2, POWER: tl.constexpr,
              PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """Values and D of the (BM, BN) tile of pairs at (row0, col0) (zero on i == j and outside), its close
    pairs and their count.

    Note [close pairs]: r^2 comes from the Gram tile; only a tile that contains a close pair
    recomputes r^2 from differences (``exact_r2_tile``) and uses it for those pairs.
    """
    cols = col0 + tl.arange(0, BN)
    cmask = cols < M
    sq_c = tl.load(SQ + cols, mask=cmask, other=0.0)
    norms = sq_r[:, None] + sq_c[None, :]
    r2 = norms - 2.0 * gram_tile(Q, row0, col0, rmask, cmask, D, stride, BM, BN, BD, PRECISION)
    keep = rmask[:, None] & cmask[None, :] & (rows[:, None] != cols[None, :])
    close = keep & (2.0 * r2 < close_r2 * norms)
    n_close = tl.sum(close.to(tl.int32))
    if n_close > 0:
        r2 = tl.where(close, exact_r2_tile(Q, row0, col0, rmask, cmask, D, stride, BM, BN), r2)
    val, deriv = riesz(r2, s, eps, POWER)
    return tl.where(keep, val, 0.0), tl.where(keep, deriv, 0.0), close, n_close


@triton.jit
def add_close_gradient(acc, d_close, Q, row0, col0, rmask, cmask, dims, d0, D, stride, BM: tl.constexpr,
                       BN: tl.constexpr, BDO: tl.constexpr):
    """acc[:, k] += sum_j d_close[i, j] (q_jk - q_ik) for the coordinates k of this d-slice (Note [close pairs]).

    The explicit differences avoid the cancellation of (D Q)_i - rowsum(D)_i q_i; the column is
    added with ``tl.where`` (adding zeros elsewhere), which is exact.
    """
    r_ptr = (Q + tl.cast(row0, tl.int64) * stride) + tl.arange(0, BM) * stride
    c_ptr = (Q + tl.cast(col0, tl.int64) * stride) + tl.arange(0, BN) * stride
    for kk in range(0, BDO):
        k = d0 + kk
        k_read = tl.minimum(k, D - 1)  # a column k >= D is never stored; read a valid one
        a = tl.load(r_ptr + k_read, mask=rmask, other=0.0)
        b = tl.load(c_ptr + k_read, mask=cmask, other=0.0)
        column = tl.sum(d_close * (b[None, :] - a[:, None]), axis=1)
        acc += tl.where(dims[None, :] == k, column[:, None], 0.0)
    return acc


@triton.autotune(configs=FORWARD_CONFIGS, key=TUNING_KEY)
@triton.jit
def forward_kernel(Q, SQ, OUT, M, D, stride, M_KEY, s, eps, close_r2, POWER: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK: tl.constexpr, BD: tl.constexpr):
    """OUT[i] = the sum of f over the pairs (i, j) of the tiles j-block >= i-block, off-diagonal tiles twice.

    The pair matrix is symmetric, so only the upper triangle of square tiles is evaluated
    (half the Gram work); the total over OUT is the sum over all ordered pairs.  Each program
    writes its own rows: deterministic.
    """
    first = tl.program_id(0) * BLOCK
    rows = first + tl.arange(0, BLOCK)
    rmask = rows < M
    sq_r = tl.load(SQ + rows, mask=rmask, other=0.0)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(first, M, BLOCK):
        val, _, _, _ = pair_tile(Q, SQ, rows, rmask, sq_r, first, start, M, D, stride, s, eps, close_r2, POWER,
                                 PRECISION, BLOCK, BLOCK, BD)
        total += tl.where(start == first, 1.0, 2.0) * tl.sum(val, axis=1)
    tl.store(OUT + rows, total, mask=rmask)


@triton.autotune(configs=BACKWARD_CONFIGS + IEEE_BACKWARD_CONFIGS, key=TUNING_KEY,
                 prune_configs_by={"early_config_prune": _backward_configs})
@triton.jit
def backward_kernel(Q, SQ, GRAD, M, D, stride, M_KEY, s, eps, close_r2, POWER: tl.constexpr,
                    PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                    BDO: tl.constexpr):
    """GRAD[i, slice] = sum_j D_ij (q_j - q_i)[slice] for BM rows and one BDO-wide slice of coordinates.

    Recomputes the Gram tiles over all of D (nothing of size M x M is stored); far pairs go
    through ``tl.dot`` at ``PRECISION`` as (D Q)_i - rowsum(D)_i q_i, close pairs through
    ``add_close_gradient``.
    """
    row0 = tl.program_id(0) * BM
    rows = row0 + tl.arange(0, BM)
    rmask = rows < M
    d0 = tl.program_id(1) * BDO
    dims = d0 + tl.arange(0, BDO)
    dmask = dims < D
    sq_r = tl.load(SQ + rows, mask=rmask, other=0.0)
    col_offs = tl.arange(0, BN)[:, None] * stride + dims[None, :]  # (BN, BDO), int32
    acc = tl.zeros((BM, BDO), dtype=tl.float32)
    rowsum = tl.zeros((BM,), dtype=tl.float32)
    for start in range(0, M, BN):
        cmask = start + tl.arange(0, BN) < M
        _, deriv, close, n_close = pair_tile(Q, SQ, rows, rmask, sq_r, row0, start, M, D, stride, s, eps, close_r2,
                                             POWER, PRECISION, BM, BN, BD)
        if n_close > 0:
            acc = add_close_gradient(acc, tl.where(close, deriv, 0.0), Q, row0, start, rmask, cmask, dims, d0, D,
                                     stride, BM, BN, BDO)
            deriv = tl.where(close, 0.0, deriv)
        q_cols = tl.load((Q + tl.cast(start, tl.int64) * stride) + col_offs, mask=cmask[:, None] & dmask[None, :],
                         other=0.0)
        acc = tl.dot(deriv, q_cols, acc, input_precision=PRECISION)
        rowsum += tl.sum(deriv, axis=1)
    offsets = tl.arange(0, BM)[:, None] * stride + dims[None, :]
    inside = rmask[:, None] & dmask[None, :]
    q_rows = tl.load((Q + tl.cast(row0, tl.int64) * stride) + offsets, mask=inside, other=0.0)
    tl.store((GRAD + tl.cast(row0, tl.int64) * stride) + offsets, acc - rowsum[:, None] * q_rows, mask=inside)
