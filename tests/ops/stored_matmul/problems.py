"""Stored weights for the stored-format op tests: random weights encoded with runtime/formats/codec.py, so the ops
and their fp64 twins read the same released bytes.

Shape legend: O out width, I in width, E experts.
"""
from __future__ import annotations

import torch

from runtime.formats.codec import fp8_block_encode, mxfp4_encode


def encode(weight: torch.Tensor, kind: str, block=None, ue8m0: bool = False):
    """(codes, scale) of weight [.., O, I] as a release stores it; ue8m0: FP8 scales as float8_e8m0fnu powers of two
    (DeepSeek-V3.2's)."""
    if kind == "mxfp4":
        return mxfp4_encode(weight)
    codes, scale = fp8_block_encode(weight, block, power_of_two=ue8m0)
    return codes, scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def stored_weight(shape, kind: str, block=None, ue8m0: bool = False, seed: int = 0):
    """A random weight of `shape` ([.., O, I], about unit-scale outputs) encoded: (codes, scale)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
    return encode(weight, kind, block, ue8m0)
