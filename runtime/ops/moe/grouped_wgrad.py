"""Per-expert weight gradients: out[e] = alpha * sum over expert e's sorted rows s of
(scale[pair(s)] * A[row_a(s)])^T B[row_b(s)], i.e. [M, N] per expert, reducing over that expert's rows.

A or B may be read by token (row pair(s) // k of a [T, .] tensor: dy is, and x when no copy in
expert order exists), else by sorted row; an expert that received no rows gets zeros. The row
scale (the routing weight) is read at the row's pair, in the router's [T * k] order.

One program per (output tile, expert). `sorted_rows_wgrad` is the same gradient through
torch._grouped_mm (CUTLASS's grouped GEMM, groups along the reduced rows) when both operands' rows
are in expert order and unscaled: both base weight gradients run faster there, the down one on a copy of dy's
rows in expert order scaled by the routing weight; the LoRA factors' gradients and the
dtypes or strides it does not take stay here.

Shape legend: S sorted rows, M and N the two sides of the gradient, E experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.common import buffers
from runtime.ops.common.launch import fast, interpreting
from runtime.ops.moe.grouped_gemm import dot_precision
from runtime.ops.moe.schedule import Schedule


@triton.jit
def grouped_wgrad_kernel(
    a_ptr, stride_am, scale_ptr,
    b_ptr, stride_bm,
    out_ptr, stride_oe, stride_om, stride_on,
    pair_ptr, ends_ptr, M, N, alpha,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, ROW_SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (tl.program_id(0) // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    end = tl.load(ends_ptr + e)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s0 in range(start, end, BLOCK_K):
        rows = s0 + tl.arange(0, BLOCK_K)
        r_ok = rows < end
        # int32 (S = T * k < 2**31) over a constexpr k: the division compiles to a multiply and shift
        pairs = tl.load(pair_ptr + rows, mask=r_ok, other=0).to(tl.int32)
        a_rows = pairs // TOP_K if GATHER_A else rows
        b_rows = pairs // TOP_K if GATHER_B else rows
        a = tl.load(a_ptr + a_rows[None, :].to(tl.int64) * stride_am + offs_m[:, None], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        if ROW_SCALE:
            row_scale = tl.load(scale_ptr + pairs, mask=r_ok, other=0.0).to(tl.float32)
            a = (a * row_scale[None, :]).to(b_ptr.dtype.element_ty)
        b = tl.load(b_ptr + b_rows[:, None].to(tl.int64) * stride_bm + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
    out = out_ptr + e.to(tl.int64) * stride_oe + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, (acc * alpha).to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _tuned_configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    # The autotuner's candidates: 8 warps win the gate/up gradient, 4 the down one
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=2),
    ]


_tuned_kernel = triton.autotune(configs=_tuned_configs(), key=["M", "N", "GATHER_A", "GATHER_B", "ROW_SCALE"])(
    grouped_wgrad_kernel
)
# Gradients with a narrow side (the rank-r LoRA factors) take one fixed config sized to it.
SMALL = 64


def _small_config(M: int, N: int) -> dict:
    fit = lambda n: max(16, min(128, triton.next_power_of_2(n)))  # noqa: E731
    return dict(BLOCK_M=fit(M), BLOCK_N=fit(N), BLOCK_K=32, num_warps=4)


def grouped_mm_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes rows like a's and b's: on CUDA bf16 only (from compute capability 9.0);
    unit column stride and every row stride a multiple of 16 bytes."""
    if a.dtype != b.dtype or a.stride(1) != 1 or b.stride(1) != 1:
        return False
    if any(t.stride(0) * t.element_size() % 16 for t in (a, b)):
        return False
    return not a.is_cuda or (a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (9, 0))


def sorted_rows_wgrad(a_SM: torch.Tensor, b_SN: torch.Tensor, sched: Schedule) -> torch.Tensor | None:
    """[E, M, N] = per expert a^T b over its sorted rows through torch._grouped_mm, or None where that op
    does not apply (grouped_mm_takes)."""
    if not grouped_mm_takes(a_SM, b_SN):
        return None
    return torch._grouped_mm(a_SM.t(), b_SN, offs=sched.ends_E)


def grouped_wgrad(a_SM, b_SN, sched: Schedule, *, gather_a=False, gather_b=False, row_scale_P=None,
                  alpha=1.0) -> torch.Tensor:
    """[E, M, N] gradient in b's dtype; a (b) read by token when gather_a (gather_b), else by sorted
    row; row_scale_P in pair order."""
    M, N, E = a_SM.shape[1], b_SN.shape[1], sched.num_experts
    out = buffers.empty(E, M, N, dtype=b_SN.dtype, device=a_SM.device)
    args = (a_SM, a_SM.stride(0), row_scale_P if row_scale_P is not None else a_SM, b_SN, b_SN.stride(0),
            out, *out.stride(), sched.pair_S, sched.ends_E, M, N, alpha)
    flags = dict(TOP_K=sched.top_k, GATHER_A=gather_a, GATHER_B=gather_b, ROW_SCALE=row_scale_P is not None,
                 PRECISION=dot_precision(b_SN.dtype))
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), E)  # noqa: E731
    if min(M, N) <= SMALL:
        config = _small_config(M, N)
        fast(grouped_wgrad_kernel)[grid(config)](*args, **flags, **config)
    else:
        _tuned_kernel[grid](*args, **flags)
    return out
