"""Load a release's safetensors into the runtime model through weight_map.json, one shard at a time.

Each tensor is read, transformed and copied into its (pre-allocated) runtime parameter, then
dropped: the checkpoint is never held twice. Every runtime parameter must be written exactly once.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from runtime.own_modules import load_own_modules


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


def _slot(tensors: dict[str, torch.Tensor], entry: dict) -> torch.Tensor:
    """The view of the runtime tensor this entry writes."""
    target = tensors[entry["target"]]
    if entry["expert"] is not None:
        target = target[entry["expert"]]
    if entry["rows"] is not None:
        target = target[entry["rows"][0]: entry["rows"][1]]
    return target


def _transformed(value: torch.Tensor, entry: dict) -> torch.Tensor:
    if entry["transpose"]:
        value = value.transpose(-1, -2)
    if entry["flatten"]:
        value = value.reshape(-1)
    return value


def load_release(model: nn.Module, model_dir: Path, weight_map: dict[str, dict], skip_prefixes=()) -> None:
    """Copy every mapped tensor of MODEL_DIR into `model`; raise if anything is missing or unmapped."""
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
                        continue  # layers cut off by a truncated model, or an own module's tensor
                    slot = _slot(tensors, entry)
                    slot.copy_(_transformed(shard.get_tensor(name), entry).to(slot.dtype))
                    written[entry["target"]] = written.get(entry["target"], 0) + slot.numel()
    unwritten = [n for n, t in tensors.items() if written.get(n, 0) != t.numel()]
    if unwritten:
        raise KeyError(f"runtime tensors not (fully) written by the release: {unwritten[:5]}")
    # parts run as the model's own modules: transformers loads the release into them by name
    load_own_modules(model, Path(model_dir))
