"""Run every benchmark: ``python -m benchmarks`` (or ``make bench``)."""

import importlib
import pkgutil
from pathlib import Path

import torch

from sphereml.train import resolve_device


def main() -> None:
    device = resolve_device("auto")
    torch.manual_seed(0)
    folder = Path(__file__).resolve().parent
    for info in sorted(pkgutil.iter_modules([str(folder)]), key=lambda m: m.name):
        if info.name.startswith("bench_"):
            importlib.import_module(f"benchmarks.{info.name}").run(device)


if __name__ == "__main__":
    main()
