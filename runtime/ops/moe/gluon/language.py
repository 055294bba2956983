"""The Gluon names the experts' Hopper kernels (down_gemm.py, glu_gemm.py, weight_grad.py) import: Gluon's Hopper
modules, or None for each where the installed triton has none (the kernels' modules then leave their Triton and torch
twins in place), and the calls whose names moved between triton releases."""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:
    gluon = gl = async_copy = fence_async_shared = mbarrier = tma = None
    warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None

if gluon is not None:
    # triton 3.6 calls these async_copy_global_to_shared, async_copy_shared_to_global and thread_barrier, 3.7 and later
    # async_load, async_store and barrier
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    barrier = getattr(gl, "barrier", None) or gl.thread_barrier
else:
    tma_load = tma_store = cp_async_load = barrier = None

# Hopper's shared memory a block can hold
SHARED_BYTES = 227 * 1024
