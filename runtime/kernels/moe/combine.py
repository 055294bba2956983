"""Sum of each token's k rows: [T * k, D] in pair order -> [T, D], accumulated in fp32.

One pass that reads every row once and writes the result once (torch's strided reduction over
the middle axis of [T, k, D] moves the same bytes more slowly: bench/NOTES.md).

Shape legend: T tokens, k top-k, D width.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.launch import fast
from runtime.kernels import buffers


# a bandwidth-bound pass: one program per token and 1024-wide column block keeps loads wide
MAX_BLOCK_D = 1024


@triton.jit
def sum_k_kernel(rows_ptr, out_ptr, D, k, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(k):
        acc += tl.load(rows_ptr + (t * k + j) * D + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def sum_k(rows_SD: torch.Tensor, k: int) -> torch.Tensor:
    """rows_SD [T * k, D] contiguous, token t's rows at t*k .. t*k+k-1 -> [T, D] in rows' dtype."""
    S, D = rows_SD.shape
    out_TD = buffers.empty(S // k, D, dtype=rows_SD.dtype, device=rows_SD.device)
    block_d = min(MAX_BLOCK_D, triton.next_power_of_2(D))
    fast(sum_k_kernel)[(S // k, triton.cdiv(D, block_d))](rows_SD, out_TD, D, k, BLOCK_D=block_d, num_warps=4)
    return out_TD
