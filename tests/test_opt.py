"""OPT layers (thesis Ch. 7): the invariants of reference §3.12 through real training steps, PE-OPT, S-OPT,
refinement, OGD, Table 7.2's energy from its definition, and the argument checks."""

import math

import pytest
import torch
from torch import nn

from sphereml import models
from sphereml.regularizers import opt, rotations
from sphereml.regularizers import orthogonalizers as orth
from sphereml.energy import hyperspherical_energy, layer_energy
from sphereml.train import fit

CONSTRAINED = opt.ORTHOGONAL_BY_CONSTRUCTION


def _layer(kind="conv", seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    layer = nn.Conv2d(4, 6, 3, padding=1) if kind == "conv" else nn.Linear(12, 6)
    return layer.to(dtype)


def _input(layer, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (5, 4, 7, 7) if isinstance(layer, nn.Conv2d) else (5, 12)
    return torch.randn(*shape, generator=g, dtype=layer.bias.dtype)


def _train(layer, steps=5, lr=0.3, weight_decay=5e-4, optimizer=None):
    x = _input(layer)
    optimizer = optimizer or torch.optim.SGD(layer.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    for _ in range(steps):
        optimizer.zero_grad()
        (layer(x) - 1.0).pow(2).mean().backward()
        optimizer.step()
    return layer


def _energies(w):
    return [float(hyperspherical_energy(w, s, metric=m, half_space=h))
            for s in (0.0, 1.0, 2.0) for m in ("euclidean", "angular") for h in (False, True)]


@pytest.mark.parametrize("kind", ["conv", "linear"])
@pytest.mark.parametrize("method", CONSTRAINED + ("ogd",))
def test_training_keeps_rotation_orthogonal_and_energy_norms_gram_and_v(kind, method):
    layer = opt.orthogonal_overparameterize(_layer(kind), method, generator=torch.Generator().manual_seed(0))
    v = opt.fixed_neurons(layer).clone()
    optimizer = opt.ogd_optimizer(layer, lr=0.3, rotation_lr=0.05, iterations=None) if method == "ogd" else None
    before = layer.weight.detach().clone()
    _train(layer, optimizer=optimizer)
    w = layer.weight.detach()
    assert not torch.allclose(w, before)  # it did train
    assert torch.equal(opt.fixed_neurons(layer), v)  # invariant 7: V bit-identical under weight decay
    tol = 1e-10
    with torch.no_grad():
        r = opt.rotation_module(layer).rotation()
    assert float(orth.orthogonality_error(r)) < tol
    flat_v, flat_w = v.flatten(1), w.flatten(1)
    torch.testing.assert_close(flat_w, flat_v @ r.mT)
    torch.testing.assert_close(flat_w @ flat_w.mT, flat_v @ flat_v.mT, rtol=tol, atol=tol)  # invariant 6
    torch.testing.assert_close(torch.tensor(_energies(w)), torch.tensor(_energies(v)), rtol=tol, atol=0)


@pytest.mark.parametrize("method", ["or", "upt"])
def test_unconstrained_rotations_change_the_energy(method):
    layer = opt.orthogonal_overparameterize(_layer(), method)
    start = _energies(layer.weight.detach())
    rotation = opt.rotation_module(layer).raw.detach()
    assert float(orth.orthogonality_error(rotation)) < 1e-12  # starts orthogonal
    _train(layer, steps=10, lr=1.0)
    assert float(orth.orthogonality_error(rotation)) > 1e-4
    assert abs(_energies(layer.weight.detach())[4] - start[4]) > 1e-6


def test_fast_and_unrolled_paths_train_identically():
    layers = [opt.orthogonal_overparameterize(_layer(), m, unrolled=u, generator=torch.Generator().manual_seed(3))
              for m, u in [("gs", False), ("gs", True), ("mgs", False), ("householder", False), ("householder", True)]]
    for layer in layers:
        _train(layer)
    torch.testing.assert_close(layers[1].weight, layers[0].weight)
    torch.testing.assert_close(layers[2].weight, layers[0].weight)
    torch.testing.assert_close(layers[4].weight, layers[3].weight)


def test_layer_output_is_the_plain_layer_with_the_rotated_weight_and_merge_keeps_it():
    layer = opt.orthogonal_overparameterize(_layer(), "cayley")
    _train(layer)
    x = _input(layer)
    plain = _layer()
    with torch.no_grad():
        plain.weight.copy_(layer.weight)
        plain.bias.copy_(layer.bias)
    out = layer(x)
    torch.testing.assert_close(out, plain(x))
    opt.merge(layer)
    assert type(layer) is nn.Conv2d and isinstance(layer.weight, nn.Parameter)
    torch.testing.assert_close(layer(x), out)  # invariant 11
    assert opt.opt_layers(layer) == []


@pytest.mark.parametrize("method", ["gs", "ogd", "or"])
def test_state_dict_round_trip(method):
    trained = _train(opt.orthogonal_overparameterize(_layer(), method))
    fresh = opt.orthogonal_overparameterize(_layer(seed=5), method)
    assert set(fresh.state_dict()) == {"bias", "parametrizations.weight.original", "parametrizations.weight.0.raw"}
    fresh.load_state_dict(trained.state_dict())
    x = _input(trained)
    torch.testing.assert_close(fresh(x), trained(x), rtol=0, atol=0)
    assert [n for n, _ in fresh.named_parameters()] == ["bias", "parametrizations.weight.0.raw"]


def test_normalize_gives_unit_neurons_and_keeps_directions():
    layer = _layer()
    directions = layer.weight.detach().flatten(1)
    directions = directions / directions.norm(dim=1, keepdim=True)
    opt.orthogonal_overparameterize(layer, "gs", normalize=True)
    v = opt.fixed_neurons(layer).flatten(1)
    torch.testing.assert_close(v.norm(dim=1), torch.ones(len(v), dtype=v.dtype))
    torch.testing.assert_close(v, directions)
    torch.testing.assert_close(layer.weight.detach().flatten(1).norm(dim=1), torch.ones(len(v), dtype=v.dtype))


@pytest.mark.parametrize("half_space", [True, False])
def test_refinement_lowers_the_energy_and_keeps_norms(half_space):
    v = torch.randn(16, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    refined = opt.refine_neurons(v, steps=200, lr=0.01, half_space=half_space)
    for h in {half_space, True}:
        assert float(hyperspherical_energy(refined, half_space=h)) < float(hyperspherical_energy(v, half_space=h))
    torch.testing.assert_close(refined.norm(dim=1), v.norm(dim=1))
    torch.testing.assert_close(opt.refine_neurons(v, steps=0), v)
    layer = opt.orthogonal_overparameterize(_layer(), "gs", refine="hs_mhe", refine_steps=50)
    plain = _layer().weight.detach()
    assert float(hyperspherical_energy(layer.weight.detach(), half_space=True)) < float(
        hyperspherical_energy(plain, half_space=True))


PAPER_COUNTS = {1: (331_776, 331_776), 2: (82_944, 165_888), 4: (20_736, 82_944), 8: (5_184, 41_472),
                16: (1_296, 20_736), 32: (324, 10_368), 64: (81, 5_184)}  # Tables F.4 / F.5 (R_s, R_u), d = 576


@pytest.mark.parametrize("blocks", sorted(PAPER_COUNTS))
def test_pe_opt_parameter_counts_match_tables_f4_f5(blocks):
    layer = nn.Conv2d(64, 64, 3)
    counts = [opt.orthogonal_overparameterize(nn.Conv2d(64, 64, 3), "gs", blocks=blocks, shared=shared)
              .parametrizations.weight[0].raw.numel() for shared in (True, False)]
    assert tuple(counts) == PAPER_COUNTS[blocks] == (576 ** 2 // blocks ** 2, 576 ** 2 // blocks)
    assert layer.weight.shape == (64, 64, 3, 3)


@pytest.mark.parametrize("blocks", [1, 4])
def test_unit_raw_std_starts_each_raw_block_with_rows_near_unit_norm(blocks):
    make = lambda std: opt.rotation_module(opt.orthogonal_overparameterize(  # noqa: E731
        nn.Conv2d(64, 64, 3), "gs", blocks=blocks, generator=torch.Generator().manual_seed(2), raw_std=std)).raw
    unit, thesis = make("unit"), make(1.0)
    m = 576 // blocks
    torch.testing.assert_close(unit, thesis / m**0.5)  # the same draw, scaled by 1 / sqrt(m)
    assert unit.shape[-1] == m and abs(float(unit.norm(dim=-1).mean()) - 1.0) < 0.05
    with pytest.raises(ValueError, match="raw_std"):
        make("units")


@pytest.mark.parametrize("method", ["gs", "householder", "lowdin"])
def test_orthogonal_start_keeps_the_rotation_and_conditions_the_raw_matrix(method):
    """Started conditioned, the raw matrix maps to the rotation its Gaussian draw maps to, with the draw's RMS row
    norm r (every row r for the QR maps; Löwdin's singular values r s, s evenly spread over [1/2, 3/2]); the map's
    derivative there is bounded by sqrt(2) / r (QR) or 1 / (r s_min) (Löwdin), and from the Gaussian draw it is
    far larger (Note [the raw matrix's conditioning]); a method without a scale-free map refuses."""
    def start(orthogonal):
        return opt.orthogonal_overparameterize(_layer(), method, generator=torch.Generator().manual_seed(4),
                                               raw_std="unit", orthogonal_start=orthogonal)
    gaussian, conditioned = start(False), start(True)
    torch.testing.assert_close(conditioned.weight, gaussian.weight)  # the same rotation of V
    raw, raw_gaussian = opt.rotation_module(conditioned).raw, opt.rotation_module(gaussian).raw
    r = float(raw_gaussian.detach().norm(dim=-1).pow(2).mean().sqrt())
    torch.testing.assert_close(raw.detach().norm(dim=-1).pow(2).mean().sqrt(), torch.tensor(r, dtype=raw.dtype))
    spread = torch.linspace(0.5, 1.5, raw.shape[-1], dtype=raw.dtype)
    singular = r * spread / spread.pow(2).mean().sqrt() if method == "lowdin" else torch.full_like(spread, r)
    torch.testing.assert_close(torch.linalg.svdvals(raw.detach()), singular.flip(0).expand(raw.shape[:-1]))
    bound = 1 / float(singular.min()) if method == "lowdin" else 2 ** 0.5 / r
    g = torch.Generator().manual_seed(5)
    directions = [torch.randn(raw.shape, generator=g, dtype=raw.dtype) for _ in range(8)]
    stretch = {}
    for name, at in (("orthogonal", raw), ("gaussian", raw_gaussian)):
        stretch[name] = max(float(torch.func.jvp(lambda u: rotations.orthogonal_blocks(u, method), (at.detach(),),
                                                 (e,))[1].norm() / e.norm()) for e in directions)
    assert stretch["orthogonal"] <= bound * (1 + 1e-6)
    assert stretch["gaussian"] > 2 * stretch["orthogonal"]
    if method == "lowdin":  # the polar map's worst direction W (e_{m-1} e_m^T - e_m e_{m-1}^T) V^T: 2 / (s_m-1 + s_m)
        worst = {}
        for name, at in (("orthogonal", raw.detach()), ("gaussian", raw_gaussian.detach())):
            w, sigma, vh = torch.linalg.svd(at)
            turn = torch.zeros_like(at)
            turn[..., -2, -1], turn[..., -1, -2] = 1.0, -1.0
            e = w @ turn @ vh
            worst[name] = float(torch.func.jvp(lambda u: rotations.orthogonal_blocks(u, method), (at,), (e,))[1].norm()
                                / e.norm())
            assert worst[name] == pytest.approx(float(2 / (sigma[..., -1] + sigma[..., -2])), rel=1e-6)
        assert worst["orthogonal"] <= bound and worst["gaussian"] > 2 * worst["orthogonal"]
    with pytest.raises(ValueError, match="orthogonal_start"):  # Cayley's map is not scale-free
        opt.orthogonal_overparameterize(_layer(), "cayley", orthogonal_start=True)
    with pytest.raises(ValueError, match="method"):
        rotations.conditioned_start(raw.detach(), "cayley")


def test_rotation_rates_scale_as_one_over_the_square_of_the_raw_scale_and_sum_over_shared_copies():
    """GS gives the same R for c U: the gradient scales as 1 / c, the relative step as 1 / c^2.  A shared block's
    gradient is the sum of its copies' (here compared with an independent layer whose blocks all start alike)."""
    def rates(std, shared, blocks=2):
        layer = opt.orthogonal_overparameterize(_layer(), "gs", blocks=blocks, shared=shared,
                                                generator=torch.Generator().manual_seed(3), raw_std=std)
        if not shared:  # both blocks start as the shared one: the same network
            with torch.no_grad():
                opt.rotation_module(layer).raw[1] = opt.rotation_module(layer).raw[0]
        layer(_input(layer)).pow(2).sum().backward()
        return opt.rotation_rates(layer)[0], opt.rotation_module(layer).raw.grad

    base, _ = rates(0.5, shared=True)
    torch.testing.assert_close(rates(1.0, shared=True)[0], base / 4)
    shared_rate, shared_grad = rates(0.5, shared=True)
    independent_rate, independent_grad = rates(0.5, shared=False)
    assert shared_rate.shape == (1,) and independent_rate.shape == (2,)
    torch.testing.assert_close(shared_grad[0], independent_grad.sum(0))
    with pytest.raises(ValueError, match="backward pass"):
        opt.rotation_rates(opt.orthogonal_overparameterize(_layer(), "gs"))


@pytest.mark.parametrize("shared", [True, False])
def test_pe_opt_blocks_rotate_channel_groups_of_each_kernel(shared):
    layer = opt.orthogonal_overparameterize(_layer(), "cayley", blocks=2, shared=shared)  # groups {0, 1}, {2, 3}
    with torch.no_grad():
        r = opt.rotation_module(layer).rotation()
    assert float(orth.orthogonality_error(r)) < 1e-12
    assert float(r[:18, 18:].abs().max()) == 0.0 and float(r[18:, :18].abs().max()) == 0.0
    blocks = opt.rotation_module(layer).blocks_of_r()
    assert len(blocks) == (1 if shared else 2)
    v = opt.fixed_neurons(layer)
    with torch.no_grad():
        opt.fixed_neurons(layer)[:, 2:] += 1.0  # change the second channel group of V only
    torch.testing.assert_close(layer.weight[:, :2], (v[:, :2].flatten(1) @ blocks[0].mT).reshape(6, 2, 3, 3))
    one = opt.orthogonal_overparameterize(_layer(), "gs", blocks=1, generator=torch.Generator().manual_seed(1))
    full = opt.orthogonal_overparameterize(_layer(), "gs", generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(one.weight, full.weight)  # k = 1 is OPT


def test_s_opt_preserves_energy_across_episodes_and_resamples_only_on_schedule():
    layer = opt.orthogonal_overparameterize(_layer(), "gs", subset=10, generator=torch.Generator().manual_seed(0))
    rot = opt.rotation_module(layer)
    torch.testing.assert_close(layer.weight, opt.fixed_neurons(layer))  # R starts at the identity
    start = _energies(layer.weight.detach())
    dims, v = rot.dims.clone(), opt.fixed_neurons(layer).clone()
    _train(layer)
    assert torch.equal(rot.dims, dims) and torch.equal(opt.fixed_neurons(layer), v)
    untouched = torch.ones(36, dtype=torch.bool)
    untouched[dims] = False
    torch.testing.assert_close(layer.weight.flatten(1)[:, untouched], v.flatten(1)[:, untouched])
    trained = layer.weight.detach().clone()
    opt.resample(layer, torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer.weight, trained)  # merging changes nothing
    assert not torch.equal(rot.dims, dims)
    _train(layer)
    torch.testing.assert_close(torch.tensor(_energies(layer.weight.detach())), torch.tensor(start), rtol=1e-9, atol=0)


def test_resampler_callback_runs_episodes_inside_fit():
    torch.manual_seed(0)
    model = models.MLP(12, 3, hidden=(8,))
    opt.overparameterize_model(model, "gs", subset=4)
    resampler = opt.Resampler(model, every=2)
    x, y = torch.randn(40, 12), torch.randint(0, 3, (40,))
    fit(model, torch.utils.data.TensorDataset(x, y), epochs=1, batch_size=10, lr=0.1, optimizer="sgd",
        callbacks=[resampler], device="cpu", progress=False)
    assert resampler.episodes == 2


def test_model_wide_opt_leaves_the_classifier_and_trains_with_fit():
    torch.manual_seed(0)
    model = models.Classifier(models.MLP(12, 8, hidden=(10,)), 3)
    layers = opt.overparameterize_model(model, "cayley")
    assert layers == opt.opt_layers(model) and model.head not in layers and len(layers) == 2
    energy = layer_energy(layers, half_space=True)
    x, y = torch.randn(60, 12), torch.randint(0, 3, (60,))
    history = fit(model, torch.utils.data.TensorDataset(x, y), epochs=3, batch_size=20, lr=0.05, optimizer="sgd",
                  device="cpu", progress=False)
    assert history.epochs[-1]["train_loss"] < history.epochs[0]["train_loss"]
    assert layer_energy(layers, half_space=True) == pytest.approx(energy, rel=1e-5)


@pytest.mark.parametrize("iterations", [2, None])
def test_ogd_optimizer_descends_and_stays_orthogonal(iterations):
    torch.manual_seed(0)
    model = models.Classifier(models.MLP(12, 8, hidden=(10,)), 3)
    layers = opt.overparameterize_model(model, "ogd")
    optimizer = opt.ogd_optimizer(model, lr=0.1, rotation_lr=0.05, weight_decay=5e-4, iterations=iterations)
    assert [g["orthogonal"] for g in optimizer.param_groups] == [True, False]
    x = torch.randn(60, 12)
    y = (x @ torch.randn(12, 3)).argmax(1)  # a learnable labelling
    losses = []
    for _ in range(50):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0]
    for layer in layers:  # float32 rounding accumulates over steps (either form); float64 is checked above
        assert float(orth.orthogonality_error(opt.rotation_module(layer).raw.detach())) < 2e-5


def test_orthogonal_relaxation_penalty():
    model = models.MLP(12, 3, hidden=(8,))
    opt.overparameterize_model(model, "or", include_output=True)
    reg = opt.OrthogonalRelaxation(model, beta=0.1)
    assert float(reg().detach()) == pytest.approx(0.0, abs=1e-5)  # starts orthogonal
    raw = opt.rotation_module(model.net[1]).raw
    with torch.no_grad():
        raw.mul_(2.0)  # R^T R - I = 3 I: ||.||_F = 3 sqrt(12)
    expected = 3 * math.sqrt(12)
    assert float(reg().detach()) == pytest.approx(0.1 * expected, rel=1e-5)
    squared = opt.OrthogonalRelaxation(model, beta=1.0, squared=True)().detach()
    assert float(squared) == pytest.approx(expected ** 2, rel=1e-5)


@pytest.mark.parametrize("method", ["gs", "ogd", "or"])
def test_training_parts_follow_the_method(method):
    """OGD trains with the Cayley optimizer (rotations at lr / 5), OR with its penalty, the rest with plain SGD."""
    model = models.MLP(12, 3, hidden=(8,))
    opt.overparameterize_model(model, method)
    make_optimizer, regularizer = opt.training_parts(model, lr=0.1, weight_decay=5e-4)
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    if method == "ogd":
        assert isinstance(optimizer, opt.OrthogonalSGD)
        rotations = next(g for g in optimizer.param_groups if g["orthogonal"])
        assert rotations["lr"] == pytest.approx(0.02) and rotations["weight_decay"] == 0.0
    else:
        assert type(optimizer) is torch.optim.SGD
        assert optimizer.defaults["lr"] == 0.1 and optimizer.defaults["weight_decay"] == 5e-4
    assert isinstance(regularizer, opt.OrthogonalRelaxation) == (method == "or")
    assert regularizer is None or regularizer.beta == 0.1
    if method == "ogd":
        with pytest.raises(ValueError, match="rotation_lr"):
            opt.training_parts(model, 0.1, rotation_lr=0.0)


def test_table_7_2_initial_energy_from_its_definition():
    """He-normal CNN-6 (Table F.1) weights with a shifted mean; half-space s = 2 pair-mean energy summed
    over the 7 OPT layers (reference §3.11).  Paper: 3.5109, 3.5160, 3.5531, 3.6761 at means 0 .. 3e-2."""
    paper = {0.0: 3.5109, 1e-2: 3.5160, 2e-2: 3.5531, 3e-2: 3.6761}
    net = models.opt_cnn(6)
    layers = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert [m.weight[0].numel() for m in layers] == [27, 576, 576, 576, 576, 576, 1024]
    g = torch.Generator().manual_seed(0)
    for mean, value in paper.items():
        draws = []
        for _ in range(3):
            with torch.no_grad():
                for m in layers:
                    std = math.sqrt(2 / m.weight[0].numel())
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std + mean)
            draws.append(layer_energy(layers, half_space=True))
        assert abs(sum(draws) / len(draws) - value) < 0.005, (mean, draws)


def test_bad_arguments():
    with pytest.raises(ValueError, match="method must be one of"):
        opt.orthogonal_overparameterize(_layer(), "givens")
    with pytest.raises(ValueError, match="blocks must divide the neuron dimension 36"):
        opt.orthogonal_overparameterize(_layer(), "gs", blocks=5)
    with pytest.raises(ValueError, match="blocks must be an integer"):
        opt.orthogonal_overparameterize(_layer(), "gs", blocks=0)
    with pytest.raises(ValueError, match="module must be one of"):
        opt.orthogonal_overparameterize(nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match="already parametrised"):
        opt.orthogonal_overparameterize(opt.orthogonal_overparameterize(_layer()))
    with pytest.raises(ValueError, match="subset must be an integer"):
        opt.orthogonal_overparameterize(_layer(), subset=37)
    with pytest.raises(ValueError, match="subset"):
        opt.orthogonal_overparameterize(_layer(), "lowdin", subset=4)
    with pytest.raises(ValueError, match="subset"):
        opt.orthogonal_overparameterize(_layer(), "gs", subset=4, blocks=2)
    with pytest.raises(ValueError, match="refine must be one of"):
        opt.orthogonal_overparameterize(_layer(), refine="energy")
    with pytest.raises(ValueError, match="no OPT parametrisation"):
        opt.rotation_module(_layer())
    with pytest.raises(ValueError, match="S-OPT"):
        opt.resample(opt.orthogonal_overparameterize(_layer()))
    with pytest.raises(ValueError, match="no S-OPT layer"):
        opt.Resampler(nn.Sequential(opt.orthogonal_overparameterize(_layer())), every=1)
    with pytest.raises(ValueError, match="method='or'"):
        opt.OrthogonalRelaxation(nn.Sequential(opt.orthogonal_overparameterize(_layer())))
    with pytest.raises(ValueError, match="method='ogd'"):
        opt.ogd_optimizer(nn.Sequential(opt.orthogonal_overparameterize(_layer())))
    with pytest.raises(ValueError, match="square"):
        opt.OrthogonalSGD([{"params": [nn.Parameter(torch.zeros(3, 4))], "orthogonal": True}])
    with pytest.raises(ValueError, match="momentum"):
        opt.OrthogonalSGD([nn.Parameter(torch.zeros(3))], momentum=1.0)
    with pytest.raises(ValueError, match="steps"):
        opt.refine_neurons(torch.randn(4, 3), steps=-1)


@pytest.mark.parametrize("method", ["gs", "householder", "lowdin", "cayley", "ogd", "or"])
def test_opt_layer_compiles_without_graph_breaks(method):
    torch.compiler.reset()
    layer = opt.orthogonal_overparameterize(_layer(dtype=torch.float32), method)
    x = _input(layer)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, layer(x))
    assert opt.rotation_module(layer).raw.grad is not None
