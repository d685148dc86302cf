"""Forward + backward of ``DecoupledConv2d`` against ``nn.Conv2d`` of the same shape, timed in the same run.

Candidates: ``nn.Conv2d`` (the baseline), the operator the issue names (TanhConv x cosine with the radius
normalised by E{||x||}, thesis eq. C.1), the same with a learned rho, SegConv x square cosine (the
best no-ReLU operator of Table 4.3), the readable unfold definition
(:func:`~sphereml.layers.decoupled.decoupled_conv2d_reference`), and on CUDA the TanhConv layer under
``torch.compile``, and the functional TanhConv x cosine (rho 1, and a learned rho) through the reference nodes
and through the fused Triton epilogue (:mod:`sphereml.layers.patch_epilogue`, h in its kernels).  Result files of
2026-11-27 were measured when the layers took the fused epilogue on CUDA (their ``note`` says so).
B=32, 64 -> 64 channels, 32x32, 3x3 (and B=128, 128 channels on CUDA).
Goal: TanhConv x cosine at most 1.5x Conv2d.
"""

from __future__ import annotations

import torch

from sphereml.layers.decoupled import DecoupledConv2d, decoupled_conv2d, decoupled_conv2d_reference
from sphereml.timing import forward_backward

from .harness import compare, compiling, sized_name, smoke_or

K = 3
SIZES = [(32, 64, 32), (128, 128, 32)]  # (batch, channels, side); the second on CUDA only


def _functional_row(rho: str, backend: str) -> str:
    return f"TanhConv cosine, {rho} ({backend} epilogue)"


FUSED_ROWS = tuple(_functional_row(rho, "fused") for rho in ("rho 1", "learned rho"))  # timed on CUDA only


def fused_result_rows() -> set[tuple[str, str]]:
    """(result name, row) of each row timed through the fused epilogue on CUDA (``benchmarks/goals.py``'s are
    checked against them)."""
    return {(sized_name("decoupled_fwd_bwd", size, SIZES[0]), row) for size in SIZES for row in FUSED_ROWS}


def run(device: torch.device, sizes: list[tuple[int, int, int]] | None = None, repeats: int = 20) -> dict:
    results = {}
    for b, c, side in sizes or smoke_or(SIZES if device.type == "cuda" else SIZES[:1], [(2, 4, 8)]):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(b, c, side, side, generator=g).to(device).requires_grad_(True)
        target = torch.randn(b, c, side, side, generator=g).to(device)
        conv = torch.nn.Conv2d(c, c, K, padding=1, bias=False).to(device)
        tanh = DecoupledConv2d(c, c, K, padding=1, magnitude="tanh", radius_norm=True).to(device)
        learned = DecoupledConv2d(c, c, K, padding=1, magnitude="tanh", radius_norm=True,
                                  learnable_rho=True).to(device)
        seg = DecoupledConv2d(c, c, K, padding=1, magnitude="seg", angular="sqcosine").to(device)
        operators = {"nn.Conv2d": conv, "TanhConv cosine, rho E{||x||}": tanh,
                     "TanhConv cosine, learned rho": learned, "SegConv square cosine": seg,
                     "unfold definition (tanh)": lambda inp: decoupled_conv2d_reference(
                         inp, tanh.weight, padding=1, magnitude="tanh", radius=1.0)}
        if compiling(device):
            operators["TanhConv cosine (compiled)"] = torch.compile(tanh)
        if device.type == "cuda":
            for backend in ("reference", "fused"):
                operators[_functional_row("rho 1", backend)] = lambda inp, b=backend: decoupled_conv2d(
                    inp, tanh.weight, padding=1, magnitude="tanh", backend=b)
                operators[_functional_row("learned rho", backend)] = \
                    lambda inp, b=backend: decoupled_conv2d(inp, learned.weight, padding=1, magnitude="tanh",
                                                            rho=learned.rho, backend=b)
        name = sized_name("decoupled_fwd_bwd", (b, c, side), SIZES[0])
        print(f"--- decoupled operators, B={b}, {c} -> {c} channels, {side}x{side}")
        results[name] = compare(name, forward_backward(operators, x, target), baseline="nn.Conv2d", device=device,
                                repeats=repeats, extra={"batch": b, "channels": c, "size": side, "kernel": K})
    return results
