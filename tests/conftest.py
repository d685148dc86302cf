import os
import random
import zlib

import numpy as np
import pytest
import torch

os.environ.setdefault("SPHEREML_NO_DOWNLOAD", "1")  # nothing downloads during tests


@pytest.fixture(autouse=True)
def restore_rng(request):
    """Every test starts from global generators seeded by its own node id, so an unseeded draw is the same in every
    run whatever ran before it (module fixtures, other files, a subset); tests may seed freely, and the generators
    are restored afterwards."""
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    yield
    torch.set_rng_state(torch_state)
    random.setstate(py_state)
    np.random.set_state(np_state)


@pytest.fixture(autouse=True)
def no_saved_trainings(monkeypatch):
    """No test saves or restores trainings (sphereml.book.resume) unless it sets SPHEREML_RESUME itself."""
    monkeypatch.delenv("SPHEREML_RESUME", raising=False)


@pytest.fixture(autouse=True)
def restore_backends():
    """A chapter's run sets cuDNN's and cuBLAS's numerics for the process (``configure_backends``); tests that run
    one leave the next test in the same worker the defaults."""
    cudnn, precision = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32), \
        torch.get_float32_matmul_precision()
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = cudnn
    torch.set_float32_matmul_precision(precision)


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors (and the Triton interpreter's small numpy ops): one thread is faster and immune to
    OpenMP contention on a shared machine.  Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_runtest_logreport(report):
    """With $SPHEREML_FAILURE_LOG set, append each failure's node id and message to that file as it happens, so a
    suite stopped by a time limit (benchmarks/gpu_check.sh) still says why its tests failed; with
    $SPHEREML_DURATION_LOG, each test's duration.  Under xdist only the controller writes (the workers forward
    their reports to it)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    path = os.environ.get("SPHEREML_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"{report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
    path = os.environ.get("SPHEREML_DURATION_LOG")  # each test's time as it ends: the slow ones of a stopped suite
    if path and report.when == "call":
        with open(path, "a") as log:
            log.write(f"{report.duration:8.2f} {report.outcome:7} {report.nodeid}\n")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "needs_cuda" in item.keywords:
            item.add_marker(skip)


_FUZZ_CASES = pytest.StashKey()


@pytest.fixture
def fuzz_cases(request):
    """A Counter of fuzz cases run, per test; the terminal summary reports the total."""
    from collections import Counter

    return request.config.stash.setdefault(_FUZZ_CASES, Counter())


def pytest_terminal_summary(terminalreporter, config):
    cases = config.stash.get(_FUZZ_CASES, None)
    if cases:
        terminalreporter.write_line(f"fuzzing: {sum(cases.values())} cases over {len(cases)} property tests")


def sm90_compile_rows(benchmark: str, function: str = "compile_check") -> list[dict]:
    """``benchmarks.<benchmark>.<function>()``'s rows: its Triton kernels compiled for an H100 on this machine
    (``benchmarks/sm90.py``), in a subprocess without TRITON_INTERPRET (the test process may interpret them)."""
    pytest.importorskip("triton.compiler", reason="needs Triton's compiler")
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = f"import json; from benchmarks.{benchmark} import {function}; print(json.dumps({function}()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], text=True,
                          capture_output=True, env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


_LOOP_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def total(X, n):
    acc = 0.0
    for i in range(0, n):
        acc += tl.load(X + i)
    tl.store(X, acc)

x = torch.ones(3)
total[(1,)](x, 3)
assert x[0].item() == 3.0
"""


def triton_interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run our kernels here, or None: a three-line kernel with a loop over a
    runtime bound, interpreted in a subprocess.  Only the known failure is a reason to skip: Triton 3.6's
    interpreter holds scalars as one-element arrays and converts them with ``int()``, which NumPy 2.4 refuses
    ("only 0-dimensional arrays can be converted"); the compiled kernels are unaffected."""
    import subprocess
    import sys

    pytest.importorskip("triton", reason="needs Triton")
    done = subprocess.run([sys.executable, "-c", _LOOP_PROBE], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=120)
    if done.returncode == 0 or "only 0-dimensional arrays" not in done.stderr:
        return None  # it works, or fails for another reason, which the test itself should show
    import numpy
    import triton

    last = done.stderr.strip().splitlines()[-1]
    return f"Triton {triton.__version__}'s interpreter fails with NumPy {numpy.__version__}: {last[-200:]}"

