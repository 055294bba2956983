"""Allocation of every buffer a fused kernel writes, and of the constant zeros some launches read.

One function for all kernels so that tests can swap in a NaN-filled allocator
(`tests` monkeypatch `runtime.ops.common.buffers.empty`) and catch any element a kernel forgets to write.
Kernel modules call it as `buffers.empty(...)` (attribute lookup at call time) so the swap reaches them.
"""
from __future__ import annotations

import functools

import torch


def empty(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def nan_empty(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The test allocator: float buffers NaN, integer buffers -1. It does not call `empty`, so that
    it can replace it."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan") if out.is_floating_point() else -1)


@functools.cache
def zeros(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    """One zero tensor per shape, dtype and device, made once: no launch fills a fresh one per call. Read-only."""
    return torch.zeros(shape, dtype=dtype, device=device)
