"""Whether the fused Triton kernels can run in this process, and if not, why.

They need triton and a CUDA GPU, or TRITON_INTERPRET=1 (Triton's CPU interpreter: slow, fp32
only). Imports neither torch nor triton unless torch is already loaded, so `inspect` stays fast;
without torch the GPU is found through the CUDA driver, as torch itself would.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys


def kernels_available() -> tuple[bool, str]:
    """(True, how they run) or (False, what is missing)."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'triton>=3.4'; wheels exist for Linux only)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "TRITON_INTERPRET=1: Triton's interpreter on the CPU (slow; fp32 inputs only)"
    if _cuda_devices() > 0:
        return True, "on the CUDA GPU"
    return False, "no CUDA GPU here (set TRITON_INTERPRET=1 to run them on the CPU, slowly)"


def _cuda_devices() -> int:
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value
