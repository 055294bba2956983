"""Token rows around the grouped GEMMs: x gathered into expert-sorted order and each token's k rows summed back.

`gather_tokens`: x's rows in expert-sorted order, out[s] = x[pair(s) // k] (optionally times a pair's
routing weight: dy's rows for the down weight gradient), for the weight gradients that reduce over them
(they run faster on rows in order than gathering along their reduction); the token
of each sorted row comes from the schedule's pair index, so no token index is materialized (torch's
index_select needs one).
`sum_k`: each token's k rows, [T * k, D] in pair order -> [T, D], accumulated in fp32, reading every row
once and writing the result once (torch's strided reduction over the middle axis of [T, k, D] moves the
same bytes more slowly).

Shape legend: T tokens, k top-k, D width, S = T * k sorted rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.common.launch import fast
from runtime.ops.common import buffers
from runtime.ops.moe.schedule import Schedule


# up to 1024 columns a step keeps loads wide; gather_tokens' programs copy about 8192 elements (rows x
# columns) each, sum_k's one token's 1024-wide column block
MAX_BLOCK_D = 1024
ELEMENTS_PER_PROGRAM = 8192


@triton.jit
def gather_tokens_kernel(x_ptr, out_ptr, pair_ptr, scale_ptr, num_rows, D, TOP_K: tl.constexpr,
                         ROW_SCALE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = rows < num_rows
    pairs = tl.load(pair_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    src = x_ptr + (pairs // TOP_K)[:, None].to(tl.int64) * D
    dst = out_ptr + rows[:, None].to(tl.int64) * D
    if ROW_SCALE:
        scale = tl.load(scale_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (cols < D)[None, :]
        x = tl.load(src + cols[None, :], mask=mask)
        if ROW_SCALE:
            x = (x.to(tl.float32) * scale).to(out_ptr.dtype.element_ty)
        tl.store(dst + cols[None, :], x, mask=mask)


@triton.jit
def sum_k_kernel(rows_ptr, out_ptr, D, k, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(k):
        acc += tl.load(rows_ptr + (t * k + j) * D + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def gather_tokens(x_TD: torch.Tensor, sched: Schedule, row_scale_P: torch.Tensor | None = None) -> torch.Tensor:
    """x_TD [T, D] contiguous -> [S, D], row s the token of sorted row s, times row_scale_P[pair(s)] (in fp32,
    rounded once) when given."""
    S, D = sched.pair_S.numel(), x_TD.shape[1]
    out_SD = buffers.empty(S, D, dtype=x_TD.dtype, device=x_TD.device)
    block_d = min(MAX_BLOCK_D, triton.next_power_of_2(D))
    block_s = max(1, ELEMENTS_PER_PROGRAM // block_d)
    fast(gather_tokens_kernel)[(triton.cdiv(S, block_s),)](
        x_TD, out_SD, sched.pair_S, row_scale_P if row_scale_P is not None else x_TD, S, D, TOP_K=sched.top_k,
        ROW_SCALE=row_scale_P is not None, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4)
    return out_SD


def sum_k(rows_SD: torch.Tensor, k: int) -> torch.Tensor:
    """rows_SD [T * k, D] contiguous, token t's rows at t*k .. t*k+k-1 -> [T, D] in rows' dtype."""
    S, D = rows_SD.shape
    out_TD = buffers.empty(S // k, D, dtype=rows_SD.dtype, device=rows_SD.device)
    block_d = min(MAX_BLOCK_D, triton.next_power_of_2(D))
    fast(sum_k_kernel)[(S // k, triton.cdiv(D, block_d))](rows_SD, out_TD, D, k, BLOCK_D=block_d, num_warps=4)
    return out_TD
