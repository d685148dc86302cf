"""The sources' training set-ups (sphereml.book.recipes), the paper profile, and the estimate command."""

import json

import pytest
import torch

from sphereml.book import chapter, recipes, runner
from sphereml.book.recipes import PAPER, Recipe, paper_estimate, recipe_for

CIFAR_TRAIN = 50_000


def lrs_by_epoch(kwargs: dict) -> list[float]:
    """The learning rate of each epoch under ``kwargs['scheduler']``, stepped once per epoch as fit does."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=kwargs["lr"])
    sched, rates = kwargs["scheduler"](opt), []
    for _ in range(kwargs["epochs"]):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


def test_iterations_become_epochs_and_milestones_the_nearest_epoch():
    thesis_2_2_7 = recipe_for("02_large_margin")  # 18k steps at batch 256, rate / 10 at 12k and 15k
    assert thesis_2_2_7.steps_per_epoch(CIFAR_TRAIN) == 196  # ceil(50000 / 256)
    assert thesis_2_2_7.num_epochs(CIFAR_TRAIN) == 92  # ceil(18000 / 196): at least the printed steps
    assert thesis_2_2_7.milestone_epochs(CIFAR_TRAIN) == [61, 77]  # 61.2 and 76.5 epochs
    rates = lrs_by_epoch(thesis_2_2_7.fit_kwargs(CIFAR_TRAIN))
    assert len(rates) == 92
    assert rates[60] == pytest.approx(0.1) and rates[61] == pytest.approx(0.01)
    assert rates[76] == pytest.approx(0.01) and rates[77] == pytest.approx(0.001) and rates[-1] == pytest.approx(1e-3)


def test_fit_kwargs_carry_the_printed_optimizer():
    kwargs = recipe_for("06_mhe").fit_kwargs(CIFAR_TRAIN)  # App. D.1
    assert {k: kwargs[k] for k in ("batch_size", "lr", "optimizer", "momentum", "weight_decay")} == {
        "batch_size": 128, "lr": 0.1, "optimizer": "sgd", "momentum": 0.9, "weight_decay": 1e-4}
    assert kwargs["epochs"] == 109  # 42,500 steps of 391
    assert recipe_for("03_spherenet").fit_kwargs(CIFAR_TRAIN)["epochs"] == 164  # 64k Adam steps at batch 128


def test_one_cycle_peaks_at_the_rate_and_lasts_the_run():
    kwargs = recipe_for("05_sharpened_cosine", "resnet18").fit_kwargs(CIFAR_TRAIN)
    rates = lrs_by_epoch(kwargs)  # stepping every epoch must not run past the schedule
    assert kwargs["epochs"] == 200 and len(rates) == 200
    assert max(rates) == pytest.approx(0.01, rel=1e-3) and rates[0] < 1e-3 and rates[-1] < 1e-4


def test_epoch_recipes_keep_their_epochs():
    cnn = recipe_for("08_convsim", "cnn")
    assert cnn.num_epochs(CIFAR_TRAIN) == cnn.num_epochs(10) == 100
    assert cnn.fit_kwargs(CIFAR_TRAIN)["batch_size"] == 512 and cnn.momentum == 0.0


def test_every_recipe_names_its_source_and_builds():
    for name, sections in PAPER.items():
        for section, recipe in sections.items():
            assert recipe.source, (name, section)
            kwargs = recipe.fit_kwargs(CIFAR_TRAIN)
            assert kwargs["epochs"] >= 1 and lrs_by_epoch(kwargs)[0] <= recipe.lr


@pytest.mark.parametrize("bad, match", [
    (dict(iterations=10, epochs=2), "iterations or as epochs"),
    (dict(), "iterations or as epochs"),
    (dict(epochs=10, optimizer="rmsprop"), "optimizer must be"),
    (dict(epochs=10, milestones=(8, 4)), "milestones must increase"),
    (dict(epochs=10, milestones=(10,)), "milestones must increase"),
    (dict(epochs=10, milestones=(5,), one_cycle=True), "no milestones"),
])
def test_recipe_rejects_bad_set_ups(bad, match):
    with pytest.raises(ValueError, match=match):
        Recipe(**{"source": "test", "optimizer": "sgd", "lr": 0.1, "batch_size": 8, **bad})


def test_recipe_for_names_what_exists():
    with pytest.raises(KeyError, match="has no paper recipe"):
        recipe_for("01_hypersphere")
    with pytest.raises(KeyError, match=r"it has \['cnn', 'resnet18'\]"):
        recipe_for("08_convsim", "cifar")


def gpu_run(**changes) -> dict:
    metrics = {"chapter": "02_large_margin", "profile": "gpu", "tiny": False, "device_name": "NVIDIA H100",
               "elapsed_seconds": 300.0,
               "fits": [{"recipe": None, "epochs": 20, "n_train": 60_000, "seconds": 50.0},
                        {"recipe": "cifar", "epochs": 20, "n_train": CIFAR_TRAIN, "seconds": 100.0}]}
    return {**metrics, **changes}


def test_paper_estimate_scales_only_the_recipe_trainings():
    est = paper_estimate(gpu_run())
    assert est["rows"] == [{"section": "cifar", "epochs": 20, "seconds": 100.0, "paper_epochs": 92, "runs": 1,
                            "estimated_s": pytest.approx(460.0)}]
    assert est["measured_s"] == 300.0 and est["estimated_s"] == pytest.approx(300.0 + 460.0 - 100.0)
    assert est["device_name"] == "NVIDIA H100"


def test_paper_estimate_of_a_resumed_run_counts_the_restored_trainings():
    """A resumed run's clock leaves out the trainings it restored (sphereml.book.resume); their time is added."""
    run = gpu_run()
    run["restored"] = {"trainings": 2, "seconds": 50.0, "trained_on": ["NVIDIA H100, torch 2.11"]}
    assert paper_estimate(run)["measured_s"] == 350.0


def test_paper_estimate_counts_the_runs_a_source_averages():
    fits = [{"recipe": "cifar", "epochs": 15, "n_train": CIFAR_TRAIN, "seconds": 60.0}]
    (row,) = paper_estimate(gpu_run(chapter="09_opt", fits=fits))["rows"]
    assert row["runs"] == 10 and row["paper_epochs"] == 192  # 75k steps of 391, App. F.3's ten runs
    assert row["estimated_s"] == pytest.approx(60.0 * 10 * 192 / 15)


def test_runs_are_the_sources_in_the_paper_profile_only(tmp_path):
    paper = chapter.Chapter("09_opt", profile="paper", device="cpu", output_dir=str(tmp_path / "a"))
    gpu = chapter.Chapter("09_opt", profile="gpu", device="cpu", output_dir=str(tmp_path / "b"))
    assert paper.runs() == 10 and gpu.runs() == 1
    with pytest.raises(KeyError):
        gpu.runs("imagenet")
    with pytest.raises(ValueError, match="runs must be at least 1"):
        Recipe("test", "sgd", 0.1, 8, epochs=2, runs=0)


@pytest.mark.parametrize("changes, match", [
    (dict(tiny=True), "tiny gpu run"),
    (dict(profile="cpu"), "'cpu' run"),
    (dict(runs_beside=2), "ran beside 2 other"),
    (dict(fits=[{"recipe": None, "epochs": 3, "n_train": 10, "seconds": 1.0}]), "CIFAR archives missing"),
])
def test_paper_estimate_refuses_runs_that_cannot_say(changes, match):
    with pytest.raises(ValueError, match=match):
        paper_estimate(gpu_run(**changes))


def test_estimate_command(tmp_path, capsys):
    (tmp_path / "02_large_margin").mkdir()
    (tmp_path / "02_large_margin" / "metrics.json").write_text(json.dumps(gpu_run()))
    assert runner.main(["estimate", "02_large_margin", "-p", "profile", "paper", "--runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cifar:  20 epochs in 1.7 min -> 92 epochs: 7.7 min" in out and "paper profile: about 11.0 min" in out
    assert "  cifar recipe: thesis §2.2.7\n" in out
    assert runner.main(["estimate", "02_large_margin", "-p", "profile", "gpu", "--runs", str(tmp_path)]) == 2
    assert runner.main(["estimate", "03_spherenet", "--runs", str(tmp_path)]) == 2
    assert "no run of 03_spherenet" in capsys.readouterr().err
    text = runner.estimate_text("02_large_margin", tmp_path, current_device="NVIDIA H200")
    assert text.endswith("this machine has NVIDIA H200: the estimate holds for NVIDIA H100")


def test_estimate_of_a_chapter_without_a_recipe_and_from_the_recorded_runs(tmp_path, monkeypatch):
    """A chapter with no source's recipe says that its paper profile is its gpu profile, timed by a full gpu run
    alone; without --runs a local run comes first where it is a full gpu run, else the run the project recorded."""
    runs, recorded = tmp_path / "_build" / "runs", tmp_path / runner.RECORDED_GPU_RUNS
    monkeypatch.setattr(runner, "repo_root", lambda: tmp_path)
    (tmp_path / "notebooks").mkdir()
    for name in ("01_hypersphere", "02_large_margin"):
        (tmp_path / "notebooks" / f"{name}.ipynb").write_text("{}")

    def record(folder, name, **changes):
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "metrics.json").write_text(json.dumps(gpu_run(chapter=name, **changes)))

    same = "01_hypersphere trains nothing with a source's recipe: its paper profile runs as its gpu profile"
    assert runner.estimate_text("01_hypersphere") == same + " (no full gpu run here to time it)"
    record(runs, "01_hypersphere", profile="cpu", elapsed_seconds=900.0)
    assert runner.estimate_text("01_hypersphere") == same + " (no full gpu run here to time it)"
    record(recorded, "01_hypersphere", restored={"seconds": 60.0})
    assert runner.estimate_text("01_hypersphere") == (
        same + ", which took 6.0 min on NVIDIA H100 (the project's recorded gpu run)")
    record(runs, "01_hypersphere", elapsed_seconds=120.0)
    assert runner.estimate_text("01_hypersphere").endswith("took 2.0 min on NVIDIA H100 (the gpu run)")
    record(runs, "01_hypersphere", elapsed_seconds=120.0, runs_beside=3)  # a shared device's clock is no timing
    assert runner.estimate_text("01_hypersphere").endswith("(the project's recorded gpu run)")
    assert runner.estimate_text("01_hypersphere", runs).endswith("(no full gpu run here to time it)")
    with pytest.raises(FileNotFoundError, match="_build/runs/02_large_margin/metrics.json or .*chapters-gpu"):
        runner.estimate_text("02_large_margin")
    record(recorded, "02_large_margin")
    assert runner.estimate_text("02_large_margin").startswith(
        "02_large_margin: the project's recorded gpu run took 5.0 min on NVIDIA H100")
    record(runs, "02_large_margin", profile="cpu")  # refused by name when it is the only run
    with pytest.raises(ValueError, match="'cpu' run"):
        runner.estimate_text("02_large_margin", runs)
    with pytest.raises(FileNotFoundError, match=r"no chapter '2_large_margin'; chapters: \['01_hypersphere', '02"):
        runner.estimate_text("2_large_margin")  # a typo, not a chapter without a recipe
    (recorded / "01_hypersphere" / "metrics.json").write_text(json.dumps(
        {k: v for k, v in gpu_run(chapter="01_hypersphere").items() if k != "device_name"}))
    assert runner.estimate_text("01_hypersphere").endswith("took 5.0 min on an unnamed device (the project's "
                                                           "recorded gpu run)")


def test_estimate_reads_the_recorded_gpu_run_of_chapter_1():
    """The run the repository keeps (benchmarks/results/chapters-gpu) answers where _build/runs has none."""
    path = runner.repo_root() / runner.RECORDED_GPU_RUNS / "01_hypersphere" / "metrics.json"
    metrics = json.loads(path.read_text())
    text = runner.estimate_text("01_hypersphere", runs_dir=path.parents[1])
    assert text.endswith(f"which took {metrics['elapsed_seconds'] / 60:.1f} min on {metrics['device_name']} "
                         "(the gpu run)")


def test_paper_profile_trains_the_sources_recipe_and_records_it(tmp_path):
    from sphereml.data import sphere_clusters
    from sphereml.models import MLP, Classifier

    ch = chapter.Chapter("02_large_margin", profile="paper", device="cpu", output_dir=str(tmp_path))
    assert ch.full_scale and chapter.resolve_profile("paper") == "paper"
    assert ch.pick(smoke=1, cpu=2, gpu=3) == 3 and ch.pick(smoke=1, cpu=2, gpu=3, paper=4) == 4
    with pytest.raises(ValueError, match="unknown \\['gpus'\\]"):
        ch.pick(smoke=1, cpu=2, gpu=3, gpus=4)
    train = sphere_clusters(3, 20, 6, seed=0)
    recipe = ch.recipe(train, epochs=2, batch_size=8, lr=0.5)
    assert recipe["epochs"] == 18_000 and recipe["batch_size"] == 256 and recipe["recipe"] == "cifar"
    with pytest.raises(KeyError):
        ch.recipe(train, "imagenet", epochs=1)
    gpu = chapter.Chapter("02_large_margin", profile="gpu", device="cpu", output_dir=str(tmp_path / "gpu"))
    recipe = gpu.recipe(train, epochs=2, batch_size=8, lr=0.5)
    assert recipe == {"epochs": 2, "batch_size": 8, "lr": 0.5, "recipe": "cifar"}
    gpu.fit(Classifier(MLP(6, 4, hidden=(8,)), 3), train, **recipe)
    saved = json.loads((tmp_path / "gpu" / "metrics.json").read_text())
    assert [{k: f[k] for k in ("recipe", "epochs", "n_train")} for f in saved["fits"]] == [
        {"recipe": "cifar", "epochs": 2, "n_train": len(train)}]
    assert saved["fits"][0]["seconds"] > 0 and saved["elapsed_seconds"] >= saved["fits"][0]["seconds"] - 0.1


def test_ledger_keeps_paper_runs_beside_the_others():
    assert recipes.PAPER and "paper" in chapter.PROFILES and "paper" in chapter.FULL_SCALE
    from sphereml.book.report import LEDGER_PROFILES

    assert LEDGER_PROFILES == ("cpu", "gpu", "paper")
