"""The benchmarks' shared parts: round-robin comparisons (``sphereml.timing``) printed and saved as JSON."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import torch

from sphereml.timing import compare as compare_round_robin
from sphereml.timing import device_name, environment, save_result, training_step

__all__ = ["RESULTS", "compare", "device_name", "environment", "save", "forward_backward", "training_step"]

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


def forward_backward(operators: dict[str, Callable], x: torch.Tensor, target: torch.Tensor,
                     dtype: torch.dtype | None = None) -> dict[str, Callable[[], None]]:
    """One forward + backward step per operator (label -> ``op(x)``): the candidates of a layer benchmark.

    Each step clears ``x.grad``, runs ``op(x)`` (under autocast to ``dtype`` when given) and back-propagates
    ``sum(op(x) * target)``, the same work for every candidate.
    """
    cast = (lambda: torch.autocast(x.device.type, dtype=dtype)) if dtype is not None else contextlib.nullcontext

    def step(op):
        x.grad = None
        with cast():
            out = op(x)
        (out.float() * target).sum().backward()

    return {label: (lambda op=op: step(op)) for label, op in operators.items()}

