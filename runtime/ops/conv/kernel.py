"""Short causal depthwise conv (+ silu) on [B, T, C] as the layers hold it: no transposes, fp32 inside.

torch's depthwise conv wants [B, C, T], so the torch form pays casts and transposed copies around it
(bench/bench_short_ops.py times both). Here one kernel reads W shifted rows of x per output row. Backward: the
same kernel recomputes the pre-activation and forms d pre = dy * silu'(pre), then runs the conv
the other way along time (anti-causal, same taps) for dx; weight and bias gradients, when wanted,
are W + 1 fp32 reductions over d pre in torch.
Shape legend: B batch, T tokens, C channels, W kernel width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from runtime.ops.common import buffers
from runtime.ops.common.launch import fast

BLOCK_T, BLOCK_C = 32, 128
# what the kernel's epilogue does with the conv sum: nothing, silu, or dy * silu'(sum)
PLAIN, SILU, SILU_GRAD = 0, 1, 2


@triton.jit
def causal_conv_kernel(x_ptr, w_ptr, b_ptr, dy_ptr, y_ptr, T, C, W: tl.constexpr, BACKWARD_IN_TIME: tl.constexpr,
                       HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    # int64 row offsets: T * C passes 2^31 at 262144 tokens of an 8192-channel conv
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    base = tl.program_id(2).to(tl.int64) * T * C
    c_ok = c < C
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for i in tl.static_range(W):
        # tap i reads W-1-i steps back (forward) or ahead (the transposed conv of the input gradient)
        if BACKWARD_IN_TIME:
            src = t + (W - 1 - i)
        else:
            src = t - (W - 1 - i)
        ok = ((src >= 0) & (src < T))[:, None] & c_ok[None, :]
        x = tl.load(x_ptr + base + src[:, None] * C + c[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += x * tl.load(w_ptr + c * W + i, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    out_ok = (t < T)[:, None] & c_ok[None, :]
    offsets = base + t[:, None] * C + c[None, :]
    if EPILOGUE == 1:  # SILU
        acc = acc * tl.sigmoid(acc)
    if EPILOGUE == 2:  # SILU_GRAD
        s = tl.sigmoid(acc)
        acc = tl.load(dy_ptr + offsets, mask=out_ok, other=0.0).to(tl.float32) * s * (1.0 + acc * (1.0 - s))
    tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty), mask=out_ok)


def _conv(x_BTC, weight_CW, bias_C, epilogue: int, backward_in_time: bool = False, dy_BTC=None):
    B, T, C = x_BTC.shape
    y_BTC = buffers.empty(B, T, C, dtype=x_BTC.dtype, device=x_BTC.device)
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(C, BLOCK_C), B)
    # x stands in for the pointers the constexprs leave unread
    bias, dy = (x_BTC if t is None else t for t in (bias_C, dy_BTC))
    fast(causal_conv_kernel)[grid](x_BTC, weight_CW, bias, dy, y_BTC, T, C, W=weight_CW.shape[1],
                                   BACKWARD_IN_TIME=backward_in_time, HAS_BIAS=bias_C is not None,
                                   EPILOGUE=epilogue, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=4)
    return y_BTC


class _CausalConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTC, weight_CW, bias_C, silu: bool):
        ctx.save_for_backward(x_BTC, weight_CW, bias_C)
        ctx.silu = silu
        return _conv(x_BTC, weight_CW, bias_C, SILU if silu else PLAIN)

    @staticmethod
    def backward(ctx, dy_BTC):
        x_BTC, weight_CW, bias_C = ctx.saved_tensors
        dy_BTC = dy_BTC.contiguous()
        dpre_BTC = _conv(x_BTC, weight_CW, bias_C, SILU_GRAD, dy_BTC=dy_BTC) if ctx.silu else dy_BTC
        dx = _conv(dpre_BTC, weight_CW, None, PLAIN, backward_in_time=True) if ctx.needs_input_grad[0] else None
        dw = _weight_grad(x_BTC, dpre_BTC, weight_CW) if ctx.needs_input_grad[1] else None
        db = dpre_BTC.float().sum((0, 1)).to(bias_C.dtype) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def _weight_grad(x_BTC, dpre_BTC, weight_CW) -> torch.Tensor:
    """dw[c, i] = sum over b, t of dpre[b, t, c] * x[b, t - (W-1-i), c] (x before t=0 is 0)."""
    W, T = weight_CW.shape[1], x_BTC.shape[1]
    x_padded = F.pad(x_BTC.float(), (0, 0, W - 1, 0))
    dpre = dpre_BTC.float()
    taps = [(dpre * x_padded[:, i:i + T]).sum((0, 1)) for i in range(W)]
    return torch.stack(taps, dim=1).to(weight_CW.dtype)


def causal_conv1d(x_BTC: torch.Tensor, weight_CW: torch.Tensor, bias_C: torch.Tensor | None = None,
                  activation: str | None = "silu") -> torch.Tensor:
    """y_BTC in x's dtype, as reference_ops.conv.causal_conv1d."""
    if activation not in ("silu", "swish", None):
        raise ValueError(f"causal_conv1d: activation {activation!r} is not silu, swish or None")
    return _CausalConv.apply(x_BTC.contiguous(), weight_CW.contiguous(), bias_C, activation is not None)
