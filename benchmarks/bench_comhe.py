"""One SGD training step of CNN-9 (thesis Table E.1: 64/128/256 channels, FC 256) with CoMHE, against MHE and none.

Same network, same batch, same run: the unregularised step is the baseline; half-space MHE and the CoMHE
variants add their penalty to the loss (defaults of the thesis: 30 dimensions, 5 random projections redrawn
every step, a basis shared by equal fan-ins; AP-CoMHE with one projection, unrolled).  The thesis's runtime
table (E.5, seconds per 100 iterations) has RP-CoMHE at 1.36x the baseline and HS-MHE at 1.15x.
Goal: any of them adds at most 10 % to the unregularised step.  Each candidate's aten operations per step are
counted too (about one kernel launch each on a GPU); on CUDA the candidates of ``COMPILED`` also run compiled, the
whole step (CUDA graphs) and the penalty alone (the network eager, as a user who compiles nothing else trains it),
and those of ``FUSED_PAIRS`` eager with the batched energy's pair kernels (:mod:`sphereml.energy._pair_kernels`:
HS-MHE's CNN-9 step 138 operations instead of 200, counted on the CPU as a GPU buckets; plain 100), and those of
``PER_FAN_IN`` with one block per fan-in, as a CPU packs them (Note [blocks by device] in
:mod:`sphereml.energy.packing`: 216 operations instead of 200, but 1.7 GFLOP per float64 Gram product instead of 3.3).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

from sphereml import models
from sphereml.energy import batched, gram
from sphereml.regularizers.comhe import CoMHE
from sphereml.regularizers import MHE

from .harness import SMOKE, compare, compiling, first_call, training_step

COMPILED = ("none", "HS-MHE", "RP-CoMHE", "G-CoMHE")  # on CUDA, also timed compiled
FUSED_PAIRS = ("HS-MHE", "RP-CoMHE", "G-CoMHE")  # on CUDA, also timed eager with the pair kernels (energy.gram)
PER_FAN_IN = ("HS-MHE",)  # on CUDA, also timed with one block per fan-in, as on a CPU (energy.batched)
REGULARIZERS = {
    "HS-MHE": lambda net: MHE(net, half_space=True),
    "RP-CoMHE": lambda net: CoMHE(net),
    "RP-CoMHE (max)": lambda net: CoMHE(net, variant="random_max"),
    "AP-CoMHE (unrolled)": lambda net: CoMHE(net, variant="angle", num_proj=1, resample_every=None),
    "G-CoMHE": lambda net: CoMHE(net, variant="group"),
}


def _with_pair_kernels(step):
    """``step`` with the batched energy's pair chain as one Triton kernel each way (``gram.PAIRS_BACKEND``)."""
    def run():
        saved, gram.PAIRS_BACKEND = gram.PAIRS_BACKEND, "fused"
        try:
            step()
        finally:
            gram.PAIRS_BACKEND = saved

    return run


def run(device: torch.device, batch: int = 128, widths: tuple[int, int, int] = (64, 128, 256), repeats: int = 3,
        names: tuple[str, ...] = tuple(REGULARIZERS), compiled: bool | None = None) -> dict:
    """``compiled`` (default: on CUDA, unless SPHEREML_BENCH_COMPILE=0): also the candidates of ``COMPILED`` with
    their loss and penalty compiled (``torch.compile(mode="reduce-overhead")``: fused kernels replayed as one
    CUDA graph; the compilation is paid before the timing)."""
    if SMOKE:
        batch, widths, names = 2, (4, 8, 8), names[:2]
    if compiled is None:  # never in a smoke run: compiling takes longer than everything else
        compiled = compiling(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 100, (batch,), generator=g).to(device)
    candidates = {}

    def make(name: str, compile: bool | str = False):
        torch.manual_seed(0)
        net = models.Classifier(models.plain_cnn(9, widths=widths, feature_dim=256), 100).to(device)
        sgd = torch.optim.SGD(net.parameters(), 0.1, momentum=0.9)
        reg = REGULARIZERS[name](net) if name != "none" else None
        if compile == "penalty":  # only the penalty through inductor; the network and its backward eager
            reg = SimpleNamespace(before_step=reg.before_step, weighted_penalty=torch.compile(reg.weighted_penalty))
        return training_step(net, x, y, sgd, reg, compile if compile != "penalty" else False)

    for name in ("none",) + tuple(names):
        modes = (False, "reduce-overhead", "penalty") if name != "none" else (False, "reduce-overhead")
        for compile in modes if compiled and name in COMPILED else (False,):
            step = make(name, compile)
            label = name + {False: "", "reduce-overhead": " (compiled)", "penalty": " (penalty compiled)"}[compile]
            if first_call("comhe", label, step):  # compiles here: a failure drops this candidate only
                candidates[label] = step
        if device.type == "cuda" and name in FUSED_PAIRS and name in candidates:
            fused = _with_pair_kernels(candidates[name])
            if first_call("comhe", f"{name} (fused pairs)", fused):  # compiles the kernels before the timing
                candidates[f"{name} (fused pairs)"] = fused
        if device.type == "cuda" and name in PER_FAN_IN:  # the blocks a CPU makes (energy.packing)
            saved, batched.ACCELERATOR_COLUMN_WASTE = batched.ACCELERATOR_COLUMN_WASTE, None
            try:  # the regulariser's plan is made at its first call, here
                step = make(name)
                if first_call("comhe", f"{name} (a block per fan-in)", step):
                    candidates[f"{name} (a block per fan-in)"] = step
            finally:
                batched.ACCELERATOR_COLUMN_WASTE = saved
    print(f"--- CNN-9 training step with a regulariser, widths {widths}, batch {batch}, 32x32x3, 100 classes")
    return compare(f"comhe_train_step_cnn9_b{batch}", candidates, baseline="none", device=device, repeats=repeats,
                   extra={"batch": batch, "widths": list(widths), "network": "CNN-9 (Table E.1)"}, count=True)


def compile_check(arch: int = 90) -> list[dict]:
    """Compile the batched energy's pair kernels (:mod:`sphereml.energy._pair_kernels`; float64, with and without
    half-space weights, each power path) for ``sm_<arch>`` on the CPU; print registers and spills.  Must run
    without TRITON_INTERPRET."""
    from sphereml.energy import _pair_kernels as kernels

    from .sm90 import compile_kernel

    types = {"GRAM": "*fp64", "MINUS": "*fp64", "PLUS": "*fp64", "PARAMS": "*fp64", "PARTIAL": "*fp64",
             "GRAD": "*fp64", "OUT": "*fp64", "N": "i32", "n_blocks": "i32"}
    bm, bn, warps = kernels.PAIR_BLOCKS
    rows = []
    for name, kernel in (("energy", kernels.energy_kernel), ("gradient", kernels.gradient_kernel)):
        for has_plus in (True, False):
            for power in (0, 1, 2, -1):
                constants = {"HAS_PLUS": has_plus, "POWER": power, "BM": bm, "BN": bn}
                row = {"kernel": name, "has_plus": has_plus, "power": power,
                       **compile_kernel(kernel, types, constants, warps, 2, arch)}
                rows.append(row)
                print(f"compile sm_{arch} pair {name:8s} plus={has_plus!s:5s} power={power:2d} registers "
                      f"{row['registers']}, spill stores {row['spill_store_bytes']} B", flush=True)
    return rows


if __name__ == "__main__":
    from sphereml.train import resolve_device

    run(resolve_device("auto"), **({"batch": 4, "widths": (4, 8, 8), "repeats": 1} if "--smoke" in sys.argv else {}))

