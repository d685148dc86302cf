"""Wall-clock timing with ratios to a baseline measured in the same run (benchmarks and chapters).

Shared machines are noisy, so a speed is only reported as a ratio to a baseline timed in the
same process, interleaved with it: :func:`compare` runs one call of every candidate per round
(round-robin) and keeps each one's median, so a slow spell hits all candidates alike; :func:`repeated_ratios`
repeats that with the order rotated, the repeats a timing verdict pairs.  CUDA
work is synchronised before every clock reading.  Timings are reported, never asserted.

Note [peak memory of one call]
    On CUDA, :func:`peak_memory` is PyTorch's own count: ``max_memory_allocated`` after a reset, less
    what was allocated before.  On the CPU PyTorch keeps no such count, and a candidate is a closure
    that cannot be sent to a fresh process, so the call runs here between two readings of the
    process's resident memory: freed heap pages are returned first (``malloc_trim``), the kernel's
    high-water mark is reset (``/proc/self/clear_refs``, Linux), and the peak is the new high-water
    mark less the resident size before the call.  That counts every allocation (BLAS workspaces
    included) at page granularity; where the kernel does not allow the reset the result is None.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import _io
from ._checks import integer

__all__ = ["device_name", "cpu_model", "environment", "synchronizer", "median_seconds", "Comparison", "compare",
           "repeated_ratios", "PeakMemory", "peak_memory", "forward_backward", "training_step", "save_result",
           "describe_saved"]


def device_name(device: torch.device | str) -> str:
    """``"NVIDIA H200"`` for a GPU, ``"x86_64 (2 threads)"`` for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def cpu_model() -> str | None:
    """The processor's name as the kernel reports it (``"AMD EPYC"``, ``"Intel(R) Xeon(R) CPU @ 2.80GHz"``), or
    None where ``/proc/cpuinfo`` is absent: two CPUs with the same vector kernels may still round differently."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    names = [line.partition(":")[2].strip() for line in lines if line.startswith("model name")]
    return names[0] if names and names[0] else None


def environment(device: torch.device | str) -> dict:
    """What a timing depends on: device, core count, the CPU's vector kernels (``cpu_capability``: AVX2, AVX512;
    the same code's CPU ratios move with it), torch / triton / CUDA versions, date."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": device_name(device), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton_version, "date": datetime.date.today().isoformat()}


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (``torch.cuda.synchronize`` on CUDA, nothing else)."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def median_seconds(fn: Callable[[], object], device: torch.device | str = "cpu", repeats: int = 10,
                   warmup: int = 2) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` calls (CUDA synchronised)."""
    return compare({"fn": fn}, "fn", device, repeats, warmup).seconds["fn"]


@dataclass
class Comparison:
    """Median seconds per candidate and each one's ratio to the baseline, from one interleaved run."""

    baseline: str
    seconds: dict[str, float]
    samples: dict[str, list[float]] = field(repr=False)

    @property
    def ratios(self) -> dict[str, float]:
        return {label: s / self.seconds[self.baseline] for label, s in self.seconds.items()}

    @classmethod
    def from_result(cls, result: dict, baseline: str) -> "Comparison":
        """The comparison a saved benchmark result (``benchmarks/results/*.json``) holds, for printing."""
        return cls(baseline, dict(result["seconds"]), {})

    def table(self, width: int = 28) -> str:
        """One line per candidate: median milliseconds and the ratio to the baseline."""
        return "\n".join(f"{label:{width}s} {1e3 * s:9.2f} ms   {self.ratios[label]:5.2f} x {self.baseline}"
                         for label, s in self.seconds.items())


def compare(candidates: dict[str, Callable[[], object]], baseline: str, device: torch.device | str = "cpu",
            repeats: int = 10, warmup: int = 2) -> Comparison:
    """Time every candidate round-robin (one call of each per round) and return the medians.

    Args:
        candidates: label -> a function of no arguments doing the work once.
        baseline (str): the label the ratios are taken against.
        device: where the work runs (CUDA is synchronised around every call).
        repeats (int): timed rounds. Default: 10.
        warmup (int): untimed calls of each candidate first (compilation, caches). Default: 2.
    """
    if baseline not in candidates:
        raise ValueError(f"baseline must be one of the candidates {sorted(candidates)}, got {baseline!r}")
    integer("repeats", repeats, at_least=1)
    integer("warmup", warmup, at_least=0)
    sync = synchronizer(device)
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    sync()
    samples: dict[str, list[float]] = {label: [] for label in candidates}
    for _ in range(repeats):
        for label, fn in candidates.items():
            start = time.perf_counter()
            fn()
            sync()
            samples[label].append(time.perf_counter() - start)
    seconds = {label: statistics.median(t) for label, t in samples.items()}
    return Comparison(baseline, seconds, samples)


def repeated_ratios(candidates: dict[str, Callable[[], object]], baseline: str, device: torch.device | str = "cpu",
                    times: int = 5, rounds: int = 10, warmup: int = 1) -> tuple[dict[str, list[float]], Comparison]:
    """``times`` independent :func:`compare` runs, the order of the round rotated by one candidate from run to run,
    and each candidate's ratio to ``baseline`` in every run: the repeats that a timing verdict pairs as its seeds
    (a busy spell of the machine slows one run, and within it every candidate alike).

    Returns ``(label -> ratios, one per run; the first run's Comparison)``, the latter for a printed table.
    """
    integer("times", times, at_least=1)
    labels = list(candidates)
    ratios: dict[str, list[float]] = {label: [] for label in labels}
    runs = []
    for run in range(times):
        order = labels[run % len(labels):] + labels[:run % len(labels)]
        runs.append(compare({label: candidates[label] for label in order}, baseline, device, rounds, warmup))
        for label in labels:
            ratios[label].append(runs[-1].ratios[label])
    return ratios, runs[0]


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` -- afterwards ``peak.bytes`` is the most memory the block held
    above what was held when it began (Note [peak memory of one call]); None where the CPU cannot tell."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.bytes: int | None = None
        self._base: int | None = None

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size
            self._base = _status_bytes("VmRSS")
        except OSError:
            self._base = None
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self._base
        elif self._base is not None:
            self.bytes = max(_status_bytes("VmHWM") - self._base, 0)


def peak_memory(fn: Callable[[], object], device: torch.device | str = "cpu") -> int | None:
    """Bytes of memory ``fn()`` needs above what is already held, at its peak (:class:`PeakMemory`)."""
    with PeakMemory(device) as peak:
        fn()
    return peak.bytes


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in /proc/self/status")


def forward_backward(operators: dict[str, Callable], x: torch.Tensor, target: torch.Tensor,
                     dtype: torch.dtype | None = None) -> dict[str, Callable[[], None]]:
    """Candidates for :func:`compare` that time layers: one forward + backward step per operator
    (label -> ``op(x)``).

    Each step clears ``x.grad``, runs ``op(x)`` (under autocast to ``dtype`` when given) and back-propagates
    ``sum(op(x) * target)``, the same work for every candidate; ``x`` needs ``requires_grad`` for the input
    gradient to count.
    """
    cast = (lambda: torch.autocast(x.device.type, dtype=dtype)) if dtype is not None else contextlib.nullcontext

    def step(op):
        x.grad = None
        with cast():
            out = op(x)
        (out.float() * target).sum().backward()

    return {label: (lambda op=op: step(op)) for label, op in operators.items()}


def _cross_entropy(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(net(x), y)


def training_step(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.Optimizer,
                  regularizer: Callable[[], torch.Tensor] | None = None,
                  compile: bool | str = False,
                  loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = _cross_entropy,
                  ) -> Callable[[], None]:
    """A candidate for :func:`compare`: one optimiser step of ``net`` on the batch (x, y), ``loss(net, x, y)``
    (default: cross-entropy of ``net(x)``) plus ``regularizer()`` when given.  ``compile`` (True or a mode):
    the loss and penalty through ``torch.compile`` (a regulariser's ``before_step`` stays eager), as
    ``fit(compile=...)`` runs them."""
    before = getattr(regularizer, "before_step", None)
    penalty = getattr(regularizer, "weighted_penalty", regularizer)

    def objective():
        value = loss(net, x, y)
        return value + penalty() if penalty is not None else value

    if compile:
        objective = torch.compile(objective, mode=None if compile is True else compile)

    def step():
        optimizer.zero_grad(set_to_none=True)
        if before is not None:
            before()
        objective().backward()
        optimizer.step()

    return step


def save_result(result: dict, path: str | os.PathLike) -> Path:
    """Write a benchmark result as JSON, atomically."""
    return _io.write_json(result, path)


def describe_saved(path: str | os.PathLike, baseline: str, goals: dict[str, float] | None = None,
                   width: int = 22) -> str | None:
    """A saved benchmark result (``benchmarks/results/*.json``, from :func:`save_result`) as text, for a chapter.

    The first line names the device and date of the run; then one line per candidate with its median
    milliseconds, its ratio to ``baseline`` and, where the result counted them, its aten operations per call;
    then, for each goal (candidate -> largest allowed ratio), whether this run met it.  None when the file is
    absent (a chapter run outside the repository, or a device never measured).
    """
    path = Path(path)
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    comparison, ops = Comparison.from_result(result, baseline), result.get("ops_per_call", {})
    lines = [f"{result['device']}, {result['date'][:10]}:"]
    lines += [f"{label:{width}s} {1e3 * s:9.2f} ms   {comparison.ratios[label]:5.2f} x {baseline}"
              + (f"   {ops[label]:6,d} ops" if label in ops else "") for label, s in comparison.seconds.items()]
    if goals:
        lines.append("goals: " + ", ".join(f"{name} at most {limit:g} x "
                                           + ("met" if comparison.ratios[name] <= limit else "missed")
                                           for name, limit in goals.items()))
    return "\n".join(lines)


def describe_saved_runs(directory: str | os.PathLike, stem: str, baseline: str,
                        goals: dict[str, float] | None = None, width: int = 22,
                        devices: tuple[str, ...] = ("cpu", "cuda")) -> list[str]:
    """:func:`describe_saved` for each device's file ``{stem}-{device}.json`` in ``directory``, absent ones left out."""
    texts = (describe_saved(Path(directory) / f"{stem}-{device}.json", baseline, goals, width) for device in devices)
    return [text for text in texts if text is not None]
