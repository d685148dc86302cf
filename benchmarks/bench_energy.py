"""Hyperspherical energy, forward + backward, s = 2: tiled (and Triton on a GPU) against dense.

Each measurement runs in a fresh subprocess (``python -m benchmarks.bench_energy --worker SPEC``),
so that its peak memory belongs to that backend alone (:class:`sphereml.timing.PeakMemory`: the
resident set or the allocated device memory above what the process held before; CUDA files written before
2026-11-27's afternoon count the inputs too), and under a timeout,
so one slow case cannot eat the run.
Times are medians of 3 runs, except the slow single runs (dense on the CPU, N = 65,536,
N = 2^20).

* CPU: N = 16,384, d = 256: dense, tiled and three Gram products W W^T (the baseline of the
  "within 1.5x" goal); N = 65,536 under an address-space limit of 24 GiB (the book's build
  machine), where dense fails to allocate its N x N matrices and tiled completes; the dense /
  tiled crossover at d = 256 (it sets ``sphereml.energy.TILED_ABOVE``); the Gram error of
  float32, TF32x3 and TF32 products emulated on the CPU (Note [close pairs]); the scaling study,
  time and peak memory of dense and tiled against N = 2^10 ... 2^16 at d = 256 under the same
  24 GiB limit (CUDA: dense, tiled and triton up to 2^20).
* CUDA (one run, a few minutes): N = 32,768, d = 512: dense; the two Triton backends, ``gemm``
  (cuBLAS products, one pair kernel) and ``triton`` (fused kernels), under each
  ``torch.set_float32_matmul_precision`` ("highest" -> ieee, "high" -> tf32, "medium" ->
  tf32) with three Gram products at the same precision, forward-only times, peak memory, the
  chosen autotuning configurations, and the error of value and gradient against a float64
  (tiled) reference; the dense / triton and dense / gemm (float32) and dense / tiled (float64)
  crossovers at d = 256 (they set ``TRITON_ABOVE`` and ``TILED_ABOVE_CUDA``); and N = 2^20, d = 512
  with each Triton backend (one fwd + bwd) at the most accurate precision whose time, extrapolated
  from N = 32,768, stays under ``HUGE_TARGET_S``.  The scaling study runs on CUDA only when asked for
  (``--only scaling``: ``gpu_check.sh scaling``), since it takes longer than the rest.

``--compile-check`` compiles every kernel configuration for sm_90 on the CPU (no GPU) and
prints registers and spills from ``ptxas -v`` (the fused kernels', then the ``gemm`` backend's).
``SPHEREML_BENCH_SMOKE=1`` (or ``--smoke``) runs every case at tiny sizes and saves nothing;
``--plan cuda`` runs the CUDA plan on CPU tensors (with ``TRITON_INTERPRET=1``), which is how
``tests/test_benchmarks.py::test_the_energy_benchmark_runs_both_plans_in_smoke_mode`` checks this file
without a GPU.  ``--only
crossover,emulated`` re-measures those parts and merges them into the saved JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from sphereml.timing import PeakMemory, median_seconds

from . import harness

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("highest", "high", "medium")
HUGE_TARGET_S = 90.0  # the N = 2^20 run picks the most accurate precision expected to finish within this
BUDGET_S = float(os.environ.get("SPHEREML_BENCH_BUDGET_S", "480"))  # all subprocesses of one run together


def _smoke() -> bool:
    return os.environ.get("SPHEREML_BENCH_SMOKE", "0") == "1"


# ---------------------------------------------------------------- the worker (one subprocess per case)

def _points(n: int, d: int, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    if device.type == "cuda" and n * d > 2**26:  # N = 2^20: draw on the device
        return torch.randn(n, d, device=device, generator=torch.Generator(device).manual_seed(0)).to(dtype)
    return torch.randn(n, d, generator=torch.Generator().manual_seed(0)).to(device, dtype)


def _median_time(fn, device: torch.device, repeats: int) -> float:
    return median_seconds(fn, device, repeats, warmup=0)  # cases warm up themselves, on a smaller input


def _energy_step(w: torch.Tensor, backend: str):
    from sphereml.energy import hyperspherical_energy

    def step():
        w.grad = None
        (_keops_energy(w) if backend == "keops" else hyperspherical_energy(w, s=2.0, backend=backend)).backward()

    return step


def _keops_energy(w: torch.Tensor) -> torch.Tensor:
    """The pair-mean Riesz s = 2 energy summed by KeOps (``pykeops``) symbolically, without the N x N matrix:
    the tool a reader would otherwise use.  The diagonal (r^2 = 0) is masked with KeOps' step function."""
    from pykeops.torch import LazyTensor

    from sphereml.geometry import normalize

    q = normalize(w)
    r2 = ((LazyTensor(q[:, None, :]) - LazyTensor(q[None, :, :])) ** 2).sum(-1)
    off_diagonal = (r2 - 1e-7).step()
    per_row = (off_diagonal / (r2 + 1 - off_diagonal)).sum(dim=1)
    return per_row.sum() / (len(q) * (len(q) - 1))


def _energy_forward(w: torch.Tensor, backend: str):
    from sphereml.energy import hyperspherical_energy

    def forward():
        with torch.no_grad():
            hyperspherical_energy(w, s=2.0, backend=backend)

    return forward


def _three_grams(u: torch.Tensor):
    def grams():
        for _ in range(3):
            u @ u.T

    return grams


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.detach().double().cpu() - exact).norm() / exact.norm())


def _case_fwd_bwd(spec: dict, device: torch.device) -> dict:
    """One backend (or the three Gram products): fwd + bwd median, forward-only median, peak memory."""
    n, d, backend, repeats = spec["n"], spec["d"], spec["backend"], spec["repeats"]
    w = _points(n, d, device).requires_grad_(True)
    if backend == "gram":
        with PeakMemory(device) as peak:
            out = {"seconds": _median_time(_three_grams(w.detach()), device, repeats)}
    else:
        _energy_step(w[:256].detach().clone().requires_grad_(True), backend)()  # warm-up (and Triton compile)
        with PeakMemory(device) as peak:
            out = {"seconds": _median_time(_energy_step(w, backend), device, repeats)}
            if spec.get("forward"):
                out["forward_seconds"] = _median_time(_energy_forward(w, backend), device, repeats)
    return {**out, "peak_bytes": peak.bytes}


def _config(kernel) -> str:
    """The autotuned configuration of the last launch, e.g. ``BM=64 BN=16 BD=32 BDO=256 warps=8 stages=2``."""
    cfg = getattr(kernel, "best_config", None)
    return "?" if cfg is None else _config_text(cfg)


def _config_text(cfg) -> str:
    blocks = [f"{k}={v}" for k, v in cfg.kwargs.items()]
    return " ".join(blocks + [f"warps={cfg.num_warps}", f"stages={cfg.num_stages}"])


def _case_fused_suite(spec: dict, device: torch.device) -> dict:
    """One Triton backend (``spec["backend"]``: the fused kernels ``triton`` or ``gemm``) at each matmul precision:
    time, forward time, Gram products, peak memory, configurations (``triton``), error against float64."""
    from sphereml.energy import _triton_kernels as kernels
    from sphereml.energy import hyperspherical_energy

    n, d, repeats, backend = spec["n"], spec["d"], spec["repeats"], spec.get("backend", "triton")
    w = _points(n, d, device).requires_grad_(True)
    exact_w = w.detach().double().requires_grad_(True)
    exact_value = hyperspherical_energy(exact_w, s=2.0, backend="tiled")
    exact_value.backward()
    exact_value, exact_grad = exact_value.detach().cpu(), exact_w.grad.cpu()
    del exact_w
    runs = {}
    for precision in PRECISIONS:
        torch.set_float32_matmul_precision(precision)
        step = _energy_step(w, backend)
        started = time.perf_counter()
        step()  # compile (and for triton autotune) at this size (the autotuning key holds the precision)
        if device.type == "cuda":
            torch.cuda.synchronize()
        tune_seconds = time.perf_counter() - started
        value = hyperspherical_energy(w, s=2.0, backend=backend)
        w.grad = None
        value.backward()
        errors = {"value_relative_error": _relative_error(value, exact_value),
                  "grad_relative_error": _relative_error(w.grad, exact_grad)}
        with PeakMemory(device) as peak:
            seconds = _median_time(step, device, repeats)
        configs = {} if backend != "triton" else {"forward_config": _config(kernels.forward_kernel),
                                                  "backward_config": _config(kernels.backward_kernel)}
        runs[precision] = {"seconds": seconds, "forward_seconds": _median_time(_energy_forward(w, backend), device,
                                                                               repeats),
                           "gram_seconds": _median_time(_three_grams(w.detach()), device, repeats),
                           "peak_bytes": peak.bytes, "first_call_seconds": tune_seconds, **errors, **configs}
    torch.set_float32_matmul_precision("highest")
    return {"precisions": runs}


def _case_crossover(spec: dict, device: torch.device) -> dict:
    """Round-robin medians of a slow and a fast backend at each size; the size above which fast wins."""
    from sphereml.timing import compare

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    out = {}
    for dtype_name, slow, fast in spec["pairs"]:
        dtype = getattr(torch, dtype_name)
        seconds = {slow: [], fast: []}
        for n in spec["sizes"]:
            w = _points(n, spec["d"], device, dtype).requires_grad_(True)
            timing = compare({b: _energy_step(w, b) for b in (slow, fast)}, slow, device, repeats=spec["repeats"],
                             warmup=1)
            for b in (slow, fast):
                seconds[b].append(timing.seconds[b])
        faster = [f <= s for f, s in zip(seconds[fast], seconds[slow])]
        # the recommended threshold: the largest size where slow still wins, if fast wins at every size above
        above = None if not faster[-1] else max([0] + [n for n, ok in zip(spec["sizes"], faster) if not ok])
        out[f"{dtype_name} {slow} vs {fast}"] = {"sizes": spec["sizes"], "seconds": seconds, "fast_above": above,
                                                 "d": spec["d"], "dtype": dtype_name, "slow": slow, "fast": fast,
                                                 "threads": torch.get_num_threads()}
    return out


def _case_huge(spec: dict, device: torch.device) -> dict:
    """One fwd + bwd of ``spec["backend"]`` at N = 2^20 (triton after tuning on a prefix, as its launcher does)."""
    from sphereml.energy.triton_backend import TUNE_CAP

    torch.set_float32_matmul_precision(spec["precision"])
    w = _points(spec["n"], spec["d"], device).requires_grad_(True)
    _energy_step(w[:TUNE_CAP].detach().clone().requires_grad_(True), spec["backend"])()  # compile (+ autotune)
    with PeakMemory(device) as peak:
        seconds = _median_time(_energy_step(w, spec["backend"]), device, 1)
    return {"seconds": seconds, "peak_bytes": peak.bytes, "finite_grad": bool(torch.isfinite(w.grad).all())}


CASES = {"fwd_bwd": _case_fwd_bwd, "fused_suite": _case_fused_suite, "crossover": _case_crossover,
         "huge": _case_huge}


def worker(spec: dict) -> dict:
    """Run one case in this process; never raises (an error becomes ``ok: False``)."""
    device = torch.device(spec["device"])
    out = {k: v for k, v in spec.items() if k not in ("device", "limit")}
    if spec.get("limit"):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (spec["limit"], spec["limit"]))
    try:
        out.update(CASES[spec["kind"]](spec, device))
        out["ok"] = True
    except (RuntimeError, MemoryError, ValueError) as exc:
        out["ok"] = False
        out["error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return out


# ---------------------------------------------------------------- the parent: plans, timeouts, report

class _Runner:
    """Runs specs in subprocesses (or in this process) within one time budget."""

    def __init__(self, device: torch.device, inline: bool):
        self.device, self.inline = device, inline
        self.deadline = time.monotonic() + BUDGET_S

    def __call__(self, spec: dict, timeout: float) -> dict:
        spec = {**spec, "device": self.device.type}
        if self.inline:
            return worker(spec)
        left = self.deadline - time.monotonic()
        if left < 5:
            return {**spec, "ok": False, "error": f"skipped: the run's budget of {BUDGET_S:.0f} s is spent"}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        try:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_energy", "--worker", json.dumps(spec)],
                                  capture_output=True, text=True, cwd=ROOT, env=env, timeout=min(timeout, left))
        except subprocess.TimeoutExpired:
            return {**spec, "ok": False, "error": f"timed out after {min(timeout, left):.0f} s"}
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines:
            return {**spec, "ok": False, "error": (proc.stderr or "killed").strip()[-300:]}
        return json.loads(lines[-1])


def _show(r: dict) -> None:
    label = f"energy N={r.get('n', '-')!s:>7} d={r.get('d', '-')} {r.get('backend', r['kind']):7s}"
    if not r.get("ok"):
        print(f"{label}: failed ({r.get('error')})")
    elif "seconds" in r:
        extra = f", forward only {r['forward_seconds']:.3f} s" if "forward_seconds" in r else ""
        print(f"{label}: {r['seconds']:8.3f} s{extra}, peak memory {r['peak_bytes'] / GIB:6.2f} GiB")


def _show_crossover(result: dict) -> None:
    for name, c in result.items():
        rows = "  ".join(f"N={n}: {s * 1e3:.1f}/{f * 1e3:.1f} ms" for n, s, f in
                         zip(c["sizes"], c["seconds"][c["slow"]], c["seconds"][c["fast"]]))
        print(f"energy crossover d={c['d']} {name} ({c['slow']}/{c['fast']}): {rows}")
        print(f"energy crossover {name}: {c['fast']} is faster above N = {c['fast_above']}")


def emulated_gram_errors(n: int = 512, dims=(3, 64, 512), seed: int = 0) -> dict:
    """|Gram r^2 - exact r^2| for unit rows with float32, TF32x3 and TF32 products emulated on the CPU.

    TF32 keeps 10 mantissa bits (round to nearest, as ``cvt.rna.tf32.f32``); its products are exact
    in float32 and accumulated in float32.  TF32x3 splits each operand into a TF32 high part and a
    TF32 low part and adds three of the four products.  Squared norms are float32, as in the kernel.
    """
    def tf32(x):
        bits = x.view(torch.int32)
        return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)

    def products(a, kind):
        if kind == "float32":
            return a @ a.T
        hi = tf32(a)
        if kind == "tf32":
            return (hi.double() @ hi.double().T).float()
        lo = tf32(a - hi)
        return (hi.double() @ hi.double().T + hi.double() @ lo.double().T + lo.double() @ hi.double().T).float()

    from sphereml.energy.kernels import CLOSE_R2

    out = {}
    for d in dims:
        q = torch.nn.functional.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)
        q64 = q.double()
        exact = torch.cdist(q64, q64).square()
        off = ~torch.eye(n, dtype=torch.bool)
        sq = (q * q).sum(1)
        for kind in ("float32", "tf32x3", "tf32"):
            raw = (sq[:, None] + sq[None, :] - 2 * products(q, kind)).double()
            err = (raw - exact)[off].abs()
            near = off & (exact >= CLOSE_R2) & (exact < 2 * CLOSE_R2)  # the closest pairs left to the Gram
            out[f"d={d} {kind}"] = {"max_abs": float(err.max()), "median_abs": float(err.median()),
                                    "max_relative_near_threshold": float(((raw - exact).abs() / exact)[near].max())
                                    if bool(near.any()) else None}
    return out


def _cpu_plan(smoke: bool) -> list:
    n, d, big = (64, 8, 128) if smoke else (16384, 256, 65536)
    limit = 0 if smoke else 24 * GIB
    return [dict(kind="fwd_bwd", n=n, d=d, backend="dense", repeats=1, timeout=600),
            dict(kind="fwd_bwd", n=n, d=d, backend="tiled", repeats=3, timeout=300),
            dict(kind="fwd_bwd", n=n, d=d, backend="gram", repeats=3, timeout=300),
            dict(kind="fwd_bwd", n=big, d=d, backend="tiled", repeats=1, limit=limit, timeout=900),
            dict(kind="fwd_bwd", n=big, d=d, backend="dense", repeats=1, limit=limit, timeout=600)]


def _keops_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("pykeops") is not None


SCALING_D = 256
SCALING_TIME_CAP_S = 600.0  # a backend stops when its next point, extrapolated as O(N^2), would take longer
SCALING_SIZES = [2**k for k in range(10, 17)]  # 1,024 ... 65,536 on the CPU
SCALING_SIZES_CUDA = [2**k for k in range(10, 21)]  # ... 2^20 on a GPU


def run_scaling(run: _Runner, backends: tuple[str, ...], sizes: list[int], limit: int, smoke: bool) -> dict:
    """Time and peak memory of fwd + bwd against N for each backend, one subprocess per point, under an
    address-space limit of ``limit`` bytes (0: none).  A backend stops at its first failure, or when its
    time extrapolated to the next N (x 4, the O(N^2) work) would exceed ``SCALING_TIME_CAP_S``."""
    d = 8 if smoke else SCALING_D
    sizes = sizes[:2] if smoke else sizes
    out = {"d": d, "address_space_limit_gib": limit / GIB or None, "time_cap_s": SCALING_TIME_CAP_S, "backends": {}}
    for backend in backends:
        points = []
        for n in sizes:
            n = n if not smoke else n // 16
            predicted = points[-1]["peak_bytes"] * (n / points[-1]["n"]) ** 2 if points else 0
            if backend == "dense" and limit and predicted > limit:
                # The machine's RAM is the limit too: a dense case allowed to grow towards it would push the
                # machine into the OOM killer rather than fail cleanly, so its O(N^2) memory is predicted.
                points.append({"n": n, "ok": False, "seconds": None, "peak_bytes": None,
                               "error": f"not run: O(N^2) memory predicts {predicted / GIB:.0f} GiB, over the limit"})
                print(f"energy N={n:>7} d={d} dense  : {points[-1]['error']}")
                break
            r = run(dict(kind="fwd_bwd", n=n, d=d, backend=backend, repeats=3 if n <= 4096 else 1, limit=limit),
                    timeout=900)
            points.append({k: r.get(k) for k in ("n", "seconds", "peak_bytes", "ok", "error")})
            _show(r)
            if not r.get("ok") or r["seconds"] * 4 > SCALING_TIME_CAP_S:
                break
        done = [p["n"] for p in points if p["ok"]]
        out["backends"][backend] = {"points": points, "largest_completed": max(done) if done else None}
    return out


def _crossover_spec(plan: str, smoke: bool) -> dict:
    if plan == "cuda":
        sizes = [32, 64] if smoke else [256, 512, 1024, 2048, 4096, 8192]
        pairs = [["float32", "dense", "triton"], ["float32", "dense", "gemm"], ["float64", "dense", "tiled"]]
    else:
        sizes = [16, 32] if smoke else [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
        pairs = [["float32", "dense", "tiled"]]
        # one thread: on the shared 2-core machine two OpenMP threads spent most of a small
        # case waiting for each other (dense N = 64: 56 ms with 2 threads, 0.8 ms with 1)
        return dict(kind="crossover", d=16 if smoke else 256, sizes=sizes, pairs=pairs, repeats=5, threads=1,
                    timeout=300)
    return dict(kind="crossover", d=16 if smoke else 256, sizes=sizes, pairs=pairs, repeats=3, timeout=150)


CUDA_PARTS = ("main", "crossover", "huge")  # the CUDA plan without --only; "scaling" is a part of its own


def _run_cuda_plan(run: _Runner, result: dict, smoke: bool, only: set | None) -> None:
    parts = set(CUDA_PARTS) if only is None else only
    n, d = (64, 16) if smoke else (32768, 512)
    suites = {}
    if "main" in parts:
        suites = _run_cuda_main(run, result, n, d)
    if "crossover" in parts:
        crossover = run({k: v for k, v in _crossover_spec("cuda", smoke).items() if k != "timeout"}, timeout=150)
        result["crossover"] = {k: v for k, v in crossover.items() if " vs " in k} or crossover
        _show_crossover(result["crossover"]) if crossover.get("ok") else print(f"energy crossover failed: {crossover}")
    if "scaling" in parts:
        backends = ("dense", "tiled", "triton", "gemm") + (("keops",) if _keops_importable() else ())
        result["scaling"] = run_scaling(run, backends, SCALING_SIZES_CUDA, 0, smoke)
    if "huge" in parts:
        _run_cuda_huge(run, result, suites, n, d, smoke)


FUSED = ("gemm", "triton")  # the Triton backends the CUDA plan times, the cheaper first


def _run_cuda_main(run: _Runner, result: dict, n: int, d: int) -> dict:
    """Dense against each Triton backend at each float32 matmul precision, N = n, d = d; {backend: suite}."""
    dense = run(dict(kind="fwd_bwd", n=n, d=d, backend="dense", repeats=3, forward=True), timeout=150)
    result["runs"].append(dense)
    _show(dense)
    print("energy: Gram products run in cuBLAS at torch's setting (highest: FP32; high and medium: TF32), the triton "
          "kernel at highest: ieee, high and medium: tf32, the gemm backend's products in cuBLAS")
    suites = {}
    for backend in FUSED:
        suite = suites[backend] = run(dict(kind="fused_suite", backend=backend, n=n, d=d, repeats=3), timeout=300)
        result["runs"].append(suite)
        if not suite.get("ok"):
            print(f"energy N={n} d={d} {backend}: failed ({suite.get('error')})")
        for precision, r in suite.get("precisions", {}).items():
            configs = f"; configs {r['forward_config']} / {r['backward_config']}" if "forward_config" in r else ""
            print(f"energy N={n} d={d} {backend} {precision:7s}: {r['seconds']:.4f} s fwd+bwd, forward only "
                  f"{r['forward_seconds']:.4f} s, three Gram products {r['gram_seconds']:.4f} s -> "
                  f"{backend}/gram x{r['seconds'] / r['gram_seconds']:.2f}, peak memory "
                  f"{r['peak_bytes'] / GIB:.2f} GiB, error vs float64: value {r['value_relative_error']:.1e}, "
                  f"gradient {r['grad_relative_error']:.1e} (first call {r['first_call_seconds']:.1f} s{configs})")
            if dense.get("ok"):
                print(f"energy N={n} d={d} {backend} {precision:7s} / dense: x{r['seconds'] / dense['seconds']:.2f} "
                      f"time, x{r['peak_bytes'] / max(dense['peak_bytes'], 1):.4f} peak memory")
    return suites


def _run_cuda_huge(run: _Runner, result: dict, suites: dict, n: int, d: int, smoke: bool) -> None:
    # N = 2^20 for each backend: the most accurate precision whose time extrapolated from N (x (2^20 / N)^2) fits
    # HUGE_TARGET_S
    huge_n = 128 if smoke else 2**20
    for backend in FUSED:
        measured = suites.get(backend, {}).get("precisions", {})
        precision = next((p for p in PRECISIONS if p in measured
                          and measured[p]["seconds"] * (huge_n / n) ** 2 <= HUGE_TARGET_S), "medium")
        estimate = measured.get(precision, {}).get("seconds", 0.1) * (huge_n / n) ** 2
        huge = run(dict(kind="huge", n=huge_n, d=d, precision=precision, backend=backend),
                   timeout=max(60.0, min(300.0, 2.5 * estimate + 30)))
        result["runs"].append(huge)
        print(f"energy N={huge_n} d={d} {backend} at precision {precision!r} (extrapolated {estimate:.0f} s): "
              + (f"{huge['seconds']:.1f} s fwd+bwd, peak memory {huge['peak_bytes'] / GIB:.2f} GiB"
                 if huge.get("ok") else f"failed ({huge.get('error')})"))


def _run_cpu_plan(run: _Runner, result: dict, smoke: bool, only: set | None) -> None:
    if only is None or "main" in only:
        for spec in _cpu_plan(smoke):
            r = run({k: v for k, v in spec.items() if k != "timeout"}, timeout=spec["timeout"])
            r["address_space_limit_gib"] = spec.get("limit", 0) / GIB or None
            result["runs"].append(r)
            _show(r)
        by = {(r["n"], r["backend"]): r for r in result["runs"] if r.get("ok")}
        n0 = _cpu_plan(smoke)[0]["n"]
        if (n0, "dense") in by and (n0, "tiled") in by:
            result["speedup_vs_dense"] = by[(n0, "dense")]["seconds"] / by[(n0, "tiled")]["seconds"]
            result["memory_ratio_vs_dense"] = by[(n0, "tiled")]["peak_bytes"] / max(by[(n0, "dense")]["peak_bytes"], 1)
            print(f"energy N={n0}: tiled x{result['speedup_vs_dense']:.2f} faster than dense, "
                  f"peak memory {result['memory_ratio_vs_dense']:.3f} of dense")
        if (n0, "gram") in by and (n0, "tiled") in by:
            result["ratio_to_three_gram_products"] = by[(n0, "tiled")]["seconds"] / by[(n0, "gram")]["seconds"]
            print(f"energy N={n0}: tiled takes {result['ratio_to_three_gram_products']:.2f}x the time of three "
                  "W W^T products of the same size")
    if only is None or "crossover" in only:
        spec = _crossover_spec("cpu", smoke)
        crossover = run({k: v for k, v in spec.items() if k != "timeout"}, timeout=spec["timeout"])
        result["crossover"] = {k: v for k, v in crossover.items() if " vs " in k} or crossover
        _show_crossover(result["crossover"]) if crossover.get("ok") else print(f"energy crossover failed: {crossover}")
    if only is None or "scaling" in only:
        backends = ("dense", "tiled") + (("keops",) if _keops_importable() else ())
        result["scaling"] = run_scaling(run, backends, SCALING_SIZES, 0 if smoke else 24 * GIB, smoke)
        if "keops" not in backends:
            print("energy scaling: pykeops is not installed, so there is no KeOps column (pip install pykeops)")
    if only is None or "emulated" in only:
        result["gram_error_emulated"] = emulated_gram_errors(64 if smoke else 512)
        for name, e in result["gram_error_emulated"].items():
            near = e["max_relative_near_threshold"]
            print(f"energy Gram r^2 error {name:14s}: max {e['max_abs']:.1e}, median {e['median_abs']:.1e}, max "
                  f"relative for r^2 in [0.05, 0.1): {'no such pairs' if near is None else f'{near:.1e}'}")


def run(device: torch.device, smoke: bool | None = None, plan: str | None = None, inline: bool = False,
        only: set | None = None) -> dict:
    """Run the plan of ``device`` (or ``plan``); save benchmarks/results/energy_fwd_bwd-<device>.json unless smoke."""
    smoke = _smoke() if smoke is None else smoke
    plan = plan or device.type
    result = {"benchmark": "energy_fwd_bwd", "plan": plan, "smoke": smoke, "runs": []}
    run_spec = _Runner(device, inline)
    if plan == "cuda":
        _run_cuda_plan(run_spec, result, smoke, only)
    else:
        _run_cpu_plan(run_spec, result, smoke, only)
    if smoke:
        print("energy: smoke run, nothing saved")
        return result
    if only is not None:  # merge into the saved result
        path = harness.RESULTS / f"energy_fwd_bwd-{device.type}.json"
        saved = json.loads(path.read_text()) if path.exists() else {}
        result = {**saved, **{k: v for k, v in result.items() if k != "runs" or v}}
    harness.save(result, "energy_fwd_bwd", device)
    return result


def compile_check(arch: int = 90) -> list[dict]:
    """Compile every autotuning configuration of the energy kernels for ``sm_<arch>`` without a GPU.

    Reports ``ptxas -v`` registers and spill stores per (kernel, precision, configuration)
    (:func:`benchmarks.sm90.compile_kernel`): the check that chose the configurations in
    :mod:`sphereml.energy._triton_kernels`.  Must run without TRITON_INTERPRET.
    """
    from sphereml.energy import _triton_kernels as kernels

    from .sm90 import compile_kernel

    types = {"Q": "*fp32", "SQ": "*fp32", "OUT": "*fp32", "GRAD": "*fp32", "M": "i32", "D": "i32", "stride": "i32",
             "M_KEY": "i32", "s": "fp32", "eps": "fp32", "close_r2": "fp32"}
    rows = []
    for name, kernel in (("forward", kernels.forward_kernel), ("backward", kernels.backward_kernel)):
        for precision in ("ieee", "tf32x3", "tf32"):
            configs = kernel.configs if name == "forward" else kernels._backward_configs(
                kernel.configs, {"D": 512}, PRECISION=precision)
            for cfg in configs:
                constants = {"POWER": 2, "PRECISION": precision, **cfg.kwargs}
                row = {"kernel": name, "precision": precision, "config": _config_text(cfg),
                       **compile_kernel(kernel, types, constants, cfg.num_warps, cfg.num_stages, arch)}
                rows.append(row)
                print(f"compile sm_{arch} {name:8s} {precision:6s} {row['config']:40s} "
                      f"{row['compile_seconds']:5.1f} s, "
                      f"registers {row.get('registers')}, spill stores {row.get('spill_store_bytes')} B, "
                      f"shared {row['shared_bytes']} B", flush=True)
    return rows


def gemm_compile_check(arch: int = 90) -> list[dict]:
    """Compile the ``gemm`` backend's two kernels (:mod:`sphereml.energy._gemm_kernels`) for ``sm_<arch>`` without a
    GPU, for each s fast path (and the pair kernel with and without the gradient): ``ptxas -v`` registers and spills.
    Compiled with one pipeline stage, as ``sphereml.energy.gemm_backend`` launches them.  Must run without
    TRITON_INTERPRET."""
    from sphereml.energy import _gemm_kernels as kernels

    from .sm90 import compile_kernel

    types = {"G": "*fp32", "Q": "*fp32", "SQ": "*fp32", "VALS": "*fp32", "DSUM": "*fp32", "FLAGS": "*i32",
             "GRAD": "*fp32", "row0": "i32", "b": "i32", "M": "i32", "D": "i32", "stride_q": "i32", "stride_g": "i32",
             "stride_grad": "i32", "tiles": "i32", "s": "fp32", "eps": "fp32", "close_r2": "fp32"}
    (bm, bn, warps), (bdo, fb, close_warps) = kernels.PAIR_BLOCKS, kernels.CLOSE_BLOCKS
    forms = [("pair", kernels.pair_kernel, {"WITH_GRAD": grad, "BM": bm, "BN": bn}, warps) for grad in (True, False)]
    forms.append(("close gradient", kernels.close_gradient_kernel, {"BM": bm, "BN": bn, "BDO": bdo, "FB": fb},
                  close_warps))
    rows = []
    for name, kernel, constants, num_warps in forms:
        for power in (0, 1, 2, -1):
            row = {"kernel": name, "power": power, **{k: v for k, v in constants.items() if k == "WITH_GRAD"},
                   **compile_kernel(kernel, types, {"POWER": power, **constants}, num_warps, 1, arch)}
            rows.append(row)
            print(f"compile sm_{arch} gemm {name:14s} POWER {power:2d} {constants}: registers {row['registers']}, "
                  f"spill stores {row['spill_store_bytes']} B", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help="run one case (JSON spec) and print its result as JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, nothing saved")
    parser.add_argument("--plan", choices=("cpu", "cuda"), help="the plan to run (default: the device's)")
    parser.add_argument("--inline", action="store_true", help="run the cases in this process (smoke runs)")
    parser.add_argument("--only", help="comma-separated parts of the plan: main, crossover, scaling, emulated (CPU); "
                                       "main, crossover, scaling, huge (CUDA, whose default leaves out scaling)")
    parser.add_argument("--compile-check", type=int, metavar="ARCH", nargs="?", const=90,
                        help="compile every kernel configuration for sm_ARCH (default 90) on the CPU and report "
                             "registers and spills (no GPU needed)")
    args = parser.parse_args(argv)
    if args.compile_check:
        compile_check(args.compile_check)
        gemm_compile_check(args.compile_check)
        return
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    from sphereml.energy.triton_backend import interpreting

    # Under TRITON_INTERPRET=1 the CUDA plan is emulated on CPU tensors, even where a real GPU is present.
    device = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")
    result = run(device, smoke=args.smoke or None, plan=args.plan, inline=args.inline,
                 only=set(args.only.split(",")) if args.only else None)
    if args.smoke:
        print(json.dumps({"ok": all(r.get("ok") for r in result["runs"]) and bool(result.get("crossover"))}))


if __name__ == "__main__":
    main()
