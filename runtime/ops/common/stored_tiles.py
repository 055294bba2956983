"""A tile of a frozen base weight decoded in registers from its stored format (the grouped GEMM of
runtime/ops/moe/grouped_gemm.py reads every stored weight through these, the experts' and, as one group, the dense
projections' of runtime/ops/stored_matmul).

A tile is always cut in the orientation the codes are stored in: rows `o_idx` of the weight's O axis times C
consecutive columns of its I axis from `i0` (a multiple of C), whichever axis the GEMM reduces over. MXFP4's 32-column
groups and its packed nibble pairs both run along I, so a tile whose I extent is a multiple of 32 holds whole groups:
one scale byte per 16 code bytes and one nibble split per byte, the same work for the forward (x W^T reduces over I)
and for the input gradient (dy W reduces over O, W's tile transposed in the dot). FP8's block scale is one value per
row of the tile (`SCALE_MODE` 1: the tile's I extent lies in one block, the forward), per column (2: its O extent lies
in one block, the input gradient, `o0` its first row) or, for a block size that does not hold the reduction's chunk,
gathered per element (0).

Formats (`FORMAT`): 1 FP8 e4m3 codes times the block's scale (float, or E8M0 bytes with `SCALE_E8M0`); 2 MXFP4, e2m1
nibbles (low first) times 2^(E8M0 - 127) per 32 columns. Codes and scales are addressed [O, .] through their row
strides with unit column stride. Values outside the weight (rows not in o_ok, columns past I) decode to 0.
"""
from __future__ import annotations

import triton
import triton.language as tl

FORMAT_DENSE, FORMAT_FP8, FORMAT_MXFP4 = 0, 1, 2
FORMAT_OF_KIND = {"fp8_block": FORMAT_FP8, "mxfp4": FORMAT_MXFP4}
SCALE_PER_ELEMENT, SCALE_PER_ROW, SCALE_PER_COLUMN = 0, 1, 2
MXFP4_GROUP = 32


@triton.jit
def e8m0_to_f32(s):
    """2^(s - 127) for E8M0 bytes s (int32): the byte is the float's exponent field; 0 is the subnormal 2^-127."""
    return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_f32(code):
    """The e2m1 value of 4-bit codes (int32): sign bit 3, exponent bits 2-1, mantissa bit 0. A normal code's
    magnitude (1 + m/2) 2^(e-1) is the fp32 with exponent e + 126 and mantissa m, i.e. bits (mag + 252) << 22;
    exponent 0 holds 0 and 0.5."""
    mag = code & 7
    normal = ((mag + 252) << 22).to(tl.float32, bitcast=True)
    value = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal)
    return tl.where(code >= 8, -value, value)


@triton.jit
def _mxfp4_tile(codes_ptr, stride_co, scale_ptr, stride_so, rows, o_ok, i0, I, C: tl.constexpr):
    # byte j of the tile holds columns i0 + 2j (low nibble) and i0 + 2j + 1; its scale is that of group j // 16
    # (MXFP4_GROUP = 32 columns, written as literals: a compiled kernel reads no plain global, and the interpreter
    # cannot mix a constexpr global into tensor arithmetic)
    j = tl.arange(0, C // 2)
    ok = o_ok[:, None] & (i0 + 2 * j < I)[None, :]
    packed = tl.load(codes_ptr + rows * stride_co + (i0 // 2 + j)[None, :], mask=ok, other=0).to(tl.int32)
    factor = e8m0_to_f32(tl.load(scale_ptr + rows * stride_so + (i0 // 32 + j // 16)[None, :],
                                 mask=ok, other=127).to(tl.int32))
    low = e2m1_to_f32(packed & 15) * factor
    high = e2m1_to_f32(packed >> 4) * factor
    return tl.reshape(tl.join(low, high), (low.shape[0], C))


@triton.jit
def _block_scale(scale_ptr, stride_so, o_idx, o_ok, o0, i0, i_idx, i_ok, block_o, block_i,
                 SCALE_E8M0: tl.constexpr, SCALE_MODE: tl.constexpr):
    if SCALE_MODE == 1:
        s = tl.load(scale_ptr + (o_idx // block_o).to(tl.int64) * stride_so + i0 // block_i, mask=o_ok,
                    other=1)[:, None]
    elif SCALE_MODE == 2:
        s = tl.load(scale_ptr + (o0 // block_o).to(tl.int64) * stride_so + i_idx // block_i, mask=i_ok, other=1)[None, :]
    else:
        s = tl.load(scale_ptr + (o_idx // block_o).to(tl.int64)[:, None] * stride_so + (i_idx // block_i)[None, :],
                    mask=o_ok[:, None] & i_ok[None, :], other=1)
    if SCALE_E8M0:
        return e8m0_to_f32(s.to(tl.int32))
    return s.to(tl.float32)


@triton.jit
def decode_tile(codes_ptr, stride_co, scale_ptr, stride_so, o_idx, o_ok, o0, i0, I, block_o, block_i,
                FORMAT: tl.constexpr, C: tl.constexpr, SCALE_E8M0: tl.constexpr, SCALE_MODE: tl.constexpr):
    """fp32 [len(o_idx), C]: the weight's rows o_idx, columns i0 .. i0 + C (o0: the first row, for SCALE_MODE 2)."""
    rows = o_idx[:, None].to(tl.int64)
    if FORMAT == 2:
        return _mxfp4_tile(codes_ptr, stride_co, scale_ptr, stride_so, rows, o_ok, i0, I, C)
    i_idx = i0 + tl.arange(0, C)
    i_ok = i_idx < I
    codes = tl.load(codes_ptr + rows * stride_co + i_idx[None, :], mask=o_ok[:, None] & i_ok[None, :], other=0.0)
    scale = _block_scale(scale_ptr, stride_so, o_idx, o_ok, o0, i0, i_idx, i_ok, block_o, block_i, SCALE_E8M0, SCALE_MODE)
    return codes.to(tl.float32) * scale


def scale_mode(fmt: int, transposed: bool, block: tuple[int, int], block_k: int) -> int:
    """FP8's scale layout in a tile whose reduction chunk is block_k long: one block along the reduction (I in the
    forward, O in the transposed read) gives one scale per row (per column) of the tile."""
    if fmt != FORMAT_FP8:
        return SCALE_PER_ELEMENT
    along_k = block[0] if transposed else block[1]
    if along_k % block_k:
        return SCALE_PER_ELEMENT
    return SCALE_PER_COLUMN if transposed else SCALE_PER_ROW

