"""The benchmarks' shared parts: round-robin comparisons (``sphereml.timing``) printed and saved as JSON."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from sphereml.launches import count_ops
from sphereml.timing import compare as compare_round_robin
from sphereml.timing import device_name, environment, peak_memory, save_result, synchronizer, training_step

__all__ = ["RESULTS", "SMOKE", "smoke_or", "sized_name", "compiling", "compile_counters", "first_call", "compare",
           "device_name", "environment", "save", "training_step"]

# SPHEREML_BENCH_RESULTS sends the JSON elsewhere (the smoke test writes to a temporary folder).
RESULTS = Path(os.environ.get("SPHEREML_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
# SPHEREML_BENCH_SMOKE=1: every benchmark at tiny sizes with one repeat, so the test suite runs the whole
# harness (`tests/test_benchmarks.py`); the numbers mean nothing and are never pass/fail.
SMOKE = os.environ.get("SPHEREML_BENCH_SMOKE", "0") == "1"


def smoke_or(full, tiny):
    """``tiny`` in a smoke run, ``full`` otherwise."""
    return tiny if SMOKE else full



def sized_name(stem: str, size: tuple[int, int, int], first: tuple[int, int, int]) -> str:
    """A layer benchmark's result name: ``stem`` for its first (batch, channels, side) size, else the size appended."""
    b, c, side = size
    return stem if size == first else f"{stem}_b{b}_c{c}_s{side}"


def compiling(device: torch.device) -> bool:
    """Whether a benchmark also times ``torch.compile`` candidates: on CUDA, never in a smoke run (compiling
    takes longer than the rest of the suite, which the tests run on a GPU box too), and not with
    ``SPHEREML_BENCH_COMPILE=0``."""
    return device.type == "cuda" and not SMOKE and os.environ.get("SPHEREML_BENCH_COMPILE", "1") != "0"


# What the compiler did during each candidate's first calls (``first_call``), by label, until ``compare`` saves it.
_COMPILED: dict[str, dict[str, int]] = {}


def compile_counters() -> dict[str, int]:
    """Totals of TorchDynamo's and Inductor's counters so far in this process: graphs compiled, graph breaks,
    graphs for which Inductor skipped CUDA graphs, and the inputs that a recorded CUDA graph copies in at every
    replay (tensors that are not parameters, buffers or otherwise static).  Never reads tensor data."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
            "copied_inputs": counters["inductor"]["cudagraph_recorded_non_static_inputs"]}


def first_call(benchmark: str, label: str, candidate: Callable[[], object],
               calls: int | None = None) -> Callable[[], object] | None:
    """``candidate`` after ``calls`` calls (default: three where CUDA is available, one elsewhere), which compile
    it where it is compiled; None, with the failure printed, when one of them fails, so that a candidate that cannot
    compile drops out alone.  Three with CUDA because ``mode="reduce-overhead"`` runs a step once as it is, records
    the CUDA graph at the second call and replays it from the third: an operation that cannot be captured
    (``linalg.solve`` in OPT's Cayley transform on an H100, 2026-12-06) fails at the second, which was inside the
    timing and took the whole benchmark down with it.  Not yet run on a GPU: whether the CUDA work after a failed
    capture runs on in the same process is the next GPU run's to see.  Where the calls compiled something, what
    the compiler made of it (:func:`compile_counters`) is printed and saved with the result, under "compiler"."""
    calls = (3 if torch.cuda.is_available() else 1) if calls is None else calls
    before = compile_counters()
    try:
        for _ in range(calls):
            candidate()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(f"{benchmark}: {label} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        return None
    done = {key: value - before[key] for key, value in compile_counters().items()}
    if done["graphs"]:  # compiled here: what became of it, printed and kept for the result file
        _COMPILED[label] = done
        print(f"{benchmark}: {label} compiled: " + ", ".join(f"{value} {key.replace('_', ' ')}"
                                                          for key, value in done.items()))
    return candidate


def save(result: dict, name: str, device: torch.device) -> Path:
    """``benchmarks/results/<name>-<cpu|cuda>.json``, with the environment that produced it."""
    return save_result({**environment(device), **result}, RESULTS / f"{name}-{device.type}.json")


def compare(name: str, candidates: dict[str, Callable[[], object]], baseline: str, device: torch.device,
            repeats: int = 10, extra: dict | None = None, count: bool = False, large: int = 0) -> dict:
    """Time every candidate in one interleaved run, print each one's ratio to ``baseline`` and its peak memory
    (:func:`sphereml.timing.peak_memory`, one more warm call each), and save JSON.  ``count``: also the aten
    operations of one call (:func:`sphereml.launches.count_ops`, about one kernel launch each on a GPU);
    ``large`` (with ``count``): also those that touch a tensor of at least that many elements (the passes over
    memory that set a large layer's time)."""
    for fn in candidates.values():  # the warm-up calls (compilation, caches), untimed, before the counters are read
        for _ in range(2):
            fn()
    synchronizer(device)()
    before = compile_counters()
    timing = compare_round_robin(candidates, baseline, device, repeats=smoke_or(repeats, 1), warmup=0)
    late = compile_counters()["graphs"] - before["graphs"]
    if late:  # a candidate compiled again inside the timing: its times include compiling
        print(f"{name}: {late} graph(s) compiled while timed (recompilation): the compiled times include it")
    memory = {label: peak_memory(fn, device) for label, fn in candidates.items()}  # one more call each, warm
    result = {"benchmark": name, "seconds": timing.seconds, "ratio_to_" + baseline: timing.ratios,
              "peak_bytes": memory, **(extra or {})}
    compiler = {label: _COMPILED.pop(label) for label in candidates if label in _COMPILED}
    if compiler:  # what the compiler made of each compiled candidate (first_call)
        result["compiler"] = compiler
    if late:
        result["graphs_compiled_while_timed"] = late
    if count:  # compiled candidates run kernels of their own: counted as eager only
        result["ops_per_call"] = {label: count_ops(fn).total for label, fn in candidates.items()
                                  if "compiled" not in label}
        if large:
            result["large_ops_per_call"] = {label: count_ops(fn, touching=large).total
                                            for label, fn in candidates.items() if "compiled" not in label}
    for line, label in zip(timing.table().splitlines(), timing.seconds):
        shown = "peak memory n/a" if memory[label] is None else f"peak memory {memory[label] / 2**20:8.1f} MiB"
        ops = f"   {result['ops_per_call'][label]:6d} ops" if label in result.get("ops_per_call", {}) else ""
        if label in result.get("large_ops_per_call", {}):
            ops += f" ({result['large_ops_per_call'][label]} large)"
        print(f"{name:30s} {line}   {shown}{ops}")
    save(result, name, device)
    return result
