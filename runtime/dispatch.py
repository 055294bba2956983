"""Pick each op's implementation: the fused kernel on CUDA when it exists, the torch fallback elsewhere.

Every layer gets its ops through `op(name)`, so one switch (`force`) runs the whole model through
the fallbacks or the kernels, which is how alignment tier 0 checks both.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Literal, Optional

import torch

from runtime.registry import OPS

_forced: Optional[Literal["fallback", "kernel"]] = None


def op(name: str, device: torch.device | None = None) -> Callable:
    family = OPS[name]
    on_cuda = device is not None and device.type == "cuda"
    if _forced != "fallback" and (on_cuda or _forced == "kernel"):
        kernel = family.resolve("kernel")
        if kernel is not None:
            return kernel
    fallback = family.resolve("fallback")
    if fallback is None:
        raise RuntimeError(f"op {name}: runtime implementation {family.fallback} is not importable")
    return fallback


@contextlib.contextmanager
def force(which: Literal["fallback", "kernel"] | None):
    """Run everything inside through one kind of implementation."""
    global _forced
    previous, _forced = _forced, which
    try:
        yield
    finally:
        _forced = previous
