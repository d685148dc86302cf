"""Where one patch layer's forward + backward spends its time, by backend: the next measurement of the fused
epilogue, which the H200 run of 2026-11-27 found slower than the reference nodes (``book/measurements.md``).

``python -m benchmarks.profile_layer [sphereconv|sigmoid|scs|decoupled ...]`` prints, for ``nn.Conv2d`` and for
the layer's functional form with ``backend="reference"`` and (on CUDA) ``backend="fused"``, at B=128, 128
channels, 32x32, float32: the wall time per call, the host time to issue one call without waiting for the
device, the device time per call and the kernels that take most of it (``torch.profiler``).  Host time near
the wall time means a call is bound by launching; device time near it, by its kernels.  A diagnosis tool for
the GPU box (it runs on the CPU too, where host and wall time coincide); nothing is saved.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sphereml.layers.decoupled import decoupled_conv2d
from sphereml.layers.patches import patch_cosine2d
from sphereml.timing import forward_backward, synchronizer

LAYERS = {  # name -> (weight, backend) -> the layer's forward on x
    "sphereconv": lambda w, b: lambda x: patch_cosine2d(x, w, padding=1, backend=b),
    "sigmoid": lambda w, b: lambda x: patch_cosine2d(x, w, padding=1, angular="sigmoid", k=0.3, backend=b),
    "scs": lambda w, b: lambda x: patch_cosine2d(x, w, padding=1, q=1e-3, power=2.0, backend=b),
    "decoupled": lambda w, b: lambda x: decoupled_conv2d(x, w, padding=1, magnitude="tanh", backend=b),
}


def profile_layer(name: str, device: torch.device, size=(128, 128, 32), calls: int = 20, rows: int = 8) -> dict:
    """Times and top kernels of ``nn.Conv2d`` and of layer ``name`` per backend; returns label -> seconds
    (wall, host, device) per call."""
    b, c, side = size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, c, side, side, generator=g).to(device).requires_grad_(True)
    target = torch.randn(b, c, side, side, generator=g).to(device)
    conv = torch.nn.Conv2d(c, c, 3, padding=1, bias=False).to(device)
    backends = ("reference", "fused") if device.type == "cuda" else ("reference",)
    operators = {"nn.Conv2d": conv, **{f"{name} ({backend})": LAYERS[name](conv.weight, backend)
                                       for backend in backends}}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    sync, found = synchronizer(device), {}
    for label, step in forward_backward(operators, x, target).items():
        for _ in range(3):
            step()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        host = (time.perf_counter() - start) / calls
        sync()
        wall = (time.perf_counter() - start) / calls
        with profile(activities=activities) as prof:
            for _ in range(5):
                step()
            sync()
        events = prof.key_averages()
        on_device = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 5 / 1e6
        found[label] = {"wall": wall, "host": host, "device": on_device}
        print(f"--- {label}: wall {wall * 1e3:.3f} ms, host {host * 1e3:.3f} ms, device {on_device * 1e3:.3f} ms "
              f"per forward + backward (B={b}, {c} channels, {side}x{side})")
        print(events.table(sort_by=sort, row_limit=rows, max_name_column_width=70))
    return found


if __name__ == "__main__":
    from sphereml.train import resolve_device

    for layer in sys.argv[1:] or list(LAYERS):
        profile_layer(layer, resolve_device("auto"))
