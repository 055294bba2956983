"""x's rows in expert-sorted order: out[s] = x[pair(s) // k], for the weight gradient that reduces
over them (it runs faster on rows in order than gathering along its reduction).

One Triton pass that reads the token of each sorted row from the schedule's pair index, so no
token index is materialized (torch's index_select needs one).

Shape legend: T tokens, D width, S sorted rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.launch import fast
from runtime.kernels import buffers
from runtime.kernels.moe.schedule import Schedule


# a bandwidth-bound copy: up to 1024 columns a step, about 8192 elements (rows x columns) a program
MAX_BLOCK_D = 1024
ELEMENTS_PER_PROGRAM = 8192


@triton.jit
def gather_tokens_kernel(x_ptr, out_ptr, pair_ptr, num_rows, D,
                         TOP_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = rows < num_rows
    tokens = tl.load(pair_ptr + rows, mask=row_ok, other=0).to(tl.int32) // TOP_K
    src = x_ptr + tokens[:, None].to(tl.int64) * D
    dst = out_ptr + rows[:, None].to(tl.int64) * D
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (cols < D)[None, :]
        tl.store(dst + cols[None, :], tl.load(src + cols[None, :], mask=mask), mask=mask)


def gather_tokens(x_TD: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """x_TD [T, D] contiguous -> [S, D], row s the token of sorted row s."""
    S, D = sched.pair_S.numel(), x_TD.shape[1]
    out_SD = buffers.empty(S, D, dtype=x_TD.dtype, device=x_TD.device)
    block_d = min(MAX_BLOCK_D, triton.next_power_of_2(D))
    block_s = max(1, ELEMENTS_PER_PROGRAM // block_d)
    fast(gather_tokens_kernel)[(triton.cdiv(S, block_s),)](x_TD, out_SD, sched.pair_S, S, D, TOP_K=sched.top_k,
                                                     BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4)
    return out_SD
