"""Forward + backward of ``SharpenedCosineSimilarity2d`` against ``nn.Conv2d`` of the same shape, same run.

Candidates: ``nn.Conv2d`` (the baseline), SCS with fixed p and q, SCS with learned p (per kernel) and q,
the unfold formulation of public ports (:func:`~sphereml.layers.scs.scs_conv2d_reference`), and on CUDA each SCS
layer under ``torch.compile``.  B=32, 64 -> 64 channels, 32x32, 3x3 (and B=128, 128 channels on CUDA).
Goal: at most 1.5x Conv2d on the CPU.  The layers take the reference nodes (the default); on CUDA
"SCS fixed p, q (fused epilogue)" and "SCS learned p, q (fused epilogue)" time the same layers through the fused
Triton epilogue (:mod:`sphereml.layers.patch_epilogue`, ``backend="fused"``).  Result files of 2026-11-27 were
measured when the layers took the fused epilogue on CUDA (their ``note`` says so).
"""

from __future__ import annotations

import torch

from sphereml.layers.patches import patch_cosine2d
from sphereml.layers.scs import SharpenedCosineSimilarity2d, scs_conv2d_reference
from sphereml.timing import forward_backward

from .harness import compare, compiling, sized_name, smoke_or

K = 3
SIZES = [(32, 64, 32), (128, 128, 32)]  # (batch, channels, side); the second on CUDA only
FUSED_ROWS = ("SCS fixed p, q (fused epilogue)", "SCS learned p, q (fused epilogue)")  # timed on CUDA only
# (benchmarks/goals.py names them)


def fused_result_rows() -> set[tuple[str, str]]:
    """(result name, row) of each row timed through the fused epilogue on CUDA (``benchmarks/goals.py``'s are
    checked against them)."""
    return {(sized_name("scs_fwd_bwd", size, SIZES[0]), row) for size in SIZES for row in FUSED_ROWS}


def run(device: torch.device) -> dict:
    results = {}
    for b, c, side in smoke_or(SIZES if device.type == "cuda" else SIZES[:1], [(2, 4, 8)]):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(b, c, side, side, generator=g).to(device).requires_grad_(True)
        target = torch.randn(b, c, side, side, generator=g).to(device)
        conv = torch.nn.Conv2d(c, c, K, padding=1, bias=False).to(device)
        fixed = SharpenedCosineSimilarity2d(c, c, K, padding=1, p=2.0, q=1e-3).to(device)
        learned = SharpenedCosineSimilarity2d(c, c, K, padding=1, learnable=True).to(device)
        operators = {"nn.Conv2d": conv, "SCS fixed p, q": fixed, "SCS learned p, q": learned,
                     "unfold (port style)": lambda inp: scs_conv2d_reference(inp, fixed.weight, 2.0, 1e-3, padding=1)}
        if compiling(device):
            operators["SCS learned p, q (compiled)"] = torch.compile(learned)
        if device.type == "cuda":
            operators[FUSED_ROWS[0]] = lambda inp: patch_cosine2d(
                inp, fixed.weight, padding=1, q=1e-3, power=2.0, backend="fused")
            operators[FUSED_ROWS[1]] = lambda inp: patch_cosine2d(  # the layer's forward, fused
                inp, learned.weight, padding=1, q=learned.q, power=learned._p(), backend="fused")
        name = sized_name("scs_fwd_bwd", (b, c, side), SIZES[0])
        print(f"--- sharpened cosine similarity, B={b}, {c} -> {c} channels, {side}x{side}")
        results[name] = compare(name, forward_backward(operators, x, target), baseline="nn.Conv2d", device=device,
                                repeats=20, extra={"batch": b, "channels": c, "size": side, "kernel": K})
    return results


def compile_check(arch: int = 90) -> list[dict]:
    """Compile the fused patch epilogue's kernels (:mod:`sphereml.layers.patch_epilogue`) for ``sm_<arch>`` on the CPU,
    in the forms the layers use (q and the parameter absent, a number or a tensor; with and without the decoupled
    operators' magnitude, as a tensor or evaluated in the kernels); float32 and bf16; NCHW, and channels-last for
    four of the forms (the unit stride on the channels: Note [layouts in the kernels]), and the backward of two
    forms reading a dL/dy broadcast from one value.
    Prints registers and spills.  Must run without TRITON_INTERPRET."""
    from sphereml.layers import _patch_kernels as kernels

    from .sm90 import compile_kernel

    # (epilogue, Q_MODE, PARAM, magnitude) as the layers use them; magnitude: False, "tensor" (HAS_MAG) or
    # (MAGNITUDE, R_MODE) for h in the kernels (R_MODE 2: a learned radius, whose gradient the backward writes)
    forms = [("cosine", 0, 0, False), ("cosine", 2, 0, False), ("sharpen", 1, 1, False), ("sharpen", 2, 2, False),
             ("linear", 0, 0, False), ("sigmoid", 0, 1, False), ("sigmoid", 0, 2, False), ("sqcosine", 0, 0, False),
             ("cosine", 0, 0, "tensor"), ("sigmoid", 0, 1, "tensor"), ("cosine", 0, 0, (3, 2)),
             ("cosine", 0, 0, (2, 1)), ("sigmoid", 0, 1, (5, 2)), ("linear", 0, 0, (7, 1))]
    layouts = [("NCHW", form) for form in forms] + [("channels-last", forms[i]) for i in (0, 3, 9, 10)]
    broadcast = [("broadcast dL/dy", forms[i]) for i in (0, 12)]  # the backward's reading of a .sum()'s gradient
    unit_strides = {"NCHW": {"SP": 1}, "channels-last": {"SC": 1}, "broadcast dL/dy": {"SP": 1}}  # as Triton
    # specialises them
    rows = []
    for name, kernel, (bc, bp, warps) in (("forward", kernels.forward_kernel, kernels.FORWARD_BLOCKS),
                                          ("backward", kernels.backward_kernel, kernels.BACKWARD_BLOCKS)):
        for dtype in ("fp32", "bf16"):
            for layout, (epilogue, q_mode, param, magnitude) in layouts + (broadcast if name == "backward" else []):
                code, r_mode = magnitude if isinstance(magnitude, tuple) else (0, 0)
                types = {"INNER": f"*{dtype}", "SQ": "*fp32", "Q": "*fp32", "A": "*fp32", "MAG": "*fp32",
                         "R": "*fp32", "GRAD_MAG": "*fp32", "GRAD_SCALAR": "*fp32", "OUT": f"*{dtype}",
                         "GRAD_Y": f"*{dtype}", "GRAD_INNER": f"*{dtype}", "GRAD_SQ": "*fp32", "GRAD_A": "*fp32",
                         "q_value": "fp32", "a_value": "fp32", "r_value": "fp32", "alpha": "fp32", "beta": "fp32",
                         "G": "i32", "CG": "i32", "P": "i32", "C_OUT": "i32", "eps2": "fp32",
                         **{stride: "i32" for stride in ("SB", "SC", "SP")}}
                constants = {"Q_MODE": q_mode, "EPILOGUE": kernels.EPILOGUES[epilogue], "PARAM": param,
                             "HAS_MAG": magnitude == "tensor", "MAGNITUDE": code, "R_MODE": r_mode, "BC": bc, "BP": bp,
                             **unit_strides[layout]}
                if name == "backward":  # dL/dq for a q tensor (learned), dL/dr for a learned radius
                    scalar_grad = 1 if q_mode == 2 else 2 if r_mode == 2 else 0
                    constants.update(SCALAR_GRAD=scalar_grad, GRAD_BROADCAST=layout == "broadcast dL/dy")
                row = {"kernel": name, "dtype": dtype, "layout": layout, "epilogue": epilogue, "q_mode": q_mode,
                       "param": param, "magnitude": str(magnitude),
                       **compile_kernel(kernel, types, constants, warps, 2, arch)}
                rows.append(row)
                print(f"compile sm_{arch} patch {name:8s} {dtype} {layout:15s} {epilogue:8s} q {q_mode} param {param} "
                      f"magnitude {row['magnitude']:6s}: "
                      f"registers {row['registers']}, spill stores {row['spill_store_bytes']} B", flush=True)
    return rows
