"""A model's OPT rotations evaluated together (Note [rotations evaluated together]): the same weights, outputs and
gradients as each layer evaluating its own, one evaluation per method and block size, nothing kept after a forward;
the Cayley steps of OGD and the relaxation penalty grouped the same way."""

import copy

import pytest
import torch
from torch import nn

from sphereml import models
from sphereml.train import default_loss, fit
from sphereml.regularizers import opt, rotations
from sphereml.regularizers import orthogonalizers as orth


def _net(depth=6, width=8, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return models.Classifier(models.opt_cnn(depth, width=width), 5).to(dtype)


def _batch(dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 32, 32, generator=g, dtype=dtype), torch.randint(0, 5, (4,), generator=g)


def _loss_and_grads(net, x, y):
    net.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(net(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def _mixed(grouped: bool):
    """A CNN-6 (d = 27, 72 x 5, 128) whose layers take different OPT settings: PE-OPT with three independent or
    shared blocks of 24 coordinates and S-OPT on 24 of them share one evaluation of 24 x 24 blocks."""
    net = _net()
    settings = [dict(), dict(blocks=3), dict(blocks=3, shared=True), dict(subset=24), dict(), dict(), dict()]
    gen = torch.Generator().manual_seed(2)
    for layer, kwargs in zip(opt.select_layers(net, include_output=False), settings):
        opt.orthogonal_overparameterize(layer, "gs", generator=gen, **kwargs)
    return opt.group_rotations(net) if grouped else net


@pytest.mark.parametrize("method", opt.ORTHOGONAL_BY_CONSTRUCTION)
def test_rotations_evaluated_together_give_each_layers_own_weights_outputs_and_gradients(method):
    alone = _net()
    gen = torch.Generator().manual_seed(3)
    for layer in opt.select_layers(alone, include_output=False):  # as overparameterize_model, without its hooks
        opt.orthogonal_overparameterize(layer, method, generator=gen)
    together = opt.group_rotations(copy.deepcopy(alone))
    assert not alone.backbone._forward_pre_hooks and together.backbone._forward_pre_hooks
    x, y = _batch()
    loss, grads = _loss_and_grads(together, x, y)
    expected_loss, expected = _loss_and_grads(alone, x, y)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=0)
    assert grads.keys() == expected.keys() and any("raw" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pe_opt_and_s_opt_layers_of_one_block_size_share_an_evaluation(dtype):
    together, alone = _mixed(True).to(dtype), _mixed(False).to(dtype)
    x, y = _batch(dtype)
    loss, grads = _loss_and_grads(together, x, y)
    expected_loss, expected = _loss_and_grads(alone, x, y)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, expected_loss, **tol)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], **tol, msg=name)


def _counting_evaluations(monkeypatch):
    calls = []
    original = rotations.orthogonal_blocks

    def counted(raw, method, unrolled=False):
        calls.append((method, tuple(raw.shape)))
        return original(raw, method, unrolled)
    monkeypatch.setattr(rotations, "orthogonal_blocks", counted)
    return calls


def test_one_evaluation_per_method_and_block_size_and_none_kept_after_the_forward(monkeypatch):
    """CNN-9's OPT layers: d = 27 (one), 72 (eight 8 x 3 x 3 convolutions) and 128 (fc6): three evaluations."""
    net = _net(depth=9)
    opt.overparameterize_model(net, "gs")
    calls = _counting_evaluations(monkeypatch)
    _loss_and_grads(net, *_batch())
    assert sorted(calls) == [("gs", (1, 27, 27)), ("gs", (1, 128, 128)), ("gs", (8, 72, 72))]
    assert all(rot.handed is None for rot in map(opt.rotation_module, opt.opt_layers(net)))


def test_fit_and_the_default_loss_evaluate_the_rotations_together(monkeypatch):
    """fit trains through Classifier.loss_and_logits, which calls the backbone, not the classifier itself."""
    net = _net(depth=9, dtype=torch.float32)
    opt.overparameterize_model(net, "gs")
    calls = _counting_evaluations(monkeypatch)
    x, y = _batch(torch.float32)
    default_loss(net, x, y)[0].backward()
    assert len(calls) == 3
    calls.clear()
    fit(net, torch.utils.data.TensorDataset(x, y), epochs=1, batch_size=2, optimizer="sgd", lr=0.01,
        device="cpu", progress=False)
    assert len(calls) == 3 * 2  # two steps


def test_an_interrupted_forward_leaves_no_stale_rotation():
    """KeyboardInterrupt skips the release; blocks made from a raw matrix changed since, or without the gradient
    now wanted, are refused."""
    together = _net()
    opt.overparameterize_model(together, "gs")
    alone = opt.ungroup_rotations(copy.deepcopy(together))
    x, y = _batch()

    def interrupt(module, args):
        raise KeyboardInterrupt
    for grad in (False, True):
        handle = together.backbone.feature.register_forward_pre_hook(interrupt)
        with torch.set_grad_enabled(grad), pytest.raises(KeyboardInterrupt):
            together(x)
        handle.remove()
        assert all(opt.rotation_module(m).handed is not None for m in opt.opt_layers(together))  # left behind
        copy.deepcopy(together)  # copies carry no handed-over blocks
        with torch.no_grad():
            for net in (together, alone):
                for m in opt.opt_layers(net):
                    opt.rotation_module(m).raw.mul_(1.5).add_(0.1)  # as an optimiser step would
        for m, fresh in zip(opt.opt_layers(together), opt.opt_layers(alone)):  # a layer used on its own
            torch.testing.assert_close(m.weight, fresh.weight, rtol=0, atol=0)
        loss, grads = _loss_and_grads(together, x, y)
        expected_loss, expected = _loss_and_grads(alone, x, y)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=0)
        for name, grad_value in expected.items():
            torch.testing.assert_close(grads[name], grad_value, rtol=1e-10, atol=1e-12, msg=name)


def test_blocks_made_without_a_gradient_are_refused_when_one_is_wanted():
    net = _net()
    opt.overparameterize_model(net, "cayley")
    rot = opt.rotation_module(opt.opt_layers(net)[1])
    with torch.no_grad():
        rot.handed = (orth_blocks := rotations.orthogonal_blocks(rot.raw, "cayley"), rot.raw, rot.raw._version)
        assert rot.handed_over() is orth_blocks
    assert rot.handed_over() is None  # a gradient is wanted now
    rot.handed = (rot.raw.detach(), rot.raw.detach(), 0)  # made from another tensor
    assert rot.handed_over() is None


def test_ungrouping_removes_every_hook_and_lets_activation_checkpointing_recompute():
    net = _net()
    opt.overparameterize_model(net, "gs")
    assert [m for m in net.modules() if m._forward_pre_hooks] == [net.backbone]
    opt.ungroup_rotations(net)
    assert not any(m._forward_pre_hooks or m._forward_hooks or m._forward_hooks_always_called for m in net.modules())
    x, y = _batch()
    expected_loss, expected = _loss_and_grads(net, x, y)
    net.zero_grad(set_to_none=True)
    features = torch.utils.checkpoint.checkpoint(net.backbone, x, use_reentrant=False)
    loss = nn.functional.cross_entropy(net.head(features), y)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-12, atol=0)
    for name, p in net.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)


def test_a_failing_forward_keeps_nothing_and_a_weight_read_alone_evaluates_its_own_layer(monkeypatch):
    net = _net()
    opt.overparameterize_model(net, "householder")
    with pytest.raises(RuntimeError):
        net(torch.randn(2, 5, 32, 32, dtype=torch.float64))  # wrong channel count: fails inside the forward
    assert all(opt.rotation_module(m).handed is None for m in opt.opt_layers(net))
    calls = _counting_evaluations(monkeypatch)
    layer = opt.opt_layers(net)[2]
    expected = rotations.orthogonal_blocks(opt.rotation_module(layer).raw, "householder")
    torch.testing.assert_close(opt.rotation_module(layer).blocks_of_r(), expected, rtol=0, atol=0)
    assert calls == [("householder", (1, 72, 72))] * 2  # the read above and the oracle


def test_the_hooks_go_on_the_smallest_module_holding_every_opt_layer_once(monkeypatch):
    net = _net()
    opt.overparameterize_model(net.backbone, "cayley")  # from the backbone: its own scope
    opt.group_rotations(net)  # from the classifier: the same scope, no second hook
    assert [m for m in net.modules() if m._forward_pre_hooks] == [net.backbone]
    assert len(net.backbone._forward_pre_hooks) == 1 and len(net.backbone._forward_hooks) == 1
    calls = _counting_evaluations(monkeypatch)
    _loss_and_grads(net, *_batch())
    assert len(calls) == 3
    with_head = _net()
    opt.overparameterize_model(with_head, "gs", include_output=True)  # the classifier holds them all
    assert [m for m in with_head.modules() if m._forward_pre_hooks] == [with_head]


def test_merged_and_unconstrained_layers_are_left_out():
    net = _net()
    layers = opt.overparameterize_model(net, "gs")
    opt.merge(layers[1])
    with torch.no_grad():
        before = net(_batch()[0])
    assert torch.isfinite(before).all()
    ogd = _net()
    opt.overparameterize_model(ogd, "ogd")
    ogd(_batch()[0])
    assert all(opt.rotation_module(m).handed is None for m in opt.opt_layers(ogd))


@pytest.mark.parametrize("method", ["gs", "cayley"])
def test_an_opt_network_compiles_as_one_graph_without_recompiling(method):
    torch.compiler.reset()
    net = _net(dtype=torch.float32)
    opt.overparameterize_model(net, method)
    sgd = torch.optim.SGD(net.parameters(), 0.1)
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    x, y = _batch(torch.float32)
    for step in range(3):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            out = compiled(x)
        nn.functional.cross_entropy(out, y).backward()
        torch.testing.assert_close(out, net(x), rtol=1e-5, atol=1e-6)
        sgd.step()
        sgd.zero_grad()
    assert all(opt.rotation_module(m).handed is None for m in opt.opt_layers(net))


@pytest.mark.parametrize("iterations", [2, None])
def test_grouped_cayley_steps_are_each_matrixs_own_step(iterations):
    """Two 6 x 6 rotations (one a batch of two blocks) and a 4 x 4 one: OrthogonalSGD steps them by size; the
    oracle steps each with cayley_sgd_step, momentum included."""
    torch.manual_seed(0)
    shapes = [(6, 6), (2, 6, 6), (4, 4)]
    params = [nn.Parameter(orth.qr_orthogonalize(torch.randn(s, dtype=torch.float64))) for s in shapes]
    expected = [p.detach().clone() for p in params]
    momenta = [torch.zeros_like(p) for p in params]
    optimizer = opt.OrthogonalSGD([{"params": params, "orthogonal": True}], lr=0.1, momentum=0.9,
                                  iterations=iterations)
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
        for i, g in enumerate(grads):
            momenta[i] = 0.9 * momenta[i] - g
            expected[i], momenta[i] = orth.cayley_sgd_step(expected[i], momenta[i], 0.1, iterations)
    for p, e, m in zip(params, expected, momenta):
        torch.testing.assert_close(p.detach(), e, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(optimizer.state[p]["momentum"], m, rtol=1e-12, atol=1e-12)


def test_relaxation_penalty_sums_every_layers_gap():
    net = _net()
    opt.overparameterize_model(net, "or")
    layers = opt.opt_layers(net)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            opt.rotation_module(layer).raw.mul_(1.0 + 0.1 * i)
    gaps = []
    for layer in layers:
        r = opt.rotation_module(layer).raw
        gaps.append(torch.linalg.matrix_norm(r.mT @ r - torch.eye(r.shape[-1], dtype=r.dtype)).sum())
    for squared in (False, True):
        expected = sum(g.pow(2) if squared else g for g in gaps)
        got = opt.OrthogonalRelaxation(net, beta=1.0, squared=squared).penalty()
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
