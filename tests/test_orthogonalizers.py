"""The orthogonalisers of OPT against their definitions and each other (reference §3.12 invariants 1-4, 8, 12)."""

import math

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from sphereml.launches import no_host_sync
from sphereml.regularizers import orthogonalizers as orth

MAPS = {
    "gs_qr": orth.qr_orthogonalize,
    "gs_classic": orth.gram_schmidt,
    "gs_modified": lambda u: orth.gram_schmidt(u, modified=True),
    "householder": orth.householder,
    "householder_qr": lambda u: orth.qr_orthogonalize(u, rows=False),
    "gs_cholesky": orth.cholesky_qr,
    "householder_cholesky": lambda u: orth.cholesky_qr(u, rows=False),
    "lowdin": orth.lowdin,
    "lowdin_eigh": orth.lowdin_eigh,
    "cayley": lambda u: orth.cayley(orth.skew(u)),
    "cayley_cholesky": lambda u: orth.cayley_cholesky(orth.skew(u)),
    "matrix_exp": lambda u: orth.exp_map(orth.skew(u)),
}


def _raw(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _fix_column_signs(q, r):
    signs = torch.where(torch.diagonal(r, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(q.dtype)
    return q * signs.unsqueeze(-2)


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_every_map_is_orthogonal(name, dtype, tol):
    r = MAPS[name](_raw(3, 12, 12, dtype=dtype))
    assert r.shape == (3, 12, 12) and r.dtype == dtype
    assert float(orth.orthogonality_error(r)) < tol
    assert float((r @ r.mT - torch.eye(12, dtype=dtype)).abs().max()) < tol


def test_gram_schmidt_is_qr_of_the_transpose_with_positive_diagonal():
    u = _raw(4, 9, 9)
    q, r = torch.linalg.qr(u.mT)
    expected = _fix_column_signs(q, r).mT
    for modified in (False, True):
        torch.testing.assert_close(orth.gram_schmidt(u, modified), expected)
    torch.testing.assert_close(orth.qr_orthogonalize(u), expected)
    # the rows are the thesis's e_i: e_1 = u_1 / ||u_1||, and e_i is orthogonal to u_1 .. u_{i-1}
    e = orth.gram_schmidt(u)
    torch.testing.assert_close(e[:, 0], u[:, 0] / u[:, 0].norm(dim=-1, keepdim=True))
    lower = torch.tril(e @ u.mT, diagonal=-1).mT  # <e_i, u_j> for j < i
    assert float(lower.abs().max()) < 1e-12


def test_householder_is_qr_up_to_column_signs():
    u = _raw(4, 9, 9)
    q, r = torch.linalg.qr(u)
    ours = orth.householder(u)
    torch.testing.assert_close(ours, _fix_column_signs(q, r))
    torch.testing.assert_close(ours.abs(), q.abs())
    torch.testing.assert_close(orth.qr_orthogonalize(u, rows=False), ours)
    assert float(torch.diagonal(ours.mT @ u, dim1=-2, dim2=-1).min()) > 0  # R = Q^T U has a positive diagonal


def test_stable_householder_zeroes_a_column_already_close_to_its_axis():
    """x = e_1 + 1e-9 (0, 1, 1, 1): u = x - ||x|| e_1 loses its first entry to cancellation."""
    x = torch.eye(4, dtype=torch.float64)
    x[1:, 0] = 1e-9
    below_diagonal = {stable: float((orth.householder(x, stable).mT @ x)[1:, 0].abs().max())
                      for stable in (True, False)}
    assert below_diagonal[True] < 1e-20
    assert below_diagonal[False] > 1e-10  # the authors' form leaves the column unreduced
    assert float(orth.orthogonality_error(orth.householder(x, stable=False))) < 1e-12  # still a reflection product


def test_householder_and_gram_schmidt_keep_zero_columns_finite():
    u = _raw(5, 5)
    u[:, 2] = 0.0
    u = u.requires_grad_(True)
    for fn in (orth.householder, orth.gram_schmidt):
        out = fn(u)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(u.grad).all()
        u.grad = None


def test_lowdin_is_the_nearest_orthogonal_matrix():
    u = _raw(6, 6)
    ls = orth.lowdin(u)
    evals, evecs = torch.linalg.eigh(u.mT @ u)
    torch.testing.assert_close(ls, u @ evecs @ torch.diag(evals.rsqrt()) @ evecs.mT)
    distance = float((ls - u).norm())
    others = [orth.qr_orthogonalize(u), orth.householder(u), orth.cayley(orth.skew(u))]
    others += [orth.qr_orthogonalize(_raw(6, 6, seed=s)) for s in range(1, 20)]
    assert all(distance <= float((q - u).norm()) + 1e-12 for q in others)


@pytest.mark.parametrize("condition", [10.0, 1e3, 1e5])
def test_lowdin_eigh_is_the_svd_map_in_values_and_gradients(condition):
    """The GPU path (eigendecomposition of U^T U in float64) against the SVD, on input with distinct singular
    values and a set condition number, up to the 1e5 of Note [Löwdin on a GPU]."""
    q1, q2 = orth.qr_orthogonalize(_raw(2, 9, 9)), orth.qr_orthogonalize(_raw(2, 9, 9, seed=1))
    u = (q1 * torch.logspace(0, -math.log10(condition), 9, dtype=torch.float64)) @ q2
    fast = orth.lowdin_eigh(u.float())
    assert fast.dtype == torch.float32
    exact = orth.lowdin(u.float().double())  # the SVD in float64 of the same float32 input
    torch.testing.assert_close(fast.double(), exact, atol=2e-7, rtol=0)
    assert float(orth.orthogonality_error(fast.double())) < 3e-7
    weights = _raw(2, 9, 9, seed=2)
    grads = []
    for fn in (orth.lowdin, orth.lowdin_eigh):
        x = u.clone().requires_grad_(True)
        (fn(x) * weights).sum().backward()
        grads.append(x.grad)
    # forming U^T U squares the condition number: float64's 2.2e-16 grows to about 2.2e-16 * condition^2
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 1e-15 * condition ** 2


def test_lowdin_takes_the_eigendecomposition_off_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(orth, "lowdin_eigh", lambda u: calls.append(u.device.type) or u)
    orth.lowdin(_raw(4, 4))
    orth.lowdin(torch.empty(4, 4, device="meta"))
    assert calls == ["meta"]


@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize("condition", [10.0, 1e3, 1e4])
def test_cholesky_qr_is_the_qr_map_in_values_and_gradients(condition, rows):
    """The GPU path of Gram-Schmidt and Householder (Cholesky of U U^T in float64) against LAPACK's QR, on input
    with a set condition number, up to the 1e4 of Note [Gram-Schmidt on a GPU]."""
    q1, q2 = orth.qr_orthogonalize(_raw(2, 9, 9)), orth.qr_orthogonalize(_raw(2, 9, 9, seed=1))
    u = (q1 * torch.logspace(0, -math.log10(condition), 9, dtype=torch.float64)) @ q2
    fast = orth.cholesky_qr(u.float(), rows)
    assert fast.dtype == torch.float32
    exact = orth.qr_lapack(u.float().double(), rows)  # the QR in float64 of the same float32 input
    torch.testing.assert_close(fast.double(), exact, atol=1e-7, rtol=0)
    weights = _raw(2, 9, 9, seed=2)
    grads = []
    for fn in (orth.qr_lapack, orth.cholesky_qr):
        x = u.clone().requires_grad_(True)
        (fn(x, rows) * weights).sum().backward()
        grads.append(x.grad)
    # forming U U^T squares the condition number: float64's 2.2e-16 grows to about 2.2e-16 * condition^2
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 1e-15 * condition ** 2


@pytest.mark.parametrize("condition,factor", [(1e5, 10.0), (1e6, 1.0)])
def test_cholesky_qr_beyond_its_range_is_still_closer_than_a_float32_qr(condition, factor):
    """What a GPU computed before (cuSOLVER's QR in float32) is the bar for ill-conditioned rotations."""
    q1, q2 = orth.qr_orthogonalize(_raw(9, 9)), orth.qr_orthogonalize(_raw(9, 9, seed=1))
    u = ((q1 * torch.logspace(0, -math.log10(condition), 9, dtype=torch.float64)) @ q2).float()
    exact = orth.qr_lapack(u.double())
    errors = [float((q.double() - exact).abs().max()) for q in (orth.cholesky_qr(u), orth.qr_lapack(u))]
    assert errors[0] < errors[1] / factor, errors


def test_cholesky_qr_is_finite_on_singular_input_and_reads_nothing_on_the_host():
    u = _raw(3, 6, 6).float()
    u[0, 2] = 0.0  # a zero row stays zero
    u[1, 4] = u[1, 3]  # two equal rows
    u[2] = 0.0
    u.requires_grad_(True)
    with no_host_sync():
        out = orth.cholesky_qr(u)
        out.sum().backward()
    out = out.detach()
    assert torch.isfinite(out).all() and torch.isfinite(u.grad).all()
    assert float(out[0, 2].abs().max()) == 0.0 and float(out[2].abs().max()) == 0.0
    kept = [0, 1, 3, 4, 5]  # the other rows of a singular matrix are still orthonormal
    gram = out[0, kept] @ out[0, kept].mT
    torch.testing.assert_close(gram, torch.eye(5), atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows", [True, False])
def test_cholesky_qr_compiles_as_one_graph(rows):
    torch._dynamo.reset()
    u = _raw(3, 7, 7).float().requires_grad_(True)
    compiled = torch.compile(orth.cholesky_qr, fullgraph=True, backend="aot_eager")
    out = compiled(u, rows)
    out.square().sum().backward()
    torch.testing.assert_close(out, orth.cholesky_qr(u, rows))


@pytest.mark.needs_cuda
def test_gram_schmidt_on_a_gpu_is_the_cpu_map():
    """OPT's gs and householder on CUDA (the Cholesky form) against LAPACK's QR of the same float32 input."""
    u = _raw(3, 64, 64).float()
    for rows in (True, False):
        gpu = orth.qr_orthogonalize(u.cuda(), rows).cpu()
        torch.testing.assert_close(gpu.double(), orth.qr_lapack(u.double(), rows), atol=1e-6, rtol=0)


def test_qr_orthogonalize_takes_the_cholesky_form_off_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(orth, "cholesky_qr", lambda u, rows: calls.append((u.device.type, rows)) or u)
    orth.qr_orthogonalize(_raw(4, 4))
    orth.qr_orthogonalize(torch.empty(4, 4, device="meta"), rows=False)
    assert calls == [("meta", False)]


def test_idempotence_on_orthogonal_input():
    q = orth.qr_orthogonalize(_raw(7, 7))  # rows from Gram-Schmidt: the positive-diagonal convention
    torch.testing.assert_close(orth.lowdin(q), q)
    torch.testing.assert_close(orth.gram_schmidt(q), q)
    torch.testing.assert_close(orth.qr_orthogonalize(q), q)


def test_cayley_properties():
    a = orth.skew(_raw(2, 8, 8))
    r = orth.cayley(a)
    torch.testing.assert_close(torch.linalg.det(r), torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(orth.cayley(torch.zeros(8, 8, dtype=torch.float64)), torch.eye(8, dtype=torch.float64))
    torch.testing.assert_close(orth.cayley(-a), r.mT)
    torch.testing.assert_close(orth.cayley(-a), torch.linalg.inv(r))
    eye = torch.eye(8, dtype=torch.float64)
    torch.testing.assert_close(torch.linalg.solve(r + eye, r - eye, left=False), a)  # (R - I)(R + I)^-1 = A
    torch.testing.assert_close(orth.skew(_raw(8, 8)), -orth.skew(_raw(8, 8)).mT)
    # the exponential agrees with the Cayley map to third order for a small A
    small = 1e-3 * a[0]
    assert float((orth.exp_map(small) - orth.cayley(small / 2)).abs().max()) < 1e-8


@pytest.mark.parametrize("shape", [(8, 8), (3, 27, 27), (2, 64, 64)])
def test_cayley_by_cholesky_equals_the_lu_form(shape):
    """Note [Cayley on a GPU]: (I + A^T A)^-1 (I + A)^2 is the transform of a skew-symmetric A, to rounding in
    float64, A of norm up to 100; its gradient through A = skew(U) is the LU form's."""
    for scale in (0.1, 1.0, 100.0):
        u = (scale * _raw(*shape, seed=3)).requires_grad_()
        ours, lu = orth.cayley_cholesky(orth.skew(u)), orth.cayley(orth.skew(u))
        torch.testing.assert_close(ours, lu, rtol=0, atol=1e-10)
        weights = _raw(*shape, seed=4)
        grad_ours, = torch.autograd.grad((ours * weights).sum(), u)
        grad_lu, = torch.autograd.grad((lu * weights).sum(), u)
        torch.testing.assert_close(grad_ours, grad_lu, rtol=1e-8, atol=1e-10 * float(grad_lu.abs().max()))


def test_cayley_by_cholesky_keeps_float32_orthogonal_and_compiles_whole():
    """In float32 the result is orthogonal to float32's rounding even for ||A|| ~ 1e3 (float64 inside); the map
    traces as one graph (it replaces the LU solve inside compiled steps off the CPU)."""
    a = orth.skew(300.0 * _raw(4, 32, 32, dtype=torch.float32, seed=5))
    r = orth.cayley_cholesky(a)
    assert r.dtype == torch.float32 and float(orth.orthogonality_error(r)) < 1e-5
    torch.testing.assert_close(orth.cayley_cholesky(torch.zeros(5, 5)), torch.eye(5))
    torch._dynamo.reset()
    compiled = torch.compile(orth.cayley_cholesky, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a), r)


def test_cayley_matches_pytorch_parametrization():
    """torch's orthogonal(orthogonal_map="cayley") computes the Cayley map of A / 2, A = X - X^T from tril(X)."""
    layer = nn.Linear(6, 6, bias=False).double()
    parametrizations.orthogonal(layer, orthogonal_map="cayley", use_trivialization=False)
    x = layer.parametrizations.weight.original.detach()
    a_torch = torch.tril(x) - torch.tril(x).mT
    raw = a_torch / 2  # skew() keeps a skew matrix: upper(A/2) - upper(A/2)^T = A / 2
    torch.testing.assert_close(orth.cayley(orth.skew(raw)), layer.weight.detach())


@pytest.mark.parametrize("name", ["gs_qr", "gs_classic", "gs_cholesky", "householder", "householder_cholesky",
                                  "lowdin", "lowdin_eigh", "cayley", "matrix_exp"])
def test_gradients_match_finite_differences(name):
    u = (_raw(5, 5) + 3 * torch.eye(5, dtype=torch.float64)).requires_grad_(True)  # well conditioned
    assert torch.autograd.gradcheck(MAPS[name], (u,))


def _least_squares(seed=0, m=6):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(20, m, generator=g, dtype=torch.float64), torch.randn(20, m, generator=g, dtype=torch.float64)
    u = orth.qr_orthogonalize(torch.randn(m, m, generator=g, dtype=torch.float64))

    def f(x):
        return 0.5 * (a @ x - b).pow(2).sum()

    u = u.requires_grad_(True)
    (grad,) = torch.autograd.grad(f(u), u)
    return f, u.detach(), grad


def test_cayley_step_descends_along_minus_gradient_and_the_printed_sign_ascends():
    f, u, grad = _least_squares()
    down, _ = orth.cayley_sgd_step(u, -grad, lr=1e-3)
    up, _ = orth.cayley_sgd_step(u, grad, lr=1e-3)  # eq. 7.5 as printed: W from +grad f
    assert float(f(down)) < float(f(u)) < float(f(up))
    for y in (down, up):
        assert float(orth.orthogonality_error(y)) < 1e-6


def test_cayley_fixed_point_converges_to_the_closed_form():
    f, u, grad = _least_squares(seed=1)
    lr = 1e-3
    w_hat = -grad @ u.mT - 0.5 * u @ (u.mT @ -grad @ u.mT)
    w = w_hat - w_hat.mT
    step = min(lr, 1.0 / (float(torch.linalg.matrix_norm(w)) + 1e-8))
    eye = torch.eye(len(u), dtype=u.dtype)
    closed = torch.linalg.solve(eye - step / 2 * w, (eye + step / 2 * w) @ u)
    errors = [float((orth.cayley_sgd_step(u, -grad, lr, k)[0] - closed).abs().max()) for k in (1, 2, 4, 8)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-12
    assert errors[1] < 1e-6  # two rounds suffice (§7.3.5)


@pytest.mark.parametrize("bad", [torch.randn(3), torch.randn(3, 4), torch.randn(2, 3, 4),
                                 torch.ones(3, 3, dtype=torch.long)])
def test_non_square_or_integer_input_is_refused(bad):
    for fn in (orth.gram_schmidt, orth.householder, orth.qr_orthogonalize, orth.lowdin, orth.skew, orth.cayley):
        with pytest.raises(ValueError, match="square|floating"):
            fn(bad)


def test_cayley_step_arguments():
    u = torch.eye(3)
    with pytest.raises(ValueError, match="direction must have the shape"):
        orth.cayley_sgd_step(u, torch.zeros(4, 4), 0.1)
    with pytest.raises(ValueError, match="lr"):
        orth.cayley_sgd_step(u, torch.zeros(3, 3), 0.0)
    with pytest.raises(ValueError, match="iterations"):
        orth.cayley_sgd_step(u, torch.zeros(3, 3), 0.1, iterations=0)


@pytest.mark.parametrize("m", [7, orth.BATCHED_LU_ROWS + 2])  # one batched call / one call per matrix on the CPU
def test_solve_invertible_solves_each_matrix_of_a_broadcast_batch(m):
    lhs = _raw(2, 1, m, m) + 2 * m * torch.eye(m, dtype=torch.float64)  # well conditioned
    rhs = _raw(1, 3, m, 2, seed=1)
    x = orth.solve_invertible(lhs, rhs)
    assert x.shape == (2, 3, m, 2)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(x[i, j], torch.linalg.solve(lhs[i, 0], rhs[0, j]), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(orth.solve_invertible, (lhs.requires_grad_(), rhs.requires_grad_()),
                                    fast_mode=True)
    assert orth.solve_invertible(lhs[:0], rhs[:, :0]).shape == (0, 0, m, 2)  # an empty batch
    square = lhs[:, 0]  # (2, m, m); on the right, as torch.linalg.solve takes them: vectors, broadcast matrices
    for right in (_raw(2, m, seed=2), _raw(m, seed=3), _raw(m, 2, seed=4), _raw(3, 1, m, 2, seed=5)):
        torch.testing.assert_close(orth.solve_invertible(square, right), torch.linalg.solve(square, right),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.subprocess
def test_batched_solves_survive_a_set_thread_count():
    """Note [batched LU on the CPU]: once torch.set_num_threads has been called, PyTorch's batched CPU solve of
    matrices from about 150 rows fails inside MKL and hangs on a machine with two threads or more; the Cayley map
    and the closed-form OGD step, forward and backward, solve them one by one."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(orth.__file__).resolve().parents[2]
    code = ("import torch\nfrom sphereml.regularizers import orthogonalizers as o\n"
            "torch.set_num_threads(max(2, torch.get_num_threads()))\n"
            "a = torch.randn(3, 256, 256, requires_grad=True)\n"
            "o.cayley(o.skew(a)).sum().backward()\n"
            "u = o.qr_orthogonalize(torch.randn(3, 256, 256))\n"
            "o.cayley_sgd_step(u, torch.randn_like(u), 0.1, iterations=None)\n"
            "print('solved')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and "solved" in done.stdout, done.stderr[-2000:]
    assert "MKL ERROR" not in done.stdout + done.stderr


def _cholesky_qr_by_autograd(u, rows):
    """cholesky_qr's forward as plain operations, differentiated by autograd: the oracle of its written-out backward."""
    a = u if rows else u.mT
    gram = a @ a.mT
    gram = gram + torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1, keepdim=True).detach().expand(
        *gram.shape[:-1]) * torch.finfo(torch.float64).eps + 1e-30)
    q = torch.linalg.solve_triangular(torch.linalg.cholesky(gram), a, upper=False)
    return q if rows else q.mT


@pytest.mark.parametrize("rows", [True, False])
def test_cholesky_qr_backward_is_autograds_of_the_same_forward(rows):
    """Note [the LQ backward], in float64 (where cholesky_qr casts nothing).  The closed form treats the ridge of
    rounding size as absent, which moves the gradient by about 1e-11 here; on ill-conditioned input both move with
    the square of the condition number (test_cholesky_qr_is_the_qr_map_in_values_and_gradients)."""
    u = _raw(3, 8, 8)
    weights = _raw(3, 8, 8, seed=4)
    grads = []
    for fn in (orth.cholesky_qr, _cholesky_qr_by_autograd):
        x = u.clone().requires_grad_(True)
        (fn(x, rows) * weights).sum().backward()
        grads.append(x.grad)
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 1e-10
    assert torch.autograd.gradcheck(lambda x: orth.cholesky_qr(x, rows), (u[:2, :5, :5].clone().requires_grad_(),))


def test_cholesky_qr_is_first_order_and_maps_over_stacked_seeds():
    u = _raw(4, 6, 6)
    x = u.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(orth.cholesky_qr(x).square().mul(_raw(4, 6, 6, seed=5)).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable"):
        grad.sum().backward()  # a second derivative would be wrong, so it is refused

    weights = _raw(6, 6, seed=6)

    def loss(v):
        return (orth.cholesky_qr(v) * weights).sum()
    stacked = torch.func.vmap(torch.func.grad(loss))(u)
    for i in range(4):
        torch.testing.assert_close(stacked[i], torch.func.grad(loss)(u[i]), rtol=1e-12, atol=1e-12)
