"""Fixtures of the kernel tests (TRITON_INTERPRET is set, where no GPU is, by tests/conftest.py)."""
from __future__ import annotations

import pytest


@pytest.fixture
def nan_buffers(monkeypatch):
    """Every buffer a kernel allocates through runtime.ops.common.buffers starts as NaN (integer ones as
    -1), so an element a kernel forgets to write fails the comparison."""
    from runtime.ops.common import buffers

    monkeypatch.setattr(buffers, "empty", buffers.nan_empty)


@pytest.fixture
def small_chunks_nan_buffers(monkeypatch, nan_buffers):
    """GDN/KDA kernels at chunk 32 in sub-chunks of 16 (both the in-block and the cross-block paths run at
    T=63), every kernel-written buffer NaN-filled so that an element a kernel forgets to write fails."""
    from runtime.ops.gated_delta import function

    monkeypatch.setattr(function, "CHUNK_SIZE", 32)
    monkeypatch.setattr(function, "SUB_CHUNK", 16)
