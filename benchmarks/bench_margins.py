"""Forward + backward of the margin heads against ``nn.Linear`` (no bias) + ``cross_entropy``, same run.

The heads add a normalisation of W and x, a gather and a few elementwise passes over the B target
logits.  Sizes: B=256, d=512, C=10,000 (face-recognition size; goal at most 1.3x on the CPU, 1.5x on a
GPU) and, on CUDA, B=512, d=512, C=100,000 (goal at most 1.2x), there each head also under ``torch.compile``
(ArcFace at both sizes).
On CUDA the kernels of ArcFace at the large size are listed from the PyTorch profiler (top 10 by GPU
time) and saved beside the timings, to show where a head's time goes.  ``SPHEREML_BENCH_COMPILE=0`` skips
the compiled candidates (their compilation takes most of the run's time).

The heads take the reference path (the default: autograd over the B x C logits); on CUDA the four heads of
``FUSED_ROWS`` also run with ``backend="fused"`` (:func:`sphereml.heads.fused_head.fused_margin_loss`, Triton).
Beside each time: the aten operations of one step and, in brackets, those that touch a B x C or C x d tensor (on
this CPU at B=256, C=10,000: 8 for the baseline, 24 for a normalised head's reference path and 19 for L-Softmax's,
8 for the fused path; in all, 8, 41-112 and 10-19 on a GPU, where the labels' range is not read).
Result files of 2026-11-27 were measured when the heads took an earlier fused path on CUDA: there the plain
rows are fused and the "(reference)" rows the reference (their ``note`` says so).
:func:`compile_check` compiles the fused kernels for sm_90 on a machine without a GPU.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from sphereml.heads.margins import ArcFaceLoss, ASoftmaxLoss, CosFaceLoss, LambdaSchedule, LSoftmaxLoss

from .harness import compare, compiling, save, smoke_or

SIZES = [(256, 512, 10_000), (512, 512, 100_000)]  # (batch, in_features, classes); the second on CUDA only
FUSED_ROWS = ("A-Softmax m=4 (annealed)", "L-Softmax m=4", "CosFace", "ArcFace")  # also timed fused on CUDA


def _heads(d: int, c: int) -> dict:
    return {
        "A-Softmax m=4 (annealed)": ASoftmaxLoss(d, c, m=4, lambda_=LambdaSchedule.sphereface()),
        "A-Softmax m=1.5 detached": ASoftmaxLoss(d, c, m=1.5, s=30.0, detach_margin=True),
        "L-Softmax m=4": LSoftmaxLoss(d, c, m=4),
        "CosFace": CosFaceLoss(d, c),
        "ArcFace": ArcFaceLoss(d, c),
    }


def _inputs(b: int, d: int, c: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, d, generator=g).to(device).requires_grad_(True)
    y = torch.randint(c, (b,), generator=g).to(device)
    return x, y


def _profile(head, x, y) -> list[dict]:
    """The ten kernels with the most GPU time in five forward + backward passes of ``head``."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        head.loss(x, y).backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            head.loss(x, y).backward()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, "device_time_total", 0.0), reverse=True)
    rows = [{"kernel": e.key[:120], "calls": e.count, "gpu_ms": getattr(e, "device_time_total", 0.0) / 1e3}
            for e in events[:10]]
    for r in rows:
        print(f"    {r['gpu_ms']:8.3f} ms  {r['calls']:4d}x  {r['kernel']}")
    return rows


def run(device: torch.device) -> dict:
    results = {}
    sizes = smoke_or(SIZES if device.type == "cuda" else SIZES[:1], [(8, 16, 32)])
    compile_heads = compiling(device)
    for b, d, c in sizes:
        x, y = _inputs(b, d, c, device)
        linear = torch.nn.Linear(d, c, bias=False).to(device)

        def step(loss_of):
            x.grad = None
            loss_of().backward()

        candidates = {"nn.Linear + cross_entropy": lambda: step(lambda: F.cross_entropy(linear(x), y))}
        for label, head in _heads(d, c).items():
            head.to(device)
            candidates[label] = lambda h=head: step(lambda: h.loss(x, y))
            if device.type == "cuda" and label in FUSED_ROWS:
                fused = _heads(d, c)[label].to(device)
                fused.backend = "fused"
                candidates[f"{label} (fused)"] = lambda h=fused: step(lambda: h.loss(x, y))
            if compile_heads and ((b, d, c) == SIZES[1] or label == "ArcFace"):
                compiled = torch.compile(head.loss)
                candidates[f"{label} (compiled)"] = lambda f=compiled: step(lambda: f(x, y))
        name = "margin_heads_fwd_bwd" if (b, d, c) == SIZES[0] else f"margin_heads_fwd_bwd_b{b}_c{c}"
        print(f"--- margin heads, B={b}, d={d}, C={c}")
        results[name] = compare(name, candidates, baseline="nn.Linear + cross_entropy", device=device, repeats=25,
                                extra={"batch": b, "in_features": d, "num_classes": c, "compiled": compile_heads},
                                count=True, large=min(b * c, c * d))
    if device.type == "cuda":
        b, d, c = SIZES[1]
        x, y = _inputs(b, d, c, device)
        print(f"--- profile of ArcFace, B={b}, d={d}, C={c}")
        rows = _profile(ArcFaceLoss(d, c).to(device), x, y)
        save({"benchmark": "margin_heads_profile", "head": "ArcFace", "batch": b, "in_features": d,
              "num_classes": c, "top_kernels": rows}, "margin_heads_profile", device)
    return results


def compile_check(arch: int = 90) -> list[dict]:
    """Compile the fused cross-entropy's kernels (float32 and bf16 products, with and without the weight
    norms; the tail of each target kind) for ``sm_<arch>`` on the CPU and print registers and spills.  Must run
    without TRITON_INTERPRET."""
    from sphereml.heads import _margin_kernels as kernels

    from .sm90 import compile_kernel

    types = {"W": "*fp32", "NORM_OUT": "*fp32", "INV_OUT": "*fp32", "DINV_OUT": "*fp32", "RAW": "*fp32",
             "INV": "*fp32", "LABELS": "*i64", "MAX_OUT": "*fp32", "SUM_OUT": "*fp32", "RAWY_OUT": "*fp32",
             "LOGITS_OUT": "*fp32", "MAX_IN": "*fp32", "SUM_IN": "*fp32", "LSE_OUT": "*fp32", "LSE": "*fp32",
             "ROW_SCALE": "*fp32", "LABEL_GRAD": "*fp32", "SCALE": "*fp32", "GRAD_OUT": "*fp32", "COLSUM_OUT": "*fp32",
             "B": "i32", "C": "i32", "d": "i32", "stride": "i32", "chunk": "i32", "n_chunks": "i32", "eps": "fp32",
             "REST": "*fp32", "RAWY": "*fp32", "XNORM": "*fp32", "WNORM": "*fp32", "LOSS_OUT": "*fp32",
             "ROW_GRAD": "*fp32", "XNORM_GRAD": "*fp32", "WNORM_GRAD": "*fp32", "s": "fp32", "a": "fp32", "b": "fp32",
             "p0": "fp32", "p1": "fp32"}  # the tail's float arguments are float32 in the kernel too
    cases = [("norm", kernels.norm_kernel, kernels.NORM_BLOCKS, dtype, {"W": f"*{dtype}"}, {}, ("BR", "BD"))
             for dtype in ("fp32", "bf16")]
    for dtype in ("fp32", "bf16"):
        for has_inv in (True, False):
            logits = "*fp32" if has_inv else f"*{dtype}"  # the logits keep the product's dtype without norms
            cases.append(("lse", kernels.lse_kernel, kernels.LSE_BLOCKS, dtype,
                          {"RAW": f"*{dtype}", "LOGITS_OUT": logits}, {"HAS_INV": has_inv, "WRITE_LOGITS": True},
                          ("BM", "BN")))
            cases.append(("grad", kernels.grad_kernel, kernels.GRAD_BLOCKS, dtype,
                          {"RAW": f"*{dtype}", "GRAD_OUT": f"*{dtype}"},
                          {"HAS_INV": has_inv, "HAS_LABEL_GRAD": True, "HAS_SCALE": True}, ("BM", "BN")))
    cases.append(("combine", kernels.combine_kernel, kernels.COMBINE_BLOCKS, "fp32", {}, {}, ("BM", "BK")))
    block, warps = kernels.TAIL_BLOCKS
    for kind, m, has_inv, scale in ((0, 1, True, 0), (0, 1, True, 1), (1, 1, True, 0), (2, 1, True, 0),
                                    (3, 4, True, 1), (4, 1, True, 0), (5, 4, False, 2)):  # margin_tail.TAIL_KINDS
        cases.append((f"tail{kind}", kernels.tail_kernel, (block, 1, warps), "fp32", {},
                      {"KIND": kind, "M": m, "HAS_INV": has_inv, "SCALE": scale}, ("BLOCK", None)))
    rows = []
    for name, kernel, (rows_block, cols_block, warps), dtype, typed, flags, block_names in cases:
        constants = {**flags, block_names[0]: rows_block}
        if block_names[1]:
            constants[block_names[1]] = cols_block
        row = {"kernel": name, "dtype": dtype, "has_inv": flags.get("HAS_INV"),
               **compile_kernel(kernel, {**types, **typed}, constants, warps, 2, arch)}
        rows.append(row)
        print(f"compile sm_{arch} {name:7s} {dtype} has_inv={row['has_inv']!s:5s} registers {row['registers']}, "
              f"spill stores {row['spill_store_bytes']} B", flush=True)
    return rows
