"""Resumable chapter runs (``SPHEREML_RESUME``, :mod:`sphereml.book.resume`): a rerun restores each saved training
and ends where the uninterrupted run ends, to the bit."""

import dataclasses
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from sphereml import models
from sphereml import regularizers as R
from sphereml.book import resume
from sphereml.book.chapter import Chapter
from sphereml.train import Tracker

ROOT = Path(__file__).resolve().parents[1]


def _data(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 16, 16, generator=g), torch.randint(0, 4, (n,), generator=g))


def _net(seed):
    torch.manual_seed(seed)
    return models.Classifier(models.plain_cnn(3, widths=(4, 4, 4), in_channels=1, image_size=16, feature_dim=8), 4)


def _run(tmp_path, monkeypatch, together: bool, folder="cache"):
    """A chapter that trains twice (one network with a tracker, then two seeds with MHE), draws a random number
    after each, and evaluates: what a resumed run must reproduce."""
    monkeypatch.setenv(resume.ENV, str(tmp_path / folder))
    monkeypatch.setenv("SPHEREML_SEEDS_TOGETHER", "1" if together else "0")
    ch = Chapter("99_resume", "smoke", "cpu", 0, str(tmp_path / "out"))
    train = _data()
    single = _net(0)
    curve = Tracker(lambda state: float(state.loss), 2)
    history = ch.fit(single, train, epochs=2, batch_size=16, lr=0.01, callbacks=[curve])
    after_first = torch.rand(3)
    seeds = [0, 1]
    pair = ch.seeded(lambda: _net(5), seeds)
    histories = ch.fit_seeds(pair, train, seeds, epochs=2, batch_size=16, lr=0.01, optimizer="sgd",
                             make_regularizer=partial(R.MHE, s=2.0))
    after_second = torch.rand(3)
    accuracy = [ch.evaluate(m, _data(seed=9))["accuracy"] for m in (single, *pair)]
    return {"history": history.to_dict(), "curve": curve.points, "after_first": after_first,
            "histories": [h.to_dict() for h in histories], "after_second": after_second, "accuracy": accuracy,
            "weights": [m.state_dict() for m in (single, *pair)], "metrics": ch.metrics}


def _timeless(history: dict) -> dict:
    return {**history, "epochs": [{k: v for k, v in e.items() if k != "seconds"} for e in history["epochs"]]}


def _assert_same_results(a, b):
    """Everything the runs computed is equal to the bit; only a retrained epoch's clock differs."""
    assert _timeless(a["history"]) == _timeless(b["history"])
    assert [_timeless(h) for h in a["histories"]] == [_timeless(h) for h in b["histories"]]
    for key in ("curve", "accuracy"):
        assert a[key] == b[key], key
    for key in ("after_first", "after_second"):
        assert torch.equal(a[key], b[key]), key
    for wa, wb in zip(a["weights"], b["weights"]):
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("together", [False, True])
def test_a_rerun_restores_every_training_and_ends_as_the_first(tmp_path, monkeypatch, together):
    first = _run(tmp_path, monkeypatch, together)
    saved = sorted(p.name[:4] for p in (tmp_path / "cache" / "99_resume" / "smoke").iterdir())
    assert saved == ["0001", "0002"] + ([] if together else ["0003"])  # the seeds: one file, or one each
    assert "restored" not in first["metrics"]
    second = _run(tmp_path, monkeypatch, together)
    _assert_same_results(first, second)
    assert second["metrics"]["restored"]["trainings"] == 3  # one network, then two seeds
    assert second["metrics"]["restored"]["trained_on"] == [f"cpu, torch {torch.__version__}"]
    assert all(fit["restored"] for fit in second["metrics"]["fits"])
    assert [f["seconds"] for f in second["metrics"]["fits"]] == [f["seconds"] for f in first["metrics"]["fits"]]


def test_a_run_stopped_after_its_first_training_goes_on_to_the_same_end(tmp_path, monkeypatch):
    first = _run(tmp_path, monkeypatch, together=True)
    (saved,) = (tmp_path / "cache" / "99_resume" / "smoke").glob("0002-*.pt")
    saved.unlink()  # as if stopped while training the seeds
    second = _run(tmp_path, monkeypatch, together=True)
    _assert_same_results(first, second)
    assert second["metrics"]["restored"]["trainings"] == 1
    assert [bool(f.get("restored")) for f in second["metrics"]["fits"]] == [True, False, False]


def test_a_changed_training_is_trained_again_beside_the_saved_one(tmp_path, monkeypatch):
    """A saved training whose description differs (here the learning rate) is not restored but trained, and saved
    beside it: the first run's trainings stay for a rerun of the first."""
    _run(tmp_path, monkeypatch, together=False)
    monkeypatch.setenv(resume.ENV, str(tmp_path / "cache"))
    ch = Chapter("99_resume", "smoke", "cpu", 0, str(tmp_path / "out"))
    ch.fit(_net(0), _data(), epochs=2, batch_size=16, lr=0.02, callbacks=[Tracker(lambda s: 0.0, 2)])
    assert "restored" not in ch.metrics
    assert len(list((tmp_path / "cache" / "99_resume" / "smoke").glob("0001-*.pt"))) == 2
    assert _run(tmp_path, monkeypatch, together=False)["metrics"]["restored"]["trainings"] == 3


def test_an_unreadable_saved_training_is_trained_again(tmp_path, monkeypatch):
    first = _run(tmp_path, monkeypatch, together=True)
    for saved in (tmp_path / "cache" / "99_resume" / "smoke").glob("*.pt"):
        saved.write_bytes(saved.read_bytes()[:100])  # cut short
    second = _run(tmp_path, monkeypatch, together=True)
    _assert_same_results(first, second)
    assert "restored" not in second["metrics"]


def test_the_key_sees_a_module_setting_without_weights():
    """Two networks with the same weights but another activation (no parameters) or margin are told apart."""
    from sphereml.heads import margins

    def net(act="relu", head=None):
        torch.manual_seed(0)
        backbone = models.plain_cnn(3, widths=(4, 4, 4), in_channels=1, image_size=16, feature_dim=8, act_layer=act)
        return models.Classifier(backbone, 4, head=head)

    key = partial(resume.training_key, {}, 1, train_data=_data(), seeds=[0], settings={})
    assert key([net()]) == key([net()])
    assert key([net()]) != key([net("gelu")])
    assert key([net(head=margins.LSoftmaxLoss(8, 4, m=2))]) != key([net(head=margins.LSoftmaxLoss(8, 4, m=3))])


def test_a_callback_without_state_is_trained_every_time(tmp_path, monkeypatch):
    """A plain function that records something cannot be restored: its training is never saved."""
    monkeypatch.setenv(resume.ENV, str(tmp_path / "cache"))
    seen = []
    ch = Chapter("99_resume", "smoke", "cpu", 0, str(tmp_path / "out"))
    ch.fit(_net(0), _data(), epochs=1, batch_size=16, callbacks=[lambda state: seen.append(state.step)])
    assert seen and not (tmp_path / "cache" / "99_resume").exists()


def test_without_the_variable_nothing_is_saved(tmp_path, monkeypatch):
    monkeypatch.delenv(resume.ENV, raising=False)
    ch = Chapter("99_resume", "smoke", "cpu", 0, str(tmp_path / "out"))
    ch.fit(_net(0), _data(), epochs=1, batch_size=16)
    assert ch._cache is None and "restored" not in ch.metrics


def test_describe_tells_settings_apart():
    """Settings that change a training change its description: partial's arguments, a closure's values, an
    object's simple attributes, a tensor's values."""
    def make(s):
        return lambda net: R.MHE(net, s=s)

    @dataclasses.dataclass
    class Options:
        num_proj: int

    pairs = [(partial(R.MHE, s=2.0), partial(R.MHE, s=1.0)), (make(2.0), make(1.0)),
             (lambda net: R.MHE(net, s=2.0), lambda net: R.MHE(net, s=1.0)),  # a literal in the body
             (torch.zeros(3), torch.ones(3)), (Tracker(len, 2), Tracker(len, 3)), (Options(1), Options(2)),
             (np.float32(0.1), np.float32(0.2)), (_data(seed=0), _data(seed=1)), ([Tracker(len, 2)], [Tracker(len, 3)])]
    for a, b in pairs:
        assert resume.describe(a) != resume.describe(b)
    assert resume.describe(partial(R.MHE, s=2.0)) == resume.describe(partial(R.MHE, s=2.0))


@pytest.mark.subprocess
def test_the_key_is_the_same_in_another_process():
    """No memory address, hash seed or clock in a description: a set of strings, a function with a set in its body
    and a regulariser describe alike in two processes (an unstable key would silently restore nothing)."""
    code = ("import torch, json; from sphereml import models, regularizers as R; from sphereml.book import resume\n"
            "torch.manual_seed(0)\n"
            "net = models.Classifier(models.plain_cnn(3, widths=(4, 4, 4), in_channels=1, image_size=16, "
            "feature_dim=8), 4)\n"
            "f = lambda x: x in {'alpha', 'beta', 'gamma'}\n"
            "print(json.dumps(resume.describe({'names': {'alpha', 'beta', 'gamma'}, 'f': f, 'reg': R.MHE(net)}), "
            "sort_keys=True))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**env, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert outs[0] == outs[1] and "alpha" in outs[0]


def test_a_tiny_run_keeps_its_trainings_apart_from_the_full_run(tmp_path, monkeypatch):
    monkeypatch.setenv(resume.ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("SPHEREML_GPU_TINY", "1")
    ch = Chapter("99_resume", "gpu", "cpu", 0, str(tmp_path / "out"))
    ch.fit(_net(0), _data(), epochs=1, batch_size=16)
    assert [p.name for p in (tmp_path / "cache" / "99_resume").iterdir()] == ["gpu-tiny"]


CHAPTER_RUNS = {  # chapter -> its profile: the smoke run, or the gpu profile's code at tiny sizes (seeds together)
    "06_mhe": {"SPHEREML_PROFILE": "smoke"},
    "04_decoupled": {"SPHEREML_PROFILE": "gpu", "SPHEREML_GPU_TINY": "1"},
    "07_comhe": {"SPHEREML_PROFILE": "gpu", "SPHEREML_GPU_TINY": "1"},
    "09_opt": {"SPHEREML_PROFILE": "gpu", "SPHEREML_GPU_TINY": "1"},
}


@pytest.mark.subprocess
@pytest.mark.notebook
@pytest.mark.parametrize("chapter", list(CHAPTER_RUNS))
def test_a_chapter_rerun_with_its_trainings_restored_shows_the_same_results(tmp_path, chapter):
    """A chapter run as a script, then again from its saved trainings: the same metrics, but for the clock.
    Chapter 6 has trackers, regularisers and recalibrated evaluations; chapter 4 weight projection and the authors'
    averaged statistics; chapter 7 CoMHE's projections, held norms and turn trackers; chapter 9 OPT's rotations,
    its optimisers and S-OPT's resampling; the last three with their seeds trained together."""
    script = tmp_path / f"{chapter}.py"
    subprocess.run([sys.executable, "-m", "jupytext", "--to", "py", "-o", str(script),
                    str(ROOT / "notebooks" / f"{chapter}.md")], check=True, capture_output=True)
    env = {**os.environ, **CHAPTER_RUNS[chapter], "MPLBACKEND": "Agg", resume.ENV: str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT / "src")}

    def run(name):
        out = tmp_path / name
        subprocess.run([sys.executable, str(script)], cwd=tmp_path, check=True, capture_output=True,
                       env={**env, "SPHEREML_OUTPUT": str(out)})
        return json.loads((out / "metrics.json").read_text())

    first, second = run("first"), run("second")
    assert second["restored"]["trainings"] == len(second["fits"]) > 0
    assert "restored" not in first and second.pop("restored")
    assert _clockless(first) == _clockless(second)  # every claim, number and training record


CLOCKED = ("seconds", "time", "timing", "step_ratios")  # in the keys of what a clock measured


def _clockless(value):
    """``value`` without what a clock measured (keys with :data:`CLOCKED`, claims about speed) or what marks a
    training restored."""
    if isinstance(value, dict):
        if value.get("kind") == "efficiency":
            return None
        return {k: _clockless(v) for k, v in value.items()
                if not any(c in k for c in CLOCKED) and k != "restored"}
    if isinstance(value, list):
        return [_clockless(v) for v in value]
    return value
