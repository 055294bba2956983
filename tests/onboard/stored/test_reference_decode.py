"""The tiers 1-2 reference of a stored-format release decodes with the block size quantization_config states
(onboard/align/stored.py): right where transformers' own FP8 dequantization, which takes the block from the scale
grid, is wrong (DeepSeek-V3's 576-row kv_a_proj_with_mqa, a 192-row weight); gpt-oss's MXFP4 experts come out in the
[E, in, out] orientation its bf16 release stores, as transformers' own MXFP4 dequantization gives them."""
from __future__ import annotations

import pytest
import torch

from onboard.align.stored import decode, fold_experts, logical
from reference_ops.formats import dequantize_fp8_block
from runtime.formats.codec import fp8_block_encode, mxfp4_encode
from runtime.formats.scheme import MXFP4, FP8Block, StoredEntry

BLOCK = (128, 128)


def _fp8_entry(name: str) -> StoredEntry:
    return StoredEntry(format=FP8Block(block=BLOCK), codes=name, scale=f"{name}_scale_inv")


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02


@pytest.mark.parametrize("rows", [576, 192])
def test_fp8_rows_off_the_block_grid_decode_with_the_stated_block(rows):
    """576 rows = 4 full 128-row blocks + 64 (5 scale rows); 192 = 128 + 64 (2 scale rows): every element is its code
    times the scale of the 128x128 block it lies in, and the decoded weight is the encoded one within FP8's rounding."""
    weight = _weight(rows, 160)
    codes, scale = fp8_block_encode(weight, BLOCK)
    decoded = logical(_fp8_entry("kv_a_proj_with_mqa.weight"), decode(_fp8_entry("w"), codes, scale), (rows, 160))
    by_element = codes.double() * scale.double().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :160]
    assert torch.equal(decoded, by_element)
    assert decoded.shape == (rows, 160)
    # e4m3 keeps 3 mantissa bits (rounding within 2^-4 of an element; more for the few below the block's normal range)
    assert (decoded - weight.double()).norm() / weight.double().norm() < 2 ** -4


def test_transformers_own_fp8_dequantization_gets_these_rows_wrong():
    """Why the reference does not inherit transformers' path (pinned version): the block from the scale grid raises
    for 576 rows and decodes 192 rows with 96-row blocks (a different weight)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    dequantize = Fp8Dequantize(hf_quantizer=None)._dequantize_one
    codes, scale = fp8_block_encode(_weight(576, 160), BLOCK)
    with pytest.raises(ValueError):
        dequantize(codes, scale, torch.float64)
    codes, scale = fp8_block_encode(_weight(192, 256, seed=1), BLOCK)
    theirs = dequantize(codes, scale, torch.float64).double()
    ours = dequantize_fp8_block(codes, scale, BLOCK)
    assert not torch.allclose(theirs, ours)


def test_power_of_two_scales_stored_as_e8m0_decode_to_their_powers():
    codes, scale = fp8_block_encode(_weight(192, 160), BLOCK, power_of_two=True)
    e8m0 = scale.to(torch.float8_e8m0fnu)
    assert torch.equal(e8m0.double(), scale.double())
    assert torch.equal(decode(_fp8_entry("w"), codes, e8m0), decode(_fp8_entry("w"), codes, scale))


def test_gpt_oss_blocks_decode_as_transformers_dequantizes_them_even_when_square():
    """Blocks [E, O, G, 16] -> the bf16 release's [E, in, out]; a square expert weight (in = out) must be transposed
    too: the layout decides, never the shape."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = _weight(3 * 64, 64).reshape(3, 64, 64) * 10
    packed, scales = mxfp4_encode(weight)
    blocks = packed.unflatten(-1, (-1, 16))
    entry = StoredEntry(format=MXFP4(layout="blocks"), codes="experts.gate_up_proj_blocks",
                        scale="experts.gate_up_proj_scales")
    ours = logical(entry, decode(entry, blocks, scales), (3, 64, 64))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours.float(), theirs)
    assert not torch.equal(ours, ours.transpose(-1, -2))


def test_a_decoded_weight_that_misses_its_logical_shape_is_named():
    codes, scale = fp8_block_encode(_weight(192, 160), BLOCK)
    with pytest.raises(ValueError, match="kv_a_proj"):
        logical(_fp8_entry("kv_a_proj.weight"), decode(_fp8_entry("kv_a_proj.weight"), codes, scale), (160, 192))


def test_expert_scale_names_fold_into_ranges():
    names = [f"model.layers.{i}.mlp.experts.{e}.down_proj.weight_scale_inv" for i in (2, 10) for e in (0, 1, 2, 5)]
    assert fold_experts(names + ["model.layers.2.self_attn.o_proj.weight_scale_inv"]) == [
        "model.layers.2.mlp.experts.{0..2,5}.down_proj.weight_scale_inv",
        "model.layers.2.self_attn.o_proj.weight_scale_inv",
        "model.layers.10.mlp.experts.{0..2,5}.down_proj.weight_scale_inv"]
