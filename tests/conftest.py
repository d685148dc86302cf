import os
import random

import numpy as np
import pytest
import torch

os.environ.setdefault("SPHEREML_NO_DOWNLOAD", "1")  # nothing downloads during tests


@pytest.fixture(autouse=True)
def restore_rng():
    """Tests may seed freely; the global generators are restored afterwards."""
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    yield
    torch.set_rng_state(torch_state)
    random.setstate(py_state)
    np.random.set_state(np_state)


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
    suite stopped by a time limit (benchmarks/gpu_check.sh) still says why its tests failed.  Under xdist only
    the controller writes (the workers forward their reports to it)."""
    path = os.environ.get("SPHEREML_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as log:
            log.write(f"{report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


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


def sm90_compile_rows(benchmark: str) -> list[dict]:
    """``benchmarks.<benchmark>.compile_check()``'s rows: its Triton kernels compiled for an H100 on this machine
    (``benchmarks/sm90.py``), in a subprocess without TRITON_INTERPRET (the test process may interpret them)."""
    pytest.importorskip("triton.compiler", reason="needs Triton's compiler")
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = f"import json; from benchmarks.{benchmark} import compile_check; print(json.dumps(compile_check()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], text=True,
                          capture_output=True, env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])
