"""The whole benchmark suite end to end at tiny sizes (SPHEREML_BENCH_SMOKE=1), so the harness never rots: the one
place a benchmark runs in the tests.

Timings are never pass/fail: the test checks that every benchmark runs and writes its JSON with the device,
versions and date that the report page (book/benchmarks.md) labels it with.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import triton_interpreter_problem

REPO = Path(__file__).resolve().parents[1]


PATH = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH")]))
# bench_energy has its own test below (its CPU plan in detail, its CUDA plan interpreted): the others run here
OTHERS = sorted(p.stem[len("bench_"):] for p in (REPO / "benchmarks").glob("bench_*.py") if p.stem != "bench_energy")


@pytest.mark.slow
def test_the_whole_suite_runs_in_smoke_mode(tmp_path):
    env = {**os.environ, "SPHEREML_BENCH_SMOKE": "1", "SPHEREML_BENCH_RESULTS": str(tmp_path), "PYTHONPATH": PATH}
    run = subprocess.run([sys.executable, "-m", "benchmarks", *OTHERS], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    # on a GPU box the suite runs on CUDA: the files are then *-cuda.json
    written = {p.stem.rsplit("-", 1)[0]: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    for name in ("margin_heads_fwd_bwd_b8_c32", "sphereconv_fwd_bwd_b2_c4_s8", "decoupled_fwd_bwd_b2_c4_s8",
                 "scs_fwd_bwd_b2_c4_s8", "convsim_fft_vs_direct", "train_step_convnet_2x4",
                 "opt_train_step_cnn6_w8_b2", "comhe_train_step_cnn9_b2",
                 "multiseed_convnet_16x32_hs_mhe_b8", "multiseed_convnet_16x32_rp_comhe_each_b8",
                 "multiseed_tanhconv_cnn9_32x64x128_projection_b8"):  # smoke sizes
        assert name in written, f"{name} wrote no JSON (have {sorted(written)})"
        result = written[name]
        assert result["device"] and result["torch"] and result["date"], name
        assert result["cpu_capability"] == torch.backends.cpu.get_cpu_capability(), name
        ratios = [k for k in result if k.startswith("ratio_to_")]
        if ratios:
            baseline = ratios[0][len("ratio_to_"):]
            assert result[ratios[0]][baseline] == 1.0 and set(result[ratios[0]]) == set(result["seconds"])
    assert not list((REPO / "benchmarks" / "results").glob("*_s8-*.json")), "a smoke run wrote to results/"


@pytest.mark.slow
def test_the_energy_benchmark_runs_both_plans_in_smoke_mode(monkeypatch, capsys):
    """benchmarks/bench_energy.py end to end at tiny sizes: the CPU plan here, the CUDA plan interpreted.

    The CUDA plan (what the GPU run executes) runs on CPU tensors in one subprocess with
    TRITON_INTERPRET=1, since Triton reads that flag when it is imported.
    """
    import torch

    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import bench_energy

    result = bench_energy.run(torch.device("cpu"), smoke=True, inline=True)
    assert all(r["ok"] for r in result["runs"]) and len(result["runs"]) == 5, result["runs"]
    assert result["crossover"]["float32 dense vs tiled"]["sizes"] == [16, 32]
    emulated = result["gram_error_emulated"]
    assert emulated["d=64 tf32"]["max_abs"] > 10 * emulated["d=64 float32"]["max_abs"]
    assert "energy: smoke run, nothing saved" in capsys.readouterr().out
    # sphereml from the checkout if not installed; one thread: the interpreter's small numpy operations gain
    # nothing from more, and a GPU box's 16 threads per process beside 16 test workers starve each other
    problem = triton_interpreter_problem()
    if problem:  # a GPU box's Triton 3.6 with NumPy 2.4; there gpu_check.sh's bench part runs the plan compiled
        pytest.skip(problem)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": PATH, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_energy", "--smoke", "--plan", "cuda", "--inline"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1] == '{"ok": true}', proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "triton medium" in proc.stdout and "gemm medium" in proc.stdout and "crossover" in proc.stdout


def test_peak_memory_sees_what_one_call_allocates():
    import pytest
    import torch

    from sphereml.timing import peak_memory

    held = torch.ones(1024, 1024)  # held before the call: not counted
    peak = peak_memory(lambda: torch.ones(4096, 4096).add_(held.sum()))  # 64 MiB while the call runs
    if peak is None:
        pytest.skip("this kernel does not let /proc/self/clear_refs reset the high-water mark")
    assert 60 * 2**20 <= peak < 128 * 2**20
    assert peak_memory(lambda: held.sum()) < 8 * 2**20


def test_forward_backward_and_training_step_do_the_work_they_time():
    import torch

    from sphereml.timing import forward_backward, training_step

    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    x, target = torch.randn(4, 3, requires_grad=True), torch.randn(4, 2)
    forward_backward({"linear": layer}, x, target)["linear"]()
    torch.testing.assert_close(x.grad, target @ layer.weight.detach())  # d sum(layer(x) * target) / dx
    before = layer.weight.detach().clone()
    calls = []

    def loss(net, inputs, labels):
        calls.append(len(labels))
        return net(inputs).square().sum()

    training_step(layer, x.detach(), torch.zeros(4, dtype=torch.long), torch.optim.SGD(layer.parameters(), 0.1),
                  loss=loss)()
    assert calls == [4] and not torch.equal(layer.weight, before)


def test_the_keops_column_computes_our_energy():
    """The KeOps formula of the scaling study (benchmarks/bench_energy.py) against backend="tiled"."""
    import pytest
    import torch

    pytest.importorskip("pykeops", reason="the KeOps column is optional (pip install pykeops)")
    import sys

    sys.path.insert(0, str(REPO))
    from benchmarks.bench_energy import _keops_energy
    from sphereml.energy import hyperspherical_energy

    w = torch.randn(256, 16, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    ours = hyperspherical_energy(w, s=2.0, backend="tiled")
    (grad_ours,) = torch.autograd.grad(ours, w)
    theirs = _keops_energy(w)
    (grad_theirs,) = torch.autograd.grad(theirs, w)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad_theirs, grad_ours, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layer", ["sphereconv", "sigmoid", "scs", "decoupled"])
def test_the_layer_profile_runs_and_accounts_for_its_time(layer, monkeypatch, capsys):
    """benchmarks/profile_layer.py at a tiny size on this machine's device: every candidate timed and profiled
    (the fused backend only where CUDA is), the host's share of a call never above the call."""
    import torch

    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.profile_layer import profile_layer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    found = profile_layer(layer, device, size=(2, 4, 8), calls=2, rows=3)
    expected = {"nn.Conv2d", f"{layer} (reference)"} | ({f"{layer} (fused)"} if device.type == "cuda" else set())
    assert set(found) == expected
    for label, seconds in found.items():
        assert 0 < seconds["host"] <= seconds["wall"], label
    assert f"--- {layer} (reference): wall" in capsys.readouterr().out


def test_a_saved_result_reads_as_device_times_ratios_ops_and_goals(tmp_path):
    from sphereml.timing import describe_saved, save_result

    result = {"device": "NVIDIA H200", "date": "2026-11-27", "seconds": {"none": 0.004, "MHE": 0.005},
              "ops_per_call": {"none": 91, "MHE": 1301}}
    path = save_result(result, tmp_path / "step-cuda.json")
    text = describe_saved(path, "none", {"MHE": 1.10})
    lines = text.splitlines()
    assert lines[0] == "NVIDIA H200, 2026-11-27:"
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
    assert rows["MHE"] == ["5.00", "ms", "1.25", "x", "none", "1,301", "ops"]
    assert rows["none"] == ["4.00", "ms", "1.00", "x", "none", "91", "ops"]
    assert lines[-1] == "goals: MHE at most 1.1 x missed"
    assert describe_saved(path, "none", {"MHE": 1.3}).endswith("MHE at most 1.3 x met")
    assert describe_saved(tmp_path / "absent.json", "none") is None


def test_describe_saved_runs_walks_the_devices_present(tmp_path):
    from sphereml.timing import describe_saved_runs, save_result

    for device, name in (("cuda", "NVIDIA H200"), ("cpu", "x86_64 CPU")):
        save_result({"device": name, "date": "2026-11-27", "seconds": {"none": 0.004, "MHE": 0.005}},
                    tmp_path / f"step-{device}.json")
    texts = describe_saved_runs(tmp_path, "step", "none", {"MHE": 1.3})
    assert [text.splitlines()[0] for text in texts] == ["x86_64 CPU, 2026-11-27:", "NVIDIA H200, 2026-11-27:"]
    assert all(text.endswith("MHE at most 1.3 x met") for text in texts)
    assert [t.splitlines()[0] for t in describe_saved_runs(tmp_path, "step", "none", devices=("cuda", "mps"))] \
        == ["NVIDIA H200, 2026-11-27:"]
    assert describe_saved_runs(tmp_path, "other", "none") == []


def test_the_goals_report_reads_the_saved_results(tmp_path, monkeypatch):
    """benchmarks/goals.py: met, missed and not measured from result files, failures from the energy's runs; every
    goal names a candidate of a committed result file (the smoke suite runs only some candidates), or a fused head
    or layer that its benchmark times on CUDA."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import goals

    goal = goals.GOALS[0]
    assert goals.status(goal, "cuda", tmp_path)["met"] is None
    for ratio, met in ((goal.limit, True), (goal.limit + 0.01, False)):
        (tmp_path / f"{goal.stem}-cuda.json").write_text(json.dumps(
            {"device": "GPU X", "date": "2026-12-01T10:00", "ratio_to_base": {"base": 1.0, goal.candidate: ratio}}))
        assert goals.status(goal, "cuda", tmp_path) == {"ratio": ratio, "met": met, "device": "GPU X",
                                                        "date": "2026-12-01"}
    (tmp_path / "energy_fwd_bwd-cuda.json").write_text(json.dumps({"device": "GPU X", "date": "2026-12-01", "runs": [
        {"kind": "fused_suite", "backend": "gemm", "n": 32768, "d": 512, "ok": True,
         "precisions": {"high": {"seconds": 0.03, "gram_seconds": 0.01}}},
        {"kind": "huge", "backend": "gemm", "n": 2**20, "d": 512, "ok": False, "error": "timed out after 9 s"}]}))
    energy = goals.energy_status("cuda", tmp_path)
    assert [(row["figure"], row["met"]) for row in energy] == [(pytest.approx(3.0), False), (None, None)]
    rows = goals.report("cuda", tmp_path)
    assert len(rows) == 2 + len(goals.GOALS) + 2 and "failed (timed out after 9 s)" in rows[-1]
    assert sum("| not measured |" in row for row in rows) == len(goals.GOALS) - 1
    from benchmarks import bench_decoupled, bench_scs, bench_sphereconv
    from benchmarks.bench_margins import FUSED_ROWS

    fused_layer_rows = set().union(*(m.fused_result_rows() for m in (bench_sphereconv, bench_scs, bench_decoupled)))

    for g in goals.GOALS:
        if g.candidate.removesuffix(" (fused)") in FUSED_ROWS and g.candidate.endswith(" (fused)"):
            continue  # a fused head's row: timed on CUDA only, and in no committed file until a GPU runs it
        if "(fused epilogue" in g.candidate:  # a fused layer's row: timed on CUDA only, in the file its benchmark
            assert (g.stem, g.candidate) in fused_layer_rows, (g.stem, g.candidate)  # writes it to
            continue
        saved = [REPO / "benchmarks" / "results" / f"{g.stem}-{device}.json" for device in ("cpu", "cuda")]
        saved = [json.loads(path.read_text())["seconds"] for path in saved if path.is_file()]
        assert saved and all(g.candidate in seconds for seconds in saved), (g.stem, g.candidate)


# The file-name prefix of the files behind each row of book/reproducing.md's CPU benchmark table.
REPRODUCING_ROWS = {"train_step": "train_step_convnet_", "margins": "margin_heads_fwd_bwd",
                    "sphereconv": "sphereconv_fwd_bwd", "energy": "energy_fwd_bwd", "decoupled": "decoupled_fwd_bwd",
                    "scs": "scs_fwd_bwd", "convsim": "convsim_fft_vs_direct", "comhe": "comhe_train_step_cnn9",
                    "opt": "opt_train_step_cnn6", "orthogonalizers": "orthogonalizers_fwd_bwd",
                    "multiseed": "multiseed_", "launches": "launch_overhead"}
DATE_ONLY = {"multiseed"}  # rows that quote some of their files only: their dates are checked, not their ratios


def _reproducing_rows() -> dict[str, list[str]]:
    import re

    text = (REPO / "book" / "reproducing.md").read_text()
    table = text.split("| benchmark | what is compared | newest result on this CPU | goal |", 1)[1].split("\n\n", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.strip().splitlines()[1:]]
    return {re.fullmatch(r"`(\w+)`", row[0]).group(1): row for row in rows}


def test_the_reproducing_page_quotes_the_newest_cpu_files():
    """book/reproducing.md's CPU table is written by hand: each row names the date of its benchmark's newest file in
    benchmarks/results, and quotes every ratio of a file it stands for (to 2, 1 or 0 decimals), so a rerun that
    rewrites a file fails here until the page says what the new run measured."""
    import re

    rows = _reproducing_rows()
    assert set(rows) == set(REPRODUCING_ROWS), "the table's rows and the benchmarks differ"
    for name, prefix in REPRODUCING_ROWS.items():
        files = [json.loads(p.read_text()) for p in (REPO / "benchmarks" / "results").glob(f"{prefix}*-cpu.json")]
        assert files, f"no CPU file for {name}"
        _, compared, result, _ = rows[name]
        assert re.findall(r"\d{4}-\d{2}-\d{2}", compared)[-1] == max(f["date"][:10] for f in files), name
        quoted = set(re.findall(r"(?<![\d.])(\d+(?:\.\d+)?)×", result))  # the ratios the row shows
        for f in [] if name in DATE_ONLY else files:
            ratio_key = next((k for k in f if k.startswith("ratio_to_") and isinstance(f[k], dict)), None)
            for candidate, ratio in (f[ratio_key].items() if ratio_key else []):
                if candidate != ratio_key[len("ratio_to_"):]:
                    shown = {f"{ratio:.2f}", f"{ratio:.1f}", f"{ratio:.0f}"}
                    assert shown & quoted, f"{name}: {candidate}'s {ratio:.2f}x is not on the page"


def test_repeated_ratios_rotates_who_goes_first_and_pairs_every_run():
    from sphereml.timing import repeated_ratios

    calls = []
    candidates = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    ratios, first = repeated_ratios(candidates, "a", times=4, rounds=2, warmup=0)
    assert {name: len(r) for name, r in ratios.items()} == {"a": 4, "b": 4, "c": 4}
    assert ratios["a"] == [1.0] * 4 and set(first.seconds) == {"a", "b", "c"}
    runs = [calls[6 * i:6 * i + 3] for i in range(4)]  # each run's first round: 3 calls of its 6
    assert runs == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    with pytest.raises(ValueError, match="times"):
        repeated_ratios(candidates, "a", times=0)
    with pytest.raises(ValueError, match="baseline"):
        repeated_ratios(candidates, "z", times=1)


def test_first_call_drops_a_candidate_that_fails_on_a_later_call(capsys):
    """A step compiled with mode="reduce-overhead" records its CUDA graph at the second call: a candidate that
    fails there drops out before the timing instead of stopping the benchmark (OPT's Cayley step, an H100)."""
    from benchmarks.harness import first_call

    calls = []

    def fails_second_time():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("operation not permitted when stream is capturing")

    assert first_call("test", "capture", fails_second_time, calls=3) is None
    assert "test: capture failed: RuntimeError: operation not permitted" in capsys.readouterr().out
    calls.clear()
    assert first_call("test", "eager", fails_second_time, calls=1) is fails_second_time
    assert len(calls) == 1


def test_first_call_and_compare_record_what_the_compiler_made_of_a_candidate(tmp_path, monkeypatch, capsys):
    """A compiled candidate's graphs and graph breaks (and, on CUDA, skipped or copying CUDA graphs) are printed at
    its first calls and saved with the timings, so that a GPU run says why a compiled step is slow; an eager
    candidate has no such record, and a recompilation inside the timing is reported."""
    import torch

    from benchmarks import harness

    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    x = torch.randn(8)

    def broken(t):
        t = t * 2
        torch._dynamo.graph_break()
        return t + 1

    candidates = {"eager": lambda: x * 2 + 1,
                  "whole": (lambda f=torch.compile(lambda t: t * 2 + 1, backend="eager"): f(x)),
                  "broken": (lambda f=torch.compile(broken, backend="eager"): f(x))}
    for label, fn in candidates.items():
        assert harness.first_call("test", label, fn, calls=2) is fn
    printed = capsys.readouterr().out
    assert "test: whole compiled: 1 graphs, 0 graph breaks, 0 cudagraph skips, 0 copied inputs" in printed
    assert "test: broken compiled: 2 graphs, 1 graph breaks" in printed and "test: eager compiled" not in printed
    result = harness.compare("compile_record", candidates, "eager", torch.device("cpu"), repeats=1)
    assert set(result["compiler"]) == {"whole", "broken"}
    assert result["compiler"]["whole"] == {"graphs": 1, "graph_breaks": 0, "cudagraph_skips": 0, "copied_inputs": 0}
    assert "graphs_compiled_while_timed" not in result and not harness._COMPILED  # handed over once

    late = torch.compile(lambda t: t.sin(), backend="eager", dynamic=False)
    calls = []  # the third call of the candidate is the first timed one: a new shape there compiles again

    def new_shape_when_timed():
        calls.append(1)
        return late(x if len(calls) <= 2 else torch.randn(3, 5))

    result = harness.compare("compile_record", {"eager": lambda: x * 2, "late": new_shape_when_timed}, "eager",
                             torch.device("cpu"), repeats=2)
    assert result["graphs_compiled_while_timed"] == 1 and "1 graph(s) compiled while timed" in capsys.readouterr().out
    calls.clear()  # compiled for both shapes now, in warm-up or timing alike: nothing reported
    result = harness.compare("compile_record", {"eager": lambda: x * 2, "late": new_shape_when_timed}, "eager",
                             torch.device("cpu"), repeats=2)
    assert "graphs_compiled_while_timed" not in result


def test_the_launch_benchmarks_triton_kernel_adds_one(monkeypatch):
    """``python -m benchmarks launches`` times a one-block Triton kernel's launch on CUDA: it must compute x + 1
    (interpreted on a CPU-only machine), for a block and a part of one, so that its time is that of a working kernel."""
    import importlib

    import torch

    pytest.importorskip("triton", reason="needs Triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from benchmarks import _launch_kernels

    kernels = importlib.reload(_launch_kernels)  # decorated again, under the interpreter where there is no GPU
    for n in (1, 128, 300):
        x = torch.arange(n, dtype=torch.float32, device=device)
        assert torch.equal(kernels.add_one(x), x + 1)


def test_the_sm90_summary_fails_only_on_a_fixed_kernel_that_spills(monkeypatch, capsys):
    """``python -m benchmarks.sm90`` runs every compile check of CHECKS and exits 1 only when a kernel of fixed
    configuration spills (autotuning candidates are reported: the tuner may leave them aside)."""
    pytest.importorskip("triton")
    import types

    from benchmarks import sm90

    def rows(*spills):
        return lambda arch: [{"registers": 40 + 8 * i, "spill_store_bytes": b} for i, b in enumerate(spills)]

    fake = types.ModuleType("benchmarks.bench_fake")
    fake.fixed, fake.tuned, fake.spilling = rows(0, 0), rows(0, 24, 8), rows(None, 4)
    monkeypatch.setitem(sys.modules, "benchmarks.bench_fake", fake)
    monkeypatch.setattr(sm90, "_ptxas", lambda: Path("ptxas"))  # the fake checks compile nothing
    monkeypatch.setattr(sm90, "CHECKS", (("bench_fake", "fixed", False), ("bench_fake", "tuned", True)))
    assert sm90.main([]) == 0
    out = capsys.readouterr().out
    assert "bench_fake.fixed" in out and "2 forms, registers 40-48, 0 spilling\n" in out
    assert "3 forms, registers 40-56, 2 spilling (autotuning candidates)" in out
    monkeypatch.setattr(sm90, "CHECKS", (("bench_fake", "spilling", False),))
    assert sm90.main(["--arch", "100"]) == 1
    assert "sm_100, Triton" in capsys.readouterr().out
    monkeypatch.setattr(sm90, "_ptxas", lambda: None)  # nothing counted is not a pass
    assert sm90.main([]) == 2 and "no ptxas" in capsys.readouterr().err


def test_the_sm90_summary_lists_every_compile_check():
    import ast

    from benchmarks import sm90

    defined = {(path.stem, node.name) for path in (REPO / "benchmarks").glob("bench_*.py")
               for node in ast.parse(path.read_text()).body
               if isinstance(node, ast.FunctionDef) and node.name.endswith("compile_check")}
    assert {(module, function) for module, function, _ in sm90.CHECKS} == defined
