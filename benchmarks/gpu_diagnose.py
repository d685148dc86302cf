"""Time (and catch failures of) each Triton energy configuration on its own, one subprocess per case.

``python benchmarks/gpu_diagnose.py`` on a CUDA machine prints one line per case: size, precision, the pinned
configuration (or autotuning), forward and forward + backward seconds, or the error.  Used to find a
configuration that fails or is slow without losing the rest of the run.
"""

import json
import os
import subprocess
import sys
import time

CASE = r"""
import json, sys, time, torch
from sphereml.energy import hyperspherical_energy
n, d, precision, part = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_float32_matmul_precision(precision)
g = torch.Generator().manual_seed(0)
w = torch.randn(n, d, generator=g).cuda().requires_grad_(True)
def run():
    e = hyperspherical_energy(w, s=2.0, backend="triton")
    if part == "fwd_bwd":
        e.backward()
    return e
run(); torch.cuda.synchronize()
times = []
for _ in range(3):
    w.grad = None
    torch.cuda.synchronize(); t0 = time.perf_counter(); e = run(); torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
print(json.dumps({"seconds": sorted(times)[1], "value": float(e)}))
"""


def case(n, d, precision, part, env=None, timeout=45):
    full_env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", **(env or {})}
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", CASE, str(n), str(d), precision, part], env=full_env,
                              capture_output=True, text=True, timeout=timeout)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:160]}
    except subprocess.TimeoutExpired:
        result = {"error": f"timeout {timeout} s"}
    result["wall"] = time.perf_counter() - started
    label = " ".join(f"{k.replace('SPHEREML_TRITON_', '')}={v}" for k, v in (env or {}).items()) or "autotuned"
    print(f"N={n} d={d} {precision:7s} {part:7s} {label:32s} "
          + (f"{result['seconds'] * 1e3:9.2f} ms" if "seconds" in result else f"FAILED: {result['error']}")
          + f"   ({result['wall']:.0f} s)", flush=True)
    return result


if __name__ == "__main__":
    n, d = 32768, 512
    for i in range(3):
        case(n, d, "highest", "fwd", {"SPHEREML_TRITON_FORWARD_CONFIG": str(i)})
    for j in range(1):
        case(n, d, "highest", "fwd_bwd",
             {"SPHEREML_TRITON_FORWARD_CONFIG": "0", "SPHEREML_TRITON_IEEE_BACKWARD_CONFIG": str(j)})
    for j in range(4):
        case(n, d, "medium", "fwd_bwd",
             {"SPHEREML_TRITON_FORWARD_CONFIG": "0", "SPHEREML_TRITON_BACKWARD_CONFIG": str(j)})
    for precision in ("high", "medium", "highest"):
        case(n, d, precision, "fwd_bwd")
    case(8192, 512, "highest", "fwd_bwd")
    case(32768, 256, "highest", "fwd_bwd")
