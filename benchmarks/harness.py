"""Timing helpers shared by every benchmark: median wall time, device description, JSON output."""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from sphereml.book import write_json

RESULTS = Path(__file__).resolve().parent / "results"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 10, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs (CUDA synchronised)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(name: str, candidates: dict[str, Callable[[], object]], baseline: str, device: torch.device,
            repeats: int = 10, extra: dict | None = None) -> dict:
    """Time every candidate in one run, print each one's ratio to ``baseline``, and save JSON.

    The candidates are timed round-robin (one call of each per round, ``repeats`` rounds,
    medians kept), so a slow spell of a shared machine hits all of them alike.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in candidates.values():
        fn()
        fn()
    sync()
    times: dict[str, list[float]] = {label: [] for label in candidates}
    for _ in range(repeats):
        for label, fn in candidates.items():
            start = time.perf_counter()
            fn()
            sync()
            times[label].append(time.perf_counter() - start)
    seconds = {label: statistics.median(t) for label, t in times.items()}
    ratios = {label: s / seconds[baseline] for label, s in seconds.items()}
    result = {"benchmark": name, "device": device_name(device), "torch": torch.__version__,
              "seconds": seconds, "ratio_to_" + baseline: ratios, **(extra or {})}
    for label in candidates:
        print(f"{name:30s} {label:28s} {seconds[label] * 1e3:9.2f} ms   x{ratios[label]:.2f} vs {baseline}")
    write_json(result, RESULTS / f"{name}-{device.type}.json")
    return result
