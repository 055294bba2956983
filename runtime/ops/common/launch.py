"""Launching an already compiled Triton kernel without Triton's per-call Python work.

`kernel[grid](*args, **kwargs)` binds every argument, builds a cache key from its specialization,
looks the compiled kernel up and checks the kernel's globals on every call: more than twice the
host time of a launch through the compiled kernel's own launcher (bench/launch_overhead.py measures
both). That host work shows in a step's wall time wherever the host falls behind the GPU.

`fast(kernel)[grid](*args, **kwargs)` launches the same compiled kernel Triton would: the first call
with a given key goes through `kernel[grid]` (compiling if needed) and keeps what it returns, later
calls with that key go straight to its launcher. The key holds everything Triton specializes on:
each tensor's dtype and 16-byte alignment, each int's value (Triton specializes ints on value), and
every keyword (constexprs and launch options). Under the interpreter it is `kernel[grid]` itself.
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

# compiled kernels kept per Triton kernel before the cache starts over (ints vary with shapes)
MAX_KEYS = 64


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _arg_key(arg):
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, float):
        return float
    return arg


class FastLaunch:
    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}
        self.params = list(inspect.signature(kernel.fn).parameters.values())

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        if interpreting() or callable(grid):
            return self.kernel[grid](*args, **kwargs)
        # Triton compiles for, and launches on, the current device
        key = (torch.cuda.current_device(), tuple(map(_arg_key, args)), tuple(kwargs.items()))
        known = self.compiled.get(key)
        if known is None:
            if len(self.compiled) >= MAX_KEYS:
                self.compiled.clear()
            compiled = self.kernel[grid](*args, **kwargs)
            # the launcher takes every parameter in order, constexprs included, but no launch options
            rest = [(p.name, p.default) for p in self.params[len(args):]]
            self.compiled[key] = (compiled, rest)
            return compiled
        compiled, rest = known
        compiled[(*grid, 1, 1)[:3]](*args, *(kwargs.get(name, default) for name, default in rest))
        return compiled


@functools.cache
def fast(kernel) -> FastLaunch:
    """The FastLaunch of a @triton.jit kernel (one per kernel)."""
    return FastLaunch(kernel)
