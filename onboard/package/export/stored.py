"""Merging LoRA into a release whose base weights are stored quantized (FP8 block-scaled, MXFP4).

The weight map names each stored weight by its logical name (as a bf16 release of the family names it) with a
`stored` step (runtime/formats/scheme.py StoredEntry): the released tensors holding its codes and scales, and the
format with the block size quantization_config states. Adding a LoRA delta to the codes is wrong (each code is
the weight divided by its block's scale): a merge decodes codes and scales, adds the delta in the codes' (out, in)
orientation (the runtime's; a stored entry never transposes) and writes either
- bf16 (the default): the logical tensor as a bf16 release stores it (gpt-oss's MXFP4 blocks are (out, in), its
  bf16 experts (in, out)), scale tensors dropped, quantization_config removed from config.json; or
- the stored format again (requantize): each block re-scaled by the codec's encoder (runtime/formats/codec.py),
  under the release's codes and scale names, in its scale dtype, quantization_config kept.
Shape legend: E experts, O rows (out), I columns (in), G = I/32 groups.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import TypeAdapter

from onboard.errors import BadInput
from runtime.formats.codec import fp8_block_decode, fp8_block_encode, mxfp4_decode, mxfp4_encode
from runtime.formats.scheme import FP8Block, StoredEntry

MXFP4_BYTES = 16  # gpt-oss's blocks: 32 e2m1 codes of a group in 16 bytes


@dataclass(frozen=True)
class StoredWeight:
    """One weight the release stores quantized: its logical name and weight-map entry, and how it is stored."""
    logical: str
    entry: dict
    stored: StoredEntry

    @property
    def transposed_in_bf16(self) -> bool:
        """gpt-oss's MXFP4 blocks group the inputs of an output row; its bf16 experts are stored (in, out)."""
        return self.stored.format.kind == "mxfp4" and self.stored.format.layout == "blocks"


def stored_weights(weight_map: dict) -> dict[str, StoredWeight]:
    """Released codes tensor name -> the stored weight it holds, for every weight-map entry with a `stored` step."""
    adapter = TypeAdapter(StoredEntry)
    out = {}
    for logical, entry in weight_map.items():
        if entry.get("stored") is None:
            continue
        stored = adapter.validate_python(entry["stored"])
        out[stored.codes] = StoredWeight(logical, entry, stored)
    return out


def decode(weight: StoredWeight, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [.., O, I] in the codes' orientation."""
    fmt = weight.stored.format
    if isinstance(fmt, FP8Block):
        return fp8_block_decode(codes, scale, fmt.block, torch.float32)
    packed = codes.flatten(-2) if fmt.layout == "blocks" else codes
    return mxfp4_decode(packed, scale, torch.float32)


def encode(weight: StoredWeight, merged: torch.Tensor, codes_like: torch.Tensor, scale_like: torch.Tensor
           ) -> dict[str, torch.Tensor]:
    """The merged fp32 weight [.., O, I] stored again as the release stores it: the same names, shapes, dtypes."""
    fmt, stored = weight.stored.format, weight.stored
    if isinstance(fmt, FP8Block):
        codes, scale = fp8_block_encode(merged, fmt.block, fmt.power_of_two, _scale_dtype(scale_like, stored))
    else:
        codes, scale = mxfp4_encode(merged)
        if fmt.layout == "blocks":
            codes = codes.unflatten(-1, (-1, MXFP4_BYTES))
    if codes.shape != codes_like.shape or scale.shape != scale_like.shape:
        raise BadInput(None, stored.codes, f"re-encoded {tuple(codes.shape)} / {tuple(scale.shape)} does not match the "
                                           f"release's {tuple(codes_like.shape)} / {tuple(scale_like.shape)}")
    return {stored.codes: codes.contiguous(), stored.scale: scale.contiguous()}


def _scale_dtype(scale_like: torch.Tensor, stored: StoredEntry) -> torch.dtype:
    if scale_like.dtype in (torch.float32, torch.bfloat16, torch.float8_e8m0fnu):
        return scale_like.dtype
    raise BadInput(None, stored.scale, f"FP8 block scales stored as {scale_like.dtype}: expected float32, bfloat16 "
                                       "or float8_e8m0fnu")


def bf16_layout(weight: StoredWeight, merged: torch.Tensor) -> torch.Tensor:
    """The merged weight as the family's bf16 release stores it under the logical name."""
    return merged.transpose(-1, -2).contiguous() if weight.transposed_in_bf16 else merged


def without_quantization_config(config_path: Path) -> bool:
    """Drop quantization_config from config.json (top level or a text_config's); whether there was one."""
    config = json.loads(config_path.read_text())
    found = config.pop("quantization_config", None) is not None
    text = config.get("text_config")
    if isinstance(text, dict):
        found = text.pop("quantization_config", None) is not None or found
    if found:
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return found
