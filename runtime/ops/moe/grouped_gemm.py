"""Grouped GEMM over expert-sorted rows: C[s] = epilogue(A[row(s)] @ W[e(s)]^T + bias + low-rank).

One kernel, two epilogues (MODE):
- PLAIN: optional row scale, then a store to C[s] or scattered to C[pair(s)] (the down projection's
  weighted combine, and dx).
- GLU_FWD: each program owns BLOCK_N gate/up units and runs two dots over the same A tile, one
  for the gate rows of W and one for the up rows; stores the pre-activation gate/up (kept for
  the backward) and h = glu(gate, up), with no reshuffling of the accumulator.
With GATHER_A row s of A is A[pair(s) // k], the sorted row's token (no copy of x or dy); the
row scale (the routing weight) is read at pair(s). The low-rank term is LoRA: scale * L[s] @ R[e]^T.
W[e] is addressed as [N, K] through its strides: nn.Linear layouts and their transposes alike. A frozen base weight
kept in its released format (FP8 block-scaled, MXFP4) is decoded tile by tile in registers as the main loop reads it
(runtime/ops/common/stored_tiles.py): its codes [E, O, I(/2)] are read as [N, K] = [O, I], or with TRANS_W as
[I, O] (the input gradient dy @ W), and never exist decoded in memory.

Shape legend: S sorted rows, N accumulator columns, K reduction width, E experts, r LoRA rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime.ops.common.launch import fast, interpreting
from runtime.ops.common.stored_tiles import FORMAT_DENSE, FORMAT_OF_KIND, MXFP4_GROUP, decode_tile, scale_mode
from runtime.ops.moe.schedule import Schedule

MODE_PLAIN, MODE_GLU_FWD = 0, 1


@triton.jit
def _glu_parts(gate, up, CLAMP: tl.constexpr, limit, HAS_ALPHA: tl.constexpr, alpha):
    """Clamped gate/up and the sigmoid of the (scaled) gate; silu when HAS_ALPHA is off."""
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    if HAS_ALPHA:
        sig = tl.sigmoid(alpha * gate)
        up = up + 1.0
    else:
        sig = tl.sigmoid(gate)
    return gate, up, sig


@triton.jit
def _tanh(x):
    # tanh through the sigmoid: one exp, and no libdevice call for the interpreter to lack
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _situ_parts(gate, up, CAP_UP: tl.constexpr, beta, linear_beta):
    """Kimi K3's SiTU-GLU pieces: (act = beta tanh(gate / beta) sigmoid(gate), its derivative, the capped up
    linear_beta tanh(up / linear_beta) (up itself without CAP_UP), the capped up's derivative)."""
    t = _tanh(gate / beta)
    sig = tl.sigmoid(gate)
    act = beta * t * sig
    d_act = (1.0 - t * t) * sig + act * (1.0 - sig)
    if CAP_UP:
        tu = _tanh(up / linear_beta)
        return act, d_act, linear_beta * tu, 1.0 - tu * tu
    return act, d_act, up, 1.0


@triton.jit
def glu_forward(gate0, up0, CLAMP: tl.constexpr, limit, HAS_ALPHA: tl.constexpr, alpha, SITU: tl.constexpr,
                CAP_UP: tl.constexpr, beta, linear_beta):
    """h = glu(gate, up): silu(gate) * up, the gpt-oss form (CLAMP / HAS_ALPHA) or SiTU-GLU (SITU)."""
    if SITU:
        act, d_act, up, d_up = _situ_parts(gate0, up0, CAP_UP, beta, linear_beta)
        return act * up
    gate, up, sig = _glu_parts(gate0, up0, CLAMP, limit, HAS_ALPHA, alpha)
    return gate * sig * up


@triton.jit
def glu_backward(gate0, up0, dh, CLAMP: tl.constexpr, limit, HAS_ALPHA: tl.constexpr, alpha, SITU: tl.constexpr,
                 CAP_UP: tl.constexpr, beta, linear_beta):
    """h and the gradients wrt the pre-clamp gate and up, given dh (the GLU backward pass of glu_backward.py)."""
    if SITU:
        act, d_act, up, d_capped = _situ_parts(gate0, up0, CAP_UP, beta, linear_beta)
        return act * up, dh * up * d_act, dh * act * d_capped
    gate, up, sig = _glu_parts(gate0, up0, CLAMP, limit, HAS_ALPHA, alpha)
    a = alpha if HAS_ALPHA else 1.0
    act = gate * sig
    d_gate = dh * up * (sig + a * act * (1.0 - sig))
    d_up = dh * act
    if CLAMP:
        # torch.clamp passes the gradient where the input sits inside the bounds, ends included
        d_gate = tl.where(gate0 <= limit, d_gate, 0.0)
        d_up = tl.where((up0 >= -limit) & (up0 <= limit), d_up, 0.0)
    return act * up, d_gate, d_up


@triton.jit
def _stored_tile(w_ptr, stride_wn, ws_ptr, stride_ws, w_rows, col_ok, n0, N, k0, K, block_o, block_i,
                 FORMAT: tl.constexpr, TRANS_W: tl.constexpr, SCALE_E8M0: tl.constexpr, SCALE_MODE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The stored W's [BLOCK_K, BLOCK_N] tile at (k0, columns w_rows) decoded to fp32, cut along the codes' own
    axes: [O, I] = [w_rows, k0 ..] transposed in registers, or with TRANS_W [k0 .., n0 ..] as it lies."""
    if TRANS_W:
        o_idx = k0 + tl.arange(0, BLOCK_K)
        return decode_tile(w_ptr, stride_wn, ws_ptr, stride_ws, o_idx, o_idx < K, k0, n0, N, block_o, block_i,
                           FORMAT, BLOCK_N, SCALE_E8M0, SCALE_MODE)
    tile = decode_tile(w_ptr, stride_wn, ws_ptr, stride_ws, w_rows, col_ok, 0, k0, K, block_o, block_i,
                       FORMAT, BLOCK_K, SCALE_E8M0, SCALE_MODE)
    return tl.trans(tile)


@triton.jit
def _mainloop(a_ptr, stride_am, a_rows, row_ok, w_ptr, stride_wn, stride_wk, w_rows, col_ok, K, up_offset,
              ws_ptr, stride_ws, n0, N, block_o, block_i,
              PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, PRECISION: tl.constexpr, FORMAT: tl.constexpr, TRANS_W: tl.constexpr,
              SCALE_E8M0: tl.constexpr, SCALE_MODE: tl.constexpr):
    """A[a_rows] @ W[w_rows]^T; with PAIR also A[a_rows] @ W[w_rows + up_offset]^T from the same A tile.
    A stored W (FORMAT) is decoded tile by tile (_stored_tile); its GLU pair's up tile is its rows w_rows + up_offset."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + w_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None].to(tl.int64) * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a_mask = row_ok[:, None]
            w_mask = col_ok[None, :]
        else:
            k_ok = offs_k < K - k0
            a_mask = row_ok[:, None] & k_ok[None, :]
            w_mask = col_ok[None, :] & k_ok[:, None]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if FORMAT == 0:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        else:
            w = _stored_tile(w_ptr, stride_wn, ws_ptr, stride_ws, w_rows, col_ok, n0, N, k0, K, block_o, block_i,
                             FORMAT, TRANS_W, SCALE_E8M0, SCALE_MODE, BLOCK_N, BLOCK_K)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
        if PAIR:
            if FORMAT == 0:
                w_up = tl.load(w_ptrs + up_offset * stride_wn, mask=w_mask, other=0.0)
            else:
                w_up = _stored_tile(w_ptr, stride_wn, ws_ptr, stride_ws, w_rows + up_offset, col_ok, n0, N, k0, K,
                                    block_o, block_i, FORMAT, TRANS_W, SCALE_E8M0, SCALE_MODE, BLOCK_N, BLOCK_K)
            acc_up = tl.dot(a, w_up.to(a.dtype), acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    return acc, acc_up


@triton.jit
def _extra_terms(acc, rows, row_ok, w_rows, col_ok, l_ptr, stride_lm, r_ptr, stride_rn, stride_rr, rank, lora_scale,
                 bias_ptr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr,
                 PRECISION: tl.constexpr):
    """acc + LoRA term + bias for the W rows `w_rows` (r_ptr and bias_ptr already at the expert)."""
    if HAS_LORA:
        # L[rows] @ R^T for the tile: [BLOCK_M, r] x [r, BLOCK_N]
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        lo = tl.load(l_ptr + rows[:, None].to(tl.int64) * stride_lm + offs_r[None, :],
                     mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        hi = tl.load(r_ptr + w_rows[None, :] * stride_rn + offs_r[:, None] * stride_rr,
                     mask=col_ok[None, :] & r_ok[:, None], other=0.0)
        acc += lora_scale * tl.dot(lo, hi.to(lo.dtype), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + w_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _store_pair(ptr, stride_m, rows, first_cols, second_offset, mask, first, second):
    """Stores two [BLOCK_M, BLOCK_N] tiles, the second `second_offset` columns after the first."""
    base = ptr + rows[:, None].to(tl.int64) * stride_m + first_cols[None, :]
    tl.store(base, first.to(ptr.dtype.element_ty), mask=mask)
    tl.store(base + second_offset, second.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def grouped_gemm_kernel(
    a_ptr, stride_am,
    w_ptr, stride_we, stride_wn, stride_wk,
    c_ptr, stride_cm,
    scale_ptr, bias_ptr, stride_be,
    l_ptr, stride_lm, r_ptr, stride_re, stride_rn, stride_rr, rank, lora_scale,
    gu_ptr, stride_gum,
    pair_ptr, tile_expert_ptr, tile_start_ptr, ends_ptr,
    N, K, num_experts, row_mult, up_offset, limit, alpha, situ_beta, situ_linear_beta,
    ws_ptr, stride_wse, stride_ws, block_o, block_i,
    TOP_K: tl.constexpr, MODE: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr, ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
    CLAMP: tl.constexpr, HAS_ALPHA: tl.constexpr, SITU: tl.constexpr, CAP_UP: tl.constexpr,
    PRECISION: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    FORMAT: tl.constexpr, TRANS_W: tl.constexpr, SCALE_E8M0: tl.constexpr, SCALE_MODE: tl.constexpr,
):
    num_n = tl.cdiv(N, BLOCK_N)
    pid_tile = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    e = tl.load(tile_expert_ptr + pid_tile)
    if e >= num_experts:
        return
    rows = tl.load(tile_start_ptr + pid_tile) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(ends_ptr + e)
    # int32 (S = T * k < 2**31) over a constexpr k: the division compiles to a multiply and shift
    pairs = tl.load(pair_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    a_rows = pairs // TOP_K if GATHER_A else rows
    # accumulator column -> row of W: in GLU_FWD a column is a gate/up unit whose gate row of W is
    # unit * row_mult (its up row sits up_offset further)
    units = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = units * row_mult if MODE == 1 else units
    col_ok = units < N
    e64 = e.to(tl.int64)
    acc, acc_up = _mainloop(a_ptr, stride_am, a_rows, row_ok, w_ptr + e64 * stride_we, stride_wn, stride_wk, w_rows,
                            col_ok, K, up_offset, ws_ptr + e64 * stride_wse, stride_ws, pid_n * BLOCK_N, N, block_o,
                            block_i, MODE == 1, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, FORMAT, TRANS_W,
                            SCALE_E8M0, SCALE_MODE)
    r_ptr += e64 * stride_re
    bias_ptr += e64 * stride_be
    acc = _extra_terms(acc, rows, row_ok, w_rows, col_ok, l_ptr, stride_lm, r_ptr, stride_rn, stride_rr, rank,
                       lora_scale, bias_ptr, HAS_LORA, HAS_BIAS, BLOCK_R, PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    if ROW_SCALE:
        row_scale = tl.load(scale_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    if MODE == 0:
        if ROW_SCALE:
            acc = acc * row_scale
        c_rows = pairs if SCATTER_C else rows
        tl.store(c_ptr + c_rows[:, None].to(tl.int64) * stride_cm + w_rows[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        acc_up = _extra_terms(acc_up, rows, row_ok, w_rows + up_offset, col_ok, l_ptr, stride_lm, r_ptr, stride_rn,
                              stride_rr, rank, lora_scale, bias_ptr, HAS_LORA, HAS_BIAS, BLOCK_R, PRECISION)
        _store_pair(gu_ptr, stride_gum, rows, w_rows, up_offset, mask, acc, acc_up)
        h = glu_forward(acc, acc_up, CLAMP, limit, HAS_ALPHA, alpha, SITU, CAP_UP, situ_beta, situ_linear_beta)
        tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + units[None, :], h.to(c_ptr.dtype.element_ty), mask=mask)


def _tuned_configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    # The autotuner's candidates, one per GEMM of the block at Qwen3-Next widths that it wins:
    # two accumulators (GLU forward) leave no room for 256 units.
    return [
        triton.Config({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
    ]


def _scale_mode(args: dict) -> int:
    return scale_mode(args["FORMAT"], args["TRANS_W"], (args["block_o"], args["block_i"]), args["BLOCK_K"])


_even_k_kernel = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
                                    "SCALE_MODE": _scale_mode})(grouped_gemm_kernel)
_tuned_kernel = triton.autotune(
    configs=_tuned_configs(),
    key=["N", "K", "MODE", "BLOCK_M", "HAS_LORA", "GATHER_A", "SCATTER_C", "FORMAT", "TRANS_W"],
)(_even_k_kernel)
# Stored weights (FORMAT) add a 32-long reduction chunk: their GLU forward decodes two weight tiles per step on top of
# the two accumulators, and at 8 warps that chunk spills least (ptxas for sm_90a, bench/kernel_resources.py).
_tuned_stored_kernel = triton.autotune(
    configs=_tuned_configs() + ([] if interpreting() else [
        triton.Config({"BLOCK_N": 128, "BLOCK_K": 32}, num_warps=8, num_stages=4)]),
    key=["N", "K", "MODE", "BLOCK_M", "HAS_LORA", "GATHER_A", "SCATTER_C", "FORMAT", "TRANS_W"],
)(_even_k_kernel)
# The autotuner's choice per GEMM shape and flags, launched afterwards without the autotuner and the
# EVEN_K heuristic in between (their per-call Python work is host time the GPU can wait on; see
# runtime/ops/common/launch.py).
CHOSEN_CONFIGS: dict = {}
# Narrow outputs (the rank-r LoRA projections) take one fixed config sized to N.
SMALL_N = 64


@dataclass(frozen=True)
class Glu:
    """The gated activation of the experts, and where gate and up sit in the 2F rows."""

    interleaved: bool = False
    clamp: float | None = None
    alpha: float | None = None
    situ: tuple[float, float | None] | None = None  # Kimi K3's SiTU-GLU: (beta, linear_beta)

    def launch_args(self) -> tuple:
        """(limit, alpha, situ beta, situ linear_beta) as the kernels take them (1.0 where unused)."""
        beta, linear_beta = self.situ if self.situ is not None else (1.0, None)
        return (self.clamp if self.clamp is not None else 0.0, self.alpha if self.alpha is not None else 1.0,
                float(beta), float(linear_beta) if linear_beta is not None else 1.0)

    def flags(self) -> dict:
        return dict(CLAMP=self.clamp is not None, HAS_ALPHA=self.alpha is not None, SITU=self.situ is not None,
                    CAP_UP=self.situ is not None and self.situ[1] is not None)

    def layout(self, num_units: int) -> tuple[int, int]:
        """(row multiplier, offset of the up row) for unit f: gate at f*m, up at f*m + offset."""
        return (2, 1) if self.interleaved else (1, num_units)


@dataclass(frozen=True)
class Stored:
    """How a Weight's data holds a frozen base weight in its released format (runtime/ops/stored_matmul/README.md):
    codes [E, O, I] float8_e4m3fn with block scales [E, ceil(O/b0), ceil(I/b1)] (kind "fp8_block"), or [E, O, I/2]
    uint8 with E8M0 scales [E, O, I/32] (kind "mxfp4")."""

    scale: torch.Tensor
    kind: str
    block: tuple[int, int] | None = None

    def scale_bytes(self) -> bool:
        """Whether the scales are E8M0 bytes (MXFP4's always; FP8's when the release ships UE8M0 scales)."""
        return self.kind == "mxfp4" or self.scale.dtype in (torch.uint8, torch.float8_e8m0fnu)

    def launch_args(self) -> tuple:
        """(scale, its expert stride, its row stride, block rows, block columns) as the kernel takes them."""
        scale = self.scale.view(torch.uint8) if self.scale.dtype == torch.float8_e8m0fnu else self.scale
        block_o, block_i = self.block if self.kind == "fp8_block" else (1, MXFP4_GROUP)
        return scale, scale.stride(0), scale.stride(1), block_o, block_i



@dataclass(frozen=True)
class Weight:
    """Per-expert matrix read as [N, K]: `data` is [E, N, K], or [E, K, N] with transposed=True. With `stored`,
    data holds the codes of [E, O, I] and the tile reads decode them: [N, K] = [O, I], transposed [I, O]."""

    data: torch.Tensor
    transposed: bool = False
    stored: Stored | None = None

    def strides(self) -> tuple[int, int, int]:
        s0, s1, s2 = self.data.stride()
        if self.stored is not None:
            # decoded tiles are cut along the codes' own rows (stored_tiles.py): the row stride, whichever way read
            return s0, s1, s2
        return (s0, s2, s1) if self.transposed else (s0, s1, s2)

    def num_columns(self) -> int:
        """N: the rows of the matrix read as [N, K] (the in width of a transposed stored weight, unpacked)."""
        if self.stored is not None and self.transposed:
            return self.data.shape[2] * (2 if self.stored.kind == "mxfp4" else 1)
        return self.data.shape[2 if self.transposed else 1]

    def format_args(self) -> tuple[tuple, dict]:
        """The kernel's stored-weight arguments and flags (a plain weight: a dummy scale and FORMAT_DENSE)."""
        if self.stored is None:
            return (self.data, 0, 0, 1, 1), dict(FORMAT=FORMAT_DENSE, TRANS_W=False, SCALE_E8M0=False)
        return self.stored.launch_args(), dict(FORMAT=FORMAT_OF_KIND[self.stored.kind], TRANS_W=self.transposed,
                                               SCALE_E8M0=self.stored.scale_bytes())


@dataclass(frozen=True)
class LowRank:
    """LoRA term scale * left_Sr @ right[e]^T, right read as [N, r]."""

    left_Sr: torch.Tensor
    right: Weight
    scale: float


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get full fp32 products so that fp32 runs can be held to fp32 tolerances
    return "ieee" if dtype == torch.float32 else "tf32"


def _small_block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def grouped_gemm(a_SK, w: Weight, sched: Schedule, out, *, mode=MODE_PLAIN, gather_a=False, scatter_out=False,
                 row_scale_P=None, bias_EN=None, low_rank: LowRank | None = None, gate_up=None,
                 glu: Glu = Glu()):
    """Runs the kernel over every row tile of `sched`; writes `out` (and gate_up in GLU_FWD).
    gather_a: A is [T, K], sorted row s reads A[pair(s) // k]; scatter_out: row s lands at out[pair(s)].
    row_scale_P is in pair order ([T * k], the router's)."""
    # Accumulator columns: W's N rows, or in GLU_FWD the F gate/up units (2F rows of W).
    N, K = w.num_columns(), a_SK.shape[1]
    N = N // 2 if mode == MODE_GLU_FWD else N
    row_mult, up_offset = glu.layout(N)
    dummy = a_SK
    format_args, format_flags = w.format_args()
    lr = low_rank or LowRank(dummy, Weight(w.data), 0.0)
    args = (
        a_SK, a_SK.stride(0),
        w.data, *w.strides(),
        out, out.stride(0),
        row_scale_P if row_scale_P is not None else dummy,
        bias_EN if bias_EN is not None else dummy, bias_EN.stride(0) if bias_EN is not None else 0,
        lr.left_Sr, lr.left_Sr.stride(0), lr.right.data, *lr.right.strides(), lr.left_Sr.shape[1], lr.scale,
        gate_up if gate_up is not None else dummy, gate_up.stride(0) if gate_up is not None else 0,
        sched.pair_S, sched.tile_expert, sched.tile_start, sched.ends_E,
        N, K, sched.num_experts, row_mult, up_offset,
        *glu.launch_args(),
        *format_args,
    )
    flags = dict(
        TOP_K=sched.top_k, MODE=mode, GATHER_A=gather_a, SCATTER_C=scatter_out, ROW_SCALE=row_scale_P is not None,
        HAS_BIAS=bias_EN is not None, HAS_LORA=low_rank is not None,
        **glu.flags(), PRECISION=dot_precision(a_SK.dtype),
        BLOCK_M=sched.block_m, BLOCK_R=_small_block(lr.left_Sr.shape[1]), **format_flags,
    )
    config = dict(BLOCK_N=_small_block(N), BLOCK_K=32, num_warps=4) if N <= SMALL_N else None
    tuned_key = (N, K, a_SK.dtype, w.data.dtype, out.dtype, *flags.values())
    if config is None and tuned_key in CHOSEN_CONFIGS:
        config = CHOSEN_CONFIGS[tuned_key].all_kwargs()
    if config is not None:
        grid = (sched.num_tiles * triton.cdiv(N, config["BLOCK_N"]),)
        block = (format_args[3], format_args[4])
        fast(grouped_gemm_kernel)[grid](*args, **flags, **config, EVEN_K=K % config["BLOCK_K"] == 0,
                                        SCALE_MODE=scale_mode(flags["FORMAT"], flags["TRANS_W"], block, config["BLOCK_K"]))
    else:
        tuner = _tuned_stored_kernel if flags["FORMAT"] != FORMAT_DENSE else _tuned_kernel
        tuner[lambda meta: (sched.num_tiles * triton.cdiv(N, meta["BLOCK_N"]),)](*args, **flags)
        CHOSEN_CONFIGS[tuned_key] = tuner.best_config
    return out
