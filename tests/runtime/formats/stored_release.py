"""Stored-format releases made from a bf16 example release, for the runtime's tests until the example releases of
`onboard example-model --weights fp8|mxfp4` exist: every projection the runtime holds as a linear layer or as
routed experts (the LM head aside, as releases keep it) encoded with runtime/formats/codec.py and written under the
names releases use, with the weight map's stored steps (runtime/formats/scheme.py); and the fp64 twin of a stored
model, its weights decoded by reference_ops/formats.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from reference_ops.formats import dequantize_fp8_block, dequantize_mxfp4
from runtime.formats import codec
from runtime.formats.scheme import FP8Block, MXFP4, StoredEntry
from runtime.formats.weight import StoredWeight
from runtime.model.decoder import HybridDecoder
from runtime.model.layers.ffn import Experts
from runtime.model.weights import shard_order


def _storable(model: nn.Module, target: str | None) -> bool:
    if not target or target.startswith("lm_head"):
        return False
    module_name, _, leaf = target.rpartition(".")
    module = dict(model.named_modules()).get(module_name)
    return (type(module) is nn.Linear and leaf == "weight") or (isinstance(module, Experts) and leaf in ("w_gate_up", "w_down"))


def _names(name: str, fmt) -> tuple[str, str]:
    """(codes, scale) tensor names of logical weight `name`, as each kind of release names them."""
    if isinstance(fmt, FP8Block):
        return name, name + "_scale_inv"
    if fmt.layout == "blocks":
        return name + "_blocks", name + "_scales"
    stem = name.removesuffix(".weight")
    return stem + ".weight_packed", stem + ".weight_scale"


def _encode(value: torch.Tensor, fmt, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(fmt, FP8Block):
        codes, scale = codec.fp8_block_encode(value, fmt.block, fmt.power_of_two)
        return codes, scale.to(scale_dtype)
    packed, scales = codec.mxfp4_encode(value)
    if fmt.layout == "blocks":
        packed = packed.unflatten(-1, (-1, 16))
    return packed, scales


def write_stored_release(release: Path, spec: dict, weight_map: dict, fmt, out: Path,
                         scale_dtype: torch.dtype = torch.float32) -> dict:
    """Write the stored copy of `release` to `out`; returns its weight map."""
    with torch.device("meta"):
        model = HybridDecoder(spec)
    out.mkdir(parents=True)
    for path in Path(release).iterdir():
        if path.is_file() and not path.name.startswith("model.safetensors") and path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    tensors, new_map = {}, {}
    for file in shard_order(Path(release)):
        for name, value in load_file(Path(release) / file).items():
            entry = weight_map[name]
            if not _storable(model, entry["target"]):
                tensors[name], new_map[name] = value, entry
                continue
            # the runtime's (out, in) orientation, as stored codes are
            oriented = value.transpose(-1, -2) if entry["transpose"] else value
            codes_name, scale_name = _names(name, fmt)
            tensors[codes_name], tensors[scale_name] = _encode(oriented.contiguous(), fmt, scale_dtype)
            stored = StoredEntry(format=fmt, codes=codes_name, scale=scale_name)
            new_map[name] = entry | {"transpose": False, "stored": stored.model_dump()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    return new_map


def decoded(weight: StoredWeight) -> torch.Tensor:
    """The weight decoded in fp64 by reference_ops/formats.py from the bits the model holds."""
    if isinstance(weight.format, FP8Block):
        codes, scale = weight.codes.view(torch.float8_e4m3fn), weight.scale.view(torch.float32)
        return dequantize_fp8_block(codes, scale, weight.format.block)
    return dequantize_mxfp4(weight.codes, weight.scale)


def fp64_twin(stored_model: nn.Module, spec: dict) -> nn.Module:
    """A plain HybridDecoder in fp64 holding the stored model's weights, stored ones decoded (LoRA factors too)."""
    twin = HybridDecoder(spec, len(stored_model.layers)).double()
    holders = {n: m for n, m in stored_model.named_modules() if isinstance(m, StoredWeight)}
    own = dict(stored_model.named_parameters()) | dict(stored_model.named_buffers())
    with torch.no_grad():
        for name, t in list(twin.named_parameters()) + list(twin.named_buffers()):
            t.copy_(decoded(holders[name]) if name in holders else own[name].double())
    return twin
