"""What a release's quantization_config says about its stored weights, in the typed form every stage reads.

onboard/release reads quantization_config into one StoredFormat and pairs each quantized weight with its scale
tensors; the spec carries the format (ModelSpec.stored_format), the weight map marks each entry it applies to
(a `stored` step, see StoredEntry), and the runtime keeps those weights in it (runtime/formats/codec.py decodes).
Shape legend: O rows (out width), I columns (in width), G = I/32 groups.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _tuple(value):
    # JSON has no tuples: spec.json and weight_map.json hold the block as a list, and read_spec validates strictly
    return tuple(value) if isinstance(value, list) else value


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FP8Block(_Format):
    """float8_e4m3fn codes [.., O, I] with one scale per block [.., ceil(O/rows), ceil(I/cols)] (DeepSeek-V3,
    Qwen3-Next-FP8, GLM, MiniMax). `power_of_two`: every scale is 2^k (quantization_config scale_fmt ue8m0, as
    DeepSeek-V3.2 ships), whether stored as float32 or float8_e8m0fnu."""
    kind: Literal["fp8_block"] = "fp8_block"
    block: Annotated[tuple[int, int], BeforeValidator(_tuple)]  # (rows, cols) as quantization_config's weight_block_size states
    power_of_two: bool = False


class MXFP4(_Format):
    """e2m1 codes, two per byte (low nibble first), with one E8M0 scale per 32 columns [.., O, G].
    layout "blocks": gpt-oss's `<name>_blocks` [.., O, G, 16] and `<name>_scales`; "packed": compressed-tensors'
    `weight_packed` [.., O, I/2] and `weight_scale` (Kimi K3's mxfp4-pack-quantized)."""
    kind: Literal["mxfp4"] = "mxfp4"
    layout: Literal["blocks", "packed"]


StoredFormat = Annotated[Union[FP8Block, MXFP4], Field(discriminator="kind")]


class StoredEntry(_Format):
    """The `stored` step of a weight map entry whose released weight is quantized: the released tensors holding
    the codes and the scales (the entry's own name is the weight's logical name, as a bf16 release names it)."""
    format: StoredFormat
    codes: str
    scale: str
