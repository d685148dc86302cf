"""Where one regularised CNN-9 training step spends its time on a GPU: the top kernels, eager and compiled.

``python -m benchmarks.profile_step [NAME ...]`` (``none`` or names of ``bench_comhe.REGULARIZERS``; default ``none
HS-MHE``) prints, for the eager step and the step compiled with ``mode="reduce-overhead"``, the device time per step,
the kernels that take most of it (``torch.profiler``) and a warm step's peak memory above what was held before it,
which a step replayed whole from its CUDA graphs does not need (the H100 of 2026-12-06 saw 0 MiB for the plain
compiled CNN-9 step and 52.5 MiB with HS-MHE); for the compiled step also what the compiler made of it (graphs, graph
breaks, graphs that skipped CUDA graphs, inputs a CUDA graph copies in at each replay).  Run with
``TORCH_LOGS=cudagraphs`` to see why CUDA graphs are skipped or recorded again (``gpu_check.sh profile-step`` does).
A diagnosis tool for the GPU box; nothing is saved.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from sphereml import models
from sphereml.timing import peak_memory, training_step

from .bench_comhe import REGULARIZERS
from .harness import compile_counters


def _step(name: str, compile, device: torch.device, batch: int = 128):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 100, (batch,), generator=g).to(device)
    torch.manual_seed(0)
    net = models.Classifier(models.plain_cnn(9, widths=(64, 128, 256), feature_dim=256), 100).to(device)
    sgd = torch.optim.SGD(net.parameters(), 0.1, momentum=0.9)
    return training_step(net, x, y, sgd, REGULARIZERS[name](net) if name != "none" else None, compile)


def profile_step(name: str, compile, device: torch.device, steps: int = 5, rows: int = 12) -> None:
    before = compile_counters()
    step = _step(name, compile, device)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    compiled = {key: value - before[key] for key, value in compile_counters().items()}
    allocated = peak_memory(step, device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / steps / 1e3
    print(f"--- {name}, {'compiled ' + compile if compile else 'eager'}: {total:.2f} ms of device time per step, "
          f"peak {allocated / 2**20:.1f} MiB above what a warm step starts with")
    if compile:
        print("compiler: " + ", ".join(f"{value} {key.replace('_', ' ')}" for key, value in compiled.items()))
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60))


if __name__ == "__main__":
    for reg in sys.argv[1:] or ["none", "HS-MHE"]:
        for mode in (False, "reduce-overhead"):
            profile_step(reg, mode, torch.device("cuda"))
