"""runtime/formats/codec.py against the fp64 decoders of reference_ops/formats.py, on bytes the encoders wrote
and on hand-set bytes whose values are known."""
from __future__ import annotations

import pytest
import torch

from reference_ops.formats import dequantize_fp8_block, dequantize_mxfp4
from runtime.formats.codec import fp8_block_decode, fp8_block_encode, mxfp4_decode, mxfp4_encode


@pytest.mark.parametrize("shape,block", [((576, 256), (128, 128)), ((192, 320), (128, 128)), ((3, 65, 130), (64, 64)),
                                         ((7, 5), (128, 128))], ids=["576rows", "192rows", "experts-odd", "one-partial"])
@pytest.mark.parametrize("power_of_two", [False, True], ids=["fp32-scales", "ue8m0-scales"])
def test_fp8_block_round_trip_matches_the_reference(shape, block, power_of_two):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    codes, scale = fp8_block_encode(weight, block, power_of_two)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape[-2:] == (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    if power_of_two:
        assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    reference = dequantize_fp8_block(codes, scale, block)
    # the decoder multiplies in fp32: a 4-bit-mantissa code times an fp32 scale, correctly rounded, is the
    # exact fp64 product rounded to fp32
    assert torch.equal(fp8_block_decode(codes, scale, block, torch.float32), reference.float())
    # e4m3 keeps 3 mantissa bits: each element within half a step (1/16 relative) of its block's scale range
    assert (reference - weight.double()).abs().max() <= weight.abs().max() / 16


def test_fp8_block_encode_with_bf16_scales_stores_the_scale_it_divided_by():
    """Qwen's FP8 releases store bf16 scales: each is rounded up to a bf16 value before the codes are computed, so
    decoding the stored scale gives the encoded weight within e4m3's half step and no code passes 448."""
    weight = torch.randn(192, 320, generator=torch.Generator().manual_seed(1))
    codes, scale = fp8_block_encode(weight, (128, 128), scale_dtype=torch.bfloat16)
    _, fp32_scale = fp8_block_encode(weight, (128, 128))
    assert scale.dtype == torch.bfloat16 and (scale.float() >= fp32_scale).all()
    assert (scale.float() <= fp32_scale * (1 + 2 ** -7)).all()  # the next bf16 up: within one bf16 step
    assert codes.float().abs().max() <= 448
    reference = dequantize_fp8_block(codes, scale, (128, 128))
    assert (reference - weight.double()).abs().max() <= weight.abs().max() / 16
    with pytest.raises(ValueError):
        fp8_block_encode(weight, (128, 128), scale_dtype=torch.float16)


def test_fp8_block_decode_uses_the_stated_block_not_the_grid():
    """A 192-row weight with 128-row blocks has a 2-row scale grid; read with 96-row blocks it would also tile.
    The decoder takes the block it is told, so row 100 takes block row 0's scale."""
    codes = torch.ones(192, 128).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0], [3.0]])
    out = fp8_block_decode(codes, scale, (128, 128), torch.float32)
    assert out[100, 0] == 2.0 and out[130, 0] == 3.0
    with pytest.raises(ValueError):
        dequantize_fp8_block(codes, scale, (64, 128))


def test_mxfp4_decode_of_known_bytes():
    # 0x71: low nibble 1 (0.5) first, high nibble 7 (6.0); 0xF8: -0.0 then -6.0; scale 128 = 2^1
    packed = torch.tensor([[0x71, 0xF8] * 8], dtype=torch.uint8)
    scales = torch.tensor([[128]], dtype=torch.uint8)
    expected = torch.tensor([1.0, 12.0, -0.0, -12.0] * 8, dtype=torch.float64)
    assert torch.equal(dequantize_mxfp4(packed, scales)[0], expected)
    assert torch.equal(mxfp4_decode(packed, scales, torch.float64)[0], expected)


@pytest.mark.parametrize("shape", [(64, 96), (3, 10, 64)], ids=["dense", "experts"])
def test_mxfp4_round_trip_matches_the_reference(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    packed, scales = mxfp4_encode(weight)
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and scales.shape == (*shape[:-1], shape[-1] // 32)
    reference = dequantize_mxfp4(packed, scales)
    assert torch.equal(mxfp4_decode(packed, scales, torch.float64), reference)
    # e2m1's coarsest step is 2 (between 4 and 6) at a group scale of amax/4 at most: half a step is amax/4
    group_amax = weight.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    error = (reference - weight.double()).unflatten(-1, (-1, 32)).abs()
    assert bool((error <= group_amax.double() / 4 + 1e-12).all())
    assert torch.equal(mxfp4_encode(reference.float())[0], packed)
