"""Triton kernels compiled for an NVIDIA GPU on a machine without one: registers and spills from ``ptxas -v``.

Triton 3.x compiles a ``@triton.jit`` function for any target through ``ASTSource`` and ``GPUTarget``, with
the ``ptxas`` it ships (``ptxas-blackwell`` where present: the older one refuses the PTX versions that recent
Triton emits).  Must run without ``TRITON_INTERPRET`` (interpreted kernels are not ``JITFunction``s).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["compile_kernel"]


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
