"""Per-expert weight gradients: out[e] = alpha * sum over expert e's sorted rows s of
(scale[s] * A[row_a(s)])^T B[row_b(s)], i.e. [M, N] per expert, reducing over that expert's rows.

A and B rows may be gathered (dy is read by token; x comes as a copy in expert order, which is
faster here than gathering along the reduction); an expert that received no rows gets zeros.
With SPLIT_K > 1 each expert's rows are cut into SPLIT_K chunks (whole BLOCK_K steps) reduced by
separate programs that add into a zeroed fp32 output atomically (a benchmark variant: more, shorter
programs per expert, at the price of the fp32 buffer and its cast).

Shape legend: S sorted rows, M and N the two sides of the gradient, E experts.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from runtime.kernels.moe import buffers
from runtime.kernels.moe.schedule import Schedule


@triton.jit
def grouped_wgrad_kernel(
    a_ptr, stride_am, a_row_ptr, scale_ptr,
    b_ptr, stride_bm, b_row_ptr,
    out_ptr, stride_oe, stride_om, stride_on,
    ends_ptr, M, N, alpha,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, ROW_SCALE: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (tl.program_id(0) // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    start, end = _row_range(ends_ptr, e, SPLIT_K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s0 in range(start, end, BLOCK_K):
        rows = s0 + tl.arange(0, BLOCK_K)
        r_ok = rows < end
        a_rows = tl.load(a_row_ptr + rows, mask=r_ok, other=0) if GATHER_A else rows
        b_rows = tl.load(b_row_ptr + rows, mask=r_ok, other=0) if GATHER_B else rows
        a = tl.load(a_ptr + a_rows[None, :].to(tl.int64) * stride_am + offs_m[:, None], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        if ROW_SCALE:
            a = (a * tl.load(scale_ptr + rows, mask=r_ok, other=0.0)[None, :]).to(b_ptr.dtype.element_ty)
        b = tl.load(b_ptr + b_rows[:, None].to(tl.int64) * stride_bm + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
    out = out_ptr + e.to(tl.int64) * stride_oe + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if SPLIT_K > 1:
        tl.atomic_add(out, acc * alpha, mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(out, (acc * alpha).to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _row_range(ends_ptr, e, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Sorted rows [start, end) this program reduces: expert e's, or its chunk program_id(2) of them."""
    end = tl.load(ends_ptr + e)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    if SPLIT_K > 1:
        chunk = tl.cdiv(tl.cdiv(end - start, SPLIT_K), BLOCK_K) * BLOCK_K
        start = start + tl.program_id(2) * chunk
        end = tl.minimum(end, start + chunk)
    return start, end


def _tuned_configs() -> list[triton.Config]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    # Winners of bench/bench_moe.py --sweep (H200, 2026-11-29): gate/up 1.94 ms with 8 warps, down
    # 1.49 ms with 4 (1.52 with 8); stages 4 and BLOCK_K 32/128, 128x256, 256x128 were slower.
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    ]


_KEY = ["M", "N", "GATHER_A", "GATHER_B", "ROW_SCALE", "SPLIT_K"]
_tuned_kernel = triton.autotune(configs=_tuned_configs(), key=_KEY)(grouped_wgrad_kernel)
# Split-K adds into its output, so each autotuning trial starts from zeros again.
_tuned_split_kernel = triton.autotune(configs=_tuned_configs(), key=_KEY, reset_to_zero=["out_ptr"])(
    grouped_wgrad_kernel
)
# Gradients with a narrow side (the rank-r LoRA factors) take one fixed config sized to it.
SMALL = 64


def _small_config(M: int, N: int) -> dict:
    fit = lambda n: max(16, min(128, triton.next_power_of_2(n)))  # noqa: E731
    return dict(BLOCK_M=fit(M), BLOCK_N=fit(N), BLOCK_K=32, num_warps=4)


def grouped_wgrad(a_SM, b_SN, sched: Schedule, *, a_rows=None, b_rows=None, row_scale_S=None, alpha=1.0,
                  out_dtype=None, split_k: int = 1, config: dict | None = None) -> torch.Tensor:
    """[E, M, N] gradient; a/b rows gathered through `a_rows`/`b_rows` when given.
    split_k > 1: each expert's reduction spread over split_k programs (fp32 atomics, then a cast).
    `config` (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) bypasses the autotuner."""
    M, N, E = a_SM.shape[1], b_SN.shape[1], sched.num_experts
    dtype = out_dtype or b_SN.dtype
    if split_k > 1:
        out = torch.zeros((E, M, N), dtype=torch.float32, device=a_SM.device)
    else:
        out = buffers.empty((E, M, N), dtype, a_SM.device)
    if config is None and min(M, N) <= SMALL:
        config = _small_config(M, N)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), E, split_k)  # noqa: E731
    kernel = grouped_wgrad_kernel if config is not None else _tuned_split_kernel if split_k > 1 else _tuned_kernel
    kernel[grid](
        a_SM, a_SM.stride(0), a_rows if a_rows is not None else sched.pair_S,
        row_scale_S if row_scale_S is not None else a_SM,
        b_SN, b_SN.stride(0), b_rows if b_rows is not None else sched.pair_S,
        out, *out.stride(), sched.ends_E, M, N, alpha,
        GATHER_A=a_rows is not None, GATHER_B=b_rows is not None, ROW_SCALE=row_scale_S is not None,
        PRECISION="ieee" if b_SN.dtype == torch.float32 else "tf32", SPLIT_K=split_k, **(config or {}),
    )
    return out.to(dtype)
