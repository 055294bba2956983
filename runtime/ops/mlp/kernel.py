"""Dense SwiGLU MLP (the dense layers' FFN and the MoE block's shared expert) as one autograd op:
cuBLAS for the three projections, one Triton pass for the activation each way.

    out = residual + sigmoid(x @ g^T) * down(silu(x @ w_gate^T) * (x @ w_up^T))

gate and up (and the shared-expert gate g, [1, D], when given) are one GEMM over their stacked
rows, so x is read once forward and dx is one GEMM backward. The sigmoid gate is applied to h
before the down projection (down is linear), and the residual (the routed experts' output) is
added by the down GEMM itself (addmm in place): neither costs a pass over [T, D]. Backward, the
same activation pass gives d(gate), d(up) and d(s) (a sum over the row's F units).

Shape legend: T tokens (all leading dims of x), D model width, F MLP width,
N = stacked rows: F gate, F up, 1 gate row of g when gated, zero rows up to a multiple of 8
(16-byte aligned rows of the [T, N] product for cuBLAS).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.common.launch import fast
from runtime.ops.common import buffers
from runtime.ops.mlp import torch_form as torch_ops


# Tiles of the activation passes: [32 rows, 128 units] forward, 16 rows walking all units backward;
# 8 warps leave both enough registers that nothing goes to local memory
FWD_BLOCK_T, BWD_BLOCK_T, MAX_BLOCK_F, NUM_WARPS = 32, 16, 128, 8


@triton.jit
def swiglu_forward_kernel(gus_ptr, h_ptr, T, F, stride_g, HAS_GATE: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr):
    """h[t, f] = silu(gate[t, f]) * up[t, f] (* sigmoid(s[t]) with HAS_GATE, s at column 2F)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_ok = rows < T
    mask = row_ok[:, None] & (cols < F)[None, :]
    base = gus_ptr + rows[:, None].to(tl.int64) * stride_g + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + F, mask=mask, other=0.0).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    if HAS_GATE:
        s = tl.load(gus_ptr + rows.to(tl.int64) * stride_g + 2 * F, mask=row_ok, other=0.0).to(tl.float32)
        h = h * tl.sigmoid(s)[:, None]
    tl.store(h_ptr + rows[:, None].to(tl.int64) * F + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_backward_kernel(gus_ptr, dh_ptr, dgus_ptr, T, F, N, stride_g, HAS_GATE: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_PAD: tl.constexpr):
    """d(gate), d(up) and, with HAS_GATE, d(s) = sigmoid'(s) * sum_f dh * silu(gate) * up, into the
    stacked layout; the padding columns get zeros (dx reads them: NaN * 0 would be NaN)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    row_off = rows[:, None].to(tl.int64)
    if HAS_GATE:
        s = tl.load(gus_ptr + rows.to(tl.int64) * stride_g + 2 * F, mask=row_ok, other=0.0).to(tl.float32)
        sig_s = tl.sigmoid(s)
    else:
        sig_s = tl.full((BLOCK_T,), 1.0, tl.float32)
    ds = tl.zeros((BLOCK_T,), tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (cols < F)[None, :]
        at = row_off * stride_g + cols[None, :]
        gate = tl.load(gus_ptr + at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gus_ptr + at + F, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + row_off * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        act = gate * sig
        if HAS_GATE:
            ds += tl.sum(dh * act * up, axis=1)
        dh = dh * sig_s[:, None]
        d_gate = dh * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(dgus_ptr + at, d_gate.to(dgus_ptr.dtype.element_ty), mask=mask)
        tl.store(dgus_ptr + at + F, (dh * act).to(dgus_ptr.dtype.element_ty), mask=mask)
    tail = 2 * F + tl.arange(0, BLOCK_PAD)
    tail_val = tl.zeros((BLOCK_T, BLOCK_PAD), tl.float32)
    if HAS_GATE:
        tail_val = tl.where((tail == 2 * F)[None, :], (ds * sig_s * (1.0 - sig_s))[:, None], 0.0)
    tl.store(dgus_ptr + row_off * stride_g + tail[None, :], tail_val.to(dgus_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (tail < N)[None, :])


def _stack_weights(w_gate_FD, w_up_FD, g_1D) -> torch.Tensor:
    """[N, D]: gate rows, up rows, g (when given), zero rows."""
    F, D = w_gate_FD.shape
    parts = [w_gate_FD, w_up_FD] + ([g_1D] if g_1D is not None else [])
    num_rows = 2 * F + int(g_1D is not None)
    pad = triton.cdiv(num_rows, 8) * 8 - num_rows
    if pad:
        # cached zeros: stacking the weights is one launch (the cat), not a fill and a cat
        parts.append(buffers.zeros(pad, D, dtype=w_gate_FD.dtype, device=w_gate_FD.device))
    return torch.cat(parts)


def _activation(gus_TN, F: int, gated: bool) -> torch.Tensor:
    T = gus_TN.shape[0]
    h_TF = buffers.empty(T, F, dtype=gus_TN.dtype, device=gus_TN.device)
    block_f = min(MAX_BLOCK_F, triton.next_power_of_2(F))
    grid = (triton.cdiv(T, FWD_BLOCK_T), triton.cdiv(F, block_f))
    fast(swiglu_forward_kernel)[grid](gus_TN, h_TF, T, F, gus_TN.stride(0), HAS_GATE=gated, BLOCK_T=FWD_BLOCK_T,
                                      BLOCK_F=block_f, num_warps=NUM_WARPS)
    return h_TF


def _activation_backward(gus_TN, dh_TF, F: int, gated: bool) -> torch.Tensor:
    T, N = gus_TN.shape
    dgus_TN = buffers.empty(T, N, dtype=gus_TN.dtype, device=gus_TN.device)
    block_f = min(MAX_BLOCK_F, triton.next_power_of_2(F))
    # one program per BWD_BLOCK_T rows walks all F units (d(s) sums over them)
    fast(swiglu_backward_kernel)[(triton.cdiv(T, BWD_BLOCK_T),)](
        gus_TN, dh_TF.contiguous(), dgus_TN, T, F, N, gus_TN.stride(0), HAS_GATE=gated, BLOCK_T=BWD_BLOCK_T,
        BLOCK_F=block_f, BLOCK_PAD=max(1, triton.next_power_of_2(N - 2 * F)), num_warps=NUM_WARPS)
    return dgus_TN


class _SwigluMlp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate_FD, w_up_FD, w_down_DF, g_1D, residual):
        F, D = w_gate_FD.shape
        x_TD = x.reshape(-1, D)
        gated = g_1D is not None
        w_ND = _stack_weights(w_gate_FD, w_up_FD, g_1D)
        gus_TN = x_TD @ w_ND.T
        h_TF = _activation(gus_TN, F, gated)
        ctx.save_for_backward(x_TD, w_ND, w_down_DF, gus_TN, h_TF)
        ctx.gated, ctx.x_shape = gated, x.shape
        if residual is None:
            return (h_TF @ w_down_DF.T).view(*x.shape[:-1], w_down_DF.shape[0])
        # the down GEMM adds its product to the residual in place (beta 1): no copy, no add pass
        residual.view(-1, residual.shape[-1]).addmm_(h_TF, w_down_DF.T)
        ctx.mark_dirty(residual)
        return residual

    @staticmethod
    def backward(ctx, dy):
        x_TD, w_ND, w_down_DF, gus_TN, h_TF = ctx.saved_tensors
        need_x, need_gate, need_up, need_down, need_g, need_residual = ctx.needs_input_grad
        F = h_TF.shape[1]
        dy_TD = dy.reshape(-1, dy.shape[-1])
        dgus_TN = _activation_backward(gus_TN, dy_TD @ w_down_DF, F, ctx.gated)
        dx = (dgus_TN @ w_ND).view(ctx.x_shape) if need_x else None
        d_down = dy_TD.T @ h_TF if need_down else None
        dw_ND = dgus_TN.T @ x_TD if (need_gate or need_up or need_g) else None
        d_gate, d_up, d_g = (None, None, None) if dw_ND is None else (dw_ND[:F], dw_ND[F:2 * F], dw_ND[2 * F:2 * F + 1])
        return dx, d_gate, d_up, d_down, d_g if ctx.gated else None, dy if need_residual else None


def _fusable(x: torch.Tensor, weights: list[torch.Tensor], residual: torch.Tensor | None) -> bool:
    """One dtype throughout (the stacked GEMM and the in-place add need it), a residual the down
    GEMM can write in place."""
    if any(w.dtype != x.dtype for w in weights):
        return False
    if residual is None:
        return True
    out_shape = (*x.shape[:-1], weights[2].shape[0])
    return residual.is_contiguous() and residual.dtype == x.dtype and residual.shape == out_shape


def swiglu_mlp(
    x_TD: torch.Tensor,
    w_gate_FD: torch.Tensor,
    w_up_FD: torch.Tensor,
    w_down_DF: torch.Tensor,
    activation: str = "silu",
    *,
    gate_1D: torch.Tensor | None = None,
    residual_TD: torch.Tensor | None = None,
    situ_betas: tuple[float, float | None] | None = None,
) -> torch.Tensor:
    """residual + sigmoid(x @ gate^T) * down(silu(gate(x)) * up(x)); x [..., D] -> [..., D].
    gate_1D (the shared-expert gate) and residual_TD are optional; residual_TD is overwritten with
    the result (autograd-safe: it is marked dirty) and returned. Contract of reference_ops/mlp.py's
    swiglu_mlp composed with the gate and the add; other activations (SiTU-GLU too), mixed dtypes and residuals that
    cannot be written in place use runtime.ops.mlp."""
    weights = [w_gate_FD, w_up_FD, w_down_DF] + ([gate_1D] if gate_1D is not None else [])
    if activation != "silu" or not _fusable(x_TD, weights, residual_TD):
        return torch_ops.swiglu_mlp(x_TD, w_gate_FD, w_up_FD, w_down_DF, activation, gate_1D=gate_1D,
                                    residual_TD=residual_TD, situ_betas=situ_betas)
    return _SwigluMlp.apply(x_TD, w_gate_FD, w_up_FD, w_down_DF, gate_1D, residual_TD)
