"""A quantized release's stored format and bytes on its spec: per tensor group, the formats it ships in and the bytes
it stores (what the memory budget and the plan count), its parameters from logical shapes (never packed bytes).

Bytes of a quantized weight are its released codes and scales (their headers' sizes when the shards are present,
else computed from the logical shape the spec gives: from the index alone the shapes are the spec's); a weight the
release keeps unquantized counts its dtype's bytes.
"""
from __future__ import annotations

import math

from onboard.recognize.param_count import tensor_categories
from onboard.release.manifest import Manifest
from onboard.release.quantization import format_label, stored_bytes
from onboard.release.safetensors_header import DTYPE_BITS
from runtime.spec import ModelSpec, StoredGroup

# how reports name an unquantized tensor's dtype (safetensors names it)
DTYPE_WORDS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64", "F8_E4M3": "fp8 e4m3", "U8": "uint8"}
CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def with_stored(spec: ModelSpec, manifest: Manifest) -> ModelSpec:
    """The spec with its release's stored format and per-group stored bytes; unchanged for an unquantized release."""
    if manifest.quantization is None:
        return spec
    groups: dict[str, tuple[set[str], int]] = {}
    for name, (category, shape) in tensor_categories(spec).items():
        label, nbytes = _stored(manifest, name, shape)
        labels, total = groups.get(category, (set(), 0))
        groups[category] = (labels | {label}, total + nbytes)
    groups["vision"] = _vision(spec, manifest)
    fmt = manifest.quantization.label
    stored = {category: StoredGroup(formats=sorted(labels, key=lambda label: (label != fmt, label)),
                                    params=getattr(spec.params, category), bytes=total)
              for category, (labels, total) in groups.items() if labels}
    return spec.model_copy(update={"stored_format": manifest.quantization.format, "stored_groups": stored})


def _stored(manifest: Manifest, name: str, shape: tuple[int, ...]) -> tuple[str, int]:
    """(format label, bytes) of one logical tensor of the spec."""
    entry = manifest.stored.get(name)
    if entry is not None:
        on_disk = manifest.stored_bytes.get(name)
        scale = manifest.released.get(entry.scale)
        scale_bytes = DTYPE_BITS[scale.dtype] // 8 if scale is not None and scale.dtype else 4
        return format_label(entry.format), on_disk if on_disk is not None else stored_bytes(entry.format, shape, scale_bytes)
    dtype = _dtype(manifest, name)
    return DTYPE_WORDS.get(dtype, dtype.lower()), math.prod(shape) * DTYPE_BITS[dtype] // 8


def _dtype(manifest: Manifest, name: str) -> str:
    info = manifest.tensors.get(name)
    if info is not None and info.dtype is not None:
        return info.dtype
    config_dtype = manifest.config.get("dtype") or manifest.config.get("torch_dtype")
    return CONFIG_DTYPES.get(config_dtype, "BF16")


def _vision(spec: ModelSpec, manifest: Manifest) -> tuple[set[str], int]:
    """The vision tower's tensors as the release stores them (counted whole, not matched by name)."""
    prefix = spec.naming.vision_prefix
    if not prefix or spec.vision is None:
        return set(), 0
    tensors = {name: info for name, info in manifest.tensors.items() if name.startswith(prefix)}
    if any(info.shape is None for info in tensors.values()):
        # the index alone: the tower's parameters at the config's dtype
        dtype = _dtype(manifest, "")
        return {DTYPE_WORDS.get(dtype, dtype.lower())}, spec.params.vision * DTYPE_BITS[dtype] // 8
    labels, total = set(), 0
    for name, info in tensors.items():
        label, nbytes = _stored(manifest, name, tuple(info.shape))
        labels.add(label)
        total += nbytes
    return labels, total


def as_bf16(spec: ModelSpec) -> ModelSpec:
    """The spec as if its release shipped bf16 (`onboard plan --weights bf16`: what the stored format saves)."""
    return spec.model_copy(update={"stored_format": None, "stored_groups": None, "dtype": "bfloat16"})
