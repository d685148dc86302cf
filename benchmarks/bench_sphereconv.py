"""Forward + backward of ``SphereConv2d`` against ``nn.Conv2d`` of the same shape, timed in the same run.

Candidates: ``nn.Conv2d`` (the baseline, eager), each SphereConv angular function (eager), the
``unfold`` formulation of public ports (patches materialised as a Tensor[B, C*9, H*W]), which is the
library's readable reference :func:`~sphereml.layers.sphereconv.sphere_conv2d_reference`, and, on CUDA, the
layers under ``torch.compile`` (which fuses the patch-norm division and g into the convolution's
neighbours) and under bfloat16 autocast.  The layers take the reference nodes after the convolution (the
default); on CUDA the "(fused epilogue)" rows time cosine and sigmoid through the fused Triton epilogue
(:mod:`sphereml.layers.patch_epilogue`, ``backend="fused"``; since 2026-12-07 with the kernels normalised by the
two kernels of :mod:`sphereml.layers.unit_kernels`, whose :func:`compile_check` is here, and the patch norms'
box sums by the two kernels of :mod:`sphereml.layers.window_sums`, whose :func:`window_compile_check` is here),
and the "(channels-last)" rows time ``nn.Conv2d`` and the fused cosine layer on channels-last tensors.
Result files of 2026-11-27 were measured when the layers took the fused epilogue on CUDA: there the plain rows are
fused and "(reference epilogue)" rows the reference (their ``note`` says so).

* CPU: B=32, 64 -> 64 channels, 32x32, 3x3 (goal: cosine at most 1.3x Conv2d).
* CUDA: the same size plus B=128 128 ch 32x32 and B=64 256 ch 16x16 (goal: cosine at most 1.3x Conv2d
  at B=128 128 ch in float32 and under bf16 autocast; sigmoid and learned k at most 1.5x).
"""

from __future__ import annotations

import copy

import torch

from sphereml.layers.patches import patch_cosine2d
from sphereml.layers.sphereconv import SphereConv2d, sphere_conv2d_reference
from sphereml.timing import forward_backward

from .harness import compare, compiling, sized_name, smoke_or

K = 3
CPU_SIZES = [(32, 64, 32)]  # (batch, channels, side)
CUDA_SIZES = [(32, 64, 32), (128, 128, 32), (64, 256, 16)]
COMPILED_SIZE = (128, 128, 32)  # on CUDA every variant is also timed under torch.compile at this size
# the rows timed on CUDA only, through the fused epilogue (benchmarks/goals.py names some of them)
FUSED_ROWS = {"cosine": "SphereConv2d cosine (fused epilogue)", "sigmoid": "SphereConv2d sigmoid (fused epilogue)",
              "channels-last": "SphereConv2d cosine (fused epilogue, channels-last)"}


def _layers(c: int, device: torch.device) -> dict[str, torch.nn.Module]:
    layers = {f"SphereConv2d {a}": SphereConv2d(c, c, K, padding=1, angular=a, k=0.3)
              for a in ("cosine", "linear", "sigmoid")}
    layers["SphereConv2d sigmoid learned k"] = SphereConv2d(c, c, K, padding=1, angular="sigmoid", learnable_k=True)
    return {label: layer.to(device) for label, layer in layers.items()}


def _candidates(size, device: torch.device, dtype: torch.dtype | None) -> dict:
    b, c, side = size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, c, side, side, generator=g).to(device).requires_grad_(True)
    target = torch.randn(b, c, side, side, generator=g).to(device)
    conv = torch.nn.Conv2d(c, c, K, padding=1, bias=False).to(device)
    operators = {"nn.Conv2d": conv}
    for label, layer in _layers(c, device).items():
        if dtype is None or "cosine" in label:
            operators[label] = layer
        if compiling(device) and size == COMPILED_SIZE and (dtype is None or "cosine" in label):
            operators[f"{label} (compiled)"] = torch.compile(layer)
    if device.type == "cuda":
        for angular in _fused_angulars(dtype):
            operators[FUSED_ROWS[angular]] = lambda inp, a=angular: patch_cosine2d(
                inp, conv.weight, padding=1, angular=a, k=0.3, backend="fused")
    if dtype is None:
        operators["unfold cosine (port style)"] = lambda inp: sphere_conv2d_reference(inp, conv.weight, padding=1)
    candidates = forward_backward(operators, x, target, dtype)
    return {**candidates, **_channels_last(conv, x, target, dtype)} if device.type == "cuda" else candidates


def _fused_angulars(dtype: torch.dtype | None) -> tuple[str, ...]:
    return ("cosine", "sigmoid") if dtype is None else ("cosine",)


def _result_name(size, dtype: torch.dtype | None) -> str:
    if dtype is None:
        return sized_name("sphereconv_fwd_bwd", size, CPU_SIZES[0])
    b, c, side = size
    return f"sphereconv_fwd_bwd_b{b}_c{c}_s{side}_bf16"


def fused_result_rows() -> set[tuple[str, str]]:
    """(result name, row) of each row timed through the fused epilogue on CUDA (``benchmarks/goals.py``'s are
    checked against them)."""
    return {(_result_name(size, dtype), FUSED_ROWS[row]) for size in CUDA_SIZES for dtype in (None, torch.bfloat16)
            for row in (*_fused_angulars(dtype), "channels-last")}


def _channels_last(conv: torch.nn.Conv2d, x: torch.Tensor, target: torch.Tensor, dtype: torch.dtype | None) -> dict:
    """``nn.Conv2d`` and the fused cosine layer with x, its kernels and the target in channels-last (Note [layouts
    in the kernels] in :mod:`sphereml.layers._layouts`), to be timed against the NCHW baseline."""
    last = torch.channels_last
    conv = copy.deepcopy(conv).to(memory_format=last)
    operators = {"nn.Conv2d (channels-last)": conv,
                 FUSED_ROWS["channels-last"]: lambda inp: patch_cosine2d(
                     inp, conv.weight, padding=1, backend="fused")}
    x = x.detach().contiguous(memory_format=last).requires_grad_(True)
    return forward_backward(operators, x, target.contiguous(memory_format=last), dtype)


def run(device: torch.device) -> dict:
    results = {}
    sizes = smoke_or(CUDA_SIZES if device.type == "cuda" else CPU_SIZES, [(2, 4, 8)])
    dtypes = [None, torch.bfloat16] if device.type == "cuda" else [None]
    for size in sizes:
        for dtype in dtypes:
            b, c, side = size
            precision = "bf16 autocast" if dtype is not None else "float32"
            name = _result_name(size, dtype)
            print(f"--- SphereConv2d, B={b}, {c} -> {c} channels, {side}x{side}, {precision}")
            results[name] = compare(name, _candidates(size, device, dtype), baseline="nn.Conv2d", device=device,
                                    repeats=30, extra={"batch": b, "channels": c, "size": side, "kernel": K,
                                                       "precision": precision})
    return results


def compile_check(arch: int = 90) -> list[dict]:
    """Compile the unit-kernel normalisation's two kernels (:mod:`sphereml.layers.unit_kernels`) for ``sm_<arch>``
    on the CPU, for float32, bf16 and fp16 weights.  Prints registers and spills.  Must run without
    TRITON_INTERPRET."""
    from sphereml.layers import _unit_kernels as kernels

    from .sm90 import compile_kernel

    br, bd, warps = kernels.BLOCKS
    rows = []
    for dtype in ("fp32", "bf16", "fp16"):
        forms = {"forward": (kernels.forward_kernel, {"W": f"*{dtype}", "U_OUT": f"*{dtype}", "INV_OUT": "*fp32",
                                                      "ACTIVE_OUT": "*fp32", "R": "i32", "D": "i32", "eps": "fp32"}),
                 "backward": (kernels.backward_kernel, {"G": f"*{dtype}", "U": f"*{dtype}", "INV": "*fp32",
                                                        "ACTIVE": "*fp32", "GW_OUT": f"*{dtype}", "R": "i32",
                                                        "D": "i32"})}
        for name, (kernel, types) in forms.items():
            row = {"kernel": f"unit kernels {name}", "dtype": dtype,
                   **compile_kernel(kernel, types, {"BR": br, "BD": bd}, warps, 2, arch)}
            rows.append(row)
            print(f"compile sm_{arch} unit kernels {name:8s} {dtype}: registers {row['registers']}, "
                  f"spill stores {row['spill_store_bytes']} B", flush=True)
    return rows


def window_compile_check(arch: int = 90) -> list[dict]:
    """Compile the patch norms' box-sum kernels (:mod:`sphereml.layers.window_sums`) for ``sm_<arch>`` on the CPU,
    for 3 x 3 and 5 x 5 windows and float32, bf16 and fp16 inputs, the gradient's in NCHW, channels-last (its
    blocks and unit strides) and x channels-last with an NCHW dL/dx.  Prints registers and spills.  Must run without
    TRITON_INTERPRET."""
    from sphereml.layers import _window_kernels as kernels

    from .sm90 import compile_kernel

    bc, bp, warps = kernels.BLOCKS
    last_bc, last_bp, _ = kernels.CHANNELS_LAST_BLOCKS
    geometry = {name: "i32" for name in ("H", "W", "HO", "WO", "SH", "SW", "PH", "PW", "DH", "DW")}
    strides = {name: "i32" for name in ("G", "XB", "XC", "XP", "GB", "GC", "GP")}
    layouts = {"gradient": {"BC": bc, "BP": bp, "XP": 1, "GP": 1, "SAME_LAYOUT": True},
               "gradient, channels-last": {"BC": last_bc, "BP": last_bp, "XC": 1, "GC": 1, "SAME_LAYOUT": True},
               "gradient, x channels-last": {"BC": last_bc, "BP": last_bp, "XC": 1, "GP": 1, "SAME_LAYOUT": False}}
    rows = []
    for size in (3, 5):
        forms = [("sums", "fp32", kernels.window_sums_kernel, {"NORMS": "*fp32", "SQ": "*fp32"}, {"BP": bp})]
        forms += [(name, dtype, kernels.window_gradient_kernel,
                   {"GRAD_SQ": "*fp32", "X": f"*{dtype}", "GRAD_X": f"*{dtype}", "CG": "i32", **strides}, constants)
                  for name, constants in layouts.items() for dtype in ("fp32", "bf16", "fp16")]
        for name, dtype, kernel, types, blocks in forms:
            row = {"kernel": f"window {name}", "dtype": dtype, "window": size,
                   **compile_kernel(kernel, {**types, **geometry}, {"KH": size, "KW": size, **blocks}, warps, 2,
                                    arch)}
            rows.append(row)
            print(f"compile sm_{arch} window {name:25s} {size}x{size} {dtype}: registers {row['registers']}, "
                  f"spill stores {row['spill_store_bytes']} B", flush=True)
    return rows
