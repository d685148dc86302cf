"""The benchmarks' shared parts: round-robin comparisons (``sphereml.timing``) printed and saved as JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from sphereml.timing import compare as compare_round_robin
from sphereml.timing import device_name, environment, save_result

__all__ = ["RESULTS", "compare", "device_name", "environment", "save"]

RESULTS = Path(__file__).resolve().parent / "results"


def save(result: dict, name: str, device: torch.device) -> Path:
    """``benchmarks/results/<name>-<cpu|cuda>.json``, with the environment that produced it."""
    return save_result({**environment(device), **result}, RESULTS / f"{name}-{device.type}.json")


def compare(name: str, candidates: dict[str, Callable[[], object]], baseline: str, device: torch.device,
            repeats: int = 10, extra: dict | None = None) -> dict:
    """Time every candidate in one interleaved run, print each one's ratio to ``baseline``, and save JSON."""
    timing = compare_round_robin(candidates, baseline, device, repeats=repeats)
    result = {"benchmark": name, "seconds": timing.seconds, "ratio_to_" + baseline: timing.ratios, **(extra or {})}
    for line in timing.table().splitlines():
        print(f"{name:30s} {line}")
    save(result, name, device)
    return result
