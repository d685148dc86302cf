import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from sphereml.data import sphere_clusters, split_dataset
from sphereml.models import MLP, Classifier
from sphereml.train import (History, Tracker, batches, evaluate, fit, num_steps, on_device, resolve_device,
                            seed_everything)


def make(seed=0, dropout=True):
    seed_everything(seed)
    backbone = MLP(6, 4, hidden=(16,))
    if dropout:  # exercises the torch RNG during training, which resume must restore
        backbone.net.insert(2, nn.Dropout(0.2))
    return Classifier(backbone, num_classes=3)


@pytest.fixture(scope="module")
def toy():
    return split_dataset(sphere_clusters(3, 60, 6, concentration=3.0, seed=0), 0.25, seed=0)


def test_history_says_whether_training_diverged(toy):
    """A learning rate of 1e30 sends the loss to inf or nan: the history says so; a sane one does not diverge."""
    train, _ = toy
    histories = [fit(make(), train, epochs=2, lr=lr, optimizer="sgd", batch_size=32, device="cpu", progress=False)
                 for lr in (1e-2, 1e30)]
    assert [h.diverged for h in histories] == [False, True]
    assert not math.isfinite(histories[1]["train_loss"][-1]) and not History().diverged


def test_fit_learns_and_records_history(toy):
    train, val = toy
    model = make()
    hist = fit(model, train, epochs=15, lr=1e-2, batch_size=32, val_data=val, device="cpu", progress=False)
    assert len(hist.epochs) == 15 and hist["epoch"] == list(range(1, 16))
    assert hist["train_loss"][-1] < hist["train_loss"][0]
    assert hist["val_acc"][-1] > 0.8
    assert len(hist.steps) == 15 * 5  # 135 examples / batch 32 -> 5 steps per epoch
    assert evaluate(model, val, device="cpu")["accuracy"] == pytest.approx(hist["val_acc"][-1])


def test_same_seed_repeats_exactly_and_other_seed_differs(toy):
    train, _ = toy
    runs = []
    for seed in (0, 0, 1):
        model = make(seed)
        fit(model, train, epochs=3, batch_size=16, device="cpu", seed=seed, progress=False)
        runs.append(torch.cat([p.flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_resume_continues_where_it_stopped(toy, tmp_path, optimizer):
    train, _ = toy
    kwargs = dict(batch_size=16, device="cpu", optimizer=optimizer, lr=0.05, progress=False,
                  scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    straight = make()
    h_straight = fit(straight, train, epochs=5, checkpoint=tmp_path / "a.pt", **kwargs)

    interrupted = make()
    fit(interrupted, train, epochs=2, checkpoint=tmp_path / "b.pt", **kwargs)  # "killed" after 2 epochs
    resumed = make()  # a fresh process would rebuild the model from scratch
    h_resumed = fit(resumed, train, epochs=5, checkpoint=tmp_path / "b.pt", **kwargs)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert h_resumed.steps == h_straight.steps
    assert h_resumed["train_loss"] == h_straight["train_loss"]


def test_checkpoint_from_a_different_run_is_refused(toy, tmp_path):
    train, _ = toy
    fit(make(), train, epochs=1, checkpoint=tmp_path / "c.pt", device="cpu", progress=False)
    with pytest.raises(ValueError, match="different run"):
        fit(make(), train, epochs=2, lr=0.5, checkpoint=tmp_path / "c.pt", device="cpu", progress=False)


def test_regularizer_and_callbacks_are_applied(toy):
    train, _ = toy
    seen = []
    model = make(dropout=False)
    strong = lambda: 10.0 * sum((p ** 2).sum() for p in model.parameters())  # noqa: E731  bound to model
    tracker, later = Tracker(lambda state: state.loss, every=4), Tracker(lambda state: state.step, 5, False)
    hist = fit(model, train, epochs=3, lr=1e-2, regularizer=strong,
               callbacks=[lambda s: seen.append(s.step), tracker, later], device="cpu", progress=False)
    assert later.steps == later.values == list(range(5, len(seen) + 1, 5))
    started = Tracker(lambda state: state.step, 5, False, start=-1.0)  # a value from before training: step 0
    fit(make(dropout=False), train, epochs=1, lr=1e-2, callbacks=[started], device="cpu", progress=False)
    assert started.points[0] == (0, -1.0) and started.steps[1:] == list(range(5, num_steps(train, 1, 128) + 1, 5))
    assert seen == list(range(1, len(hist.steps) + 1)) and len(seen) == num_steps(train, 3, 128)
    assert tracker.steps == [1] + list(range(4, len(seen) + 1, 4))
    assert tracker.values == [hist.steps[i - 1] for i in tracker.steps]
    assert all(r > 0 for r in hist["reg"])
    plain = make(dropout=False)
    fit(plain, train, epochs=3, lr=1e-2, device="cpu", progress=False)
    norm = lambda m: sum(float(p.detach().norm()) for p in m.parameters())  # noqa: E731
    assert norm(model) < norm(plain)  # the penalty shrank the weights


def test_device_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            resolve_device("cuda")


def test_bad_arguments(toy):
    train, _ = toy
    with pytest.raises(ValueError, match="epochs must be an integer >= 0"):
        fit(make(), train, epochs=-1)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        fit(make(), train, epochs=1, batch_size=0)
    with pytest.raises(ValueError, match="optimizer must be"):
        fit(make(), train, epochs=1, optimizer="lbfgs", device="cpu")
    with pytest.raises(ValueError, match="seed must be an integer"):
        seed_everything(-3)
    with pytest.raises(ValueError, match="seed must be an integer"):
        seed_everything(True)
    with pytest.raises(ValueError, match="epochs must be an integer >= 0"):
        fit(make(), train, epochs=True)
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        fit(make(), train, epochs=1, lr=0.0)
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        Tracker(lambda s: 0.0, every=0)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        num_steps(100, 1, batch_size=True)


def test_num_steps_counts_batches():
    assert num_steps(135, 15, 32) == 75 and num_steps(128, 1, 128) == 1 and num_steps(0, 3) == 0


@pytest.mark.needs_cuda
def test_fit_on_cuda_matches_evaluate(toy):
    train, val = toy
    model = make(dropout=False)
    hist = fit(model, train, epochs=2, device="cuda", val_data=val, progress=False)
    assert next(model.parameters()).is_cuda
    assert evaluate(model, val, device="cuda")["accuracy"] == pytest.approx(hist["val_acc"][-1])


@pytest.mark.needs_cuda
def test_resume_on_cuda(toy, tmp_path):
    train, _ = toy
    kwargs = dict(batch_size=16, device="cuda", progress=False)
    straight = make()
    fit(straight, train, epochs=3, checkpoint=tmp_path / "a.pt", **kwargs)
    fit(make(), train, epochs=1, checkpoint=tmp_path / "b.pt", **kwargs)
    resumed = make()
    fit(resumed, train, epochs=3, checkpoint=tmp_path / "b.pt", **kwargs)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


@pytest.mark.needs_cuda
def test_augmented_cifar_batches_are_cut_on_the_gpu_from_one_copy():
    from sphereml.data import RandomCropFlip
    from sphereml.launches import no_host_sync

    aug = RandomCropFlip(TensorDataset(torch.rand(40, 3, 8, 8), torch.arange(40) % 10), padding=2)
    on_gpu = on_device(aug, "cuda")
    assert on_gpu.images.is_cuda and on_device(aug, "cuda:0") is on_gpu  # moved once, then reused
    epoch = batches(on_gpu, 16, True, torch.Generator().manual_seed(3))
    with no_host_sync():
        cut = [(x, y) for x, y in epoch]
    assert all(x.is_cuda and y.is_cuda for x, y in cut)
    on_cpu = list(batches(aug, 16, True, torch.Generator().manual_seed(3)))  # the same epoch, drawn on the CPU
    assert all(torch.equal(x.cpu(), a) and torch.equal(y.cpu(), b) for (x, y), (a, b) in zip(cut, on_cpu))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10))
    fit(model, aug, epochs=1, batch_size=16, device="cuda", progress=False)  # fit trains from the GPU copy


def test_resume_continues_the_regularizers_projections(toy, tmp_path):
    """CoMHE's projections come from its own generator, which the checkpoint carries: a resumed run draws the
    projections the uninterrupted run drew."""
    from sphereml.regularizers.comhe import CoMHE

    train, _ = toy
    kwargs = dict(batch_size=16, device="cpu", optimizer="sgd", lr=0.05, progress=False)
    straight = make(dropout=False)
    fit(straight, train, epochs=3, regularizer=CoMHE(straight, proj_dim=3, num_proj=2, seed=7),
        checkpoint=tmp_path / "a.pt", **kwargs)
    interrupted = make(dropout=False)
    fit(interrupted, train, epochs=1, regularizer=CoMHE(interrupted, proj_dim=3, num_proj=2, seed=7),
        checkpoint=tmp_path / "b.pt", **kwargs)
    resumed = make(dropout=False)
    reg = CoMHE(resumed, proj_dim=3, num_proj=2, seed=7)
    fit(resumed, train, epochs=3, regularizer=reg, checkpoint=tmp_path / "b.pt", **kwargs)
    assert reg.calls == 3 * 9  # 135 examples, batch 16: 9 steps per epoch, counted across the resumption
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.timeout(240)  # inductor builds C++ for the CPU: 89 s of the GPU box's 90-s limit on 2026-12-06
def test_compiled_step_trains_like_the_eager_step(toy):
    """fit(compile=True): the loss and the penalty through torch.compile, the regulariser's state stepped eagerly."""
    from sphereml.regularizers import MHE

    train, _ = toy
    torch._dynamo.reset()
    weights = []
    for compile in (False, True):
        model = make(dropout=False)
        fit(model, train, epochs=1, batch_size=32, device="cpu", optimizer="sgd", lr=0.05, progress=False,
            regularizer=MHE(model, half_space=True), compile=compile)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(weights[1], weights[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="compile must be one of"):
        fit(make(), train, epochs=1, device="cpu", progress=False, compile="fast")


def test_on_device_copies_a_tensor_dataset_once_and_keeps_the_copy():
    from torch.utils.data import TensorDataset

    from sphereml.train import batches, on_device

    data = TensorDataset(torch.randn(10, 3), torch.arange(10))
    assert on_device(data, "cpu") is data  # already there: nothing copied
    moved = on_device(data, "meta")
    assert all(t.device.type == "meta" for t in moved.tensors) and on_device(data, "meta") is moved
    assert on_device(moved, "meta") is moved
    shuffled = list(batches(moved, 4, True, torch.Generator().manual_seed(0)))
    assert [b[0].shape for b in shuffled] == [(4, 3), (4, 3), (2, 3)] and shuffled[0][1].device.type == "meta"
    in_order = [b[1].tolist() for b in batches(data, 4, True, torch.Generator().manual_seed(0))]
    assert sorted(sum(in_order, [])) == list(range(10))  # the same draw on the CPU: a permutation
    plain = [1, 2, 3]
    assert on_device(plain, "meta") is plain  # not a TensorDataset: left to the DataLoader


def test_fit_moves_the_data_once_and_evaluate_reads_the_device_once(toy, monkeypatch):
    from sphereml import launches, train

    train_set, _ = toy
    model = make()
    calls = []
    real = train.on_device
    monkeypatch.setattr(train, "on_device", lambda data, dev: calls.append(len(data)) or real(data, dev))
    fit(model, train_set, epochs=2, batch_size=16, device="cpu", progress=False)
    assert calls == [len(train_set)]  # once per fit, not per epoch or batch
    reads = launches.count_ops(lambda: evaluate(model, train_set, batch_size=8, device="cpu"))
    assert len(train_set) > 3 * 8 and reads.by_op["aten::_local_scalar_dense"] == 2  # loss and accuracy, once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_device_keeps_one_copy_per_gpu():
    from torch.utils.data import TensorDataset

    from sphereml.train import on_device

    data = TensorDataset(torch.randn(10, 3), torch.arange(10))
    moved = on_device(data, "cuda")
    assert on_device(data, "cuda:0") is moved and on_device(moved, "cuda") is moved


def test_a_fit_step_adds_three_operations_to_the_bare_step(toy):
    """Note [a step's bookkeeping]: beyond the step itself (loss, backward, optimiser), ``fit`` cuts the batch (two
    gathers) and keeps the predictions (an argmax); the casts, comparisons and counts happen once per epoch, so the
    difference per step does not depend on the number of steps, and the history is what those counts make."""
    from sphereml import launches
    from sphereml.train import default_loss

    train_set, _ = toy  # 135 examples
    small = TensorDataset(*(t[:64] for t in train_set.tensors))
    per_epoch = {len(data): launches.count_ops(lambda data=data: fit(
        make(dropout=False), data, epochs=1, batch_size=8, optimizer="sgd", device="cpu", progress=False)).total
        for data in (small, TensorDataset(*(t[:128] for t in train_set.tensors)))}
    model = make(dropout=False)
    opt = torch.optim.SGD(model.parameters(), 1e-3, momentum=0.9)
    x, y = small.tensors[0][:8], small.tensors[1][:8]

    def bare_step():
        loss, _ = default_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    bare_step()  # the optimiser's state exists from the first step, as in fit's later steps
    per_step = (per_epoch[128] - per_epoch[64]) / 8
    assert per_step - launches.count_ops(bare_step).total == 3
    history = fit(make(), small, epochs=2, batch_size=8, device="cpu", progress=False)  # 8 steps of 8 an epoch
    assert history["train_loss"][-1] == pytest.approx(sum(history.steps[8:]) / 8, rel=1e-12)
    assert all(isinstance(v, float) for v in history.steps)  # read back as Python floats, from float64
    right = [a * 64 for a in history["train_acc"]]
    assert right == [round(r) for r in right] and 0 < right[-1] <= 64  # whole counts of correct predictions


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_named_optimisers_fuse_their_update_on_cuda_only(toy, name):
    """make_optimizer's fused kernels (one launch per update on CUDA) make the default form's update up to rounding:
    checked with PyTorch's fused CPU kernels over a short fit; on the CPU fit keeps the default form."""
    from functools import partial

    from sphereml.train import make_optimizer

    train_set, _ = toy
    assert make_optimizer(name, make().parameters(), 1e-2, 1e-4, 0.9).defaults["fused"] is None  # the CPU: default
    kind = {"adam": torch.optim.Adam, "sgd": partial(torch.optim.SGD, momentum=0.9)}[name]
    weights = []
    for fused in (None, True):
        model = make(dropout=False)
        fit(model, train_set, epochs=2, batch_size=16, device="cpu", progress=False,
            optimizer=lambda params, fused=fused: kind(params, lr=1e-2, weight_decay=1e-4, fused=fused))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    start = torch.cat([p.detach().flatten() for p in make(dropout=False).parameters()])
    assert torch.allclose(weights[0], weights[1], rtol=1e-5, atol=1e-6)
    assert (weights[0] - start).abs().max() > 1e-2  # the two trained the same, and trained
    if torch.cuda.is_available():
        assert make_optimizer(name, make().cuda().parameters(), 1e-2, 1e-4, 0.9).defaults["fused"] is True


def test_step_records_copy_what_cuda_graphs_would_overwrite_and_count_per_seed():
    """Note [a step's bookkeeping]: with ``copy`` (fit compiled into CUDA graphs) the records own their values; the
    counts are fit's (class dimension 1, any trailing dimensions) and fit_seeds' (one per seed)."""
    from sphereml._step_records import StepRecords

    loss, penalty = torch.tensor(2.0), torch.tensor(0.5, dtype=torch.float64)
    for copy in (False, True):
        records = StepRecords(copy=copy)
        records.add(loss, penalty, None, torch.zeros(3), 3)
        shares = [kept.data_ptr() == made.data_ptr() for kept, made in zip(records.losses + records.penalties,
                                                                           (loss, penalty))]
        assert shares == [not copy, not copy] and records.correct() is None
        assert StepRecords.values(records.losses + [torch.tensor(1.5)]) == [2.0, 1.5]
    records = StepRecords()
    logits = torch.tensor([[[0.0, 1.0], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]]])  # (B=2, C=2, L=2)
    records.add(loss, None, logits, torch.tensor([[1, 1], [0, 0]]), 2)
    records.add(loss, None, logits[:1], torch.tensor([[0, 0]]), 1)  # a smaller last batch
    assert records.correct().item() == 3 + 1
    seeds = StepRecords(seeds=True)
    for _ in range(2):  # (S=2, B=3, C=2)
        seeds.add(loss, None, torch.tensor([[[1.0, 0.0]] * 3, [[0.0, 1.0]] * 3]), torch.tensor([[0, 0, 1]] * 2), 3)
    assert seeds.correct().tolist() == [4, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fit_compiled_into_cuda_graphs_keeps_its_losses(toy):
    """A step replayed from CUDA graphs overwrites its previous loss: fit's records and a callback's loss must be
    copies (Note [a step's bookkeeping])."""
    train, _ = toy
    seen = []
    history = fit(make(dropout=False), train, epochs=2, batch_size=16, device="cuda", progress=False,
                  compile="reduce-overhead", callbacks=[lambda state: seen.append(state.loss_tensor)])
    assert len(history.steps) == len(seen) >= 6 and all(math.isfinite(v) for v in history.steps)
    assert [float(t) for t in seen] == history.steps
