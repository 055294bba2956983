"""The matmul over a frozen base weight in its released format, decoding the weight's tiles in registers: the grouped
GEMM of the routed experts (runtime/ops/moe/grouped_gemm.py) run as one group holding every row, so the dense
projections and the experts share one main loop, one set of tile decoders (runtime/ops/common/stored_tiles.py) and
one LoRA epilogue. Contract: README.md beside this file; truth: reference_ops/stored.py.

Forward: y = x W^T + b + s (x A^T) B^T, the LoRA term added in the GEMM's epilogue. Backward: dx = dy W + s (dy B) A
from the same kernel reading W transposed (its tiles still cut along the codes' rows), and the LoRA factors' and the
bias's gradients in torch (rank-r and vector sized); W has no gradient (frozen).
Shape legend: T tokens, O out width, I in width, r LoRA rank.
"""
from __future__ import annotations

import torch

from runtime.ops.common import buffers
from runtime.ops.moe.grouped_gemm import LowRank, Stored, Weight, grouped_gemm
from runtime.ops.moe.schedule import Schedule
from runtime.ops.stored_matmul.torch_form import stored_operands

# Row tile: the experts' (runtime/ops/moe/experts.py), whose kernel this runs.
BLOCK_M = 128


def one_group(num_rows: int, device: torch.device, block_m: int = BLOCK_M) -> Schedule:
    """The grouped GEMM's schedule for a plain matmul: one expert owning rows 0 .. num_rows in row tiles."""
    tile_start = torch.arange(0, num_rows, block_m, dtype=torch.int32, device=device)
    return Schedule(pair_S=torch.arange(num_rows, device=device), expert_S=torch.zeros(num_rows, dtype=torch.int16,
                    device=device), ends_E=torch.full((1,), num_rows, dtype=torch.int32, device=device),
                    tile_expert=torch.zeros_like(tile_start), tile_start=tile_start, block_m=block_m, num_experts=1,
                    top_k=1)


def _low_rank(left, right, transposed: bool, scale: float) -> LowRank | None:
    return None if left is None else LowRank(left, Weight(right[None], transposed), scale)


class _StoredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lora_scale, stored, x_TI, codes, scale, bias_O, A_rI, B_Or):
        T, dtype = x_TI.shape[0], x_TI.dtype
        weight = Weight(codes[None], stored=Stored(scale[None], *stored))
        sched = one_group(T, x_TI.device)
        A, B = (None, None) if A_rI is None else (A_rI.to(dtype), B_Or.to(dtype))
        xa_Tr = x_TI @ A.T if A is not None else None
        y_TO = buffers.empty(T, codes.shape[0], dtype=dtype, device=x_TI.device)
        if T:
            grouped_gemm(x_TI, weight, sched, y_TO, bias_EN=None if bias_O is None else bias_O[None],
                         low_rank=_low_rank(xa_Tr, B, False, lora_scale))
        ctx.save_for_backward(x_TI if A is not None else None, xa_Tr, codes, scale, A, B)
        ctx.lora_scale, ctx.stored, ctx.sched, ctx.x_dtype = lora_scale, stored, sched, dtype
        ctx.dtypes = (bias_O.dtype if bias_O is not None else None, *(f.dtype if f is not None else None
                                                                         for f in (A_rI, B_Or)))
        return y_TO

    @staticmethod
    def backward(ctx, dy_TO):
        x_TI, xa_Tr, codes, scale, A, B = ctx.saved_tensors
        need_x, need_bias, need_A, need_B = (ctx.needs_input_grad[i] for i in (2, 5, 6, 7))
        s = ctx.lora_scale
        dy = dy_TO.contiguous().to(ctx.x_dtype)
        dyb_Tr = dy @ B if B is not None and (need_x or need_A) else None
        dx = None
        if need_x:
            weight = Weight(codes[None], transposed=True, stored=Stored(scale[None], *ctx.stored))
            dx = buffers.empty(dy.shape[0], weight.num_columns(), dtype=dy.dtype, device=dy.device)
            if dy.shape[0]:
                grouped_gemm(dy, weight, ctx.sched, dx, low_rank=_low_rank(dyb_Tr, A, True, s))
        bias_dtype, A_dtype, B_dtype = ctx.dtypes
        d_bias = dy.float().sum(0).to(bias_dtype) if need_bias else None
        dA = (s * dyb_Tr.float().T @ x_TI.float()).to(A_dtype) if need_A else None
        dB = (s * dy.float().T @ xa_Tr.float()).to(B_dtype) if need_B else None
        return None, None, dx, None, None, d_bias, dA, dB


def stored_linear(
    x_TI: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    *,
    kind: str,
    block: tuple[int, int] | None = None,
    bias_O: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
    lora_scale: float = 1.0,
) -> torch.Tensor:
    """y = x W^T + b + lora_scale * (x A^T) B^T with W = decode(codes, scale) decoded tile by tile in the kernel;
    x [.., I] -> y [.., O] in x's dtype."""
    codes, scale = stored_operands(codes, scale, kind)
    A_rI, B_Or = lora if lora is not None else (None, None)
    stored = (kind, tuple(block) if block is not None else None)
    x = x_TI.reshape(-1, x_TI.shape[-1]).contiguous()
    y = _StoredLinear.apply(float(lora_scale), stored, x, codes, scale, bias_O, A_rI, B_Or)
    return y.view(*x_TI.shape[:-1], y.shape[-1])

