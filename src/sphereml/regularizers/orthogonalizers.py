"""Maps from an unconstrained square matrix to an orthogonal one, and the Cayley step of OGD (thesis §7.3.3-7.3.5).

Each map takes ``Tensor[..., m, m]`` (a batch of raw matrices U) and returns orthogonal matrices of
the same shape, differentiably.  They are the functional core of :mod:`sphereml.regularizers.opt`:

* :func:`gram_schmidt` — Gram-Schmidt on the **rows** of U, as the authors' code orthonormalises
  them (the thesis's Algorithm 1 and eqs. F.1-F.2 write it on columns): classic or modified (eq. F.3),
  unrolled in a loop of m steps.
* :func:`householder` — Householder QR of the **columns** of U (eq. 7.3, Algorithm 3), unrolled, with
  the stable choice of the reflection vector (``stable=False``: the authors' reflector u = x - ||x|| e_1;
  the map still fixes the sign of the last column, which the authors' code leaves as it falls, so that
  their Q has determinant (-1)^(m-1) and ours a non-negative diagonal of R).
* :func:`qr_orthogonalize` — the same two maps computed by LAPACK's QR, with the signs fixed so
  that the triangular factor has a positive diagonal: ``rows=True`` equals :func:`gram_schmidt`,
  ``rows=False`` equals :func:`householder` (in exact arithmetic, and to rounding in practice); on a GPU
  :func:`cholesky_qr` computes the same map from a Cholesky factorisation in float64.
  Classic and modified Gram-Schmidt are one map computed two ways; they differ only in rounding.
* :func:`lowdin` — Löwdin's symmetric orthogonalisation U (U^T U)^(-1/2) = W V^T from the SVD
  U = W S V^T (eq. 7.4, F.12-F.14): the orthogonal matrix nearest to U in Frobenius norm; on a GPU
  :func:`lowdin_eigh` computes it from the eigendecomposition of U^T U in float64.
* :func:`cayley` — (I + A)(I - A)^(-1) of a skew-symmetric A (§7.3.4); :func:`skew` builds A = T - T^T
  from the strict upper triangle T of U; :func:`exp_map` is the matrix exponential exp(A).  The Cayley
  map of A is the (1, 1) Padé approximant of exp(2A).
* :func:`cayley_sgd_step` — one step of orthogonality-preserving gradient descent on the Cayley curve
  (eqs. 7.5-7.6) along a *descent* direction; see Note [the sign of eq. 7.5].

Note [the sign of eq. 7.5]
    The thesis builds the skew matrix from +grad f and moves along Y(lambda) with lambda > 0.  To
    first order that changes f by +(lambda / 4) ||A - A^T||_F^2 with A = U^T grad f (for square U):
    the printed step *ascends*.  The authors' code moves along the momentum m <- mu m - grad f, a
    descent direction.  :func:`cayley_sgd_step` takes the direction to move along (``-grad`` or
    the momentum), so the sign is explicit; the tests and chapter 9 show both signs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._autograd import Function
from .._checks import integer, real_number
from ..geometry import max_abs_scale
from ..launches import on_accelerator  # the GPU forms; tests make it say True

__all__ = ["check_square", "gram_schmidt", "householder", "qr_orthogonalize", "qr_lapack", "cholesky_qr", "lowdin",
           "lowdin_svd", "lowdin_eigh", "skew", "cayley", "cayley_cholesky", "solve_invertible", "BATCHED_LU_ROWS",
           "exp_map", "exp_map_fixed", "MAX_SQUARINGS", "cayley_sgd_step", "orthogonality_error"]

_TINY = 1e-30  # a floor on squared norms: zero vectors give zeros, never NaN


def check_square(u: Tensor, name: str = "u") -> Tensor:
    """``u`` if it is a floating-point Tensor[..., m, m]; a ValueError naming the argument ``name`` otherwise."""
    if not isinstance(u, Tensor) or u.dim() < 2 or u.shape[-1] != u.shape[-2]:
        raise ValueError(f"{name} must be a Tensor[..., m, m] of square matrices, "
                         f"got shape {tuple(getattr(u, 'shape', ()))}")
    if not torch.is_floating_point(u):
        raise ValueError(f"{name} must be a floating-point tensor, got {u.dtype}")
    return u


def _rescaled(u: Tensor) -> Tensor:
    """``u`` divided by its largest absolute entry (per matrix, detached).  The orthogonalisers below return the same Q
    for U and cU (c > 0), and on the rescaled matrix their squared norms neither overflow nor underflow in
    float32; the gradient is unchanged, Q being scale-invariant."""
    return u / max_abs_scale(u, (-2, -1))


def _unit(x: Tensor) -> Tensor:
    return x * (x * x).sum(-1, keepdim=True).clamp_min(_TINY).rsqrt()


def gram_schmidt(u: Tensor, modified: bool = False) -> Tensor:
    r"""Orthonormalise the rows of ``u`` in order, unrolled (thesis Algorithm 1; eq. F.3 when ``modified``).

    Classic: :math:`e_i = t_i / \lVert t_i \rVert` with
    :math:`t_i = u_i - \sum_{j<i} \langle u_i, e_j \rangle e_j`.  Modified: the projection
    on :math:`e_i` is removed from every later row as soon as :math:`e_i` is known, which loses less orthogonality
    when U is ill-conditioned.  Both are the map of :func:`qr_orthogonalize` with ``rows=True``.

    Args:
        u (Tensor[..., m, m]): raw matrices.
        modified (bool): modified instead of classic Gram-Schmidt. Default: False.

    Returns:
        Tensor[..., m, m] with orthonormal rows.
    """
    u = _rescaled(check_square(u))
    rows = []
    if modified:
        rest = u
        for _ in range(u.shape[-1]):
            e = _unit(rest[..., 0, :])
            rows.append(e)
            rest = rest[..., 1:, :]
            rest = rest - (rest @ e.unsqueeze(-1)) * e.unsqueeze(-2)
        return torch.stack(rows, -2)
    for i in range(u.shape[-1]):
        t = u[..., i, :]
        if rows:
            basis = torch.stack(rows, -2)  # (..., i, m)
            t = t - ((basis @ t.unsqueeze(-1)) * basis).sum(-2)
        rows.append(_unit(t))
    return torch.stack(rows, -2)


def _reflector(x: Tensor, stable: bool) -> tuple[Tensor, Tensor]:
    """v and 2 / v^T v of the reflection H = I - (2 / v^T v) v v^T with H x = ||x|| e_1 (Algorithm 3)."""
    x0, tail = x[..., 0], (x[..., 1:] ** 2).sum(-1)
    norm = (x0 ** 2 + tail).clamp_min(_TINY).sqrt()  # a zero column keeps a finite gradient
    if stable:  # x0 - ||x|| rewritten as -tail / (x0 + ||x||) when x0 > 0: no cancellation
        positive = x0 > 0
        v0 = torch.where(positive, -tail / torch.where(positive, x0 + norm, 1.0), x0 - norm)
    else:  # the authors' u = x - ||x|| e_1
        v0 = x0 - norm
    v = torch.cat([v0.unsqueeze(-1), x[..., 1:]], -1)
    vtv = v0 ** 2 + tail
    nonzero = vtv > _TINY
    return v, torch.where(nonzero, 2.0 / torch.where(nonzero, vtv, 1.0), 0.0)


def householder(u: Tensor, stable: bool = True) -> Tensor:
    """Q of the QR factorisation U = Q R by m - 1 Householder reflections, unrolled (eq. 7.3, Algorithm 3).

    Every reflection maps its column x to +||x|| e_1, so R has a non-negative diagonal and Q is the
    map of :func:`qr_orthogonalize` with ``rows=False``.  ``stable=False`` forms the reflection
    vector as x - ||x|| e_1 (the authors' code), which cancels catastrophically when x is close to
    ||x|| e_1; the stable form computes the same vector without the subtraction.

    Args:
        u (Tensor[..., m, m]): raw matrices.
        stable (bool): the stable reflection vector. Default: True.

    Returns:
        Tensor[..., m, m], orthogonal.
    """
    u = _rescaled(check_square(u))
    m = u.shape[-1]
    a = u
    q = torch.eye(m, dtype=u.dtype, device=u.device).expand_as(u)
    for k in range(m - 1):
        v, scale = _reflector(a[..., k:, k], stable)
        # H_k acts on rows (of A) / columns (of Q) k..m-1 only.
        a_tail = a[..., k:, :] - (scale[..., None, None] * v.unsqueeze(-1)) * (v.unsqueeze(-2) @ a[..., k:, :])
        a = torch.cat([a[..., :k, :], a_tail], -2)
        q_tail = q[..., :, k:] - ((q[..., :, k:] @ v.unsqueeze(-1)) * scale[..., None, None]) * v.unsqueeze(-2)
        q = torch.cat([q[..., :, :k], q_tail], -1)
    # The last 1x1 block: its sign makes the final diagonal entry of R non-negative.
    last = torch.where(a[..., m - 1, m - 1] < 0, -1.0, 1.0).to(u.dtype)
    return torch.cat([q[..., :, :m - 1], q[..., :, m - 1:] * last[..., None, None]], -1)


def qr_orthogonalize(u: Tensor, rows: bool = True) -> Tensor:
    """Gram-Schmidt (``rows=True``) or Householder (``rows=False``) by one factorisation, signs fixed.

    ``rows=False``: Q of U = Q R with diag(R) >= 0, as :func:`householder` computes it.
    ``rows=True``: the same applied to U^T and transposed back, so the rows of the result are the
    Gram-Schmidt orthonormalisation of the rows of U, as :func:`gram_schmidt` computes them.
    One call instead of a loop of m steps: the fast path of :mod:`sphereml.regularizers.opt`.
    On the CPU :func:`qr_lapack`, elsewhere :func:`cholesky_qr` (Note [Gram-Schmidt on a GPU]).
    """
    u = _rescaled(check_square(u))
    return cholesky_qr(u, rows) if on_accelerator(u.device) else qr_lapack(u, rows)


def qr_lapack(u: Tensor, rows: bool = True) -> Tensor:
    """The map of :func:`qr_orthogonalize` by LAPACK's (cuSOLVER's) Householder QR, the signs of Q's columns set so
    that R has a non-negative diagonal."""
    a = check_square(u).mT if rows else check_square(u)
    q, r = torch.linalg.qr(a)
    signs = torch.where(torch.diagonal(r, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(u.dtype)
    q = q * signs.unsqueeze(-2)
    return q.mT if rows else q


def cholesky_qr(u: Tensor, rows: bool = True) -> Tensor:
    """The map of :func:`qr_orthogonalize` by one Cholesky factorisation in float64, cast back.

    ``rows=True``: U = L Q with L lower triangular and a positive diagonal, so L L^T = U U^T and Q = L^-1 U,
    the Gram-Schmidt rows of U.  ``rows=False``: the same on U^T, transposed back (Householder's Q).

    Note [Gram-Schmidt on a GPU]
        cuSOLVER's QR of OPT's CNN-6 rotations (d = 27, 576 x 5, 1024), one call per layer, took 17.8 ms forward and
        backward on an H200; this Cholesky form took 8.6 ms and left them as orthogonal (3.5e-8; ``benchmarks/results/
        logs/gpu-check-4-h200.txt``, :mod:`benchmarks.bench_orthogonalizers`).  Forming U U^T squares the
        condition number: in float64 the values keep float32's accuracy up to cond(U) = 1e4, and the error
        grows as 1e-16 cond(U)^2 beyond, still below that of a QR in float32 at 1e5 and 1e6 (tested).
        Rounding already perturbs the float64 Gram matrix by about 2^-52 of its trace, so a ridge of that
        size on its diagonal costs no accuracy and keeps the factorisation finite for a singular U (whose Q
        is not unique; a zero row stays zero).  No host synchronisation: ``cholesky_ex`` does not check for
        failure.  The backward is written out (Note [the LQ backward]).
    """
    u = check_square(u)
    a = u.to(torch.float64)
    q = _CholeskyLQ.apply(a if rows else a.mT)[0]
    return (q if rows else q.mT).to(u.dtype)


class _CholeskyLQ(Function):
    """(Q, L) with A = L Q, L L^T = A A^T plus a ridge of rounding size, L lower triangular (:func:`cholesky_qr`);
    the gradient reaches A through Q only, by the closed form of Note [the LQ backward].

    Note [the LQ backward]
        With A = L Q, Q orthogonal and the loss a function of Q alone, C = dQ Q^T is skew-symmetric and
        L^-1 dA Q^T = L^-1 dL + C, whose first term is lower triangular: C is the strictly upper part of
        X = L^-1 dA Q^T minus its transpose.  So dF = <G, dQ> = <G Q^T, C> = <triu(G Q^T - Q G^T, 1), X>, and
        dF/dA = L^-T triu(G Q^T - Q G^T, 1) Q: two products and one triangular solve, where autograd through
        the Cholesky factorisation and the solve takes several solves and products more (CNN-6's Gram-Schmidt
        step: 231 -> 189 operations, counted as in ``tests/test_step_cost.py``).  It treats the ridge as absent:
        against autograd through the same forward it differs by about 1e-11 relative in float64 on well-conditioned
        input, the size of the ridge's own effect (tested).  First order only: its second derivative would miss the
        dependence of Q and L on A, so asking for one raises.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(a: Tensor) -> tuple[Tensor, Tensor]:
        gram = a @ a.mT  # (..., m, m)
        diagonal = torch.diagonal(gram, dim1=-2, dim2=-1)
        diagonal += diagonal.sum(-1, keepdim=True) * torch.finfo(torch.float64).eps + _TINY  # the ridge
        lower = torch.linalg.cholesky_ex(gram)[0]
        return torch.linalg.solve_triangular(lower, a, upper=False), lower

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, lower = output
        ctx.mark_non_differentiable(lower)
        ctx.set_materialize_grads(False)  # L's gradient is never used: no zeros made for it
        ctx.save_for_backward(q, lower)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_q: Tensor | None, grad_lower: None) -> Tensor | None:
        if grad_q is None:
            return None
        q, lower = ctx.saved_tensors
        gq = grad_q @ q.mT  # G Q^T
        return torch.linalg.solve_triangular(lower.mT, torch.triu(gq - gq.mT, 1) @ q, upper=True)


def lowdin(u: Tensor) -> Tensor:
    """Löwdin's symmetric orthogonalisation U (U^T U)^(-1/2) = W V^T, with U = W S V^T (eqs. 7.4, F.12-F.14).

    The orthogonal matrix nearest to U in Frobenius norm (F.15, whose square the thesis drops).
    Its gradient has 1 / (s_i^2 - s_j^2) factors (the SVD's), so it needs distinct singular values.
    On the CPU: LAPACK's SVD.  Elsewhere :func:`lowdin_eigh` (Note [Löwdin on a GPU]).
    """
    u = _rescaled(check_square(u))
    return lowdin_eigh(u) if on_accelerator(u.device) else lowdin_svd(u)


def lowdin_svd(u: Tensor) -> Tensor:
    """W V^T from the SVD U = W S V^T (eq. F.14): the map of :func:`lowdin`, as it computes it on the CPU."""
    w, _, vh = torch.linalg.svd(check_square(u))
    return w @ vh


def lowdin_eigh(u: Tensor) -> Tensor:
    """U (U^T U)^(-1/2) from the eigendecomposition U^T U = V diag(lambda) V^T in float64, cast back
    (eqs. F.12-F.14 computed as written): the map of :func:`lowdin`.

    Note [Löwdin on a GPU]
        On a GPU, cuSOLVER's float32 SVD of OPT's CNN-6 rotations (d = 27, 576 x 5, 1024) left them orthogonal
        only to about 3e-4 and took several times longer forward and backward than the symmetric
        eigendecomposition of U^T U in float64, which left them orthogonal to about 5e-8
        (``benchmarks/results/logs/gpu-check-4-h200.txt``; :mod:`benchmarks.bench_orthogonalizers` times both).
        Forming U^T U squares the condition number: in float64 the values keep float32's accuracy up to
        cond(U) = 1e5 at least (tested), the gradient a relative error of about 2e-16 cond(U)^2.  Both
        factorisations check convergence on the host (one synchronisation per call).
    """
    u = check_square(u)
    x = u.to(torch.float64)
    lam, v = torch.linalg.eigh(x.mT @ x)
    inv_sqrt = lam.clamp_min(_TINY).rsqrt()  # a singular U keeps finite values
    return (((x @ v) * inv_sqrt.unsqueeze(-2)) @ v.mT).to(u.dtype)


def skew(u: Tensor) -> Tensor:
    """The skew-symmetric A = T - T^T of the strict upper triangle T of ``u`` (the learnt half, §7.3.4)."""
    check_square(u)
    upper = torch.triu(u, diagonal=1)
    return upper - upper.mT


def cayley(a: Tensor) -> Tensor:
    """The Cayley transform (I + A)(I - A)^(-1) of a skew-symmetric ``a`` (§7.3.4).

    I - A is always invertible (its eigenvalues are 1 - i lambda), and (I + A) commutes with
    (I - A)^(-1), so this is solve(I - A, I + A).  det = +1: the map reaches SO(m) only, and never a
    rotation with eigenvalue -1.  ``torch.nn.utils.parametrizations.orthogonal`` with
    ``orthogonal_map="cayley"`` computes the same map of A / 2.

    By an LU solve, but under ``torch.compile`` off the CPU by :func:`cayley_cholesky` (Note [Cayley on a GPU]).
    """
    check_square(a, "a")
    if on_accelerator(a.device) and torch.compiler.is_compiling():
        return cayley_cholesky(a)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return solve_invertible(eye - a, eye + a)


def cayley_cholesky(a: Tensor) -> Tensor:
    """The Cayley transform of a skew-symmetric ``a`` as (I + A^T A)^(-1) (I + A)^2, by one Cholesky factorisation
    and two triangular solves in float64, cast back.

    Note [Cayley on a GPU]
        (I - A)(I + A) = I - A^2, and for a skew-symmetric A, I - A^2 = I + A^T A: symmetric positive definite with
        every eigenvalue at least 1.  So (I - A)^-1 = (I + A)(I + A^T A)^-1, and the transform, a rational function of
        A whose factors commute, is (I + A^T A)^-1 (I + A)^2.  Its condition number is that of I - A squared; in
        float64 that keeps float32's accuracy for ||A|| up to about 1e4.  The reason for it: on an H100 (2026-12-06)
        the LU solve (``linalg.solve``) of OPT's compiled Cayley step could not be captured into a CUDA graph
        ("operation not permitted when stream is capturing"), while the Cholesky factorisation and triangular solves
        of Gram-Schmidt's GPU form (:func:`cholesky_qr`) appear, from the order of the run's steps, to have been
        captured before it (inferred, not seen; :data:`~sphereml.launches.CAPTURE_UNSAFE`).  The two forms agree on
        skew-symmetric A, so their gradients agree along every skew-symmetric direction, the only ones a
        parametrisation A = T - T^T reaches.  Eager steps keep the LU solve: autograd through this form makes 90 more
        operations per CNN-6 step (238 against 148, counted as in ``tests/test_step_cost.py``), launches that a
        compiled step fuses or replays but an eager one pays.  Not yet run on a GPU.
    """
    check_square(a, "a")
    x = a.to(torch.float64)
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    factor = torch.linalg.cholesky_ex(eye + x.mT @ x)[0]  # no check on the host: the matrix is positive definite
    plus = eye + x
    half = torch.linalg.solve_triangular(factor, plus @ plus, upper=False)
    return torch.linalg.solve_triangular(factor.mT, half, upper=True).to(a.dtype)


#: solve_invertible on the CPU: matrices of at most this many rows are solved as one batch (Note [batched LU on the
#: CPU]: 144 rows were safe here, 151 are not in pytorch/pytorch#142815).
BATCHED_LU_ROWS = 64


def solve_invertible(lhs: Tensor, rhs: Tensor) -> Tensor:
    """lhs^-1 rhs for a batch of invertible ``lhs`` (Tensor[..., m, m]) and ``rhs`` as ``torch.linalg.solve`` takes
    it, with no check for singularity (a check reads the device on the host).  One call for the batch, but on the
    CPU for matrices of more than :data:`BATCHED_LU_ROWS` rows (Note [batched LU on the CPU]).

    Note [batched LU on the CPU]
        PyTorch's CPU solve of a batch runs MKL's threaded LU inside its own parallel loop over the batch.  Once
        ``torch.set_num_threads`` has been called, even with the current count (it turns MKL's dynamic threading
        off), matrices from about 150 rows on make MKL fail ("Parameter 6 was incorrect on entry to SLASWP") and
        then hang (pytorch/pytorch#142815; reproduced here with torch 2.13 on 2 threads: five 256 x 256 matrices
        hang, five of 144 rows or one of any size do not).  The test suite sets the thread count, and so may a
        reader's script; so on the CPU larger matrices are solved one at a time, as LAPACK solves them inside a
        batched call anyway (the same numbers), and smaller ones, where a loop would cost more than the solves,
        in one call.  Under ``torch.func.vmap`` (seeds trained together, :mod:`sphereml.multiseed`) the stacked
        dimension is out of its sight, so such a run on the CPU after ``torch.set_num_threads`` can still hang.
    """
    vector = rhs.dim() == 1 or (rhs.dim() == lhs.dim() - 1 and rhs.shape == lhs.shape[:-1])  # linalg.solve's rule
    columns = rhs.unsqueeze(-1) if vector else rhs  # (..., m, k)
    batch = torch.broadcast_shapes(lhs.shape[:-2], columns.shape[:-2])
    if on_accelerator(lhs.device) or lhs.shape[-1] <= BATCHED_LU_ROWS or math.prod(batch) <= 1:
        return torch.linalg.solve_ex(lhs, rhs)[0]
    lhs, columns = lhs.expand(*batch, *lhs.shape[-2:]), columns.expand(*batch, *columns.shape[-2:])
    solved = [torch.linalg.solve_ex(a, b)[0] for a, b in zip(lhs.flatten(0, -3), columns.flatten(0, -3))]
    solved = torch.stack(solved).unflatten(0, batch)
    return solved.squeeze(-1) if vector else solved

MAX_SQUARINGS = 16  # exp_map on a GPU: handles ||A||_1 up to 2^16 (random skew 1024 x 1024: about 1e3)


def exp_map(a: Tensor) -> Tensor:
    """exp(A) of a skew-symmetric ``a`` (§7.3.4); ``cayley(a / 2)`` approximates it to third order.

    On the CPU: ``torch.linalg.matrix_exp``.  Elsewhere :func:`exp_map_fixed`, because PyTorch's matrix_exp
    reads the norm of A on the host to choose its degree and number of squarings (a device synchronisation
    per call).
    """
    check_square(a, "a")
    return exp_map_fixed(a) if on_accelerator(a.device) else torch.linalg.matrix_exp(a)


def exp_map_fixed(a: Tensor) -> Tensor:
    """exp(A) by scaling and squaring with every decision on the device (Note [exp without host branches]).

    Note [exp without host branches]
        A / 2^j with j = max(0, ceil(log2 ||A||_1)) has 1-norm at most 1, where the degree-18 Taylor
        polynomial is exact to float64 rounding (e / 19! < 2e-17); it is evaluated by Horner's rule in X^3
        over blocks c_3q I + c_3q+1 X + c_3q+2 X^2 (8 products).  Then the result is squared
        :data:`MAX_SQUARINGS` times, each squaring kept only while its index is below j (``torch.where``),
        so shapes and launches never depend on A.  Cost: 8 + MAX_SQUARINGS products, about what matrix_exp
        spends on a large norm; beyond ||A||_1 = 2^MAX_SQUARINGS the count is capped and the result inaccurate.
    """
    check_square(a, "a")
    norm = torch.linalg.matrix_norm(a, ord=1)  # (...,)
    squarings = torch.log2(norm.clamp_min(1.0)).ceil().clamp_max(MAX_SQUARINGS)  # j, on the device
    x = a / torch.exp2(squarings)[..., None, None]
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    x2 = x @ x
    x3 = x2 @ x
    c = [1.0 / math.factorial(k) for k in range(21)] + [0.0, 0.0]
    result = c[18] * eye + c[19] * x + c[20] * x2  # the last block (c_19, c_20 add less than rounding)
    for q in range(5, -1, -1):
        result = (c[3 * q] * eye + c[3 * q + 1] * x + c[3 * q + 2] * x2) + x3 @ result
    for k in range(MAX_SQUARINGS):
        result = torch.where((squarings > k)[..., None, None], result @ result, result)
    return result


def cayley_sgd_step(u: Tensor, direction: Tensor, lr: float, iterations: int | None = 2) -> tuple[Tensor, Tensor]:
    """One orthogonality-preserving step from ``u`` along ``direction`` on the Cayley curve (eqs. 7.5-7.6).

    W_hat = D U^T - 1/2 U (U^T D U^T) and W = W_hat - W_hat^T (skew) for the direction D; the step
    Y(a) = (I - a/2 W)^(-1) (I + a/2 W) U is approximated by ``iterations`` rounds of the fixed point
    Y = U + a/2 W (U + Y) started from Y = U + a W U, with a = min(lr, 1 / (||W||_F + 1e-8)).  Each
    round shrinks the distance to the closed form by about a ||W|| / 2, but the iterate is orthogonal
    only up to an error that grows with a ||W|| (chapter 9 measures it); ``iterations=None`` solves the
    closed form instead (orthogonal to rounding).  D must be a descent direction (-grad f, or the
    momentum built from it): see Note [the sign of eq. 7.5].

    Args:
        u (Tensor[..., m, m]): orthogonal matrices.
        direction (Tensor[..., m, m]): the direction D of the same shape.
        lr (float): the step length lambda, > 0.
        iterations (int or None): fixed-point rounds, >= 1 (two suffice, §7.3.5); None: the closed
            form by one linear solve. Default: 2.

    Returns:
        (the new orthogonal matrices, the direction projected on the tangent space W U).
    """
    check_square(u)
    if direction.shape != u.shape:
        raise ValueError(f"direction must have the shape of u {tuple(u.shape)}, got {tuple(direction.shape)}")
    lr = real_number("lr", lr, above=0.0)
    if iterations is not None:
        integer("iterations", iterations, at_least=1)
    w_hat = direction @ u.mT - 0.5 * u @ (u.mT @ direction @ u.mT)
    w = w_hat - w_hat.mT
    tangent = w @ u
    norm = torch.linalg.matrix_norm(w)[..., None, None]  # one step length per matrix
    step = torch.clamp(1.0 / (norm + 1e-8), max=lr)
    if iterations is None:
        eye = torch.eye(u.shape[-1], dtype=u.dtype, device=u.device)
        return solve_invertible(eye - 0.5 * step * w, u + 0.5 * step * (w @ u)), tangent
    y = u + step * tangent
    for _ in range(iterations):
        y = u + 0.5 * step * (w @ (u + y))
    return y, tangent


def orthogonality_error(r: Tensor) -> Tensor:
    """the largest entry of abs(R^T R - I) (per matrix of a batch: the max over all of them)."""
    check_square(r, "r")
    eye = torch.eye(r.shape[-1], dtype=r.dtype, device=r.device)
    return (r.mT @ r - eye).abs().amax()
