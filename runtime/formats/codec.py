"""Decode and encode the stored weight formats (reference_ops/formats.py is the fp64 truth and says the layouts).

Decoding is what a frozen base weight goes through on its way into a matmul (the torch form: one layer's weight
at a time, never the model); encoding writes example releases and re-quantizes a merged export.
Shape legend: O rows, I columns, leading dims (experts) pass through.
"""
from __future__ import annotations

import torch

from reference_ops.formats import E2M1_VALUES, MXFP4_GROUP

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
E2M1_MAX = 6.0
E8M0_BIAS = 127


def _expand_blocks(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """The per-block scale broadcast to every element of a [.., O, I] weight (partial last blocks cut)."""
    rows, cols = shape[-2:]
    return scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]


def _product_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp64 callers (alignment's fp64 runs) get the exact product; fp32 rounds a code times an fp32 scale once
    return torch.float64 if dtype == torch.float64 else torch.float32


def fp8_block_decode(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """codes [.., O, I] float8_e4m3fn, scale [.., ceil(O/b), ceil(I/b)] -> [.., O, I] in dtype (fp32 product,
    fp64 for an fp64 result)."""
    work = _product_dtype(dtype)
    full = _expand_blocks(scale.to(work), codes.shape, block)
    return (codes.to(work) * full).to(dtype)


def fp8_block_encode(weight: torch.Tensor, block: tuple[int, int], power_of_two: bool = False,
                     scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """[.., O, I] -> (codes float8_e4m3fn, scale [.., ceil(O/b), ceil(I/b)] in scale_dtype): each block's largest
    magnitude maps to the format's largest value; power_of_two rounds each scale up to 2^k (UE8M0 scales).
    scale_dtype bfloat16 (Qwen's FP8 releases store their scales so): each scale is rounded UP to a bf16 value
    before the codes are computed, so the stored scale is the one the codes were divided by and no code overflows;
    float8_e8m0fnu (power_of_two only) holds the powers of two exactly."""
    w = weight.to(torch.float32)
    rows, cols = w.shape[-2:]
    b_rows, b_cols = block
    pad_r, pad_c = -rows % b_rows, -cols % b_cols
    padded = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r))
    tiles = padded.unflatten(-1, (-1, b_cols)).unflatten(-3, (-1, b_rows))  # [.., Ob, br, Ib, bc]
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    if scale_dtype == torch.bfloat16:
        scale = _round_up_to_bf16(scale)
    elif scale_dtype == torch.float8_e8m0fnu and not power_of_two:
        raise ValueError("float8_e8m0fnu scales hold powers of two only: encode with power_of_two")
    elif scale_dtype not in (torch.float32, torch.float8_e8m0fnu):
        raise ValueError(f"FP8 block scales are stored as float32, bfloat16 or float8_e8m0fnu, not {scale_dtype}")
    codes = (w / _expand_blocks(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale.to(scale_dtype)


def _round_up_to_bf16(positive: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 value >= each positive finite float32 (bf16 is float32's upper 16 bits)."""
    bits = positive.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def mxfp4_decode(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed [.., O, I/2] uint8 (low nibble first), scales [.., O, I/32] uint8 E8M0 -> [.., O, I] in dtype."""
    work = _product_dtype(dtype)
    lut = torch.tensor(E2M1_VALUES, dtype=work, device=packed.device)
    values = torch.stack([lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]], dim=-1).flatten(-2)
    factor = torch.exp2(scales.to(work) - E8M0_BIAS)
    return (values.unflatten(-1, (-1, MXFP4_GROUP)) * factor[..., None]).flatten(-2).to(dtype)


def mxfp4_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[.., O, I] (I a multiple of 32) -> (packed uint8 [.., O, I/2], scales uint8 [.., O, I/32]).
    The shared exponent is the OCP MX rule: floor(log2(group amax)) minus e2m1's largest exponent (2), so the
    group's largest magnitude lands in [4, 8) and saturates at 6; each value rounds to the nearest e2m1 code."""
    w = weight.to(torch.float32)
    if w.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs a multiple of {MXFP4_GROUP} columns, got {w.shape[-1]}")
    groups = w.unflatten(-1, (-1, MXFP4_GROUP))
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -E8M0_BIAS))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = (groups / torch.exp2(exponent)[..., None]).clamp(-E2M1_MAX, E2M1_MAX).flatten(-2)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + E8M0_BIAS).to(torch.uint8)
