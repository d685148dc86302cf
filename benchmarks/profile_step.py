"""Where one regularised CNN-9 training step spends its time on a GPU: the top kernels, eager and compiled.

``python -m benchmarks.profile_step [NAME ...]`` (names of ``bench_comhe.REGULARIZERS``, default HS-MHE) prints,
for the eager step and the step compiled with ``mode="reduce-overhead"``, the device time per step and the
kernels that take most of it (``torch.profiler``).  Run with ``TORCH_LOGS=cudagraphs`` to see why CUDA
graphs are skipped, if they are.  A diagnosis tool for the GPU box; nothing is saved.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from sphereml import models
from sphereml.timing import training_step

from .bench_comhe import REGULARIZERS


def _step(name: str, compile, device: torch.device, batch: int = 128):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 100, (batch,), generator=g).to(device)
    torch.manual_seed(0)
    net = models.Classifier(models.plain_cnn(9, widths=(64, 128, 256), feature_dim=256), 100).to(device)
    sgd = torch.optim.SGD(net.parameters(), 0.1, momentum=0.9)
    return training_step(net, x, y, sgd, REGULARIZERS[name](net) if name != "none" else None, compile)


def profile_step(name: str, compile, device: torch.device, steps: int = 5, rows: int = 12) -> None:
    step = _step(name, compile, device)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / steps / 1e3
    print(f"--- {name}, {'compiled ' + compile if compile else 'eager'}: {total:.2f} ms of device time per step")
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60))


if __name__ == "__main__":
    for reg in sys.argv[1:] or ["HS-MHE"]:
        for mode in (False, "reduce-overhead"):
            profile_step(reg, mode, torch.device("cuda"))
