"""The whole benchmark suite end to end at tiny sizes (SPHEREML_BENCH_SMOKE=1), so the harness never rots.

Timings are never pass/fail: the test checks that every benchmark runs and writes its JSON with the device,
versions and date that the report page (book/benchmarks.md) labels it with.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_whole_suite_runs_in_smoke_mode(tmp_path):
    env = {**os.environ, "SPHEREML_BENCH_SMOKE": "1", "SPHEREML_BENCH_RESULTS": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    # on a GPU box the suite runs on CUDA: the files are then *-cuda.json
    written = {p.stem.rsplit("-", 1)[0]: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    for name in ("margin_heads_fwd_bwd_b8_c32", "sphereconv_fwd_bwd_b2_c4_s8", "decoupled_fwd_bwd_b2_c4_s8",
                 "scs_fwd_bwd_b2_c4_s8", "convsim_fft_vs_direct", "train_step_convnet_2x4",
                 "opt_train_step_cnn6_w8_b2", "comhe_train_step_cnn9_b2"):  # smoke sizes name their files
        assert name in written, f"{name} wrote no JSON (have {sorted(written)})"
        result = written[name]
        assert result["device"] and result["torch"] and result["date"], name
        ratios = [k for k in result if k.startswith("ratio_to_")]
        if ratios:
            baseline = ratios[0][len("ratio_to_"):]
            assert result[ratios[0]][baseline] == 1.0 and set(result[ratios[0]]) == set(result["seconds"])
    assert "energy: smoke run, nothing saved" in run.stdout
    assert not list((REPO / "benchmarks" / "results").glob("*_s8-*.json")), "a smoke run wrote to results/"


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
