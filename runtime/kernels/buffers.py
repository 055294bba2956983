"""Allocation of every buffer a fused kernel writes.

One function for all kernels so that tests can swap in a NaN-filled allocator
(`tests` monkeypatch `runtime.kernels.buffers.empty`) and catch any element a kernel forgets to write.
Kernel modules call it as `buffers.empty(...)` (attribute lookup at call time) so the swap reaches them.
"""
from __future__ import annotations

import torch


def _shape(shape: tuple) -> tuple:
    """Shape given as ints or as one tuple."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        return tuple(shape[0])
    return shape


def empty(*shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty(*shape); shape given as ints or as one tuple."""
    return torch.empty(_shape(shape), dtype=dtype, device=device)


def nan_empty(*shape, dtype: torch.dtype, device) -> torch.Tensor:
    """The test allocator: float buffers NaN, integer buffers -1. It does not call `empty`, so that
    it can replace it."""
    out = torch.empty(_shape(shape), dtype=dtype, device=device)
    return out.fill_(float("nan") if out.is_floating_point() else -1)
