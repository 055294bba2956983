"""Load a release's safetensors into the runtime model through weight_map.json, one tensor at a time.

Shards are memory-mapped (safe_open); each released tensor is read through get_slice, only the part
this process holds, viewed in the runtime layout and copied (with its dtype conversion) straight into
the pre-allocated runtime parameter. No tensor is held twice and the checkpoint never is.
`select` says which part of each runtime tensor this process holds (an expert range, a row range: the
per-rank slices of expert and data parallelism); every element of every runtime tensor the model has
must be written exactly once.
A weight the release stores quantized (the entry's `stored` step, runtime/formats/scheme.py) fills the runtime
model's `<target>.codes` and `<target>.scale` (runtime/formats/weight.py) from the released codes and scale
tensors, each read in its own row range (an expert range, FSDP's rows: codes and scales sliced alike, the scale
rows of FP8 blocks being block rows), as bits, never transposed and never decoded.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from runtime.errors import InputFileError
from runtime.formats.scheme import FP8Block, MXFP4
from runtime.model.own_modules import load_own_modules
from runtime.formats.entry import stored_parts

# runtime tensor name -> the region of the full tensor this process holds, as slices with explicit
# start and stop over its leading dims (the model's tensor has that region's shape), or None for all of it
Select = Callable[[str], tuple[slice, ...] | None]


def shard_order(model_dir: Path) -> dict[str, list[str]]:
    """shard file -> released tensor names in it."""
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        with safe_open(model_dir / "model.safetensors", "pt") as f:
            return {"model.safetensors": list(f.keys())}
    by_file: dict[str, list[str]] = {}
    for name, file in json.loads(index.read_text())["weight_map"].items():
        by_file.setdefault(file, []).append(name)
    return by_file


def _region(entry: dict, value_shape: list[int]) -> tuple[list[int], list[int]]:
    """(start, stop) per dim of the full runtime tensor that the entry's value fills, in the runtime
    layout (the value after transpose), the expert dim first when the entry writes one expert."""
    shape = list(value_shape)
    if entry["transpose"]:
        shape[-2], shape[-1] = shape[-1], shape[-2]
    starts, stops = [0] * len(shape), list(shape)
    if entry["rows"] is not None:
        starts[0], stops[0] = entry["rows"]
    if entry["expert"] is not None:
        starts, stops = [entry["expert"], *starts], [entry["expert"] + 1, *stops]
    return starts, stops


def _plan(entry: dict, value_shape: list[int], held: tuple[slice, ...] | None):
    """-> (slices of the released tensor to read, slices of the local runtime tensor to write), or None
    when this process holds none of it."""
    starts, stops = _region(entry, value_shape)
    held = held or ()
    read, write = [], []
    for dim, (a, b) in enumerate(zip(starts, stops)):
        lo, hi = (held[dim].start, held[dim].stop) if dim < len(held) else (a, b)
        offset = lo if dim < len(held) else 0
        s, e = max(a, lo), min(b, hi)
        if s >= e:
            return None
        write.append(slice(s - offset, e - offset))
        read.append(slice(s - a, e - a))
    if entry["expert"] is not None:
        read = read[1:]
    if entry["transpose"]:
        read[-2], read[-1] = read[-1], read[-2]
    return tuple(read), tuple(write)


def _copy_entry(shard, name: str, entry: dict, tensors: dict, select: Select | None, file: Path) -> int:
    """Copy the held part of one released tensor into its runtime tensor; returns elements written."""
    target = tensors[entry["target"]]
    part = shard.get_slice(name)
    if entry["flatten"]:
        held = select(entry["target"]) if select is not None else None
        # a sharded model holds such tensors (buffers, e.g. a router's correction bias) whole on every rank
        if held is not None and (held[0].start, held[0].stop) != (0, target.shape[0]):
            raise ValueError(f"{name}: a flattened tensor cannot be loaded in slices")
        target.copy_(part[:].reshape(-1))
        _require_finite(target, file, name)
        return target.numel()
    plan = _plan(entry, part.get_shape(), select(entry["target"]) if select else None)
    if plan is None:
        return 0
    read, write = plan
    value = part[read]
    slot = target[write]
    # a one-expert entry's value lacks the expert dim of its slot: copy_ broadcasts over it
    slot.copy_(value.transpose(-1, -2) if entry["transpose"] else value)
    _require_finite(slot, file, name)
    return slot.numel()


def _require_finite(loaded: torch.Tensor, file: Path, name: str) -> None:
    """A base weight that is NaN or infinite trains nothing but NaN: the release is refused, naming the tensor."""
    if loaded.is_floating_point() and not bool(torch.isfinite(loaded).all()):
        raise InputFileError(file, name, "holds non-finite values (NaN or infinity): a released weight must be finite")


def _stored_roles(weight_map: dict[str, dict]) -> dict[str, dict]:
    """released codes or scale tensor name -> its entry (runtime/model/stored.py stored_parts)."""
    roles = {}
    for entry in weight_map.values():
        if entry.get("stored") is not None and entry["target"] is not None:
            roles |= dict(stored_parts(entry))
    return roles


def _stored_bits(value: torch.Tensor, fmt: FP8Block | MXFP4, role: str, file: Path, name: str) -> torch.Tensor:
    """A released codes or scale value as the bits the runtime holds (runtime/formats/weight.py SCALE_HOLDER)."""
    fp8 = isinstance(fmt, FP8Block)
    if role == "codes":
        want = torch.float8_e4m3fn if fp8 else torch.uint8
        if value.dtype != want:
            raise InputFileError(file, name, f"is {value.dtype}; {fmt.kind} codes are {want}")
        return value.view(torch.uint8)
    if fp8:
        return value.to(torch.float32).view(torch.int32)
    if value.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise InputFileError(file, name, f"is {value.dtype}; MXFP4 scales are uint8 or float8_e8m0fnu E8M0 exponents")
    return value.view(torch.uint8)


def _require_valid_stored(bits: torch.Tensor, fmt: FP8Block | MXFP4, role: str, file: Path, name: str) -> None:
    """NaN codes (e4m3 0x7F / 0xFF), non-finite FP8 scales and E8M0's NaN byte 255 are refused, naming the tensor."""
    if isinstance(fmt, FP8Block) and role == "codes":
        bad, what = (bits & 0x7F) == 0x7F, "NaN codes (float8_e4m3fn 0x7F / 0xFF)"
    elif isinstance(fmt, FP8Block):
        bad, what = ~torch.isfinite(bits.view(torch.float32)), "non-finite scales (NaN or infinity)"
    elif role == "scale":
        bad, what = bits == 255, "the E8M0 NaN scale (byte 255)"
    else:
        return
    if bool(bad.any()):
        raise InputFileError(file, name, f"holds {what}: a released weight must decode to finite values")


def _copy_stored(shard, name: str, entry: dict, tensors: dict, select: Select | None, file: Path) -> int:
    """Copy the held part of a released codes or scale tensor into `<target>.codes` / `<target>.scale`."""
    target, role = entry["target"], entry["role"]
    if target not in tensors:
        return 0
    fmt = entry["stored"].format
    part = shard.get_slice(name)
    shape = list(part.get_shape())
    # gpt-oss's blocks [.., O, G, 16] are the packed codes [.., O, I/2] with the last two dims apart
    collapsed = role == "codes" and isinstance(fmt, MXFP4) and fmt.layout == "blocks"
    value_shape = shape[:-2] + [shape[-2] * shape[-1]] if collapsed else shape
    plan = _plan(entry | {"transpose": False}, value_shape, select(target) if select else None)
    if plan is None:
        return 0
    read, write = plan
    slot = tensors[target][write]
    value = part[read[:-1] if collapsed else read]
    slot.copy_(_stored_bits(value, fmt, role, file, name).reshape(slot.shape))
    _require_valid_stored(slot, fmt, role, file, name)
    return slot.numel()


def load_release(model: nn.Module, model_dir: Path, weight_map: dict[str, dict], skip_prefixes=(),
                 select: Select | None = None, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Copy every mapped tensor of MODEL_DIR (the part `select` assigns) into `model`; raise if anything
    is unmapped or a runtime tensor is not fully written. tensors: name -> the tensor to write (default
    the model's own; a sharded model passes its local shards)."""
    if tensors is None:
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    written: dict[str, int] = {}
    roles = _stored_roles(weight_map)
    with torch.no_grad():
        for file, names in shard_order(Path(model_dir)).items():
            with safe_open(Path(model_dir) / file, "pt") as shard:
                for name in names:
                    if name.startswith(tuple(skip_prefixes)):
                        continue
                    if name in roles:
                        count = _copy_stored(shard, name, roles[name], tensors, select, Path(model_dir) / file)
                        written[roles[name]["target"]] = written.get(roles[name]["target"], 0) + count
                        continue
                    entry = weight_map.get(name)
                    if entry is None:
                        raise KeyError(f"{file}: tensor {name} has no entry in the weight map")
                    if entry["target"] not in tensors:
                        continue  # layers cut off by a truncated model, or tensors this rank does not hold, or an own module's tensor
                    count = _copy_entry(shard, name, entry, tensors, select, Path(model_dir) / file)
                    written[entry["target"]] = written.get(entry["target"], 0) + count
    unwritten = [n for n, t in tensors.items() if written.get(n, 0) != t.numel()]
    if unwritten:
        raise KeyError(f"runtime tensors not (fully) written by the release: {unwritten[:5]}")
    # parts run as the model's own modules: transformers loads the release into them by name
    load_own_modules(model, Path(model_dir))
