"""What the Gluon kernels for Hopper (the gluon/ folders of the ops) share: the device's
SM count (their persistent grids), and the fallback to their Triton twins where a Gluon kernel does not compile with
the installed triton (Gluon is experimental: its calls move between releases, so a moved API costs speed, not the
run). Whether a device runs them at all is its op's backend selector's call (runtime/ops/common/backend.py)."""
from __future__ import annotations

import functools
import warnings

import torch
import triton
from triton.compiler.errors import CompilationError

# the Gluon kernels that did not compile in this process: the Triton kernels run in their place
FAILED: set[str] = set()


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def compiles(name: str, launch) -> bool:
    """Runs launch() and returns True, or, where the Gluon kernel `name` does not compile, warns once, remembers it in
    FAILED and returns False, so that the caller runs its Triton kernel. Other errors propagate."""
    if name in FAILED:
        return False
    try:
        launch()
    except (CompilationError, RuntimeError) as error:
        # MLIR pass failures surface as RuntimeError("PassManager::run failed"); CUDA errors must not be swallowed
        if not isinstance(error, CompilationError) and "PassManager" not in str(error):
            raise
        FAILED.add(name)
        last_line = (str(error).strip().splitlines() or [""])[-1][:200]
        warnings.warn(f"the Gluon {name} kernel does not compile with triton {triton.__version__} "
                      f"({type(error).__name__}: {last_line}); the Triton kernel runs instead", stacklevel=3)
        return False
    return True
