"""Two CPU processes (gloo): the sharded energy equals the single-process energy, value and gradient."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sphereml.regularizers import comhe
from sphereml import energy, regularizers

pytestmark = pytest.mark.subprocess  # every test here spawns ranks

WORLD = 2


def _spawn(worker, tmp_path, *args):
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(worker, args=(init, str(tmp_path)) + args, nprocs=WORLD, join=True)


def _join(rank, init):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)


SPLITS = {"even": (5, 5), "uneven": (7, 3), "one rank empty": (10, 0)}
ENERGIES = [dict(s=2.0), dict(s=0.0), dict(s=1.0, metric="angular"), dict(s=2.0, half_space=True),
            dict(s=1.5, metric="angular", half_space=True)]


def _sharded_worker(rank, init, out, split):
    _join(rank, init)
    try:
        start = sum(split[:rank])
        results = []
        for case in ENERGIES:
            local = _neurons()[start:start + split[rank]].clone().requires_grad_(True)
            value = energy.sharded_energy(local, **case)
            value.backward()
            results.append({"value": value.detach(), "grad": local.grad})
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _neurons():
    w = torch.randn(10, 3, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w[4] = w[1]  # a duplicate neuron: a close pair across the ranks' boundary
    return w


@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
def test_sharded_energy_equals_the_single_process_energy(split, tmp_path):
    """Every energy (Riesz s = 0, 1, 1.5, 2; euclidean and angular; half-space) for rows split evenly,
    unevenly and all on one rank: the value on each rank and the gradient rows equal one process's."""
    _spawn(_sharded_worker, tmp_path, SPLITS[split])
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    for i, case in enumerate(ENERGIES):
        w = _neurons().requires_grad_(True)
        expected = energy.hyperspherical_energy(w, backend="dense", **case)
        expected.backward()
        for got in ranks:
            torch.testing.assert_close(got[i]["value"], expected.detach(), rtol=1e-12, atol=0, msg=str(case))
        torch.testing.assert_close(torch.cat([got[i]["grad"] for got in ranks]), w.grad, rtol=1e-9, atol=1e-12,
                                   msg=str(case))


def test_sharded_energy_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        energy.sharded_energy(torch.randn(4, 3))


# ------------------------------------------------------------------ fit under data parallelism
def _model():
    """A margin-head classifier (its own loss_and_logits) with an OPT layer: the paths a DDP wrapper
    would miss."""
    from sphereml.heads import margins
    from sphereml import models
    from sphereml.regularizers import opt

    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    backbone.feature_dim = 4
    model = models.Classifier(backbone, 3, head=margins.CosFaceLoss(4, 3, s=8.0, m=0.2))
    opt.orthogonal_overparameterize(backbone[0], "gs")
    return model.double()


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(150, 6, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def _fit(model, epochs, checkpoint=None):
    from sphereml import regularizers, train

    reg = regularizers.MHE(model, s=2.0)
    # SGD: Adam divides by sqrt(v), so a gradient entry that is 0 up to rounding would move by lr either way
    return train.fit(model, _data(), epochs=epochs, batch_size=32, lr=0.05, optimizer="sgd", regularizer=reg,
                     device="cpu", progress=False, checkpoint=checkpoint, seed=2)


def _fit_worker(rank, init, out, epochs, checkpoint):
    _join(rank, init)
    try:
        model = _model()
        if rank == 1:  # a different start on rank 1: fit must begin from rank 0's weights
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
        history = _fit(model, epochs, checkpoint=f"{out}/{checkpoint}" if checkpoint else None)
        torch.save({"state": model.state_dict(), "history": history.to_dict()}, f"{out}/fit{rank}.pt")
    finally:
        dist.destroy_process_group()


def _strip_seconds(history):
    return {"steps": history["steps"],
            "epochs": [{k: v for k, v in e.items() if k != "seconds"} for e in history["epochs"]]}


def test_fit_on_two_ranks_equals_one_process_on_the_whole_batch(tmp_path):
    _spawn(_fit_worker, tmp_path, 3, None)
    ranks = [torch.load(tmp_path / f"fit{rank}.pt", weights_only=False) for rank in range(WORLD)]
    for name, value in ranks[0]["state"].items():  # identical on every rank
        assert torch.equal(value, ranks[1]["state"][name]), name
    single = _model()
    history = _fit(single, 3)
    for name, value in single.state_dict().items():  # one process: the same up to summation order
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=1e-9, atol=1e-11, msg=name)
    ours, theirs = _strip_seconds(ranks[0]["history"]), _strip_seconds(history.to_dict())
    torch.testing.assert_close(ours["steps"], theirs["steps"], rtol=1e-9, atol=1e-12)
    for a, b in zip(ours["epochs"], theirs["epochs"]):
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-9, atol=1e-12, msg=key)


def test_two_ranks_resume_from_rank_zeros_checkpoint(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir(), resumed.mkdir()
    _spawn(_fit_worker, straight, 4, "run.pt")
    _spawn(_fit_worker, resumed, 2, "run.pt")  # stopped after 2 epochs ...
    assert (resumed / "run.pt").is_file()
    _spawn(_fit_worker, resumed, 4, "run.pt")  # ... and resumed by both ranks
    for rank in range(WORLD):
        a = torch.load(straight / f"fit{rank}.pt", weights_only=False)
        b = torch.load(resumed / f"fit{rank}.pt", weights_only=False)
        for name, value in a["state"].items():
            assert torch.equal(value, b["state"][name]), name
        assert _strip_seconds(a["history"]) == _strip_seconds(b["history"])


TORCHRUN_SCRIPT = """
import sys
import torch
from sphereml import distributed
from sphereml.book.chapter import Chapter

out = sys.argv[1]
ch = Chapter("toy", profile="smoke", device="auto", output_dir=out)  # joins torchrun's process group
torch.manual_seed(distributed.rank())  # different weights on each rank: fit starts from rank 0's
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
x = torch.randn(96, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
history = ch.fit(model, data, epochs=2, batch_size=16, lr=0.1, optimizer="sgd")
ch.record(final_loss=history.epochs[-1]["train_loss"], world=distributed.world_size())
torch.save(model.state_dict(), f"{out}/rank{distributed.rank()}.pt")
"""


def test_a_chapter_script_runs_unchanged_under_torchrun(tmp_path):
    """``torchrun --nproc_per_node=2`` on a script that builds a Chapter and calls ch.fit: the process group
    comes from the environment, the ranks end with the same weights, and rank 0 alone writes metrics.json."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "toy.py"
    script.write_text(TORCHRUN_SCRIPT)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = (torch.load(tmp_path / "out" / f"rank{r}.pt") for r in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["world"] == 2 and metrics["final_loss"] > 0


REGULARIZERS = {
    "MHE half-space": lambda m: regularizers.MHE(m, half_space=True),
    "CoMHE random": lambda m: comhe.CoMHE(m, proj_dim=3, num_proj=2, beta_hidden=0.01),  # bounded weights
    "CoMHE adversarial": lambda m: comhe.CoMHE(m, variant="adversarial", proj_dim=3, num_proj=1, ap_every=2),
    "Orthonormality": lambda m: regularizers.Orthonormality(m, beta=0.1),
    "ConvSimilarity": lambda m: regularizers.ConvSimilarity(m, beta=0.01),
}


def _conv_model():
    from sphereml import models

    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Conv2d(1, 6, 3), torch.nn.ReLU(), torch.nn.Conv2d(6, 6, 3),
                                   torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(6 * 4 * 4, 5))
    backbone.feature_dim = 5
    return models.Classifier(backbone, 3).double()


def _images():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 1, 8, 8, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 0).long())


def _fit_regularized(name):
    from sphereml import train

    model = _conv_model()
    reg = REGULARIZERS[name](model)
    train.fit(model, _images(), epochs=2, batch_size=16, lr=0.05, optimizer="sgd", regularizer=reg, device="cpu",
              progress=False, seed=1)
    return model.state_dict()


def _regularizer_worker(rank, init, out, name):
    _join(rank, init)
    try:
        torch.save(_fit_regularized(name), f"{out}/reg{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(REGULARIZERS))
def test_regularizers_under_data_parallel_fit(name, tmp_path):
    """Each regulariser (its projections, adversarial updates and random draws included) stays in sync over two
    ranks and trains the weights one process trains on the whole batch."""
    _spawn(_regularizer_worker, tmp_path, name)
    a, b = (torch.load(tmp_path / f"reg{rank}.pt") for rank in range(WORLD))
    single = _fit_regularized(name)
    for key, value in single.items():
        assert torch.equal(a[key], b[key]), key
        # To 1e-9 of each tensor's scale: the adversarial CoMHE arm grows some weights to 1e20 here, and sums of
        # two half-batch gradients round differently from one whole-batch sum (2e-11 of the scale on an AVX2 CPU)
        scale = float(value.abs().max())
        torch.testing.assert_close(a[key], value, rtol=1e-9, atol=1e-11 + 1e-9 * scale, msg=key)


def _uneven_worker(rank, init, out):
    from sphereml import train

    _join(rank, init)
    try:
        model = _model()
        frozen = torch.nn.Linear(2, 2).double()  # a parameter no loss reaches: it must not move
        model.add_module("unused", frozen)
        x = _data().tensors[0][:33]
        data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
        train.fit(model, data, epochs=2, batch_size=32, lr=0.05, optimizer="sgd", weight_decay=0.1, device="cpu",
                  progress=False, seed=2)  # the last batch holds 1 sample: rank 1's share is empty
        torch.save(model.state_dict(), f"{out}/uneven{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_an_empty_share_and_an_unused_parameter(tmp_path):
    """With no regulariser a rank whose share of the last batch is empty still takes part in the step; a parameter
    that no rank's loss reaches keeps no gradient, so weight decay leaves it alone, as in one process."""
    _spawn(_uneven_worker, tmp_path)
    a, b = (torch.load(tmp_path / f"uneven{rank}.pt") for rank in range(WORLD))
    start = _model()
    start.add_module("unused", torch.nn.Linear(2, 2).double())
    for key, value in a.items():
        assert torch.equal(value, b[key]), key
    assert torch.equal(a["unused.weight"], start.state_dict()["unused.weight"])
