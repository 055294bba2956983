"""Which runtime weights a release ships in a stored format, and the model made to hold them so.

The weight map's `stored` steps (runtime/formats/scheme.py StoredEntry) name them by runtime target. apply_stored turns
each such nn.Linear into a StoredLinear and each such stacked expert weight into a StoredWeight, before any
memory is given to them (the model built on the meta device), so no bf16 copy of a stored weight ever exists, and
runs each layer part holding one inside runtime/formats/saved.py's redecoding(): what its ops save of a decoded
weight is a way to decode it again, so only one layer's decoded weights are alive at a time.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from runtime.errors import StoredUnsupported
from runtime.formats.entry import stored_entry
from runtime.formats.linear import StoredLinear
from runtime.formats.saved import redecoding
from runtime.formats.scheme import StoredFormat
from runtime.formats.weight import StoredWeight
from runtime.model.layers.ffn import Experts
from runtime.model.own_modules import OwnModel, OwnModule

EXPERT_WEIGHTS = ("w_gate_up", "w_down")


def stored_targets(weight_map: dict[str, dict]) -> dict[str, StoredFormat]:
    """runtime target -> the format its released weight is stored in."""
    out = {}
    for entry in weight_map.values():
        stored = stored_entry(entry)
        if stored is not None and entry["target"] is not None:
            out[entry["target"]] = stored.format
    return out


def apply_stored(model: nn.Module, stored: dict[str, StoredFormat]) -> list[str]:
    """Make every target of `stored` the model has (a truncated model lacks later layers') a stored holder, in the
    dtype the model was cast to; returns the targets done. StoredUnsupported (exit 3) for a target no stored holder
    can take."""
    done = []
    modules = dict(model.named_modules())
    for target, fmt in sorted(stored.items()):
        module_name, _, leaf = target.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            continue
        if type(module) is nn.Linear and leaf == "weight":
            parent_name, _, child = module_name.rpartition(".")
            setattr(modules[parent_name] if parent_name else model, child, StoredLinear(module, fmt))
        elif isinstance(module, Experts) and leaf in EXPERT_WEIGHTS:
            current = getattr(module, leaf)
            delattr(module, leaf)
            setattr(module, leaf, StoredWeight(fmt, tuple(current.shape), current.dtype, current.device))
        else:
            raise StoredUnsupported(f"{target}: the runtime holds stored weights in linear layers and routed experts "
                                    f"only, not in {type(module).__name__}.{leaf}")
        done.append(target)
    for layer in getattr(model, "layers", []):
        for part in (layer.attn, layer.ffn):
            if part is not None and any(isinstance(m, StoredWeight) for m in part.modules()):
                part.forward = functools.partial(_redecoding_forward, part.forward)
    return done


def _redecoding_forward(forward, *args, **kwargs):
    # the part's forward itself, so that the memory policy's and any other saved-tensor hooks, which wrap it
    # later, lie outside: decoded weights are packed as recipes first, the rest passed on to them
    with redecoding():
        return forward(*args, **kwargs)


def build_stored_model(spec, stored: dict[str, StoredFormat], device, dtype: torch.dtype = torch.bfloat16,
                       num_layers: int | None = None) -> nn.Module:
    """HybridDecoder of `spec` in dtype on `device`, its stored weights as holders, every tensor allocated but not
    filled (load_release writes them all): built on the meta device, so no full-width copy of a stored weight is
    ever allocated."""
    from runtime.model.decoder import HybridDecoder

    with torch.device("meta"):
        model = HybridDecoder(spec, num_layers).to(dtype)
    if any(isinstance(m, (OwnModel, OwnModule)) for m in model.modules()):
        raise StoredUnsupported("a release with stored weights runs without transformers' own modules in this runtime")
    apply_stored(model, stored)
    return model.to_empty(device=device)
