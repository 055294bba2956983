"""Shared fixtures of the Triton kernel tests."""
import pytest

from runtime.kernels import buffers


@pytest.fixture
def nan_buffers(monkeypatch):
    """Every buffer a kernel allocates through runtime.kernels.buffers starts as NaN (integer ones as
    -1), so an element a kernel forgets to write fails the comparison."""
    monkeypatch.setattr(buffers, "empty", buffers.nan_empty)
