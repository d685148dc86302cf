"""Interruption safety: a training run killed mid-epoch (SIGTERM or SIGKILL) and started again resumes from its
last checkpoint and ends exactly where an uninterrupted run ends; a kill during a write never leaves a
half-written metrics file, figure or checkpoint behind (each is written beside its target and renamed)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # every test here runs and kills a training process

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src")}  # the subprocesses import sphereml from this checkout

TRAIN = textwrap.dedent("""
    import signal, sys, time
    import torch
    from sphereml import _io, train
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a parent that ignores SIGTERM passes that on through exec
    torch.set_num_threads(1)
    out = sys.argv[1]
    pause_at = int(sys.argv[2]) if len(sys.argv) > 2 else -1  # the step where the run waits to be killed
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2))

    def slow(state):  # prints the step for the parent, and waits at pause_at, so that the kill lands there
        print(state.step, flush=True)
        time.sleep(300 if state.step == pause_at else 0.01)

    history = train.fit(model, torch.utils.data.TensorDataset(x, y), epochs=4, batch_size=32, lr=0.01,
                        optimizer="sgd", checkpoint=f"{out}/run.pt", callbacks=[slow], device="cpu",
                        progress=False, seed=3)
    epochs = [{k: v for k, v in e.items() if k != "seconds"} for e in history.epochs]  # all but wall time
    _io.write_json({"epochs": epochs, "steps": history.steps, "weights": [p.tolist() for p in model.parameters()]},
                   f"{out}/metrics.json")
""")
STEPS_PER_EPOCH = 512 // 32


def _start(out: Path, pause_at: int = -1) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAIN, str(out), str(pause_at)], stdout=subprocess.PIPE,
                            text=True, env=ENV)


def _finish(out: Path) -> dict:
    proc = _start(out)
    proc.communicate(timeout=300)
    assert proc.returncode == 0
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _finish(tmp_path_factory.mktemp("straight"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_run_killed_mid_epoch_resumes_to_the_same_result(sig, tmp_path, uninterrupted):
    kill_at = 2 * STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2  # halfway through the third epoch
    proc = _start(tmp_path, pause_at=kill_at)  # waits there: a loaded machine cannot let it run past the kill
    for line in proc.stdout:
        if int(line) == kill_at:
            proc.send_signal(sig)
            break
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the run outlived signal {sig.name} by 60 s")
    assert proc.returncode == -sig, f"the run ended with {proc.returncode}, not killed by {sig.name}"
    assert not (tmp_path / "metrics.json").exists()
    assert (tmp_path / "run.pt").is_file(), "no checkpoint survived the kill"
    resumed = _finish(tmp_path)
    assert resumed == uninterrupted
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "a stale temporary was kept"


WRITE = textwrap.dedent("""
    import sys
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from sphereml import _io
    from sphereml.book import viz
    out = sys.argv[1]
    i = 0
    while True:  # rewrite all three files until killed
        i += 1
        _io.write_json({"i": i, "pad": list(range(20000))}, f"{out}/metrics.json")
        _io.save_torch({"i": i, "w": torch.zeros(50000)}, f"{out}/ckpt.pt")
        fig, ax = plt.subplots()
        ax.plot(range(100))
        viz.save_and_show(fig, f"{out}/fig.png", show=False)
        if i == 2:
            print("ready", flush=True)
""")


def test_a_kill_during_writes_leaves_whole_files(tmp_path):
    """Kill a process that keeps rewriting a metrics file, a checkpoint and a figure, at 8 random moments:
    every file present afterwards is complete (parses, loads, decodes)."""
    import random

    import matplotlib.image
    import torch

    rng = random.Random(0)
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", WRITE, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                env=ENV)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.05))
        proc.kill()
        proc.wait(timeout=30)
        assert json.loads((tmp_path / "metrics.json").read_text())["pad"][-1] == 19999
        assert torch.load(tmp_path / "ckpt.pt")["w"].numel() == 50000
        assert matplotlib.image.imread(tmp_path / "fig.png").size > 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if not n.startswith(".")] == ["ckpt.pt", "fig.png", "metrics.json"]
    assert len(names) <= 3 + 3, f"stale temporaries pile up: {names}"  # at most the last killed process's
