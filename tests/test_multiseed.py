"""fit_seeds: several seeds of one network in one batched step, ending where fit ends seed by seed
(Note [fit_seeds is fit, seed by seed]), with one step's launches independent of the number of seeds."""

import warnings
from functools import partial

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from sphereml import launches, models, multiseed
from sphereml.attacks import adversarial_loss
from sphereml.heads import ArcFaceLoss, ASoftmaxLoss, LambdaSchedule
from sphereml.layers.decoupled import DecoupledConv2d
from sphereml.layers.decoupled_training import (WeightProjection, mean_kernel_norm, project_weights,
                                                training_aids)
from sphereml.multiseed import (can_train_together, elementwise_optimizer, fit_seeds, stack_state, stacked_callbacks,
                                unstack_state)
from sphereml.regularizers import MHE, ConvSimilarity, Orthogonality, Orthonormality, opt, select_layers
from sphereml.regularizers.comhe import CoMHE
from sphereml.recalibration import BiasCorrectedAverage, has_running_stats
from sphereml.train import Tracker, evaluate, fit

pytestmark = pytest.mark.usefixtures("one_thread")


def _data(n=96, side=8, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, side, side, generator=g, dtype=torch.float64),
                         torch.randint(0, classes, (n,), generator=g))


BODIES = {  # each on 1 x 8 x 8 inputs
    "CNN-3 with BatchNorm": lambda: models.plain_cnn(3, widths=(3, 4, 5), in_channels=1, image_size=8, feature_dim=6),
    "ConvNet, PReLU": lambda: models.ConvNet(1, 6, (3, 4), image_size=8, act_layer="prelu"),
    "SphereNet-3, linear": lambda: models.spherenet(3, "linear", widths=(3, 4, 5), in_channels=1, image_size=8,
                                                    feature_dim=6),
    "SphereNet-3, sigmoid with learned k": lambda: models.spherenet(3, "sigmoid", learnable_k=True, widths=(3, 4, 5),
                                                                    in_channels=1, image_size=8, feature_dim=6),
    "SCS, learned p and q": lambda: models.scs_net((3, 4), in_channels=1, image_size=8),
    "decoupled TanhConv x sigmoid, radius norm": lambda: models.ConvNet(
        1, 6, (3, 4), image_size=8, conv_layer=partial(DecoupledConv2d, angular="sigmoid", radius_norm=True)),
}
BATCHED = list(BODIES)  # what fit_seeds can batch


def _cnn(seed, head=None, body="CNN-3 with BatchNorm"):
    torch.manual_seed(seed)
    return models.Classifier(BODIES[body](), 4, head=head).double()


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("body", BATCHED)
@pytest.mark.parametrize("optimizer,kwargs", [("adam", {"weight_decay": 1e-3}),
                                              ("sgd", {"momentum": 0.9, "weight_decay": 5e-4, "lr": 0.05})])
def test_fit_seeds_ends_where_fit_ends_seed_by_seed(optimizer, kwargs, body):
    data, seeds = _data(), [3, 7, 11]
    together = [_cnn(s, body=body) for s in seeds]
    alone = [_cnn(s, body=body) for s in seeds]
    schedule = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)  # noqa: E731
    settings = dict(epochs=2, batch_size=40, optimizer=optimizer, scheduler=schedule, device="cpu", **kwargs)
    with warnings.catch_warnings():  # every operation has a batching rule: no slow per-seed fallback
        warnings.simplefilter("error", UserWarning)
        histories = fit_seeds(together, data, seeds=seeds, **settings)
    for model, twin, seed, history in zip(together, alone, seeds, histories):
        expected = fit(twin, data, seed=seed, progress=False, **settings)
        assert history.steps == pytest.approx(expected.steps, rel=1e-10)  # 3 batches (40, 40, 16) x 2 epochs
        for key in ("train_loss", "train_acc"):
            assert history[key] == pytest.approx(expected[key], rel=1e-10)
        got, want = _state(model), _state(twin)
        assert got.keys() == want.keys()
        for name in want:  # weights (k, p, q included), and BatchNorm's running statistics and batch counts
            # atol: a conv bias before BatchNorm has no gradient but rounding, and Adam scales that to whole steps
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-9, msg=name)
    assert not torch.equal(_state(together[0])["head.weight"], _state(together[1])["head.weight"])


def test_each_seed_is_validated_after_each_epoch_as_fit_validates_it():
    data, held_out, seeds = _data(), _data(n=24, seed=5), [3, 7]
    together, alone = [_cnn(s) for s in seeds], [_cnn(s) for s in seeds]
    settings = dict(epochs=2, batch_size=40, optimizer="adam", device="cpu", val_data=held_out)
    histories = fit_seeds(together, data, seeds=seeds, **settings)
    for twin, seed, history in zip(alone, seeds, histories):
        expected = fit(twin, data, seed=seed, progress=False, **settings)
        assert [list(e) for e in history.epochs] == [list(e) for e in expected.epochs]  # the same keys, in order
        for key in ("val_loss", "val_acc"):
            assert history[key] == pytest.approx(expected[key], rel=1e-9)
    assert histories[0]["val_loss"] != histories[1]["val_loss"]


def test_trackers_see_each_seed_as_fit_shows_it():
    """A tracker of each model's weights, of its held-out accuracy (an evaluation in the middle of training,
    BatchNorm included) and of the step's loss records what it records under fit, at the same steps."""
    data, held_out, seeds = _data(), _data(n=32, seed=5), [3, 7]

    def trackers(model):
        return [Tracker(lambda state: float(sum(p.detach().norm() for p in state.model.parameters())), 2),
                Tracker(lambda state, m=model: evaluate(m, held_out, device="cpu")["loss"], 3, include_first=False),
                Tracker(lambda state: state.loss, 4)]

    together, alone = [_cnn(s) for s in seeds], [_cnn(s) for s in seeds]
    settings = dict(epochs=2, batch_size=40, optimizer="adam", device="cpu")
    calls = [trackers(m) for m in together]
    fit_seeds(together, data, seeds=seeds, callbacks=calls, **settings)
    for model, twin, seed, mine in zip(together, alone, seeds, calls):
        theirs = trackers(twin)
        fit(twin, data, seed=seed, progress=False, callbacks=theirs, **settings)
        for a, b in zip(mine, theirs):
            assert a.steps == b.steps and a.steps  # 6 steps: 1, 2, 4, 6 / 3, 6 / 1, 4
            assert a.values == pytest.approx(b.values, rel=1e-9)
        for name, value in _state(twin).items():
            torch.testing.assert_close(_state(model)[name], value, rtol=1e-9, atol=1e-9, msg=name)


REGULARIZERS = {
    "orthonormality": lambda net: Orthonormality(net, beta=1e-2),
    "orthogonality": lambda net: Orthogonality(net, beta=1e-2),
    "convolutional similarity": lambda net: ConvSimilarity(net, beta=1e-2),
    "MHE, half-space": lambda net: MHE(net, s=2.0, half_space=True, beta_hidden=1e-2, beta_output=1e-2),
    **{f"CoMHE, {variant}": partial(lambda net, variant: CoMHE(net, variant, beta_hidden=1e-2, beta_output=1e-2,
                                                                seed=4), variant=variant)
       for variant in ("random", "random_max", "group", "bilateral")},
}


@pytest.mark.parametrize("name", REGULARIZERS)
def test_a_regularizer_bound_to_the_first_model_regularizes_each_seed_as_fit_does(name):
    data, seeds = _data(), [3, 7]
    together, alone = [_cnn(s) for s in seeds], [_cnn(s) for s in seeds]
    settings = dict(epochs=2, batch_size=40, optimizer="sgd", lr=0.05, device="cpu")
    with warnings.catch_warnings():  # every operation of the penalty has a batching rule
        warnings.simplefilter("error", UserWarning)
        histories = fit_seeds(together, data, seeds=seeds, regularizer=REGULARIZERS[name](together[0]), **settings)
    for model, twin, seed, history in zip(together, alone, seeds, histories):
        expected = fit(twin, data, seed=seed, progress=False, regularizer=REGULARIZERS[name](twin), **settings)
        assert history["reg"] == pytest.approx(expected["reg"], rel=1e-9) and history["reg"][0] > 0
        assert history.steps == pytest.approx(expected.steps, rel=1e-9)
        for key, value in _state(twin).items():
            torch.testing.assert_close(_state(model)[key], value, rtol=1e-9, atol=1e-9, msg=lambda m: key + m)
    with pytest.raises(ValueError, match="bound to models\\[0\\]"):
        fit_seeds(together, data, seeds=seeds, regularizer=REGULARIZERS[name](together[1]), **settings)


@pytest.mark.parametrize("variant", ["random", "random_max", "angle", "adversarial", "group", "bilateral"])
def test_each_seed_can_have_its_own_regularizer(variant, monkeypatch):
    """One CoMHE per model, its projections seeded by the run and (angle, adversarial) fitted to its own weights at
    every step, all evaluated in the batched step: each seed ends where fit ends it with that regulariser."""
    monkeypatch.setattr(multiseed, "_seed_penalties", lambda *args: pytest.fail("evaluated one seed after another"))
    data, seeds = _data(), [3, 7]
    together, alone = [_cnn(s) for s in seeds], [_cnn(s) for s in seeds]
    settings = dict(epochs=2, batch_size=40, optimizer="sgd", lr=0.05, device="cpu")

    def comhe(net, seed):
        return CoMHE(net, variant, num_proj=2, beta_hidden=1e-2, beta_output=1e-2, seed=seed)

    histories = fit_seeds(together, data, seeds=seeds, regularizer=[comhe(m, s) for m, s in zip(together, seeds)],
                          **settings)
    for model, twin, seed, history in zip(together, alone, seeds, histories):
        expected = fit(twin, data, seed=seed, progress=False, regularizer=comhe(twin, seed), **settings)
        assert history["reg"] == pytest.approx(expected["reg"], rel=1e-9) and history["reg"][0] > 0
        for key, value in _state(twin).items():
            torch.testing.assert_close(_state(model)[key], value, rtol=1e-9, atol=1e-9, msg=lambda m: key + m)
    if variant in ("angle", "adversarial"):  # one regulariser for every seed: its P would follow the first seed's
        with pytest.raises(ValueError, match="before_step reads the weights"):
            fit_seeds(together, data, seeds=seeds, regularizer=comhe(together[0], 0), **settings)
    with pytest.raises(ValueError, match="regularizer 1 is not bound to models\\[1\\]"):
        fit_seeds(together, data, seeds=seeds, regularizer=[comhe(together[0], 0)] * 2, **settings)
    with pytest.raises(ValueError, match="one per model"):
        fit_seeds(together, data, seeds=seeds, regularizer=[comhe(together[0], 0)], **settings)


def test_one_regularizer_per_seed_is_batched_only_when_they_differ_in_seed_state_alone():
    """One regulariser per seed is evaluated as the first one with each seed's weights and state (one batched call)
    when each may be (its class declares batches_seeds) and their settings are equal; otherwise one after another,
    which ends where fit ends too."""
    from sphereml.multiseed import _alike, batches_seeds

    nets, seeds = [_cnn(s) for s in (3, 7)], [3, 7]

    def comhe(net, seed, **settings):
        return CoMHE(net, seed=seed, **{"num_proj": 2, "beta_hidden": 1e-2, "beta_output": 1e-2, **settings})

    class Stateful(MHE):  # a subclass may add state: it does not inherit its parent's declaration
        pass

    assert _alike([comhe(net, seed) for net, seed in zip(nets, seeds)], nets)  # their seeds make their states
    first, second = comhe(nets[0], 3), comhe(nets[1], 7)
    second.calls = 5  # a counter of before_step, which the penalty does not read
    assert _alike([first, second], nets) and _alike([MHE(net, half_space=True) for net in nets], nets)
    for unlike in ([comhe(nets[0], 3), comhe(nets[1], 7, num_proj=3)], [comhe(nets[0], 3), MHE(nets[1])],
                   [Orthonormality(nets[0]), Orthonormality(nets[1], beta=1.0)],
                   [ConvSimilarity(nets[0], normalized=np.False_), ConvSimilarity(nets[1], normalized=np.True_)],
                   [Stateful(net) for net in nets], [MHE(net, backend="dense") for net in nets]):
        assert not _alike(unlike, nets)
    assert not batches_seeds(Stateful(nets[0])) and not batches_seeds(MHE(nets[0], backend="dense"))
    data, alone = _data(), [_cnn(s) for s in seeds]
    settings = dict(epochs=1, batch_size=40, optimizer="sgd", lr=0.05, device="cpu")
    with pytest.raises(ValueError, match="does not declare batches_seeds"):  # an energy without a batching rule
        fit_seeds(nets, data, seeds=seeds, regularizer=MHE(nets[0], backend="dense"), **settings)
    unlike = {"betas": lambda net, seed, i: comhe(net, seed, beta_hidden=[1e-2, 3e-2][i]),
              "a backend": lambda net, seed, i: MHE(net, backend="dense", beta_hidden=1e-2, beta_output=1e-2)}
    for why, make in unlike.items():
        together, alone = [_cnn(s) for s in seeds], [_cnn(s) for s in seeds]
        fit_seeds(together, data, seeds=seeds, regularizer=[make(net, seed, i) for i, (net, seed) in
                                                            enumerate(zip(together, seeds))], **settings)
        for i, (model, twin, seed) in enumerate(zip(together, alone, seeds)):
            fit(twin, data, seed=seed, progress=False, regularizer=make(twin, seed, i), **settings)
            for key, value in _state(twin).items():
                torch.testing.assert_close(_state(model)[key], value, rtol=1e-9, atol=1e-9, msg=f"{why}: {key}")


@pytest.mark.parametrize("method", ["gs", "householder", "lowdin", "cayley", "or"])
def test_opt_layers_train_their_seeds_together(method):
    """OPT's parametrised layers (chapter 9; Gram-Schmidt rotations of fixed neurons: chapter 7's rotation baseline)
    under fit_seeds, with their element-wise SGD and, for "or", each seed's own relaxation penalty: the
    orthogonalisers are batched like any other operation."""
    def rotated(seed):
        net, generator = _cnn(seed), torch.Generator().manual_seed(seed)
        for layer in select_layers(net, include_output=False):
            opt.orthogonal_overparameterize(layer, method, generator=generator, raw_std=layer.weight[0].numel() ** -0.5)
            if method == "or":  # off the orthogonal start, where the unsquared norm's gradient is the direction of
                raw = opt.rotation_module(layer).raw  # rounding noise, which a batched product rounds differently
                raw.data.add_(torch.randn(raw.shape, generator=generator, dtype=raw.dtype), alpha=1e-3)
        return net

    data, seeds = _data(), [3, 7]
    together, alone = [rotated(s) for s in seeds], [rotated(s) for s in seeds]
    parts = [opt.training_parts(net, lr=0.1, weight_decay=1e-3) for net in together]  # SGD, as a partial
    assert elementwise_optimizer(parts[0][0]) and (parts[0][1] is not None) == (method == "or")
    regularizers = [relaxation for _, relaxation in parts] if method == "or" else None
    fit_seeds(together, data, seeds=seeds, epochs=1, batch_size=40, optimizer=parts[0][0], regularizer=regularizers,
              device="cpu")
    for model, twin, seed in zip(together, alone, seeds):
        make_optimizer, relaxation = opt.training_parts(twin, lr=0.1, weight_decay=1e-3)
        fit(twin, data, seed=seed, epochs=1, batch_size=40, optimizer=make_optimizer, regularizer=relaxation,
            device="cpu", progress=False)
        for key, value in _state(twin).items():
            torch.testing.assert_close(_state(model)[key], value, rtol=1e-9, atol=1e-9, msg=lambda m: key + m)


def test_what_the_stacked_step_would_silently_drop_is_refused_by_name():
    data, seeds = _data(n=16), [0, 1]
    nets = [_cnn(s, body="decoupled TanhConv x sigmoid, radius norm") for s in seeds]
    with training_aids(nets, "weighted"):  # gradient hooks on each model's own weights
        with pytest.raises(ValueError, match="gradient hook"):
            fit_seeds(nets, data, seeds=seeds, epochs=1, device="cpu")
    with pytest.raises(ValueError, match="names no layers"):  # a bare function: which tensors would it read?
        fit_seeds(nets, data, seeds=seeds, epochs=1, device="cpu", regularizer=lambda: nets[0].head.weight.sum())
    with pytest.raises(ValueError, match="a gradient taken inside the loss"):
        fit_seeds(nets, data, seeds=seeds, epochs=1, device="cpu", loss_fn=adversarial_loss(0.1))


def test_can_train_together_says_when_fit_seeds_trains_as_fit_would():
    nets = [_cnn(0), _cnn(1)]
    sgd = partial(torch.optim.SGD, lr=0.1)
    assert can_train_together(nets, ["sgd", "sgd"], settings={"epochs": 2, "lr": 0.1, "checkpoint": None})
    assert can_train_together(nets, [sgd, partial(torch.optim.SGD, lr=0.1)], regularizers=[MHE(nets[0]), None],
                              callbacks=[[WeightProjection()], [WeightProjection()]])
    refused = {"one model": dict(models=nets[:1]), "a checkpoint": dict(settings={"checkpoint": "run.pt"}),
               "compile": dict(settings={"compile": True}), "two optimisers": dict(optimizers=["sgd", "adam"]),
               "a function as optimiser": dict(optimizers=[lambda params: torch.optim.SGD(params, lr=0.1)] * 2),
               "a bare function as regulariser": dict(regularizers=[lambda: nets[0].head.weight.sum()]),
               "callbacks only fit runs": dict(callbacks=[[lambda step, model: None]] * 2),
               "adversarial training": dict(settings={"loss_fn": adversarial_loss(0.1)})}
    for why, changed in refused.items():
        arguments = {"models": nets, "optimizers": ["sgd", "sgd"], **changed}
        assert not can_train_together(**arguments), why
    decoupled = [_cnn(s, body="decoupled TanhConv x sigmoid, radius norm") for s in (0, 1)]
    assert can_train_together(decoupled, ["sgd", "sgd"])
    with training_aids(decoupled, "weighted"):  # gradient hooks on each model's own weights
        assert not can_train_together(decoupled, ["sgd", "sgd"])


def test_only_element_wise_optimizers_are_taken():
    adam = partial(torch.optim.Adam, lr=1e-2, weight_decay=1e-4)
    assert elementwise_optimizer("sgd") and elementwise_optimizer(adam)
    for other in ("rmsprop", lambda params: torch.optim.SGD(params, lr=0.1), partial(torch.optim.LBFGS, lr=1.0),
                  partial(torch.optim.SGD, [], lr=0.1)):  # may mix elements, or build its groups elsewhere
        assert not elementwise_optimizer(other)
        with pytest.raises(ValueError, match="element-wise"):
            fit_seeds([_cnn(0), _cnn(1)], _data(n=16), seeds=[0, 1], epochs=1, optimizer=other, device="cpu")


def test_weight_projection_acts_on_the_stack_as_fit_calls_it():
    """Decoupled networks trained with weight projection (every second step), the released code's bias-corrected
    average of their running norms (chapter 4) and a tracker of the kernel norms after them end where fit ends them
    seed by seed; the projection is one operation per layer for all seeds."""
    data, seeds = _data(), [3, 7, 11]
    body = "decoupled TanhConv x sigmoid, radius norm"
    together, alone = [_cnn(s, body=body) for s in seeds], [_cnn(s, body=body) for s in seeds]
    assert has_running_stats(together[0])  # each layer's E{||x||}

    def callbacks(model):
        return [WeightProjection(2), BiasCorrectedAverage(model, decay=0.9),
                Tracker(lambda state, m=model: mean_kernel_norm(m), 1)]

    settings = dict(epochs=2, batch_size=40, optimizer="sgd", lr=0.5, device="cpu")
    calls = [callbacks(m) for m in together]
    fit_seeds(together, data, seeds=seeds, callbacks=calls, **settings)
    for model, twin, seed, mine in zip(together, alone, seeds, calls):
        theirs = callbacks(twin)
        fit(twin, data, seed=seed, progress=False, callbacks=theirs, **settings)
        assert mine[2].values == pytest.approx(theirs[2].values, rel=1e-9)
        assert mine[2].values[1] == pytest.approx(1.0) and mine[2].values[2] != pytest.approx(1.0)  # steps 2 and 3
        for name, value in _state(twin).items():
            torch.testing.assert_close(_state(model)[name], value, rtol=1e-9, atol=1e-9, msg=name)
    params, _ = stack_state(together)
    ops = launches.count_ops(lambda: WeightProjection().stacked(1, together[0], params))
    assert ops.total == launches.count_ops(lambda: project_weights(alone[0])).total  # three seeds as one model


@pytest.mark.parametrize("calls,why", [
    ([[print], []], "a plain function"),
    ([[WeightProjection(2)], [WeightProjection(3)]], "projections that differ between models"),
    ([[Tracker(float, 1), WeightProjection()], [Tracker(float, 1), WeightProjection()]], "a projection after a "
     "tracker (fit would call it second)"),
])
def test_callbacks_fit_seeds_cannot_run_as_fit_does_are_refused(calls, why):
    nets, data = [_cnn(0), _cnn(1)], _data(n=16)
    assert stacked_callbacks(calls) is None, why
    with pytest.raises(ValueError, match="fit_seeds takes Tracker callbacks, and callbacks with a stacked"):
        fit_seeds(nets, data, seeds=[0, 1], epochs=1, callbacks=calls, device="cpu")
    with pytest.raises(ValueError, match="one list per model"):
        fit_seeds(nets, data, seeds=[0, 1], epochs=1, callbacks=[[]], device="cpu")


def test_fit_seeds_takes_a_margin_head_and_a_custom_loss():
    data, seeds = _data(seed=1), [0, 1]
    heads = [ArcFaceLoss(6, 4, s=8.0, m=0.3).double() for _ in seeds]
    together = [_cnn(s, heads[i]) for i, s in enumerate(seeds)]
    alone = [_cnn(s, ArcFaceLoss(6, 4, s=8.0, m=0.3).double()) for s in seeds]
    for model, twin in zip(together, alone):
        twin.load_state_dict(model.state_dict())
    with warnings.catch_warnings():  # the head's hand-written backward has batching rules too
        warnings.simplefilter("error", UserWarning)
        fit_seeds(together, data, seeds=seeds, epochs=1, batch_size=32, device="cpu")
    for model, twin, seed in zip(together, alone, seeds):
        fit(twin, data, seed=seed, epochs=1, batch_size=32, device="cpu", progress=False)
        # atol: a conv bias before BatchNorm has no gradient but rounding, and Adam scales that to whole steps
        torch.testing.assert_close(_state(model), _state(twin), rtol=1e-9, atol=1e-9)

    def feature_loss(model, x, y):  # a loss without logits: no accuracy is recorded
        return model.backbone(x).pow(2).mean(), None

    histories = fit_seeds(together, data, seeds=seeds, epochs=1, batch_size=32, device="cpu", loss_fn=feature_loss)
    assert histories[0]["train_acc"] == [None] and histories[0]["train_loss"][0] > 0


@pytest.mark.parametrize("regularizer", [None, "HS-MHE", "RP-CoMHE, one per seed"])
def test_a_step_launches_as_many_operations_for_four_seeds_as_for_two(regularizer):
    data = _data(n=32)

    def bind(nets):  # what fit_seeds takes for these models: one regulariser bound to the first, or one per model
        if regularizer == "HS-MHE":
            return MHE(nets[0], half_space=True, beta_hidden=1e-2, beta_output=1e-2)
        if regularizer:
            return [CoMHE(net, num_proj=2, beta_hidden=1e-2, beta_output=1e-2, seed=i) for i, net in enumerate(nets)]
        return None

    def one_epoch(n_seeds):  # an epoch of one step: two epochs' operations minus one's (stacking the state apart)
        nets = [_cnn(s) for s in range(n_seeds)]
        return [launches.count_ops(lambda: fit_seeds(nets, data, seeds=list(range(n_seeds)), epochs=epochs,
                                                     batch_size=32, device="cpu", regularizer=bind(nets))).total
                for epochs in (2, 1)]

    two, four = (two_epochs - one_epoch_ for two_epochs, one_epoch_ in (one_epoch(2), one_epoch(4)))
    net = _cnn(0)
    bound = bind([net])
    alone = [launches.count_ops(lambda: fit(net, data, seed=0, epochs=epochs, batch_size=32, device="cpu",
                                            progress=False, regularizer=bound[0] if isinstance(bound, list) else bound
                                            )).total
             for epochs in (2, 1)]
    alone = alone[0] - alone[1]
    # per extra seed only its data order is drawn and its batch cut (randperm and one index per tensor) and, for
    # one regulariser per seed, its before_step run on its weights (CoMHE's draw): no operation of the network, its
    # loss, the penalty or the optimiser is repeated (one seed alone takes a few views fewer)
    per_seed = 3
    if regularizer == "RP-CoMHE, one per seed":
        from sphereml.multiseed import _before_steps
        nets = [_cnn(0)]
        reg, params = bind(nets), stack_state(nets)[0]
        _before_steps(reg, nets, params)
        per_seed += launches.count_ops(lambda: _before_steps(reg, nets, params)).total
    assert four - two == 2 * per_seed, (two, four, per_seed)
    # vmap's batching rules add some (batched products for the linear layers, the loss's gather and scatter): four
    # seeds' step takes 1.5 times one seed's operations (309 against 203 in torch 2.13; with one CoMHE per seed
    # 569 against 456), not four times
    assert four < 1.6 * alone, (four, alone)


def test_the_stacked_step_reads_nothing_on_the_host():
    data, nets = _data(n=64), [_cnn(s) for s in (0, 1)]
    fit_seeds(nets, data, seeds=[0, 1], epochs=1, batch_size=32, device="cpu")  # the epoch's end reads the losses
    from sphereml.multiseed import _before_steps, _Objective, _stacked_step
    from sphereml.train import default_loss

    params, buffers = stack_state(nets)
    step = _stacked_step(_Objective(nets[0], default_loss, MHE(nets[0], beta_hidden=1e-2, beta_output=1e-2)), [])
    x = torch.stack([data.tensors[0][:16]] * 2)
    y = torch.stack([data.tensors[1][:16]] * 2)
    with launches.no_host_sync():
        loss, logits, penalty = step(params, buffers, x, y, [])
        (loss + penalty).sum().backward()
    assert loss.shape == (2,) and logits.shape == (2, 16, 4)
    regularizers = [CoMHE(net, num_proj=2, seed=seed) for seed, net in enumerate(nets)]  # one per seed: its state
    step = _stacked_step(_Objective(nets[0], default_loss, regularizers[0]), [])
    with launches.no_host_sync():
        _before_steps(regularizers, nets, params)
        seed_state = [torch.stack(parts) for parts in zip(*(reg.seed_state() for reg in regularizers))]
        loss, logits, penalty = step(params, buffers, x, y, seed_state)
        (loss + penalty).sum().backward()
    assert penalty.shape == (2,) and penalty[0] != penalty[1]


def test_stack_and_unstack_round_trip_and_refuse_other_architectures():
    nets = [_cnn(s) for s in (0, 1)]
    params, buffers = stack_state(nets)
    assert params["head.weight"].shape == (2, 4, 6) and params["head.weight"].requires_grad
    assert buffers["backbone.body.1.running_var"].shape[0] == 2
    copies = [_cnn(5), _cnn(6)]
    unstack_state(copies, params, buffers)
    for net, copy in zip(nets, copies):
        torch.testing.assert_close(_state(net), _state(copy), rtol=0, atol=0)
    wider = models.Classifier(models.plain_cnn(3, widths=(3, 4, 6), in_channels=1, image_size=8, feature_dim=6), 4)
    with pytest.raises(ValueError, match="model 1 is not the architecture of model 0"):
        stack_state([nets[0], wider.double()])
    with pytest.raises(ValueError, match="model 1 is not the architecture"):
        stack_state([nets[0], nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="at least one model"):
        stack_state([])


def test_an_annealed_margin_head_keeps_its_schedule_in_every_seed():
    """A-Softmax's lambda follows a step counter kept on the host beside its buffer; only the first model's forward
    runs, so the others' host copies must follow their buffers when the state is written back."""
    data, seeds = _data(seed=2), [0, 1]

    def net(seed):
        return _cnn(seed, ASoftmaxLoss(6, 4, m=4, lambda_=LambdaSchedule(base=100.0, gamma=0.5)).double())

    together, alone = [net(s) for s in seeds], [net(s) for s in seeds]
    for model, twin in zip(together, alone):  # the head is drawn before _cnn seeds the generator
        twin.load_state_dict(model.state_dict())
    fit_seeds(together, data, seeds=seeds, epochs=2, batch_size=32, optimizer="sgd", lr=0.05, device="cpu")
    for model, twin, seed in zip(together, alone, seeds):
        fit(twin, data, seed=seed, epochs=2, batch_size=32, optimizer="sgd", lr=0.05, device="cpu", progress=False)
        assert model.head.schedule._step == twin.head.schedule._step == 6  # 3 batches x 2 epochs
        assert model.head.schedule.value() == twin.head.schedule.value()
        torch.testing.assert_close(evaluate(model, data, device="cpu")["loss"],
                                   evaluate(twin, data, device="cpu")["loss"], rtol=1e-9, atol=0)


def test_no_epoch_changes_nothing_and_other_configurations_are_refused():
    nets = [_cnn(0), _cnn(1)]
    before = [_state(n) for n in nets]
    assert [h.epochs for h in fit_seeds(nets, _data(n=16), seeds=[0, 1], epochs=0, device="cpu")] == [[], []]
    for net, state in zip(nets, before):
        torch.testing.assert_close(_state(net), state, rtol=0, atol=0)
    heads = [_cnn(s, ArcFaceLoss(6, 4, s=8.0, m=m).double()) for s, m in ((0, 0.3), (1, 0.5))]
    with pytest.raises(ValueError, match="type, configuration"):  # same shapes, another margin
        fit_seeds(heads, _data(n=16), seeds=[0, 1], epochs=1, device="cpu")
    single = _cnn(2).float()
    with pytest.raises(ValueError, match="dtypes"):
        fit_seeds([nets[0], single], _data(n=16), seeds=[0, 1], epochs=1, device="cpu")


class _OldStyleSquare(torch.autograd.Function):
    """A hand-written backward in the form torch.func cannot batch (forward takes ctx)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        return 2 * ctx.saved_tensors[0] * grad


class _Squared(nn.Module):
    def forward(self, x):
        return _OldStyleSquare.apply(x)


def test_a_layer_without_a_batching_rule_is_refused_by_name():
    nets = [_cnn(s) for s in (0, 1)]
    for net in nets:
        net.backbone = nn.Sequential(_Squared(), net.backbone)
    with pytest.raises(ValueError, match="hand-written backward without a vmap rule"):
        fit_seeds(nets, _data(n=16), seeds=[0, 1], epochs=1, device="cpu")


def test_bad_arguments_are_named():
    nets, data = [_cnn(0), _cnn(1)], _data(n=16)
    with pytest.raises(ValueError, match="one seed per model"):
        fit_seeds(nets, data, seeds=[0], epochs=1, device="cpu")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        fit_seeds(nets, data, seeds=[0, 1], epochs=1, optimizer="lbfgs", device="cpu")
    with pytest.raises(ValueError, match="seed"):
        fit_seeds(nets, data, seeds=[0, -1], epochs=1, device="cpu")
    with pytest.raises(ValueError, match="batch_size"):
        fit_seeds(nets, data, seeds=[0, 1], epochs=1, batch_size=0, device="cpu")
    with pytest.raises(ValueError, match="lr"):
        fit_seeds(nets, data, seeds=[0, 1], epochs=1, lr=0.0, device="cpu")


@pytest.mark.needs_cuda
@pytest.mark.parametrize("body,extra", [("CNN-3 with BatchNorm", None), ("SphereNet-3, sigmoid with learned k", None),
                                        ("SCS, learned p and q", None), ("CNN-3 with BatchNorm", "HS-MHE"),
                                        ("decoupled TanhConv x sigmoid, radius norm", "projection"),
                                        ("CNN-3 with BatchNorm", "OPT gs"), ("CNN-3 with BatchNorm", "RP-CoMHE")])
def test_fit_seeds_on_cuda_matches_fit_seed_by_seed(body, extra, monkeypatch):
    """float32 on CUDA: batched (grouped) kernels against single ones.  TF32 convolutions off, as in the chapters:
    the two paths pick different cuDNN algorithms, whose TF32 rounding (10-bit mantissa) is not what this tests."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    data, seeds = _data(n=256), [0, 1, 2]
    data32 = TensorDataset(data.tensors[0].float(), data.tensors[1])
    together, alone = [_cnn(s, body=body).float() for s in seeds], [_cnn(s, body=body).float() for s in seeds]
    if extra == "OPT gs":  # the Cholesky form of Gram-Schmidt on a GPU, batched over the seeds
        for net, seed in zip(together + alone, seeds + seeds):
            opt.overparameterize_model(net, "gs", generator=torch.Generator().manual_seed(seed), raw_std="unit")
    settings = dict(epochs=1, batch_size=64, optimizer="sgd", lr=0.01, momentum=0.0, device="cuda")

    def extras(model, seed, stacked=False):  # a regulariser bound to the (first) model, or one list per model
        if extra == "HS-MHE":
            return {"regularizer": MHE(model, half_space=True, beta_hidden=1e-2, beta_output=1e-2)}
        if extra == "RP-CoMHE":  # one per seed, its projections drawn on the GPU from the run's seed
            comhe = partial(CoMHE, num_proj=2, beta_hidden=1e-2, beta_output=1e-2)
            if stacked:
                return {"regularizer": [comhe(net, seed=s) for net, s in zip(together, seeds)]}
            return {"regularizer": comhe(model, seed=seed)}
        if extra == "projection":
            return {"callbacks": [[WeightProjection()] for _ in seeds] if stacked else [WeightProjection()]}
        return {}

    # SGD: Adam would turn rounding-only gradients into steps
    fit_seeds(together, data32, seeds=seeds, **extras(together[0], None, stacked=True), **settings)
    for model, twin, seed in zip(together, alone, seeds):
        fit(twin, data32, seed=seed, progress=False, **extras(twin, seed), **settings)
        for name, value in _state(twin).items():
            torch.testing.assert_close(_state(model)[name], value, rtol=1e-3, atol=1e-4,
                                       msg=lambda text, name=name: f"seed {seed}, {name}: {text}")
