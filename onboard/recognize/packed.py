"""Parameters of tensors stored packed: compressed-tensors' 4-bit packs hold two values per byte (`weight_packed`,
uint8 [out, in/2]) and their scales (`weight_scale`, uint8 E8M0 per group) are no parameters. Counts of a release
with packed weights count the values, never the bytes."""
from __future__ import annotations

from math import prod

PACKED_SUFFIX = "weight_packed"  # two 4-bit values per byte (mxfp4-pack-quantized, nvfp4-pack-quantized)
SCALE_SUFFIXES = ("weight_scale", "weight_global_scale")


def tensor_params(name: str, shape) -> int:
    """The parameters a released tensor holds (its shape as stored)."""
    if name.endswith(SCALE_SUFFIXES):
        return 0
    return prod(shape) * (2 if name.endswith(PACKED_SUFFIX) else 1)


def stored_params(manifest) -> int:
    """The release's parameters from its headers' shapes (packed values counted, scales not); the manifest's own
    count where only the index is present."""
    if not manifest.shards_present:
        return manifest.total_params
    return sum(tensor_params(name, info.shape) for name, info in manifest.tensors.items())
