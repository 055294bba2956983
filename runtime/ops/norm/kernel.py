"""RMSNorm and the gated output RMSNorm of linear-attention layers, forward and backward in one kernel each.

The torch forms (runtime/ops/norm/torch_form.py) cast x to fp32, normalize, multiply and cast back, and the gated form
adds an fp32 activation of the gate and a product: each step a pass over the rows, and the backward as many
again. Here x, the gate and dy are read once in their own dtype, the math is fp32 and the
result is written once in x's dtype; the forward keeps one fp32 inverse RMS per row for the backward.
The weight gradient is summed per program over the rows it walks (a persistent grid of at most
MAX_PROGRAMS programs), then over programs in torch.

y = x * rstd * (offset + w) * act(gate); act: none, silu (Qwen3-Next), sigmoid (Kimi KDA).
Shape legend: R rows (every leading dim flattened), D normalized width, P programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.common import buffers
from runtime.ops.common.launch import fast

ACT_NONE, ACT_SILU, ACT_SIGMOID = 0, 1, 2
_ACTIVATIONS = {None: ACT_NONE, "silu": ACT_SILU, "sigmoid": ACT_SIGMOID}
# rows x columns one program holds at a time: wide rows go one or two a program, head-wide ones in dozens
ELEMENTS_PER_BLOCK = 4096
NUM_WARPS = 8
# the backward's persistent grid: about one full wave of a large GPU at 8 warps, and few partial dw rows to sum
MAX_PROGRAMS = 1024


@triton.jit
def _act(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32."""
    sig = tl.sigmoid(g)
    if ACT == 1:
        return g * sig, sig * (1.0 + g * (1.0 - sig))
    return sig, sig * (1.0 - sig)


@triton.jit
def rms_norm_fwd_kernel(x_ptr, gate_ptr, w_ptr, y_ptr, rstd_ptr, num_rows, D, eps, offset,
                        ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < D)[None, :]
    at = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32) + offset
    y = x * rstd[:, None] * w[None, :]
    if ACT != 0:
        a, _ = _act(tl.load(gate_ptr + at, mask=mask, other=0.0).to(tl.float32), ACT)
        y = y * a
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < num_rows)


@triton.jit
def rms_norm_bwd_kernel(dy_ptr, x_ptr, gate_ptr, w_ptr, rstd_ptr, dx_ptr, dgate_ptr, dw_ptr, num_rows, D, offset,
                        ACT: tl.constexpr, WANT_DW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r0 in range(tl.program_id(0) * BLOCK_R, num_rows, tl.num_programs(0) * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < num_rows)[:, None] & col_ok[None, :]
        at = rows[:, None].to(tl.int64) * D + cols[None, :]
        n = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < num_rows, other=0.0)
        n = n * rstd[:, None]
        dy = tl.load(dy_ptr + at, mask=mask, other=0.0).to(tl.float32)
        if ACT != 0:
            a, da = _act(tl.load(gate_ptr + at, mask=mask, other=0.0).to(tl.float32), ACT)
            tl.store(dgate_ptr + at, (dy * n * w[None, :] * da).to(dgate_ptr.dtype.element_ty), mask=mask)
            dy = dy * a
        if WANT_DW:
            dw += tl.sum(dy * n, axis=0)
        dn = dy * w[None, :]
        dx = rstd[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / D)[:, None])
        tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if WANT_DW:
        tl.store(dw_ptr + tl.program_id(0) * D + cols, dw, mask=col_ok)


def _blocks(D: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(D)
    return max(1, ELEMENTS_PER_BLOCK // block_d), block_d


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps: float, offset: float, act: int):
        D = x.shape[-1]
        x_RD = x.reshape(-1, D).contiguous()
        gate_RD = gate.reshape(-1, D).contiguous() if gate is not None else x_RD
        R = x_RD.shape[0]
        y = buffers.empty(R, D, dtype=x.dtype, device=x.device)
        rstd = buffers.empty(R, dtype=torch.float32, device=x.device)
        block_r, block_d = _blocks(D)
        # (no launch for zero rows: CUDA refuses an empty grid)
        if R:
            fast(rms_norm_fwd_kernel)[(triton.cdiv(R, block_r),)](
                x_RD, gate_RD, weight, y, rstd, R, D, eps, offset, ACT=act, BLOCK_R=block_r, BLOCK_D=block_d,
                num_warps=NUM_WARPS)
        ctx.save_for_backward(x_RD, gate if gate is None else gate_RD, weight, rstd)
        ctx.offset, ctx.act, ctx.shape = offset, act, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x_RD, gate_RD, weight, rstd = ctx.saved_tensors
        R, D = x_RD.shape
        dy_RD = dy.reshape(R, D).contiguous()
        block_r, block_d = _blocks(D)
        programs = min(triton.cdiv(R, block_r), MAX_PROGRAMS)
        want_dw = ctx.needs_input_grad[2]
        dx = buffers.empty(R, D, dtype=x_RD.dtype, device=x_RD.device)
        dgate = buffers.empty(R, D, dtype=gate_RD.dtype, device=x_RD.device) if gate_RD is not None else dx
        dw = buffers.empty(programs, D, dtype=torch.float32, device=x_RD.device) if want_dw else rstd
        if programs:
            fast(rms_norm_bwd_kernel)[(programs,)](
                dy_RD, x_RD, gate_RD if gate_RD is not None else x_RD, weight, rstd, dx, dgate, dw, R, D, ctx.offset,
                ACT=ctx.act, WANT_DW=want_dw, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=NUM_WARPS)
        d_gate = dgate.view(ctx.shape) if gate_RD is not None else None
        d_weight = dw.sum(0).to(weight.dtype) if want_dw else None
        return dx.view(ctx.shape), d_gate, d_weight, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """y[..., D] = x / rms(x) * (offset + weight[D]) in fp32, returned in x.dtype (runtime/ops/norm/torch_form.py's contract)."""
    return _RmsNorm.apply(x, None, weight, float(eps), float(offset), ACT_NONE)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   activation: str = "silu") -> torch.Tensor:
    """y[..., D] = rms_norm(x) * weight[D] * act(gate[..., D]), act silu or sigmoid, in fp32, returned in x.dtype."""
    return _RmsNorm.apply(x, gate, weight, float(eps), 0.0, _ACTIVATIONS[activation])
