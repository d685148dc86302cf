"""Hyperspherical energy, forward + backward, s = 2: tiled (and Triton on a GPU) against dense.

Each measurement runs in a fresh subprocess so that its peak resident memory (``ru_maxrss``)
belongs to that backend alone; on CUDA the peak allocated device memory is used instead.  Times are
medians of 3 runs, except the slow single runs (dense on the CPU, N = 65,536).
The dense backend at N = 65,536 is run under an address-space limit of 24 GiB (the size of the
book's build machine), where it fails to allocate its N x N matrices; the tiled backend
completes under the same limit.  The baseline of the "within 1.5x" goal is three Gram
products W W^T of the same size, timed in the same subprocess as the tiled run.
"""

import json
import subprocess
import sys

import torch

from sphereml.book import write_json

from .harness import RESULTS, device_name

WORKER = r"""
import json, resource, sys, time, torch
from sphereml.energy import hyperspherical_energy
n, d, backend, device, limit = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
g = torch.Generator().manual_seed(0)
w = torch.randn(n, d, generator=g).to(device).requires_grad_(True)
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = {"n": n, "d": d, "backend": backend}
try:
    repeats = 3 if (n <= 16384 and backend != "dense") or device == "cuda" else 1
    times = []
    if backend == "gram":
        u = w.detach()
        for _ in range(repeats):
            sync(); t0 = time.perf_counter()
            for _ in range(3):
                u @ u.T
            sync(); times.append(time.perf_counter() - t0)
    else:
        hyperspherical_energy(w[:256], backend=backend).backward()  # warm-up (and Triton compile)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(repeats):
            w.grad = None
            sync(); t0 = time.perf_counter()
            hyperspherical_energy(w, s=2.0, backend=backend).backward()
            sync(); times.append(time.perf_counter() - t0)
    out["seconds"] = sorted(times)[len(times) // 2]
    out["repeats"] = repeats
    out["ok"] = True
except (RuntimeError, MemoryError) as exc:
    out["ok"] = False
    out["error"] = str(exc).splitlines()[0][:200]
if device == "cuda":
    out["peak_bytes"] = torch.cuda.max_memory_allocated()
else:
    out["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
print(json.dumps(out))
"""

GIB = 2**30


def _measure(n: int, d: int, backend: str, device: torch.device, limit: int = 0) -> dict:
    proc = subprocess.run([sys.executable, "-c", WORKER, str(n), str(d), backend, device.type, str(limit)],
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"n": n, "d": d, "backend": backend, "ok": False, "error": (proc.stderr or "killed").strip()[-200:]}
    return json.loads(lines[-1])


def _show(r: dict) -> None:
    if r.get("ok"):
        print(f"energy N={r['n']:6d} d={r['d']} {r['backend']:6s}: {r['seconds']:8.2f} s, "
              f"peak memory {r['peak_bytes'] / GIB:6.2f} GiB")
    else:
        print(f"energy N={r['n']:6d} d={r['d']} {r['backend']:6s}: failed ({r.get('error')})")


def run(device: torch.device) -> dict:
    result = {"benchmark": "energy_fwd_bwd", "device": device_name(device), "torch": torch.__version__, "runs": []}
    if device.type == "cuda":
        plan = [(32768, 512, "dense", 0), (32768, 512, "triton", 0), (32768, 512, "gram", 0)]
    else:
        plan = [(16384, 256, "dense", 0), (16384, 256, "tiled", 0), (16384, 256, "gram", 0),
                (65536, 256, "tiled", 24 * GIB), (65536, 256, "dense", 24 * GIB)]
    for n, d, backend, limit in plan:
        r = _measure(n, d, backend, device, limit)
        r["address_space_limit_gib"] = limit / GIB if limit else None
        result["runs"].append(r)
        _show(r)
    by = {(r["n"], r["backend"]): r for r in result["runs"] if r.get("ok")}
    n0 = 32768 if device.type == "cuda" else 16384
    fast = "triton" if device.type == "cuda" else "tiled"
    if (n0, "dense") in by and (n0, fast) in by:
        result["speedup_vs_dense"] = by[(n0, "dense")]["seconds"] / by[(n0, fast)]["seconds"]
        result["memory_ratio_vs_dense"] = by[(n0, fast)]["peak_bytes"] / max(by[(n0, "dense")]["peak_bytes"], 1)
        print(f"energy N={n0}: {fast} x{result['speedup_vs_dense']:.2f} faster than dense, "
              f"peak memory {result['memory_ratio_vs_dense']:.3f} of dense")
    if (n0, "gram") in by and (n0, fast) in by:
        result["ratio_to_three_gram_products"] = by[(n0, fast)]["seconds"] / by[(n0, "gram")]["seconds"]
        print(f"energy N={n0}: {fast} takes {result['ratio_to_three_gram_products']:.2f}x the time of three "
              "W W^T products of the same size")
    write_json(result, RESULTS / f"energy_fwd_bwd-{device.type}.json")
    return result
