"""Hyperspherical energy: invariants of reference §1.12, closed forms, Thomson minima, backends, argument checks.

The MHE regulariser is tested in ``test_regularizers.py``; float32 accuracy in ``test_energy_precision.py``.
"""

import itertools
import math

import pytest
import torch

from sphereml import energy
from sphereml.energy import (energy_metric, hyperspherical_energy, layer_energy, minibatch_energy,
                             minimal_energy_points, output_energy)
from sphereml.energy.tiled import tiled_energy
from sphereml.geometry import min_pair_angle, normalize

F64 = torch.float64
E = hyperspherical_energy


def _w(n=12, d=5, seed=0, dtype=F64):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _orthogonal(d, seed=0):
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=F64))
    return q


VARIANTS = [dict(metric=m, half_space=h, s=s) for m in ("euclidean", "angular") for h in (False, True)
            for s in (0.0, 1.0, 2.0)]


# ---------------------------------------------------------------- invariants

@pytest.mark.parametrize("kw", VARIANTS, ids=str)
def test_rotation_scale_permutation_invariance(kw):
    w = _w()
    base = E(w, **kw)
    torch.testing.assert_close(E(w @ _orthogonal(5), **kw), base)
    torch.testing.assert_close(E(w * (torch.rand(12, 1, dtype=F64) * 10 + 0.01), **kw), base)
    torch.testing.assert_close(E(w[torch.randperm(12)], **kw), base)


@pytest.mark.parametrize("metric", ["euclidean", "angular"])
def test_half_space_is_invariant_to_sign_flips_full_space_is_not(metric):
    w = _w()
    flipped = w * torch.tensor([1.0, -1.0] * 6, dtype=F64)[:, None]
    torch.testing.assert_close(E(flipped, metric=metric, half_space=True), E(w, metric=metric, half_space=True))
    assert abs(float(E(flipped, metric=metric) - E(w, metric=metric))) > 1e-6
    torch.testing.assert_close(E(w, metric=metric, half_space=True), E(torch.cat([w, -w]), metric=metric))


@pytest.mark.parametrize("s", [0.5, 1.0, 2.0, 3.0])
@pytest.mark.parametrize("n,d", [(3, 2), (4, 3), (5, 4), (4, 6)])
def test_regular_simplex_closed_form(n, d, s):
    # regular simplex: n points in R^(n-1) with cos = -1/(n-1), embedded in R^d
    centred = torch.eye(n, dtype=F64) - 1.0 / n
    basis = torch.linalg.svd(centred).U[:, : n - 1]  # (n, n-1) coordinates of the simplex
    pts = torch.zeros(n, d, dtype=F64)
    pts[:, : n - 1] = normalize(centred @ basis)
    expected = (2 + 2 / (n - 1)) ** (-s / 2)
    assert float(E(pts, s=s)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("d", [2, 3, 5])
def test_cross_polytope_and_half_space_orthonormal_optimum_value(d):
    eye = torch.eye(d, dtype=F64)
    s = 2.0
    expected = ((2 * d - 2) * 2 ** (-s / 2) + 4 ** (-s / 2)) / (2 * d - 1)
    assert float(E(torch.cat([eye, -eye]), s=s)) == pytest.approx(expected, rel=1e-12)
    assert float(E(eye, s=s, half_space=True)) == pytest.approx(expected, rel=1e-12)  # reference §1.12 item 8


def test_log_relaxation_and_jensen():
    w = _w()
    for s in (0.5, 1.0, 2.0):
        gram = normalize(w) @ normalize(w).T
        r = torch.sqrt(2 - 2 * gram[~torch.eye(12, dtype=torch.bool)])
        e_log = torch.log(r.pow(-s)).mean()
        torch.testing.assert_close(e_log, s * E(w, s=0.0))
        assert float(torch.log(E(w, s=s))) >= float(e_log)


def test_weighted_energy_scaling_and_importance():
    w = _w()
    beta = 3.0
    weights = torch.full((12,), beta, dtype=F64)
    torch.testing.assert_close(E(w, s=2.0, weights=weights), beta ** -2 * E(w, s=2.0))
    torch.testing.assert_close(E(w, s=0.0, weights=weights), E(w, s=0.0) - math.log(beta))
    # a heavier neuron feels a smaller tangential gradient (it "moves less", Figs. D.1-D.2)
    uneven = torch.ones(12, dtype=F64)
    uneven[0] = 10.0
    x = w.clone().requires_grad_(True)
    E(x, weights=uneven).backward()
    radial = (x.grad * normalize(x.detach())).sum(1, keepdim=True) * normalize(x.detach())
    tangential = (x.grad - radial).norm(dim=1) * x.detach().norm(dim=1)
    assert float(tangential[0]) < float(tangential[1:].min())


def test_minibatch_estimator_is_exactly_unbiased():
    w = _w(6)
    full = E(w, s=1.0)
    subsets = [E(w[list(c)], s=1.0) for c in itertools.combinations(range(6), 3)]
    torch.testing.assert_close(torch.stack(subsets).mean(), full)
    value = minibatch_energy(w, 3, s=1.0, generator=torch.Generator().manual_seed(0))
    assert any(torch.isclose(value, sub) for sub in subsets)


# ---------------------------------------------------------------- Thomson problem

THOMSON = {2: 0.5, 3: 1.732050808, 4: 3.674234614, 5: 6.474691495, 6: 9.985281374, 7: 14.452977414,
           8: 19.675287861, 9: 25.759986531, 10: 32.716949460, 11: 40.596450510, 12: 49.165253058}


@pytest.mark.parametrize("n", sorted(THOMSON))
def test_thomson_minima_on_the_sphere(n):
    energy, points = minimal_energy_points(n, s=1.0, restarts=3, generator=torch.Generator().manual_seed(n))
    assert energy * n * (n - 1) / 2 == pytest.approx(THOMSON[n], rel=1e-7)  # unordered-pair convention
    torch.testing.assert_close(points.norm(dim=1), torch.ones(n, dtype=F64))
    assert float(E(points, s=1.0)) == pytest.approx(energy, rel=1e-12)  # the points reach the energy returned


def test_minimal_energy_points_finds_the_known_optima_of_other_settings():
    # two neurons in the plane: half-space MHE makes them orthogonal (thesis Fig. 5.2); six points on S^2 under a
    # large s: the octahedron, 90 degrees apart (also the Tammes optimum); N <= dim: the regular simplex
    _, pair = minimal_energy_points(2, dim=2, s=2.0, half_space=True, generator=torch.Generator().manual_seed(0))
    assert abs(float(pair[0] @ pair[1])) < 1e-6
    _, octahedron = minimal_energy_points(6, s=12.0, restarts=2, generator=torch.Generator().manual_seed(0))
    assert min_pair_angle(octahedron) == pytest.approx(math.pi / 2, abs=1e-6)
    energy, _ = minimal_energy_points(4, dim=5, s=2.0, restarts=1, generator=torch.Generator().manual_seed(0))
    assert energy == pytest.approx((2 + 2 / 3) ** -1, rel=1e-9)  # Exercise 1 of chapter 6


def test_minimal_energy_points_is_reproducible_and_follows_dtype():
    runs = [minimal_energy_points(5, restarts=2, warm_steps=20, max_iter=50,
                                  generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)
    _, points = minimal_energy_points(4, restarts=1, max_iter=5, dtype=torch.float32)
    assert points.dtype == torch.float32


def test_minimal_energy_points_says_when_the_energy_overflows():
    # float32 cannot hold r^-400 for r < 1: the energy and then the points stop being finite, and the search says so
    with pytest.raises(ValueError, match="finite"):
        minimal_energy_points(12, s=400.0, restarts=1, warm_steps=1, max_iter=1, dtype=torch.float32,
                              generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kwargs", [dict(n=1), dict(n=2.0), dict(n=4, dim=1), dict(n=4, s=-1.0),
                                    dict(n=4, metric="cosine"), dict(n=4, restarts=0), dict(n=4, warm_steps=-1),
                                    dict(n=4, max_iter=0), dict(n=4, dtype=torch.int64)], ids=str)
def test_minimal_energy_points_names_each_bad_argument(kwargs):
    with pytest.raises(ValueError, match=next(k for k in kwargs if k != "n") if len(kwargs) > 1 else "n"):
        minimal_energy_points(**kwargs)


# ---------------------------------------------------------------- backends

def _special_sets():
    w = _w(20, 4)
    dup = w.clone()
    dup[1] = dup[0] * 2.5  # the same direction twice
    anti = w.clone()
    anti[1] = -anti[0]
    return {"random": w, "duplicated": dup, "antipodal": anti}


@pytest.mark.parametrize("kw", VARIANTS, ids=str)
def test_tiled_matches_dense_values_and_gradients(kw):
    for name, w in _special_sets().items():
        a, b = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
        va, vb = E(a, backend="dense", **kw), E(b, backend="tiled", **kw)
        va.backward()
        vb.backward()
        torch.testing.assert_close(vb, va, rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
        assert bool(torch.isfinite(a.grad).all()), name


def test_tiled_blocks_and_weights_and_float32():
    w = _w(37, 6)
    weights = torch.rand(37, dtype=F64) + 0.5
    pts = normalize(w) * weights[:, None]
    for block in (1, 5, 37):
        torch.testing.assert_close(tiled_energy(pts, 2.0, "euclidean", 1e-7, block), E(w, weights=weights))
    w32 = w.float()
    torch.testing.assert_close(E(w32, backend="tiled"), E(w32, backend="dense"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("metric", ["euclidean", "angular"])
@pytest.mark.parametrize("s", [0.0, 2.0])
def test_gradcheck_tiled_and_dense(metric, s):
    w = _w(7, 3).requires_grad_(True)
    for backend in ("dense", "tiled"):
        assert torch.autograd.gradcheck(lambda x, b=backend: E(x, s=s, metric=metric, backend=b, half_space=True),
                                        (w,))


def test_auto_backend_choice():
    from sphereml.energy import TILED_ABOVE, _backend_for

    small, large = torch.zeros(10, 3), torch.zeros(TILED_ABOVE + 1, 3)
    assert _backend_for(small, len(small), "euclidean", "auto") == "dense"
    assert _backend_for(large, len(large), "euclidean", "auto") == "tiled"
    assert _backend_for(small, 2 * TILED_ABOVE, "euclidean", "auto") == "tiled"  # half space counts 2N points
    assert _backend_for(large.double(), len(large), "angular", "auto") == "tiled"
    assert energy_metric(_w(), s=1.0) == pytest.approx(float(E(_w(), s=1.0)))


@pytest.mark.parametrize("backend", ["triton", "gemm"])
def test_triton_refused_where_it_cannot_run(monkeypatch, backend):
    from sphereml.energy import triton_importable

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if triton_importable() and not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=f"backend='{backend}' needs CUDA"):
            E(_w().float(), backend=backend)
    with pytest.raises(ValueError, match=f"the {backend} backend fuses the euclidean metric only"):
        E(_w().float(), metric="angular", backend=backend)
    with pytest.raises(ValueError, match="float64.*backend='tiled'"):
        E(_w(), backend=backend)  # never computed in float32 behind the caller's back


def test_argument_checks_read_no_tensor_values():
    """The per-step checks look at dtype, shape and device only: meta tensors have no values to read."""
    from sphereml.energy import _points

    w = torch.empty(12, 5, device="meta")
    points = _points(w, "euclidean", True, torch.empty(12, device="meta"))
    assert points.shape == (24, 5) and points.device.type == "meta"


# ---------------------------------------------------------------- output-layer energy (SphereFace+)

def test_output_energy_matches_its_definition():
    w = _w(5, 3)
    labels = torch.tensor([0, 0, 3, 4])
    unit = normalize(w)
    brute = [float((unit[y] - unit[j]).norm() ** -2) for y in labels.tolist() for j in range(5) if j != y]
    assert float(output_energy(w, labels)) == pytest.approx(sum(brute) / len(brute))


def test_output_energy_reads_nothing_on_the_host_and_batches_over_seeds():
    """SphereFace+'s term in each training step: no host read (the close classes come from a float64 Gram, not a
    list of close pairs), and under vmap (seeds trained together) each slice's value and gradient."""
    from sphereml.launches import no_host_sync

    w = _w(6, 4).float().requires_grad_(True)
    labels = torch.tensor([0, 2, 2, 5])
    with no_host_sync():
        output_energy(w, labels).backward()
    stacked = torch.stack([_w(6, 4, seed=s) for s in (1, 2, 3)]).requires_grad_(True)
    together = torch.vmap(output_energy, in_dims=(0, None))(stacked, labels)
    together.sum().backward()
    for i in range(3):
        alone = stacked[i].detach().clone().requires_grad_(True)
        value = output_energy(alone, labels)
        value.backward()
        torch.testing.assert_close(together[i], value.detach())
        torch.testing.assert_close(stacked.grad[i], alone.grad)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("call,match", [
    (lambda: E(_w(), s=-1.0), "s must be"),
    (lambda: E(_w(), s=float("nan")), "s must be"),
    (lambda: E(_w(), s=True), "s must be"),
    (lambda: E(_w(1, 3)), "at least 2 neurons"),
    (lambda: E(torch.randn(5)), "w must be a Tensor"),
    (lambda: E(torch.tensor([[1.0, float("inf")], [0.0, 1.0]])), "finite"),
    (lambda: E(torch.ones(3, 3, dtype=torch.long)), "floating-point"),
    (lambda: E(_w(), metric="cosine"), "metric must be one of"),
    (lambda: E(_w(), backend="cuda"), "backend must be one of"),
    (lambda: E(_w(), half_space=1), "half_space"),
    (lambda: E(_w(), weights=torch.zeros(12)), "positive"),
    (lambda: E(_w(), weights=torch.ones(3)), r"weights must be a Tensor\[12\]"),
    (lambda: E(_w(), metric="angular", weights=torch.ones(12)), "euclidean metric only"),
    (lambda: E(_w(), eps=0.0), "eps must be"),
    (lambda: E(_w(), eps=1.0), "eps must be"),
    (lambda: minibatch_energy(_w(), 1), r"batch must be an integer in \[2, 12\]"),
    (lambda: minibatch_energy(_w(), 13), r"batch must be an integer in \[2, 12\]"),
    (lambda: minibatch_energy(_w(), 3.0), "batch must be an integer"),
    (lambda: output_energy(_w(5, 3), torch.tensor([5])), r"labels must lie in \[0, 5\)"),
    (lambda: output_energy(_w(5, 3), torch.tensor([0.0])), "int64"),
    (lambda: output_energy(_w(5, 3), torch.tensor([[0]])), r"labels must be a Tensor\[m\]"),
    (lambda: output_energy(_w(5, 3), torch.tensor([0]), eps=2.0), "eps must be"),
    (lambda: output_energy(_w(5, 3)[0], torch.tensor([0])), "weight must be"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_eq_6_2_gradient_has_factor_four_for_ordered_pairs():
    """Thesis eq. 6.2 prints grad_i E_2 = sum_{j != i} -2 (w_i - w_j) / ||w_i - w_j||^4 for the ordered-pair sum
    E_2 = sum_{i != j} ||w_i - w_j||^-2; each pair appears twice, so autograd gives twice the printed value."""
    w = normalize(_w(6, 4)).requires_grad_(True)
    n = len(w)
    total = hyperspherical_energy(w, s=2.0, backend="dense") * n * (n - 1)  # the pair mean back to the sum
    (ours,) = torch.autograd.grad(total, w)  # through the normalisation: tangent to the sphere
    diff = w.detach()[:, None, :] - w.detach()[None, :, :]
    dist4 = diff.norm(dim=-1).pow(4).fill_diagonal_(float("inf"))
    printed = (-2 * diff / dist4[..., None]).sum(1)  # eq. 6.2 with respect to the unit vectors
    tangent = printed - (printed * w.detach()).sum(1, keepdim=True) * w.detach()  # what w -> w/||w|| passes on
    torch.testing.assert_close(ours, 2 * tangent)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_angular_half_space_energy_of_antipodal_pairs_is_floored_as_documented(backend):
    """Two orthogonal neurons and their negatives: angles pi (w, -w) and pi / 2.  The symmetric floor caps the
    antipodal angle at arccos(-1 + eps / 2) (Note [close pairs]): a known relative error of about 2e-5 here."""
    w = torch.eye(2, 3, dtype=F64)
    eps = 1e-7
    capped = math.acos(-1 + eps / 2)
    expected = (1 / capped + 2 * 2 / math.pi) / 3  # per point: one (capped) antipode, two right angles
    value = float(hyperspherical_energy(w, 1.0, "angular", half_space=True, backend=backend, eps=eps))
    assert value == pytest.approx(expected, rel=1e-12)
    assert abs(value / ((1 / math.pi + 4 / math.pi) / 3) - 1) < 3e-5


def _layers():
    torch.manual_seed(0)
    return [torch.nn.Conv2d(3, 6, 3), torch.nn.Linear(12, 5), torch.nn.Linear(12, 7)]


@pytest.mark.parametrize("half_space", [False, True])
@pytest.mark.parametrize("s", [0.0, 1.0, 2.0])
def test_layer_energy_is_the_sum_of_each_layers_energy(half_space, s):
    layers = _layers()
    per_layer = [float(hyperspherical_energy(m.weight.detach(), s, half_space=half_space, backend="dense"))
                 for m in layers]
    assert layer_energy(layers, s, half_space) == pytest.approx(sum(per_layer), rel=1e-6)
    points = [2 * len(m.weight) if half_space else len(m.weight) for m in layers]
    pair_sum = sum(e * n * (n - 1) for e, n in zip(per_layer, points))
    assert layer_energy(layers, s, half_space, reduction="pair_sum") == pytest.approx(pair_sum, rel=1e-6)
    assert layer_energy([m.weight for m in layers], s, half_space) == pytest.approx(sum(per_layer), rel=1e-6)


@pytest.mark.parametrize("reduction", ["pair_mean", "pair_sum"])
def test_layer_energy_of_layers_above_the_batched_limit_agrees(monkeypatch, reduction):
    layers = _layers()
    batched = layer_energy(layers, 1.0, True, reduction)
    monkeypatch.setattr(energy, "BATCHED_MAX", 5)  # the 6- and 7-neuron layers take the one-by-one path
    assert layer_energy(layers, 1.0, True, reduction) == pytest.approx(batched, rel=1e-6)  # float32 per layer


def test_layer_energy_measures_the_angular_metric_without_touching_gradients():
    layers = _layers()
    value = layer_energy(layers, 2.0, metric="angular")
    expected = sum(float(hyperspherical_energy(m.weight.detach(), 2.0, metric="angular", backend="dense"))
                   for m in layers)
    assert isinstance(value, float) and value == pytest.approx(expected, rel=1e-6)
    assert all(m.weight.grad is None for m in layers)


def test_layer_energy_bad_arguments():
    with pytest.raises(ValueError, match="at least one layer"):
        layer_energy([])
    with pytest.raises(ValueError, match="reduction must be one of"):
        layer_energy(_layers(), reduction="mean")
    with pytest.raises(ValueError, match="at least 2 neurons"):
        layer_energy([torch.randn(1, 4)])
    with pytest.raises(ValueError, match="half_space must be True or False"):
        layer_energy(_layers(), half_space=1)
