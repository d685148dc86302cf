"""Run the benchmarks: ``python -m benchmarks`` (or ``make bench``) runs all, ``python -m benchmarks margins`` one."""

import importlib
import pkgutil
import sys
from pathlib import Path

import torch

from sphereml.train import resolve_device


def main(names: list[str]) -> None:
    device = resolve_device("auto")
    torch.manual_seed(0)
    folder = Path(__file__).resolve().parent
    for info in sorted(pkgutil.iter_modules([str(folder)]), key=lambda m: m.name):
        if info.name.startswith("bench_") and (not names or info.name[len("bench_"):] in names):
            importlib.import_module(f"benchmarks.{info.name}").run(device)


if __name__ == "__main__":
    main(sys.argv[1:])
