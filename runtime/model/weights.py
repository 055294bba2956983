"""Load a release's safetensors into the runtime model through weight_map.json, one tensor at a time.

Shards are memory-mapped (safe_open); each released tensor is read through get_slice, only the part
this process holds, viewed in the runtime layout and copied (with its dtype conversion) straight into
the pre-allocated runtime parameter. No tensor is held twice and the checkpoint never is.
`select` says which part of each runtime tensor this process holds (an expert range, a row range: the
per-rank slices of expert and data parallelism); every element of every runtime tensor the model has
must be written exactly once.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from runtime.errors import InputFileError
from runtime.model.own_modules import load_own_modules

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


def load_release(model: nn.Module, model_dir: Path, weight_map: dict[str, dict], skip_prefixes=(),
                 select: Select | None = None, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Copy every mapped tensor of MODEL_DIR (the part `select` assigns) into `model`; raise if anything
    is unmapped or a runtime tensor is not fully written. tensors: name -> the tensor to write (default
    the model's own; a sharded model passes its local shards)."""
    if tensors is None:
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    written: dict[str, int] = {}
    with torch.no_grad():
        for file, names in shard_order(Path(model_dir)).items():
            with safe_open(Path(model_dir) / file, "pt") as shard:
                for name in names:
                    if name.startswith(tuple(skip_prefixes)):
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
