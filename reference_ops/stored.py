"""fp64 reference of the ops that read a frozen base weight in its stored format: decode the stored bytes with
reference_ops/formats.py, then the plain op (the truth for runtime/ops/stored_matmul and the stored experts).

Stored tensors and the format keywords are those of runtime/ops/stored_matmul/README.md:
- kind "fp8_block": codes float8_e4m3fn [.., O, I], scale [.., ceil(O/b0), ceil(I/b1)] (any float dtype; UE8M0 as
  float8_e8m0fnu or its uint8 bytes), block (b0, b1);
- kind "mxfp4": codes uint8 [.., O, I/2] (or gpt-oss's blocks [.., O, I/32, 16]), scale uint8 (or float8_e8m0fnu)
  E8M0 [.., O, I/32].
Shape legend: T tokens, O out width, I in width, r LoRA rank; the experts' legend is reference_ops/moe.py's.
"""
from __future__ import annotations

import torch

from reference_ops import moe
from reference_ops.formats import dequantize_fp8_block, dequantize_mxfp4


def decode(codes: torch.Tensor, scale: torch.Tensor, kind: str, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The logical weight [.., O, I] in fp64 (codes may arrive already widened to a float dtype: values are exact)."""
    if kind == "fp8_block":
        if block is None:
            raise ValueError("fp8_block needs the block size quantization_config states")
        if scale.dtype == torch.uint8:
            # UE8M0 scales handed over as their bytes
            scale = torch.pow(2.0, scale.to(torch.float64) - 127.0)
        return dequantize_fp8_block(codes, scale, tuple(block))
    if kind == "mxfp4":
        # E8M0 is the byte itself; a float8_e8m0fnu tensor's .to() would give the power of two instead
        scale_bytes = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale.to(torch.uint8)
        # gpt-oss's blocks [.., O, G, 16] are the packed rows [.., O, G * 16]
        packed = codes.flatten(-2) if codes.dim() == scale.dim() + 1 else codes
        return dequantize_mxfp4(packed.to(torch.uint8), scale_bytes)
    raise ValueError(f"stored format {kind!r}: expected fp8_block or mxfp4")


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
    """y = x W^T + b + lora_scale * x A^T B^T with W = decode(codes, scale); x [.., I] -> y [.., O] in fp64."""
    w_OI = decode(codes, scale, kind, block)
    x = x_TI.to(torch.float64)
    y = x @ w_OI.T
    if bias_O is not None:
        y = y + bias_O.to(torch.float64)
    if lora is not None:
        A_rI, B_Or = (f.to(torch.float64) for f in lora)
        y = y + lora_scale * (x @ A_rI.T) @ B_Or.T
    return y


def stored_swiglu_experts(
    x_TD: torch.Tensor,
    weights_Tk: torch.Tensor,
    idx_Tk: torch.Tensor,
    gate_up_codes: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down_codes: torch.Tensor,
    down_scale: torch.Tensor,
    *,
    kind: str,
    block: tuple[int, int] | None = None,
    **experts_kwargs,
) -> torch.Tensor:
    """reference_ops.moe.swiglu_experts over the decoded weights (gate/up [E, 2F, D], down [E, D, F]); the keywords
    after `block` are that op's."""
    return moe.swiglu_experts(x_TD, weights_Tk, idx_Tk, decode(gate_up_codes, gate_up_scale, kind, block),
                              decode(down_codes, down_scale, kind, block), **experts_kwargs)
