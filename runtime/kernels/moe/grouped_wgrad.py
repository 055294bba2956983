"""Per-expert weight gradients: out[e] = alpha * sum over expert e's sorted rows s of
(scale[pair(s)] * A[row_a(s)])^T B[row_b(s)], i.e. [M, N] per expert, reducing over that expert's rows.

A or B may be read by token (row pair(s) // k of a [T, .] tensor: dy is, and x when no copy in
expert order exists), else by sorted row; an expert that received no rows gets zeros. The row
scale (the routing weight) is read at the row's pair, in the router's [T * k] order.

Two kernels. `grouped_wgrad_kernel`: one program per (output tile, expert); at ~320 rows per
expert each reduces ~5 steps of 64 rows, so pipeline fill, drain and the epilogue dominate (gate/up
gradient 1.94 ms = 354 TFLOP/s, down 1.49 ms = 231, H200, T 16384, k 10, E 512, D 2048, F 512).
`grouped_wgrad_multi_kernel` (Tuning.wgrad_group): one program per (output tile, GROUP consecutive
experts), whose sorted rows are contiguous; one loop walks all their row steps (a step never
straddles two experts) and stores each expert's tile after its last step, so loads keep flowing
across expert boundaries and there are GROUP times fewer programs. An expert without rows takes
one empty step, which stores its zeros. The store is a TMA store: per-element store pointers
stayed live across the loop.

ptxas for sm_90a (triton 3.9, bench/kernel_resources.py with the launch's divisibility hints),
GROUP 8, 8 warps, BLOCK_K 64, gate/up | down gradient: 128x128 3 stages 116 | 145 registers,
160 | 112 KB shared (one program per SM), 4 stages 120 | 145, 192 | 112 KB; 128x64 3 stages
71 | 114, 104 | 64 KB (two per SM); 128x256 178 | 214, 240 (does not launch) | 176 KB; no spills.
The pointer store instead: 255 registers and 20-32 bytes of spills at 128x128 (245 | 242 at
128x64). The per-expert kernel: 102 | 128 registers, 96 | 49 KB. The LoRA factor gradients (r 16,
their fixed narrow configs, 4 warps): 53-85 registers with the TMA store, 96-132 without.

Prediction (not measured), H200 at the shape above, GROUP 8: gate/up gradient ~1.35 ms (from
1.94: ~40 steps per program at ~550 TFLOP/s of MMA issue less 10% of padded rows, its 2.1 GB of
output written behind the next expert's MMAs), down ~1.0 ms (from 1.49: its A tile is scaled in
registers, ~400 TFLOP/s); so ~1.1 ms off the 11.3 ms fwd+bwd. GROUP 4 / 16 within ~0.05 ms of 8.

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
def _rows_dot(acc, s0, end, a_ptr, stride_am, scale_ptr, b_ptr, stride_bm, pair_ptr, offs_m, m_ok, offs_n, n_ok,
              TOP_K: tl.constexpr, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, ROW_SCALE: tl.constexpr,
              PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + (scale * A[rows])^T B[rows] over the sorted rows [s0, min(s0 + BLOCK_K, end))."""
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
    return tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)


@triton.jit
def _tile_origin(pid, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """First row and column of output tile `pid` (N fastest)."""
    num_n = tl.cdiv(N, BLOCK_N)
    return (pid // num_n) * BLOCK_M, (pid % num_n) * BLOCK_N


@triton.jit
def _store_tile(out_ptr, e, stride_oe, stride_om, stride_on, offs_m, m_ok, offs_n, n_ok, tile):
    """out[e][offs_m, offs_n] = tile, through per-element pointers."""
    out = out_ptr + e.to(tl.int64) * stride_oe + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, tile.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


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
    """One program per (output tile, expert)."""
    e = tl.program_id(1)
    m0, n0 = _tile_origin(tl.program_id(0), N, BLOCK_M, BLOCK_N)
    offs_m, offs_n = m0 + tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    end = tl.load(ends_ptr + e)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s0 in range(start, end, BLOCK_K):
        acc = _rows_dot(acc, s0, end, a_ptr, stride_am, scale_ptr, b_ptr, stride_bm, pair_ptr, offs_m, m_ok, offs_n,
                        n_ok, TOP_K, GATHER_A, GATHER_B, ROW_SCALE, PRECISION, BLOCK_K)
    _store_tile(out_ptr, e, stride_oe, stride_om, stride_on, offs_m, m_ok, offs_n, n_ok, acc * alpha)


@triton.jit
def _group_rows(ends_ptr, e0, num_experts, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Ends of experts [e0, e0 + GROUP) ([GROUP], 0 past the last expert) and their number of row
    steps: cdiv(rows, BLOCK_K) each, and one (with no rows) for an expert that received none, so
    that its zero gradient is stored too."""
    experts = e0 + tl.arange(0, GROUP)
    e_ok = experts < num_experts
    ends = tl.load(ends_ptr + experts, mask=e_ok, other=0)
    starts = tl.load(ends_ptr + experts - 1, mask=e_ok & (experts > 0), other=0)
    steps = tl.maximum(tl.cdiv(ends - starts, BLOCK_K), 1)
    return ends, tl.sum(tl.where(e_ok, steps, 0), axis=0)


@triton.jit
def grouped_wgrad_multi_kernel(
    a_ptr, stride_am, scale_ptr,
    b_ptr, stride_bm,
    out_ptr, stride_oe, stride_om, stride_on,
    pair_ptr, ends_ptr, M, N, alpha, num_experts,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, ROW_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, GROUP: tl.constexpr, TMA_STORE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per (output tile, GROUP consecutive experts), one loop over all their row steps;
    expert e0 + j's rows are [s0, end) at its first step."""
    e0 = tl.program_id(1) * GROUP
    m0, n0 = _tile_origin(tl.program_id(0), N, BLOCK_M, BLOCK_N)
    offs_m, offs_n = m0 + tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    if TMA_STORE:
        # clipped at each expert's M x N bounds; no tile of addresses live across the loop
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[num_experts, M, N], strides=[stride_oe, stride_om, 1],
                                             block_shape=[1, BLOCK_M, BLOCK_N])
    ends_G, num_steps = _group_rows(ends_ptr, e0, num_experts, GROUP, BLOCK_K)
    group_g = tl.arange(0, GROUP)
    j = 0
    s0 = tl.load(ends_ptr + e0 - 1, mask=e0 > 0, other=0)
    end = tl.sum(tl.where(group_g == 0, ends_G, 0), axis=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(num_steps):
        acc = _rows_dot(acc, s0, end, a_ptr, stride_am, scale_ptr, b_ptr, stride_bm, pair_ptr, offs_m, m_ok, offs_n,
                        n_ok, TOP_K, GATHER_A, GATHER_B, ROW_SCALE, PRECISION, BLOCK_K)
        last = s0 + BLOCK_K >= end
        if last:
            if TMA_STORE:
                out_desc.store([e0 + j, m0, n0], (acc * alpha).to(out_ptr.dtype.element_ty)[None, :, :])
            else:
                _store_tile(out_ptr, e0 + j, stride_oe, stride_om, stride_on, offs_m, m_ok, offs_n, n_ok, acc * alpha)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The next expert's rows start at this one's end. Its end is picked from registers: loaded
        # here, feeding the next steps' addresses, it crashed triton 3.9's pipeliner.
        j += last.to(tl.int32)
        s0 = tl.where(last, end, s0 + BLOCK_K)
        end = tl.sum(tl.where(group_g == j, ends_G, 0), axis=0)


def _tuned_configs() -> list[triton.Config]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    # Winners of bench/bench_moe.py --sweep (H200, 2026-11-29): gate/up 1.94 ms with 8 warps, down
    # 1.49 ms with 4 (1.52 with 8); stages 4 and BLOCK_K 32/128, 128x256, 256x128 were slower.
    # Each program reduces only ~5 steps of 64 rows (~320 rows per expert), so the load latency
    # before its first step is hidden by other programs on the SM: with 2 stages a program takes
    # 64 KB of shared memory instead of 96, three fit on an SM instead of two (not yet timed).
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=2),
    ]


def _grouped_configs() -> list[triton.Config]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    # Candidates, not yet timed (resources in the module docstring). A program walks ~GROUP * 5
    # steps, so its own pipeline must hide the load latency: 128x128 with 3 stages (one program per
    # SM) and 4 (one more step in flight); 128x64, two programs per SM, so one's store and loop
    # start overlap the other's MMAs, for twice the reads of the M side; 128x256 halves the reads
    # of the gathered dy in the down gradient (the gate/up one needs 240 KB of shared memory and
    # fails to launch, which the autotuner skips).
    tile = lambda m, n: {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 64}  # noqa: E731
    return [
        triton.Config(tile(128, 128), num_warps=8, num_stages=3),
        triton.Config(tile(128, 128), num_warps=8, num_stages=4),
        triton.Config(tile(128, 64), num_warps=8, num_stages=3),
        triton.Config(tile(128, 64), num_warps=8, num_stages=4),
        triton.Config(tile(128, 256), num_warps=8, num_stages=3),
    ]


_KEY = ["M", "N", "GATHER_A", "GATHER_B", "ROW_SCALE"]
_tuned_kernel = triton.autotune(configs=_tuned_configs(), key=_KEY)(grouped_wgrad_kernel)
_grouped_tuned_kernel = triton.autotune(configs=_grouped_configs(), key=_KEY + ["GROUP", "TMA_STORE"])(
    grouped_wgrad_multi_kernel)
# Gradients with a narrow side (the rank-r LoRA factors) take one fixed config sized to it.
SMALL = 64


def _small_config(M: int, N: int) -> dict:
    fit = lambda n: max(16, min(128, triton.next_power_of_2(n)))  # noqa: E731
    return dict(BLOCK_M=fit(M), BLOCK_N=fit(N), BLOCK_K=32, num_warps=4)


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def grouped_wgrad(a_SM, b_SN, sched: Schedule, *, gather_a=False, gather_b=False, row_scale_P=None, alpha=1.0,
                  group: int | None = None, tma_store: bool = True, config: dict | None = None) -> torch.Tensor:
    """[E, M, N] gradient in b's dtype; a (b) read by token when gather_a (gather_b), else by sorted
    row; row_scale_P in pair order. `group` (a power of two): experts per program of the grouped
    kernel (None: one program per output tile and expert), which stores through TMA when
    `tma_store` and rows of N are a multiple of 16 bytes (TMA's stride rule). `config` (BLOCK_M,
    BLOCK_N, BLOCK_K, num_warps, num_stages) bypasses the autotuner."""
    M, N, E = a_SM.shape[1], b_SN.shape[1], sched.num_experts
    out = buffers.empty((E, M, N), b_SN.dtype, a_SM.device)
    tma_store = tma_store and (N * out.element_size()) % 16 == 0
    if config is None and min(M, N) <= SMALL:
        config = _small_config(M, N)
    num_programs_e = E if group is None else triton.cdiv(E, group)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), num_programs_e)  # noqa: E731
    args = (a_SM, a_SM.stride(0), row_scale_P if row_scale_P is not None else a_SM,
            b_SN, b_SN.stride(0),
            out, *out.stride(), sched.pair_S, sched.ends_E, M, N, alpha)
    flags = dict(TOP_K=sched.top_k, GATHER_A=gather_a, GATHER_B=gather_b, ROW_SCALE=row_scale_P is not None,
                 PRECISION="ieee" if b_SN.dtype == torch.float32 else "tf32", **(config or {}))
    if group is None:
        kernel = grouped_wgrad_kernel if config is not None else _tuned_kernel
        kernel[grid](*args, **flags)
    else:
        kernel = grouped_wgrad_multi_kernel if config is not None else _grouped_tuned_kernel
        # a TMA descriptor is built on the device, in scratch memory from this allocator; set at
        # each launch because triton keeps it per thread and autograd runs backward in its own
        if tma_store and out.is_cuda:
            triton.set_allocator(_descriptor_scratch)
        kernel[grid](*args, E, GROUP=group, TMA_STORE=tma_store, **flags)
    return out
