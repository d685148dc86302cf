"""The chapter runtime: profiles, output folders, metrics, figures, claims, training helpers."""

import json
from pathlib import Path

import pytest
import torch

from sphereml.book import chapter, verdicts
from sphereml import recalibration
from sphereml.models import Classifier, ConvNet

REPO = Path(__file__).resolve().parents[1]


def test_resolve_profile(monkeypatch):
    monkeypatch.delenv("SPHEREML_PROFILE", raising=False)
    assert chapter.resolve_profile("auto") == ("gpu" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("SPHEREML_PROFILE", "smoke")
    assert chapter.resolve_profile("auto") == "smoke"
    assert chapter.resolve_profile("gpu") == "gpu"  # an explicit profile beats the environment
    with pytest.raises(ValueError, match="profile must be 'auto' or one of"):
        chapter.resolve_profile("fast")
    monkeypatch.setenv("SPHEREML_PROFILE", "turbo")
    with pytest.raises(ValueError, match="'turbo'"):
        chapter.resolve_profile("auto")


def test_output_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("SPHEREML_OUTPUT", raising=False)
    monkeypatch.delenv("SPHEREML_GPU_TINY", raising=False)
    assert chapter.resolve_output_dir("ch", tmp_path / "x") == tmp_path / "x"
    monkeypatch.chdir(REPO / "notebooks")
    runs = REPO / "_build" / "runs"
    assert chapter.resolve_output_dir("ch", profile="cpu") == runs / "ch"
    assert chapter.default_output_dir("ch", profile="cpu", custom=True) == runs / "custom" / "ch"  # a reader's run
    assert chapter.default_output_dir("ch", profile="smoke", custom=True) == runs / "smoke" / "ch"
    assert chapter.resolve_output_dir("ch", profile="gpu") == runs / "ch"
    # the runs the ledger skips keep apart, so that a quick check never overwrites a recorded run's metrics
    assert chapter.resolve_output_dir("ch", profile="smoke") == runs / "smoke" / "ch"
    monkeypatch.setenv("SPHEREML_GPU_TINY", "1")
    assert chapter.resolve_output_dir("ch", profile="gpu") == runs / "tiny" / "ch"
    assert chapter.resolve_output_dir("ch", profile="cpu") == runs / "ch"
    assert chapter.default_output_dir("ch", profile="cpu", custom=True) == runs / "custom" / "ch"  # a reader's run
    assert chapter.default_output_dir("ch", profile="smoke", custom=True) == runs / "smoke" / "ch"
    monkeypatch.setenv("SPHEREML_PROFILE", "smoke")
    assert chapter.resolve_output_dir("ch") == runs / "smoke" / "ch"
    monkeypatch.setenv("SPHEREML_OUTPUT", str(tmp_path / "env"))
    assert chapter.resolve_output_dir("ch") == tmp_path / "env"


def test_chapter_records_metrics_and_picks_by_profile(tmp_path):
    ch = chapter.Chapter("demo", profile="smoke", device="cpu", seed=3, output_dir=str(tmp_path), params={"k": 1})
    assert ch.pick(smoke=1, cpu=2, gpu=3) == 1
    with pytest.raises(ValueError, match="missing \\['gpu'\\]"):
        ch.pick(smoke=1, cpu=2)
    ch.record(answer=torch.tensor(42.0), path=Path("a"))
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["answer"] == 42.0 and saved["profile"] == "smoke" and saved["params"] == {"k": 1}
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    ch.savefig(fig, "line", show=False)
    assert (tmp_path / "line.png").stat().st_size > 0
    assert json.loads((tmp_path / "metrics.json").read_text())["figures"] == ["line.png"]


def test_comparison_seeds_follow_the_profile_or_the_readers_count(tmp_path):
    smoke = chapter.Chapter("demo", profile="smoke", device="cpu", seed=3, output_dir=str(tmp_path / "s"))
    assert smoke.comparison_seeds() == [3, 4] and smoke.metrics["params"]["num_seeds"] == 0
    assert json.loads((tmp_path / "s" / "metrics.json").read_text())["seed"] == 3
    cpu = chapter.Chapter("demo", profile="cpu", device="cpu", seed=0, output_dir=str(tmp_path / "c"))
    assert cpu.comparison_seeds(0) == [0, 1, 2]
    assert cpu.comparison_seeds(3) == [0, 1, 2] and cpu.metrics["params"]["num_seeds"] == 0  # the default, named
    assert cpu.comparison_seeds(5) == [0, 1, 2, 3, 4] and cpu.metrics["params"]["num_seeds"] == 5
    for bad in (1, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_seeds"):
            cpu.comparison_seeds(bad)


def test_a_chapter_may_pair_more_seeds_in_one_profile(tmp_path):
    def seeds(profile, **defaults):
        ch = chapter.Chapter("demo", profile=profile, device="cpu", seed=0, output_dir=str(tmp_path / profile))
        return ch.comparison_seeds(**defaults), ch.metrics["params"]["num_seeds"]

    assert seeds("cpu", cpu=5) == ([0, 1, 2, 3, 4], 0)  # the chapter's default: recorded as the default
    assert seeds("gpu", cpu=5) == ([0, 1, 2], 0)
    assert seeds("smoke", cpu=5, gpu=4) == ([0, 1], 0)
    assert seeds("paper", gpu=4) == ([0, 1, 2, 3], 0)
    cpu = chapter.Chapter("demo", profile="cpu", device="cpu", seed=0, output_dir=str(tmp_path / "c"))
    assert cpu.comparison_seeds(3, cpu=5) == [0, 1, 2] and cpu.metrics["params"]["num_seeds"] == 3  # a reader's
    for bad in (1, 0, 2.0, True):
        with pytest.raises(ValueError, match="cpu must be an integer >= 2"):
            cpu.comparison_seeds(cpu=bad)
        with pytest.raises(ValueError, match="gpu must be an integer >= 2"):
            cpu.comparison_seeds(gpu=bad)


def test_say_wraps_a_sentence_to_the_column_width(capsys):
    chapter.Chapter.say("abcdefghi " * 20)  # ten characters a word: 9 words (89 characters) on a line of 96
    lines = capsys.readouterr().out.splitlines()
    assert [len(line) for line in lines] == [89, 89, 19] and " ".join(lines).split() == ["abcdefghi"] * 20
    assert chapter.PAGE_WIDTH == 96


def test_chapter_helpers_train_on_its_device(tmp_path):
    from sphereml.data import sphere_clusters
    from sphereml.models import MLP, Classifier

    ch = chapter.Chapter("demo", profile="smoke", device="cpu", seed=0, output_dir=str(tmp_path))
    data = sphere_clusters(3, 20, 6, seed=0)
    model = Classifier(MLP(6, 4, hidden=(8,)), 3)
    history = ch.fit(model, data, epochs=2, batch_size=16)
    assert len(history.epochs) == 2
    assert set(ch.evaluate(model, data)) == {"loss", "accuracy"}
    features, labels = ch.collect(model.features, data)
    assert features.shape == (60, 4) and labels.shape == (60,)


def test_claims_are_shown_and_recorded(tmp_path, capsys):
    ch = chapter.Chapter("demo", profile="cpu", device="cpu", seed=0, output_dir=str(tmp_path))
    returned = ch.claim("afs", "A-Softmax lowers the angular Fisher score below softmax", "thesis Table 2.3",
                        ours={"softmax": 0.138, "A-Softmax": 0.116}, holds=0.116 < 0.138, paper=None,
                        kind="geometry/theory")
    assert returned is None  # nothing for a notebook cell to echo
    record = json.loads((tmp_path / "metrics.json").read_text())["claims"][0]
    ch.claim("tie", "two heads differ", "thesis Table 2.4", ours=0.001, holds=None, paper=0.5, kind="generalisation")
    ch.claim("afs", "A-Softmax lowers the angular Fisher score below softmax", "thesis Table 2.3",  # replaced
             ours={"softmax": 0.138, "A-Softmax": 0.2}, holds=False, kind="geometry/theory")
    printed = capsys.readouterr().out
    assert "[holds] A-Softmax lowers" in printed and "ours: softmax 0.138; A-Softmax 0.116" in printed
    assert "[not distinguishable] two heads differ" in printed and "source: 0.5" in printed
    assert record["verdict"] == "holds" and record["profile"] == "cpu"
    saved = json.loads((tmp_path / "metrics.json").read_text())["claims"]
    assert [c["id"] for c in saved] == ["tie", "afs"] and saved[1]["verdict"] == "does not hold"
    assert set(saved[0]) == {"id", "statement", "source", "paper", "ours", "profile", "verdict", "kind"}
    assert saved[0]["kind"] == "generalisation"
    ch.claim("unit", "a claim on a named scale", "thesis Table 2.4", ours={"a": 91.5}, holds=True,
             kind="generalisation", unit="test accuracy %")
    assert "ours: (test accuracy %) a 91.5" in capsys.readouterr().out
    assert json.loads((tmp_path / "metrics.json").read_text())["claims"][-1]["unit"] == "test accuracy %"
    with pytest.raises(ValueError, match="holds must be True, False, None or 'not testable'"):
        ch.claim("x", "y", "z", ours=1, holds="yes", kind="efficiency")
    with pytest.raises(ValueError, match="kind must be one of"):
        ch.claim("x", "y", "z", ours=1, holds=True, kind="speed")
    with pytest.raises(TypeError):
        ch.claim("x", "y", "z", ours=1, holds=True)  # every claim says what it is about
    ch.claim("arm", "a claim whose arm never trained", "thesis Table 7.5", ours=0.1, holds=verdicts.NOT_TESTABLE,
             kind="generalisation")
    ch.show_verdicts()
    summary = capsys.readouterr().out.splitlines()[-4:]
    assert summary == ["- [not distinguishable] two heads differ (thesis Table 2.4)",
                       "- [does not hold] A-Softmax lowers the angular Fisher score below softmax (thesis Table 2.3)",
                       "- [holds] a claim on a named scale (thesis Table 2.4)",
                       "- [not testable] a claim whose arm never trained (thesis Table 7.5)"]


def test_cifar_is_skipped_with_a_note_when_the_archive_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPHEREML_NO_DOWNLOAD", "1")
    monkeypatch.setenv("SPHEREML_DATA", str(tmp_path / "empty"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(chapter.data, "search_paths", lambda name, root=None: [tmp_path / "empty" / name])
    ch = chapter.Chapter("demo", profile="gpu", device="cpu", seed=0, output_dir=str(tmp_path / "out"))
    assert ch.cifar(10) is None
    printed = capsys.readouterr().out
    assert "CIFAR-10 skipped: cifar-10-python.tar.gz" in printed and "$SPHEREML_DATA/cifar-10/" in printed
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["cifar10_skipped"] is True


def test_evaluate_recalibrates_running_statistics_once_after_each_fit(tmp_path, monkeypatch):
    """The book's one rule: a network with BatchNorm is evaluated with statistics re-estimated from its training
    data (once per fit), unless the chapter asks to see the stale ones."""
    from sphereml.data import sphere_clusters

    ch = chapter.Chapter("demo", profile="cpu", device="cpu", seed=0, output_dir=str(tmp_path))
    data = sphere_clusters(3, 40, 6, concentration=3.0, seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    calls = []
    monkeypatch.setattr(chapter, "recalibrate", lambda *a, **k: calls.append(1) or recalibration.recalibrate(*a, **k))
    ch.fit(model, data, epochs=1, lr=0.1)
    assert not recalibration.stats_fresh(model)
    ch.evaluate(model, data, recalibrate=False)
    assert calls == []
    ch.evaluate(model, data)
    ch.evaluate(model, data)
    assert calls == [1] and recalibration.stats_fresh(model)
    ch.fit(model, data, epochs=1, lr=0.1)  # new weights: stale again
    ch.collect(model.forward, data)
    assert calls == [1, 1]
    plain = torch.nn.Linear(6, 3)
    ch.fit(plain, data, epochs=1)
    ch.evaluate(plain, data)
    assert calls == [1, 1]  # nothing to recalibrate


def test_seeded_builds_each_network_just_after_its_seed():
    make = lambda: torch.nn.Linear(4, 3)  # noqa: E731
    built = chapter.Chapter.seeded(make, [7, 8, 7])
    torch.manual_seed(8)
    twin = make()
    assert torch.equal(built[1].weight, twin.weight)
    assert torch.equal(built[0].weight, built[2].weight) and not torch.equal(built[0].weight, built[1].weight)
    assert chapter.Chapter.seeded(make, []) == []


def test_fit_seeds_trains_like_fit_and_recalibrates_each_model(tmp_path, monkeypatch):
    from sphereml.data import sphere_clusters

    monkeypatch.setenv("SPHEREML_SEEDS_TOGETHER", "1")
    ch = chapter.Chapter("demo", profile="cpu", device="cpu", seed=0, output_dir=str(tmp_path))
    data = sphere_clusters(3, 40, 6, concentration=3.0, seed=0)

    def net(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                   torch.nn.Linear(8, 3)).double()

    data = torch.utils.data.TensorDataset(data.tensors[0].double(), data.tensors[1])
    together, alone = [net(1), net(2)], [net(1), net(2)]
    ch.fit_seeds(together, data, [4, 5], epochs=2, lr=0.05, batch_size=32)
    for model, twin, seed in zip(together, alone, (4, 5)):
        ch.fit(twin, data, epochs=2, lr=0.05, batch_size=32, seed=seed)
        assert ch.evaluate(model, data) == pytest.approx(ch.evaluate(twin, data), rel=1e-9)
        assert recalibration.stats_fresh(model)
    fits = json.loads((tmp_path / "metrics.json").read_text())["fits"]
    assert [f.get("together") for f in fits] == [2, 2, None, None] and all(f["n_train"] == 120 for f in fits)


def test_seeds_train_together_in_the_full_scale_profiles_unless_told_otherwise(tmp_path, monkeypatch):
    monkeypatch.delenv("SPHEREML_SEEDS_TOGETHER", raising=False)
    together = {p: chapter.Chapter("demo", profile=p, device="cpu", output_dir=str(tmp_path)).seeds_together
                for p in chapter.PROFILES}
    assert together == {"smoke": False, "cpu": False, "gpu": True, "paper": True}
    monkeypatch.setenv("SPHEREML_SEEDS_TOGETHER", "0")
    assert not chapter.Chapter("demo", profile="gpu", device="cpu", output_dir=str(tmp_path)).seeds_together
    monkeypatch.setenv("SPHEREML_SEEDS_TOGETHER", "yes")
    with pytest.raises(ValueError, match="SPHEREML_SEEDS_TOGETHER must be 0 or 1"):
        chapter.Chapter("demo", profile="gpu", device="cpu", output_dir=str(tmp_path))


def test_a_run_records_how_many_others_shared_its_device(tmp_path, monkeypatch):
    """gpu_check.sh chapters-at-once sets SPHEREML_RUNS_BESIDE, so that no one takes such a run's clock for its own
    (recipes.paper_estimate refuses it)."""
    monkeypatch.delenv("SPHEREML_RUNS_BESIDE", raising=False)
    assert chapter.Chapter("demo", profile="smoke", device="cpu", output_dir=str(tmp_path)).metrics["runs_beside"] == 0
    monkeypatch.setenv("SPHEREML_RUNS_BESIDE", "2")
    assert chapter.Chapter("demo", profile="smoke", device="cpu", output_dir=str(tmp_path)).metrics["runs_beside"] == 2
    monkeypatch.setenv("SPHEREML_RUNS_BESIDE", "-1")
    with pytest.raises(ValueError, match="SPHEREML_RUNS_BESIDE must be a whole number"):
        chapter.Chapter("demo", profile="smoke", device="cpu", output_dir=str(tmp_path))


def test_fit_seeds_one_after_another_is_fit_seed_by_seed(tmp_path, monkeypatch):
    monkeypatch.setenv("SPHEREML_SEEDS_TOGETHER", "0")
    ch = chapter.Chapter("demo", profile="cpu", device="cpu", seed=0, output_dir=str(tmp_path))
    data = torch.utils.data.TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))

    def net(seed):
        torch.manual_seed(seed)
        return torch.nn.Linear(5, 3)

    together, alone = [net(1), net(2)], [net(1), net(2)]
    ch.fit_seeds(together, data, [4, 5], epochs=2, lr=0.05, batch_size=16)
    for model, twin, seed in zip(together, alone, (4, 5)):
        ch.fit(twin, data, epochs=2, lr=0.05, batch_size=16, seed=seed)
        assert torch.equal(model.weight, twin.weight)
    fits = json.loads((tmp_path / "metrics.json").read_text())["fits"]
    assert [f.get("together") for f in fits] == [None] * 4
    with pytest.raises(ValueError, match="seeds needs one entry per model"):
        ch.fit_seeds(together, data, [4], epochs=1)
    with pytest.raises(ValueError, match="callbacks needs one entry per model"):
        ch.fit_seeds(together, data, [4, 5], callbacks=[[]], epochs=1)


def test_fit_seeds_takes_trackers_along_and_other_callbacks_one_after_another(tmp_path, monkeypatch):
    from sphereml.train import Tracker

    monkeypatch.setenv("SPHEREML_SEEDS_TOGETHER", "1")
    ch = chapter.Chapter("demo", profile="gpu", device="cpu", seed=0, output_dir=str(tmp_path))
    data = torch.utils.data.TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    nets = [torch.nn.Linear(5, 3) for _ in range(2)]
    trackers = [Tracker(lambda state, m=m: float(m.weight.detach().norm()), 1) for m in nets]
    ch.fit_seeds(nets, data, [4, 5], callbacks=[[trackers[0]], []], epochs=1, lr=0.05, batch_size=16)
    assert len(trackers[0].values) == 4 and trackers[1].values == []
    steps = []
    ch.fit_seeds(nets, data, [4, 5], callbacks=[[lambda state: steps.append(state.step)], []], epochs=1, lr=0.05,
                 batch_size=16)
    assert steps == [1, 2, 3, 4]
    adam = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731  (may mix elements: fit_seeds refuses it)
    ch.fit_seeds(nets, data, [4, 5], epochs=1, batch_size=16, optimizer=adam)
    ch.fit_seeds(nets, data, [4, 5], epochs=1, batch_size=16, loss_fn=None)
    fits = json.loads((tmp_path / "metrics.json").read_text())["fits"]
    assert [f.get("together") for f in fits] == [2, 2, None, None, None, None, 2, 2]


@pytest.mark.parametrize("variant,shared", [("random", True), ("angle", False)])
def test_fit_seeds_gives_each_model_its_regularizer(tmp_path, monkeypatch, variant, shared):
    """Together, the first model's regulariser serves every seed, unless its projections are fitted to the weights:
    then each model gets its own, as when they train one after another."""
    from sphereml.regularizers.comhe import CoMHE

    monkeypatch.setenv("SPHEREML_SEEDS_TOGETHER", "1")
    ch = chapter.Chapter("demo", profile="gpu", device="cpu", seed=0, output_dir=str(tmp_path))
    data = torch.utils.data.TensorDataset(torch.randn(32, 1, 8, 8), torch.randint(0, 3, (32,)))
    nets = [Classifier(ConvNet(1, 6, (3, 4), image_size=8), 3) for _ in range(2)]
    bound = []

    def make(model):
        bound.append(model)
        return CoMHE(model, variant, beta_hidden=0.1, beta_output=0.1)

    histories = ch.fit_seeds(nets, data, [4, 5], epochs=1, batch_size=16, make_regularizer=make)
    assert bound == (nets[:1] if shared else nets) and all(h["reg"][0] > 0 for h in histories)
    monkeypatch.setenv("SPHEREML_SEEDS_TOGETHER", "0")
    alone = chapter.Chapter("demo", profile="gpu", device="cpu", seed=0, output_dir=str(tmp_path / "alone"))
    bound.clear()
    alone.fit_seeds(nets, data, [4, 5], epochs=1, batch_size=16, make_regularizer=make)
    assert bound == nets
    ch.fit_seeds(nets, data, [4, 5], epochs=1, batch_size=16, regularizers=[None, None])  # none: plain training
    fits = json.loads((tmp_path / "metrics.json").read_text())["fits"]
    assert [f.get("together") for f in fits] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="not both"):
        ch.fit_seeds(nets, data, [4, 5], epochs=1, make_regularizer=make, regularizers=[make(n) for n in nets])
    with pytest.raises(ValueError, match="give make_regularizer or regularizers"):
        ch.fit_seeds(nets, data, [4, 5], epochs=1, regularizer=make(nets[0]))


def test_fit_seeds_trains_alone_what_the_stacked_step_cannot_take(tmp_path, monkeypatch):
    """Gradient hooks (weighted gradients), a setting only fit takes, a function without layers as regulariser."""
    from sphereml.layers.decoupled import DecoupledConv2d
    from sphereml.layers.decoupled_training import training_aids

    monkeypatch.setenv("SPHEREML_SEEDS_TOGETHER", "1")
    ch = chapter.Chapter("demo", profile="gpu", device="cpu", seed=0, output_dir=str(tmp_path))
    data = torch.utils.data.TensorDataset(torch.randn(32, 1, 8, 8), torch.randint(0, 3, (32,)))
    nets = [Classifier(ConvNet(1, 6, (3, 4), image_size=8, conv_layer=DecoupledConv2d), 3) for _ in range(2)]
    with training_aids(nets, "weighted") as callbacks:
        ch.fit_seeds(nets, data, [4, 5], callbacks=callbacks, epochs=1, batch_size=16)
    ch.fit_seeds(nets, data, [4, 5], epochs=1, batch_size=16, progress=True)
    ch.fit_seeds(nets, data, [4, 5], epochs=1, batch_size=16, make_regularizer=lambda m: lambda: m.head.weight.sum())
    ch.fit_seeds(nets, data, [4, 5], epochs=1, batch_size=16)
    fits = json.loads((tmp_path / "metrics.json").read_text())["fits"]
    assert [f.get("together") for f in fits] == [None] * 6 + [2, 2]


def test_a_tiny_gpu_run_takes_gpu_paths_at_smoke_sizes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPHEREML_GPU_TINY", "1")
    ch = chapter.Chapter("demo", profile="gpu", device="cpu", output_dir=str(tmp_path))
    assert ch.profile == "gpu" and ch.tiny and ch.scale == "smoke" and ch.pick(smoke=1, cpu=8, gpu=50) == 1
    assert ch.gpu_size(40, 1) == 1
    train, test = ch.cifar(100)
    assert train.tensors[0].shape == (32, 3, 32, 32) and len(test) == 16
    assert set(train.tensors[1].tolist()) == set(range(32)) and ch.metrics["tiny"] is True
    assert not chapter.Chapter("demo", profile="cpu", device="cpu", output_dir=str(tmp_path)).tiny
    monkeypatch.delenv("SPHEREML_GPU_TINY")
    full = chapter.Chapter("demo", profile="gpu", device="cpu", output_dir=str(tmp_path))
    assert full.pick(smoke=1, cpu=8, gpu=50) == 50 and full.gpu_size(40, 1) == 40


def test_published_sources_clones_once_and_refuses_remote_clones_offline(tmp_path, monkeypatch):
    import subprocess

    origin = tmp_path / "origin"
    (origin / "book").mkdir(parents=True)
    (origin / "_toc.yml").write_text("root: index\n")
    (origin / "book" / "claims.json").write_text('{"chapters": {}}\n')
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(origin)]
    for args in (["init", "--quiet"], ["add", "."], ["commit", "--quiet", "-m", "sources"]):
        subprocess.run(git + args, check=True, capture_output=True)
    dest = tmp_path / "cache" / "sources"
    assert chapter.published_sources(f"file://{origin}", dest) == dest
    assert (dest / "book" / "claims.json").read_text() == '{"chapters": {}}\n'
    (origin / "_toc.yml").unlink()  # a second call uses the clone as it is, without git
    assert chapter.published_sources("file:///nowhere", dest) == dest
    monkeypatch.setenv("SPHEREML_NO_DOWNLOAD", "1")
    with pytest.raises(RuntimeError, match="refusing to clone https://example.org/x"):
        chapter.published_sources("https://example.org/x", tmp_path / "other")
    with pytest.raises(RuntimeError, match="could not clone file:///nowhere"):
        chapter.published_sources("file:///nowhere", tmp_path / "other")


def test_full_scale_runs_on_cuda_let_cudnn_pick_its_algorithms_and_keep_tf32_off(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)  # PyTorch's default for convolutions
    assert chapter.configure_backends("cpu", torch.device("cuda")) == {
        "cudnn_benchmark": False, "cudnn_allow_tf32": False, "float32_matmul_precision": "highest"}
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert chapter.configure_backends("gpu", torch.device("cpu"))["cudnn_allow_tf32"] is True  # the CPU's untouched
    assert chapter.configure_backends("gpu", torch.device("cpu"))["cudnn_benchmark"] is False
    assert chapter.configure_backends("paper", torch.device("cuda")) == {
        "cudnn_benchmark": True, "cudnn_allow_tf32": False, "float32_matmul_precision": "highest"}


def test_published_sources_says_when_git_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on the path
    with pytest.raises(RuntimeError, match="git is not installed"):
        chapter.published_sources("file:///nowhere", tmp_path / "clone")


def test_fit_seeds_takes_one_optimizer_per_model(tmp_path, monkeypatch):
    """Equal element-wise optimisers train the seeds together; optimisers bound to their own model (OPT's
    orthogonal gradient descent) train each model with its own, one after another."""
    from functools import partial

    monkeypatch.setenv("SPHEREML_SEEDS_TOGETHER", "1")
    ch = chapter.Chapter("demo", profile="gpu", device="cpu", seed=0, output_dir=str(tmp_path))
    data = torch.utils.data.TensorDataset(torch.randn(32, 5), torch.randint(0, 3, (32,)))
    nets = [torch.nn.Linear(5, 3) for _ in range(2)]
    ch.fit_seeds(nets, data, [4, 5], epochs=1, batch_size=16,
                 optimizers=[partial(torch.optim.SGD, lr=0.05, momentum=0.9) for _ in nets])
    used = []

    def own(model):
        def make_optimizer(params):
            used.append(model)
            return torch.optim.SGD(model.parameters(), lr=0.05)
        return make_optimizer

    ch.fit_seeds(nets, data, [4, 5], epochs=1, batch_size=16, optimizers=[own(net) for net in nets])
    assert used == nets
    fits = json.loads((tmp_path / "metrics.json").read_text())["fits"]
    assert [f.get("together") for f in fits] == [2, 2, None, None]
    with pytest.raises(ValueError, match="not both"):
        ch.fit_seeds(nets, data, [4, 5], epochs=1, optimizer="sgd", optimizers=["sgd", "sgd"])
