"""Registers, spills and shared memory of a Triton kernel compiled for the H200 (sm_90a), on a machine
without a GPU: what decides occupancy and whether a tile layout spills, checked before device time.

    from bench.kernel_resources import resources
    resources(forward.scan_kernel, {"w_ptr": "*bf16", ..., "n": "i32"}, {"H": 32, "K": 128}, num_warps=8)
    -> {"registers": 255, "spill_bytes": 24, "stack_bytes": 8, "shared_bytes": 32768}

Pointer arguments not named in `signature` default to "*bf16", other non-constexpr ones to "i32". Gluon kernels
(`@gluon.jit`) compile the same way.
Uses the ptxas that ships with triton (its newer build: the older one rejects triton 3.9's PTX).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def resources(kernel, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 1,
              divisible_by_16: tuple[str, ...] = ()) -> dict:
    """`divisible_by_16`: arguments (pointers, strides) the launch would specialize as multiples of
    16, as it does for contiguous bf16 rows: what lets loads vectorize, so the report matches the GPU."""
    fn = kernel
    while not hasattr(fn, "arg_names"):  # an autotuned or heuristics kernel wraps the JIT function
        fn = fn.fn
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = signature.get(name, "*bf16" if name.endswith("_ptr") else "i32")
    source = ASTSource
    if type(fn).__name__ == "GluonJITFunction":
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=fn, signature=sig,
                 constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                 attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible_by_16})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # triton 3.6 and later ship a second, newer ptxas; earlier releases one
    ptxas = next(p for p in (os.path.join(bin_dir, name) for name in ("ptxas-blackwell", "ptxas")) if os.path.exists(p))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, report)) else 0  # noqa: E731
    return {"registers": number(r"Used (\d+) registers"), "spill_bytes": number(r"(\d+) bytes spill stores"),
            "stack_bytes": number(r"(\d+) bytes stack frame"), "shared_bytes": compiled.metadata.shared}
