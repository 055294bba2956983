"""The routed experts' GLU backward as its own pass over the sorted rows, after a plain grouped GEMM.

Given dh_raw = dy @ W_down[e] (+ LoRA) per sorted row, before the routing weight: dh = w * dh_raw, h
recomputed from the saved pre-activation gate/up, d(gate/up) stored, and the routing weight's gradient
sum_f dh_raw * h written at the row's pair; optionally w * h too, the rows the down weight gradient reduces over
when it reads dy by token (gluon/weight_grad.py). One program owns whole rows, so that sum is a plain store.
Apart from the GEMM, not in its epilogue: there each program's serial epilogue loads came after its main loop
and doubled the GEMM's time; apart, the GEMM takes 256-column tiles and this pass streams at memory speed.

Shape legend: S sorted rows, F expert units (gate/up width 2F), P = T * k pairs in the router's order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.common import buffers
from runtime.ops.common.launch import fast
from runtime.ops.moe.grouped_gemm import Glu, glu_backward
from runtime.ops.moe.schedule import Schedule

# 16 rows a program walking the units 128 at a time (as the dense MLP's activation backward)
BLOCK_S, MAX_BLOCK_F, NUM_WARPS = 16, 128, 8


@triton.jit
def routed_glu_backward_kernel(dh_ptr, gu_ptr, scale_ptr, pair_ptr, dgu_ptr, dw_ptr, wh_ptr, S, F, row_mult,
                               up_offset, limit, alpha, situ_beta, situ_linear_beta, CLAMP: tl.constexpr,
                               HAS_ALPHA: tl.constexpr, SITU: tl.constexpr, CAP_UP: tl.constexpr,
                               WANT_DW: tl.constexpr, WANT_WH: tl.constexpr, BLOCK_S: tl.constexpr,
                               BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = rows < S
    pairs = tl.load(pair_ptr + rows, mask=row_ok, other=0)
    w = tl.load(scale_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    row64 = rows[:, None].to(tl.int64)
    dw = tl.zeros((BLOCK_S,), tl.float32)
    for f0 in range(0, F, BLOCK_F):
        units = f0 + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (units < F)[None, :]
        dh_raw = tl.load(dh_ptr + row64 * F + units[None, :], mask=mask, other=0.0).to(tl.float32)
        gu_at = row64 * (2 * F) + (units * row_mult)[None, :]
        gate0 = tl.load(gu_ptr + gu_at, mask=mask, other=0.0).to(tl.float32)
        up0 = tl.load(gu_ptr + gu_at + up_offset, mask=mask, other=0.0).to(tl.float32)
        h, d_gate, d_up = glu_backward(gate0, up0, dh_raw * w, CLAMP, limit, HAS_ALPHA, alpha, SITU, CAP_UP, situ_beta,
                                       situ_linear_beta)
        if WANT_DW:
            dw += tl.sum(dh_raw * h, axis=1)
        if WANT_WH:
            tl.store(wh_ptr + row64 * F + units[None, :], (w * h).to(wh_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_ptr + gu_at, d_gate.to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_ptr + gu_at + up_offset, d_up.to(dgu_ptr.dtype.element_ty), mask=mask)
    if WANT_DW:
        tl.store(dw_ptr + pairs, dw, mask=row_ok)


def routed_glu_backward(dh_raw_SF, gate_up_S2F, w_P, sched: Schedule, glu: Glu, want_dw: bool,
                        want_wh: bool = False):
    """-> (d_gate_up_S2F in gate_up's dtype, d(routing weight) [P] fp32 or None, w * h [S, F] or None)."""
    S, F = dh_raw_SF.shape
    d_gate_up = buffers.empty(S, 2 * F, dtype=gate_up_S2F.dtype, device=gate_up_S2F.device)
    # every pair has exactly one sorted row, so every entry is written
    dw_P = buffers.empty(S, dtype=torch.float32, device=gate_up_S2F.device) if want_dw else None
    wh = buffers.empty(S, F, dtype=gate_up_S2F.dtype, device=gate_up_S2F.device) if want_wh else None
    row_mult, up_offset = glu.layout(F)
    fast(routed_glu_backward_kernel)[(triton.cdiv(S, BLOCK_S),)](
        dh_raw_SF, gate_up_S2F, w_P, sched.pair_S, d_gate_up, dw_P if want_dw else w_P,
        wh if want_wh else d_gate_up, S, F, row_mult, up_offset,
        *glu.launch_args(), **glu.flags(), WANT_DW=want_dw, WANT_WH=want_wh,
        BLOCK_S=BLOCK_S, BLOCK_F=min(MAX_BLOCK_F, triton.next_power_of_2(F)), num_warps=NUM_WARPS)
    return d_gate_up, dw_P, wh
