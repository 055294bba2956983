"""The reference's weights for a release that stores them quantized (FP8 block-scaled, MXFP4): each stored weight
decoded in fp64 by reference_ops/formats.py with the block size quantization_config states, cast to the dtype the
tier runs in, under its logical name and in the orientation a bf16 release of the family stores it; transformers'
class is then built from the config without its quantization_config (so no quantizer runs) and loaded with them.

transformers' own dequantization is not the truth here: its CPU FP8 path takes the block size from the scale grid
(rows // scale rows), which raises on DeepSeek-V3's 576-row kv_a_proj_with_mqa (5 scale rows) and decodes a 192-row
weight (2 scale rows) with 96-row blocks; its MXFP4 path wants kernels from a hub unless told to dequantize.
Shape legend: O rows (out width), I columns (in width), G groups of 32 columns; leading dims (experts) pass through.
"""
from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors import safe_open

from reference_ops.formats import MXFP4_GROUP, dequantize_fp8_block, dequantize_mxfp4
from runtime.formats.scheme import FP8Block, StoredEntry

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor name belongs to (None for embeddings, the final norm, the head)."""
    m = LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def decode(entry: StoredEntry, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The stored weight in fp64, [.., O, I] as the codes are laid out."""
    fmt = entry.format
    if isinstance(fmt, FP8Block):
        return dequantize_fp8_block(codes, scale, fmt.block)
    if fmt.layout == "blocks":
        # gpt-oss: [.., O, G, 16] bytes, 16 bytes holding one group of 32 codes
        codes = codes.flatten(-2)
    if scale.dtype == torch.float8_e8m0fnu:
        # E8M0 is the byte itself (the float8_e8m0fnu dtype's values would be the powers of two)
        scale = scale.view(torch.uint8)
    if codes.shape[-1] * 2 != scale.shape[-1] * MXFP4_GROUP:
        raise ValueError(f"{entry.codes}: {tuple(codes.shape)} bytes do not hold the {tuple(scale.shape)} groups of "
                         f"{entry.scale}")
    return dequantize_mxfp4(codes, scale)


def logical(entry: StoredEntry, decoded_OI: torch.Tensor, shape: tuple[int, ...] | None) -> torch.Tensor:
    """The decoded weight as the family's bf16 release stores it: gpt-oss's experts ("blocks" layout) are stored
    [E, in, out] in bf16 although their blocks are [E, out, in] (transformers' own MXFP4 dequantization transposes
    them alike); every other stored weight keeps the codes' orientation. Decided by the layout, never by the shape:
    a square weight would fit either way."""
    value = decoded_OI.transpose(-1, -2) if entry.format.kind == "mxfp4" and entry.format.layout == "blocks" \
        else decoded_OI
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{entry.codes} decodes to {tuple(value.shape)}, not the logical shape {tuple(shape)}")
    return value


class ReleaseReader:
    """Reads a release's tensors by their released names, each shard opened once, closed with the `with` block."""

    def __init__(self, source: Path):
        from runtime.model.weights import shard_order

        self.source = Path(source)
        self.files = {n: f for f, names in shard_order(self.source).items() for n in names}
        self._stack, self._handles = ExitStack(), {}

    def __enter__(self) -> "ReleaseReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _slice(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(self.source / file, "pt"))
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> list[int]:
        return self._slice(name).get_shape()

    def read(self, name: str, experts: int | None = None) -> torch.Tensor:
        """The whole tensor, or its first `experts` entries along the leading dim."""
        part = self._slice(name)
        return part[:experts] if experts is not None else part[:]

    def decoded(self, entry: StoredEntry) -> torch.Tensor:
        """A stored weight decoded in fp64, [.., O, I] as its codes are laid out."""
        return decode(entry, self.read(entry.codes), self.read(entry.scale))


def in_prefix(name: str, num_layers: int | None) -> bool:
    """Whether an aligned prefix of num_layers decoder layers (None: all) holds the tensor."""
    layer = layer_of(name)
    return num_layers is None or layer is None or layer < num_layers


def reference_state_dict(manifest, dtype: torch.dtype, num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the release (a Manifest of onboard/release) by its logical name, in `dtype`: the stored weights
    decoded (fp64, then cast) and checked against their logical shapes, the rest as released; the scale tensors
    hidden; tensors of decoder layers past num_layers left out (an aligned prefix reads no more)."""
    stored = manifest.stored
    hidden = set(manifest.quantization.hidden) if manifest.quantization else set()
    out = {}
    with ReleaseReader(manifest.root) as release:
        plain = [n for n in release.files if n not in hidden]
        for name in [n for n in [*stored, *plain] if in_prefix(n, num_layers)]:
            if name in stored:
                shape = manifest.tensors[name].shape if name in manifest.tensors else None
                value = logical(stored[name], release.decoded(stored[name]), shape)
            else:
                value = release.read(name)
            out[name] = value.to(dtype) if value.is_floating_point() else value
    return out


def _parts(config) -> list:
    """The config and its text part (once when they are one object)."""
    return list({id(c): c for c in (config, config.get_text_config())}.values())


def quantized(config) -> bool:
    """Whether the release's config (or its text part) states a quantization_config."""
    return any(getattr(part, "quantization_config", None) is not None for part in _parts(config))


def without_quantizer(config) -> None:
    """Drop quantization_config from a transformers config (and its text part), in place: the model is then built
    with plain linears and experts, to be loaded with decoded weights."""
    for part in _parts(config):
        if hasattr(part, "quantization_config"):
            delattr(part, "quantization_config")


def scales_read(weight_map: Mapping[str, dict], layers: Iterable[int], outside: bool = False) -> list[str]:
    """The released scale tensors of the stored weights in `layers` (and, with `outside`, of those in no layer: an
    embedding or head), as the weight map (what the runtime loader reads) pairs them, expert numbers folded."""
    keep = set(layers)
    names = []
    for name, entry in weight_map.items():
        step = entry.get("stored")
        layer = layer_of(name)
        if step and (layer in keep or (outside and layer is None)):
            names.append(step["scale"])
    return fold_experts(names)


EXPERT_RE = re.compile(r"(?<=\.experts\.)(\d+)(?=\.)")


def fold_experts(names: Iterable[str]) -> list[str]:
    """Names that differ only in their expert number, as one: `layers.1.mlp.experts.{0..7}.down_proj.weight_scale_inv`
    (a DeepSeek-V3 layer has 768 expert scale tensors), naturally sorted."""
    groups: dict[str, list[int]] = {}
    for name in names:
        m = EXPERT_RE.search(name)
        key = EXPERT_RE.sub("{}", name, count=1) if m else name
        groups.setdefault(key, []).append(int(m.group(1)) if m else -1)
    out = []
    for key, experts in groups.items():
        out.append(key.replace("{}", "{" + _ranges(sorted(set(experts))) + "}") if "{}" in key else key)
    return sorted(out, key=_natural)


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0..2,5"."""
    runs, start = [], numbers[0]
    for prev, cur in zip(numbers, numbers[1:] + [None]):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}..{prev}")
            start = cur
    return ",".join(runs)


def _natural(name: str) -> list:
    """Sort key ordering layers by number (layers.2 before layers.10)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]
