"""Compressive MHE (thesis Ch. 6): the energies against their definitions, the theory by Monte Carlo, the
regulariser's projection bookkeeping (sharing, resampling, seeds), each variant's own step, and bad arguments."""

import dataclasses
import functools
import math

import pytest
import torch
from torch import nn

from sphereml.regularizers import comhe, comhe_functional
from sphereml import models
from sphereml.regularizers.comhe import CoMHE, angle_distortion, bilateral_energy, group_energy, projected_energies
from sphereml.energy import hyperspherical_energy
from sphereml.geometry import normalize
from sphereml.regularizers.orthogonalizers import qr_orthogonalize
from sphereml.train import fit


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _w(n=12, d=40, seed=0):
    return torch.randn(n, d, generator=_g(seed), dtype=torch.float64)


def _p(c=3, k=5, d=40, seed=1):
    return torch.randn(c, k, d, generator=_g(seed), dtype=torch.float64)


@pytest.mark.parametrize("half_space", [False, True])
def test_projected_energy_is_the_energy_of_explicitly_projected_neurons(half_space):
    w, p = _w(), _p()
    energies = projected_energies(w, p, s=2.0, half_space=half_space)
    for c in range(len(p)):
        g = normalize(w @ p[c].T)  # g(w) = P w / ||P w||
        brute = hyperspherical_energy(g, 2.0, half_space=half_space, backend="dense")
        torch.testing.assert_close(energies[c], brute)
    assert float(energies.amax()) >= float(energies.mean())  # invariant 7: max >= mean


def test_projection_is_scale_invariant_and_exact_for_a_square_orthogonal_p():
    w, p = _w(), _p()
    torch.testing.assert_close(projected_energies(3.0 * w, 0.2 * p), projected_energies(w, p))
    q = qr_orthogonalize(torch.randn(40, 40, generator=_g(3), dtype=torch.float64))[None]  # k = d, P orthogonal
    for s in (1.0, 2.0):
        torch.testing.assert_close(projected_energies(w, q, s)[0], hyperspherical_energy(w, s, half_space=True))


def test_projected_energy_tends_to_the_original_as_k_grows():
    w = _w(16, 60)
    exact = float(hyperspherical_energy(w, 2.0, half_space=True))
    gaps = [abs(float(projected_energies(w, torch.randn(20, k, 60, generator=_g(k), dtype=torch.float64)).mean())
                - exact) for k in (5, 40, 400)]
    assert gaps[2] < gaps[1] < gaps[0]


def test_lemma_3_inner_products_are_preserved_in_mean_with_variance_one_over_k():
    """E<P w1, P w2> = <w1, w2> for P_ij ~ N(0, 1/k) (k rows: the thesis writes 1/n); unscaled gives k <w1, w2>."""
    d, k, draws = 50, 10, 20000
    w1, w2 = _w(2, d)[0], _w(2, d)[1]
    p = torch.randn(draws, k, d, generator=_g(7), dtype=torch.float64)
    products = ((p @ w1) * (p @ w2)).sum(-1)  # unscaled entries
    target = float(w1 @ w2)
    scaled = products / k
    assert abs(float(scaled.mean()) - target) < 4 * float(scaled.std()) / math.sqrt(draws)
    assert abs(float(products.mean()) - k * target) < 4 * float(products.std()) / math.sqrt(draws)


@pytest.mark.parametrize("k,eps", [(200, 0.3), (400, 0.2)])
def test_theorem_3_sandwich_holds_at_least_as_often_as_stated(k, eps):
    """(cos - eps) / (1 + eps) < cos_P < (cos + eps) / (1 - eps) with probability >= (1 - 2 exp(-k eps^2 / 8))^2."""
    d, draws = 576, 400
    w = torch.randn(2, d, generator=_g(11), dtype=torch.float64)
    w[1] = 0.6 * w[0] + 0.8 * w[1]  # a pair at a moderate angle
    cos = float(normalize(w[0], dim=0) @ normalize(w[1], dim=0))
    p = torch.randn(draws, k, d, generator=_g(12), dtype=torch.float64)
    proj = normalize(w @ p.mT, dim=-1)  # (draws, 2, k)
    cos_p = (proj[:, 0] * proj[:, 1]).sum(-1)
    inside = ((cos - eps) / (1 + eps) < cos_p) & (cos_p < (cos + eps) / (1 - eps))
    stated = (1 - 2 * math.exp(-k * eps ** 2 / 8)) ** 2
    assert stated > 0.3  # the bound says something at these sizes (it is vacuous at k = 30 for eps < 0.43)
    assert float(inside.double().mean()) >= stated


def test_angle_distortion_is_zero_for_an_orthogonal_square_projection_and_positive_for_a_random_one():
    w = _w()
    q = qr_orthogonalize(torch.randn(40, 40, generator=_g(3), dtype=torch.float64))[None]
    assert float(angle_distortion(w, q)) < 1e-20
    assert float(angle_distortion(w, _p())) > 1e-3


def test_group_energy_with_one_group_is_mhe_and_splits_channels():
    w = torch.randn(6, 8, 3, 3, generator=_g(), dtype=torch.float64)
    torch.testing.assert_close(group_energy(w, 8), hyperspherical_energy(w, 2.0, half_space=True))
    parts = [hyperspherical_energy(w[:, i:i + 4], 2.0, half_space=True) for i in (0, 4)]
    torch.testing.assert_close(group_energy(w, 4), (parts[0] + parts[1]) / 2)


def test_bilateral_energy_is_the_sum_of_its_two_energies():
    w = _w()
    p1, p2 = torch.randn(5, 40, generator=_g(1), dtype=torch.float64), torch.randn(4, 12, generator=_g(2),
                                                                                   dtype=torch.float64)
    expected = hyperspherical_energy(w @ p1.T, half_space=True) + hyperspherical_energy(p2 @ w, half_space=True)
    torch.testing.assert_close(bilateral_energy(w, p1, p2), expected)


def _net(seed=0):
    torch.manual_seed(seed)
    return models.Classifier(models.ConvNet(1, 32, widths=(8, 8, 16), image_size=16), 4)


def test_layers_shared_basis_and_small_fan_in():
    model = _net()
    reg = CoMHE(model, proj_dim=30, num_proj=2)
    fan_ins = [m.weight[0].numel() for m in reg.hidden]
    assert fan_ins == [9, 72, 72, 64]  # the last is the 64 -> 32 feature layer; the classifier is separate
    assert reg.output is model.head
    reg()
    assert not reg.compressed(reg.hidden[0])  # fan-in 9 <= 30: plain half-space MHE, as the authors' first layer
    keys = [reg.key(i) for i in range(4)]
    assert keys[1] == keys[2] != keys[3]
    assert reg.projections[keys[1]].shape == (2, 30, 72)
    independent = CoMHE(model, proj_dim=30, num_proj=2, shared_basis=False)
    independent()
    assert not torch.equal(independent.projections[("layer", 1)], independent.projections[("layer", 2)])
    plain = hyperspherical_energy(reg.hidden[0].weight, 2.0, half_space=True)
    torch.testing.assert_close(reg.layer_energy(0), plain)


def test_group_comhe_groups_a_feature_layer_by_the_channels_it_reads():
    """Eq. 6.9's groups are 8 consecutive input channels (§6.6.1).  A linear layer after a conv layer reads that
    layer's maps flattened channel by channel, so a group is its channels with all their positions (the authors'
    CNN-9 computes that layer as a 4 x 4 convolution over 256 channels); another linear layer's inputs are its
    channels."""
    model = _net()
    reg = CoMHE(model, variant="group", group_size=4)
    feature = reg.hidden[3]
    assert [tuple(reg.neuron_shape(m)) for m in reg.hidden] == [(1, 3, 3), (8, 3, 3), (8, 3, 3), (16, 4)]
    assert reg.compressed(feature)  # 16 channels, 4 groups (by its 64 inputs it would have had 16)
    by_channel = group_energy(feature.weight.view(32, 16, 4), 4)
    torch.testing.assert_close(reg.layer_energy(3), by_channel)
    assert not torch.allclose(by_channel, group_energy(feature.weight, 4))  # 16 groups of 4 inputs: another energy
    cnn9 = models.Classifier(models.plain_cnn(9, widths=(16, 16, 32), feature_dim=24), 10)
    assert tuple(CoMHE(cnn9, variant="group").neuron_shape(cnn9.backbone.feature)) == (32, 16)  # 32 maps of 4 x 4
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 3))
    assert [tuple(CoMHE(mlp, variant="group").neuron_shape(m)) for m in mlp[:4:2]] == [(32,), (64,)]


def test_penalty_matches_its_definition():
    model = _net()
    reg = CoMHE(model, proj_dim=20, num_proj=3, beta_hidden=2.0, beta_output=0.5)
    value = reg()
    hidden = [hyperspherical_energy(reg.hidden[0].weight, 2.0, half_space=True)]
    for i in (1, 2, 3):
        hidden.append(projected_energies(reg.hidden[i].weight, reg.projections[reg.key(i)]).mean())
    expected = 2.0 * sum(hidden) + 0.5 * hyperspherical_energy(model.head.weight, 2.0)
    torch.testing.assert_close(value, expected)


def _defined_energy(reg: CoMHE, index: int) -> torch.Tensor:
    """A compressed hidden layer's energy from the functional definitions, with the projections the penalty used."""
    w = reg.hidden[index].weight
    if reg.variant == "group":
        if w.dim() == 2:  # _net's feature layer reads the last conv's 16 maps of 2 x 2, flattened: 16 channels
            w = w.view(len(w), 16, 4)
        return group_energy(w, reg.options.group_size)
    p = reg.projections[reg.key(index)]
    if reg.variant == "bilateral":
        return bilateral_energy(w, p[0], reg.projections[("combine", index)])
    energies = projected_energies(w, p)
    return energies.amax() if reg.variant == "random_max" else energies.mean()


@pytest.mark.parametrize("variant", comhe.VARIANTS)
def test_every_variants_penalty_matches_its_definition(variant):
    """The penalty's one weighted sum (or, for the max, its per-layer maxima) is each variant's definition: eqs. 6.4,
    6.5, 6.9 and E.22 with the projections as fitted or ascended, beta_hidden on every hidden layer and beta_output on
    the classifier's full-space energy."""
    model = _net()
    options = dict(num_proj=1, unrolled=False) if variant in ("angle", "bilateral") else dict(num_proj=3)
    reg = CoMHE(model, variant=variant, proj_dim=20, group_size=4, beta_hidden=2.0, beta_output=0.5, **options)
    value = reg()
    hidden = [_defined_energy(reg, i) if reg.compressed(m) else hyperspherical_energy(m.weight, 2.0, half_space=True)
              for i, m in enumerate(reg.hidden)]
    assert sum(reg.compressed(m) for m in reg.hidden) >= 2
    expected = 2.0 * sum(hidden) + 0.5 * hyperspherical_energy(model.head.weight, 2.0)
    torch.testing.assert_close(value, expected)


@pytest.mark.parametrize("every", [1, 3, None])
def test_resampling_follows_its_schedule_and_seeds_reproduce(every):
    model = _net()
    reg, twin = CoMHE(model, resample_every=every, seed=5), CoMHE(model, resample_every=every, seed=5)
    seen = []
    for _ in range(6):
        reg(), twin()
        key = reg.key(1)
        assert torch.equal(reg.projections[key], twin.projections[key])
        seen.append(reg.projections[key].clone())
    changed = [not torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    expected = [every is not None and (i + 1) % every == 0 for i in range(5)]
    assert changed == expected
    other = CoMHE(model, resample_every=every, seed=6)
    other()
    assert not torch.equal(other.projections[reg.key(1)], seen[0])


def test_projections_get_no_gradient_from_the_loss():
    model = _net()
    reg = CoMHE(model)
    reg().backward()
    assert all(not p.requires_grad for p in reg.projections.values())
    assert reg.hidden[1].weight.grad is not None


def test_angle_fitting_lowers_the_distortion():
    model = _net()
    reg = CoMHE(model, variant="angle", num_proj=1, proj_dim=10, ap_every=1, ap_steps=10, ap_lr=0.05,
                unrolled=False)
    assert reg.resample_every is None  # "auto": a fitted projection is kept
    reg.resample()
    key = reg.key(1)
    users = [m.weight.detach() for i, m in enumerate(reg.hidden) if reg.key(i) == key]
    assert len(users) == 2  # a shared basis: one fit on both layers' summed L_P

    def distortion():
        return sum(float(angle_distortion(w, reg.projections[key])) for w in users)

    before = distortion()
    reg()
    assert distortion() < 0.9 * before


def test_unrolled_angle_energy_has_the_second_order_gradient():
    """d/dW of E(W, P - lr grad_P L_P(W, P)) by autograd equals finite differences (float64)."""
    torch.manual_seed(0)
    layer = nn.Linear(12, 6).double()
    model = nn.Sequential(layer, nn.ReLU(), nn.Linear(6, 3).double())
    reg = CoMHE(model, variant="angle", proj_dim=4, num_proj=1, beta_output=0.0, resample_every=None,
                ap_every=10 ** 6)
    reg.resample()
    p = reg.projections[reg.key(0)]

    def energy(weight):
        with torch.no_grad():
            layer.weight.copy_(weight)
        return reg.layer_energy(0)

    def energy_of(weight):
        q = p.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(angle_distortion(weight, q), q, create_graph=True)
        stepped = q - reg.options.ap_lr * q.detach().norm() / grad.norm() * grad  # the scale-free step
        return projected_energies(weight, stepped).mean()

    w0 = layer.weight.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(energy_of, (w0,))
    torch.testing.assert_close(energy(w0.detach()), energy_of(w0.detach()))


def _unrolled_case(shared, num_proj, dtype=torch.float64):
    """Three layers packed to 7 rows: layer 1 has 5 neurons (two zero pad rows), layer 2 a real zero neuron."""
    g = _g(4)
    x = torch.randn(3, 7, 10, generator=g, dtype=dtype)
    x[1, 5:] = 0.0
    x[2, 3] = 0.0
    sizes = (7, 5, 7)
    share = torch.zeros(3, 7, 7, dtype=dtype)
    for layer, n in enumerate(sizes):
        share[layer, :n, :n] = (1.0 - torch.eye(n, dtype=dtype)) / (num_proj * n * (n - 1))
    shape = (num_proj, 4, 10) if shared else (3, num_proj, 4, 10)
    return x, torch.randn(*shape, generator=g, dtype=dtype), share


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("num_proj", [1, 3])
@pytest.mark.parametrize("scale_free", [True, False])
def test_unrolled_projection_backward_is_autograds(shared, num_proj, scale_free):
    """The written-out backward of the unrolled step against autograd's through the same forward, with padding
    rows and a zero neuron (whose projection sits below the norm floor), and by gradcheck in float64 (the
    scale-free step: its size eta_l a constant, eq. 6.7, so its gradient is the plain step's scaled by eta_l)."""
    x, p, share = _unrolled_case(shared, num_proj)
    weight = torch.randn(3, num_proj, 4, 10, generator=_g(5), dtype=torch.float64)
    grads = []
    for unrolled in (comhe.unrolled_projection, comhe_functional.unrolled_projection_reference):
        w = x.clone().requires_grad_(True)
        out = unrolled(w, p, share, 0.3, scale_free)
        grads.append((out, *torch.autograd.grad((out * weight).sum(), w)))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)
    assert grads[0][1][1, 5:].abs().max() == 0  # pad rows get nothing
    w = x.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: comhe.unrolled_projection(t, p, share, 0.3, False), (w,))
    if scale_free:
        g = comhe.angle_distortion_grad(x, p, share)
        eta = 0.3 * p.flatten(-3).norm(dim=-1) / g.flatten(1).norm(dim=1)  # one eta per layer
        plain = comhe.unrolled_projection(w, p, share, 1.0, False)
        (want,) = torch.autograd.grad((plain * weight * eta.view(-1, 1, 1, 1)).sum(), w)
        torch.testing.assert_close(grads[0][1], want, rtol=1e-12, atol=1e-12)


def test_unrolled_projection_is_the_step_on_the_distortions_gradient():
    """P - lr ||P|| / ||G|| G per layer, G the gradient of each layer's L_P (eq. 6.6) by autograd."""
    x, p, share = _unrolled_case(shared=True, num_proj=2)
    for layer, n in enumerate((7, 5, 7)):
        q = p.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(angle_distortion(x[layer, :n], q), q)
        expected = p - 0.3 * p.norm() / grad.norm() * grad
        torch.testing.assert_close(comhe.unrolled_projection(x, p, share, 0.3)[layer], expected)


def test_unrolled_projection_batches_over_seeds_and_costs_fewer_operations():
    """torch.func.vmap over stacked seeds (fit_seeds' batched step) gives each seed's gradient; and the written-out
    backward dispatches fewer operations than autograd's.  Compared in float64: the scale-free step divides by
    small gradient norms, so float32 rounding alone (batched products sum in another order) moves some entries by
    1e-3 relative on an AVX2 CPU, while in float64 the two agree to 1e-15."""
    from sphereml.launches import count_ops
    x, p, share = _unrolled_case(shared=False, num_proj=2)
    seeds = torch.stack([x, 2 * x.flip(1)]).requires_grad_(True)
    out = torch.func.vmap(lambda t: comhe.unrolled_projection(t, p, share, 0.3))(seeds)
    (batched,) = torch.autograd.grad(out.square().sum(), seeds)
    for i in range(2):
        w = seeds[i].detach().clone().requires_grad_(True)
        (alone,) = torch.autograd.grad(comhe.unrolled_projection(w, p, share, 0.3).square().sum(), w)
        torch.testing.assert_close(batched[i], alone)

    def ops(unrolled):
        w = x.clone().requires_grad_(True)
        return count_ops(lambda: unrolled(w, p, share, 0.3).sum().backward()).total
    fast, reference = ops(comhe.unrolled_projection), ops(comhe_functional.unrolled_projection_reference)
    assert fast <= 0.85 * reference, (fast, reference)


def test_unrolled_projection_differentiates_p_by_autograd_when_p_requires_grad():
    """With P a variable, d/dP of the stepped projections is that of P - lr ||P|| / ||G|| G with G = grad_P L_P by
    autograd (create_graph) and its size lr ||P|| / ||G|| a constant, as the scale-free step takes it (eq. 6.7's
    eta); the plain step passes gradcheck."""
    x, p, share = _unrolled_case(shared=True, num_proj=1)
    x[2, 3] = torch.randn(x.shape[-1], generator=_g(9), dtype=x.dtype)  # autograd's second derivative at 0 is nan
    weight = torch.randn(3, *p.shape, generator=_g(6), dtype=torch.float64)

    def by_autograd(q):
        out = []
        for layer, n in enumerate((7, 5, 7)):
            (grad,) = torch.autograd.grad(angle_distortion(x[layer, :n], q), q, create_graph=True)
            out.append(q - 0.3 * q.detach().norm() / grad.detach().norm() * grad)
        return torch.stack(out)

    q = p.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((comhe.unrolled_projection(x, q, share, 0.3) * weight).sum(), q)
    (expected,) = torch.autograd.grad((by_autograd(q) * weight).sum(), q)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: comhe.unrolled_projection(x, t, share, 0.3, False), (q,))


def test_angle_distortion_grad_takes_any_pair_weights():
    """An asymmetric share: grad_P of sum_ij share_ij (v_i . v_j - c_ij)^2 by autograd, and the unrolled step's
    written-out backward in x still autograd's."""
    x, p, share = _unrolled_case(shared=False, num_proj=2)
    share = share * torch.rand(share.shape, generator=_g(7), dtype=share.dtype)
    q = p.clone().requires_grad_(True)
    cos = comhe_functional.project(x, q)
    v = cos / cos.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    u = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    loss = (share.unsqueeze(1) * (v @ v.mT - (u @ u.mT).unsqueeze(1)).square()).sum()
    (expected,) = torch.autograd.grad(loss, q)
    torch.testing.assert_close(comhe_functional.angle_distortion_grad(x, p, share), expected, rtol=1e-12, atol=1e-14)
    weight = torch.randn(p.shape, generator=_g(8), dtype=p.dtype)
    grads = []
    for unrolled in (comhe.unrolled_projection, comhe_functional.unrolled_projection_reference):
        w = x.clone().requires_grad_(True)
        grads.append(torch.autograd.grad((unrolled(w, p, share, 0.3) * weight).sum(), w)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_unrolled_projection_is_first_order_only_and_runs_outside_autocast():
    """The written-out backward treats its saved terms as constants: a second derivative raises instead of coming
    out wrong.  Under autocast the step runs in the weights' dtype (its backward mixes saved terms with x)."""
    x, p, share = _unrolled_case(shared=True, num_proj=2)
    x.requires_grad_(True)
    (grad,) = torch.autograd.grad(comhe.unrolled_projection(x, p, share, 0.3).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(grad.sum(), x)
    model = _net()
    reg = CoMHE(model, variant="angle", num_proj=2)
    params = [w for w in model.parameters() if w.dim() > 1]
    expected = torch.autograd.grad(reg.penalty(), params, allow_unused=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        penalty = reg.penalty()
    for got, want in zip(torch.autograd.grad(penalty, params, allow_unused=True), expected):
        assert (got is None) == (want is None) and (got is None or torch.equal(got, want))


@pytest.mark.parametrize("scale_free", [True, False])
def test_unrolled_projection_has_forward_mode_adjoint_to_its_backward(scale_free):
    """Forward mode (torch.func.jvp and forward_ad) through the unrolled step takes the reference's path; its
    tangent J t satisfies <u, J t> = <J^T u, t> with J^T u from the written-out backward (float64)."""
    from torch.autograd import forward_ad
    x, p, share = _unrolled_case(shared=False, num_proj=2)
    t = torch.randn(x.shape, generator=_g(6), dtype=x.dtype)
    u = torch.randn(3, 2, 4, 10, generator=_g(7), dtype=x.dtype)
    step = functools.partial(comhe.unrolled_projection, p=p, share=share, lr=0.3, scale_free=scale_free)
    out, tangent = torch.func.jvp(step, (x,), (t,))
    with forward_ad.dual_level():
        dual = forward_ad.unpack_dual(step(forward_ad.make_dual(x, t)))
    torch.testing.assert_close(dual.tangent, tangent, rtol=0, atol=0)
    torch.testing.assert_close(dual.primal, out, rtol=0, atol=0)
    w = x.clone().requires_grad_(True)
    (pullback,) = torch.autograd.grad(step(w), w, u)
    assert tangent.abs().max() > 0
    torch.testing.assert_close((u * tangent).sum(), (pullback * t).sum(), rtol=1e-12, atol=1e-12)


def test_adversarial_step_raises_the_projected_energy():
    model = _net()
    reg = CoMHE(model, variant="adversarial", num_proj=2, ap_lr=0.05)
    assert reg.resample_every is None
    reg.resample()
    w = reg.hidden[1].weight.detach()
    before = float(projected_energies(w, reg.projections[reg.key(1)]).mean())
    reg()  # ascends first, then returns the penalty with the new projection
    after = float(projected_energies(w, reg.projections[reg.key(1)]).mean())
    assert after > before


@pytest.mark.parametrize("variant", comhe.VARIANTS)
def test_every_variant_trains_with_fit(variant):
    model = _net()
    kwargs = {"num_proj": 1, "ap_every": 2} if variant == "angle" else {}
    reg = CoMHE(model, variant=variant, proj_dim=16, group_size=4, **kwargs)
    x, y = torch.rand(48, 1, 16, 16), torch.randint(0, 4, (48,))
    history = fit(model, torch.utils.data.TensorDataset(x, y), epochs=2, batch_size=16, lr=0.05, optimizer="sgd",
                  regularizer=reg, device="cpu", progress=False)
    assert all(math.isfinite(e["reg"]) and e["reg"] > 0 for e in history.epochs)
    assert reg.calls == 6 and reg.original_energy() > 0


def test_comhe_alone_lowers_the_original_energy():
    """A few steps of the regulariser alone (no data) lower the layers' original half-space energy."""
    model = _net()
    reg = CoMHE(model, proj_dim=20, beta_output=0.0)
    start = reg.original_energy()
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(20):
        sgd.zero_grad()
        reg().backward()
        sgd.step()
    assert reg.original_energy() < start


def test_bad_arguments():
    model = _net()
    with pytest.raises(ValueError, match="variant must be one of"):
        CoMHE(model, variant="sketch")
    with pytest.raises(ValueError, match="proj_dim must be an integer >= 1"):
        CoMHE(model, proj_dim=0)
    with pytest.raises(ValueError, match="num_proj must be an integer >= 1"):
        CoMHE(model, num_proj=0)
    with pytest.raises(ValueError, match="resample_every"):
        CoMHE(model, resample_every=0)
    with pytest.raises(ValueError, match="resample_every"):
        CoMHE(model, resample_every="often")
    with pytest.raises(ValueError, match="ap_lr"):
        CoMHE(model, ap_lr=0.0)
    with pytest.raises(ValueError, match="no layer"):
        CoMHE(nn.Sequential(nn.ReLU()))
    with pytest.raises(ValueError, match=r"p must be a Tensor\[C, k, 40\]"):
        projected_energies(_w(), torch.randn(5, 40))
    with pytest.raises(ValueError, match="group_size must divide"):
        group_energy(torch.randn(4, 6, 3, 3), 4)
    with pytest.raises(ValueError, match="p2 must be"):
        bilateral_energy(_w(), torch.randn(5, 40, dtype=torch.float64), torch.randn(1, 12, dtype=torch.float64))


def test_plain_angle_step_is_the_authors_gradient_step():
    """ap_step="plain": the unrolled projection is P - ap_lr grad_P L_P, as the authors' code takes it."""
    torch.manual_seed(0)
    layer = nn.Linear(12, 6).double()
    model = nn.Sequential(layer, nn.ReLU(), nn.Linear(6, 3).double())
    reg = CoMHE(model, variant="angle", proj_dim=4, num_proj=1, beta_output=0.0, resample_every=None,
                ap_every=10 ** 6, ap_step="plain", ap_lr=0.3)
    reg.resample()
    p = reg.projections[reg.key(0)].detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(angle_distortion(layer.weight, p), p)
    expected = projected_energies(layer.weight, p.detach() - 0.3 * grad).mean()
    torch.testing.assert_close(reg.layer_energy(0), expected)
    with pytest.raises(ValueError, match="ap_step must be one of"):
        CoMHE(model, ap_step="adam")


def test_options_come_as_one_dataclass_or_as_its_fields():
    net = _net()
    options = comhe.CoMHEOptions(proj_dim=16, num_proj=2, seed=3)
    given, spelled = CoMHE(net, options=options), CoMHE(_net(), proj_dim=16, num_proj=2, seed=3)
    assert given.options == spelled.options == options
    assert CoMHE(net, options=options, num_proj=4).options.num_proj == 4 and options.num_proj == 2
    assert "proj_dim=16" in repr(given) and given.resample_every == 1
    assert CoMHE(net, variant="angle", options=options).resample_every is None  # "auto" for a fitted P
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_proj = 3
    with pytest.raises(TypeError, match="proj_dims"):
        CoMHE(net, proj_dims=16)
    with pytest.raises(ValueError, match="num_proj must be an integer >= 1"):
        comhe.CoMHEOptions(num_proj=0)
