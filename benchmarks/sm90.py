"""Triton kernels compiled for an NVIDIA GPU on a machine without one: registers and spills from ``ptxas -v``.

Triton 3.x compiles a ``@triton.jit`` function for any target through ``ASTSource`` and ``GPUTarget``, with
the ``ptxas`` it ships (``ptxas-blackwell`` where present: the older one refuses the PTX versions that recent
Triton emits).  Must run without ``TRITON_INTERPRET`` (interpreted kernels are not ``JITFunction``s).

``python -m benchmarks.sm90`` compiles every kernel of the library in the forms its benchmarks list
(:data:`CHECKS`) and prints a summary; it exits 1 when a kernel of fixed configuration spills, 2 when there is no
``ptxas`` to count registers.  ``make sm90`` runs it
under the Triton version of the GPU boxes (``TRITON_VERSION``, default 3.6.0), installed beside the environment:
registers differ between versions, and the tests check them under the version installed here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["CHECKS", "compile_kernel", "main"]

# (benchmark module, its compile check, whether its rows are autotuning candidates): the tuner times every candidate
# and may leave a spilling one aside, so their spills are reported, not failed
CHECKS = (("bench_scs", "compile_check", False), ("bench_sphereconv", "compile_check", False),
          ("bench_sphereconv", "window_compile_check", False), ("bench_margins", "compile_check", False),
          ("bench_comhe", "compile_check", False), ("bench_energy", "gemm_compile_check", False),
          ("bench_energy", "compile_check", True))


def _ptxas() -> Path | None:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return next((p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists()), None)


def compile_kernel(kernel, types: dict, constants: dict, num_warps: int, num_stages: int, arch: int = 90) -> dict:
    """Compile ``kernel`` (a JITFunction, or an Autotuner's ``.fn``) for ``sm_<arch>``.

    ``types``: Triton type of each runtime argument (``"*fp32"``, ``"i32"``, ...); ``constants``: the
    ``tl.constexpr`` arguments.  Returns compile seconds, shared memory, registers and spill-store bytes.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jit = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel  # the JITFunction
    signature = {arg: "constexpr" if arg in constants else types[arg] for arg in jit.arg_names}
    source = ASTSource(fn=jit, signature=signature,
                       constexprs={(jit.arg_names.index(k),): v for k, v in constants.items()})
    started = time.perf_counter()
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    row = {"compile_seconds": time.perf_counter() - started, "shared_bytes": compiled.metadata.shared,
           "registers": None, "spill_store_bytes": None}
    ptxas = _ptxas()
    if ptxas is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(compiled.asm["ptx"])
            f.flush()
            arch_flag = f"-arch=sm_{arch}a" if arch == 90 else f"-arch=sm_{arch}"
            log = subprocess.run([str(ptxas), arch_flag, "-v", f.name, "-o", os.devnull],
                                 capture_output=True, text=True).stderr
        registers, spills = re.findall(r"Used (\d+) registers", log), re.findall(r"(\d+) bytes spill stores", log)
        row["registers"] = int(registers[0]) if registers else None
        row["spill_store_bytes"] = int(spills[0]) if spills else None
    return row


def main(argv: list[str] | None = None) -> int:
    """Run every compile check of :data:`CHECKS`; print registers and spills per check; 1 when a fixed one spills,
    2 without ``ptxas``."""
    parser = argparse.ArgumentParser(description="every Triton kernel compiled for sm_<arch> on this machine")
    parser.add_argument("--arch", type=int, default=90)
    arch = parser.parse_args(argv).arch
    import triton

    if _ptxas() is None:
        print(f"Triton {triton.__version__} ships no ptxas here: no registers to count", file=sys.stderr)
        return 2

    summary, failed = [], False
    for module, function, tuned in CHECKS:
        rows = getattr(importlib.import_module(f"benchmarks.{module}"), function)(arch)
        spilling = [row for row in rows if row["spill_store_bytes"]]
        failed |= bool(spilling) and not tuned
        registers = [row["registers"] for row in rows]
        note = " (autotuning candidates)" if tuned and spilling else ""
        summary.append(f"{module + '.' + function:38s} {len(rows):3d} forms, registers {min(registers)}-"
                       f"{max(registers)}, {len(spilling)} spilling{note}")
    print(f"\nsm_{arch}, Triton {triton.__version__}:", *summary, sep="\n  ")
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
