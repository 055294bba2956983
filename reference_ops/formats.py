"""fp64 reference decoders of the stored weight formats releases ship (the truth for runtime/formats and
every op that dequantizes in its kernel).

Shape legend: O rows (out width), I columns (in width), G groups of 32 columns; leading dims (experts) pass through.
- FP8 block-scaled (DeepSeek-V3 style): codes float8_e4m3fn [.., O, I] and one scale per (b_rows x b_cols)
  block, [.., ceil(O/b_rows), ceil(I/b_cols)], float32 or float8_e8m0fnu; value = code * scale (the scale
  is the inverse of the quantizer's, hence releases name it weight_scale_inv). The block size is the one
  quantization_config states: the last block of a row or column may be partial (576 rows with 128-row blocks).
- MXFP4 (OCP microscaling): 4-bit e2m1 codes, two per byte, the low nibble first, [.., O, I/2] uint8, and
  one E8M0 scale per 32 consecutive columns [.., O, G] uint8; value = e2m1(code) * 2^(scale - 127).
"""
from __future__ import annotations

import torch

# e2m1: sign, 2 exponent bits, 1 mantissa bit; the code's value by its 4-bit index
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32


def dequantize_fp8_block(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """codes [.., O, I] float8, scale [.., ceil(O/b_rows), ceil(I/b_cols)] -> weights [.., O, I] fp64."""
    rows, cols = codes.shape[-2:]
    b_rows, b_cols = block
    if scale.shape[-2:] != (-(-rows // b_rows), -(-cols // b_cols)):
        raise ValueError(f"scale grid {tuple(scale.shape)} does not tile {tuple(codes.shape)} in {block} blocks")
    out = torch.empty(codes.shape, dtype=torch.float64)
    values, scales = codes.to(torch.float64), scale.to(torch.float64)
    for i in range(0, rows, b_rows):
        for j in range(0, cols, b_cols):
            out[..., i:i + b_rows, j:j + b_cols] = (values[..., i:i + b_rows, j:j + b_cols]
                                                    * scales[..., i // b_rows, j // b_cols, None, None])
    return out


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed [.., O, I/2] uint8 (low nibble first), scales [.., O, I/32] uint8 E8M0 -> weights [.., O, I] fp64."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    low, high = (packed & 0x0F).long(), (packed >> 4).long()
    values = torch.stack([lut[low], lut[high]], dim=-1).flatten(-2)
    if values.shape[-1] != scales.shape[-1] * MXFP4_GROUP:
        raise ValueError(f"{tuple(scales.shape)} scales do not cover {values.shape[-1]} columns in groups of 32")
    exponent = scales.to(torch.float64) - 127.0
    grouped = values.unflatten(-1, (scales.shape[-1], MXFP4_GROUP))
    return (grouped * torch.pow(2.0, exponent)[..., None]).flatten(-2)
