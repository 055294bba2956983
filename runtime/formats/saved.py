"""Decoded weights that autograd saves are kept as a way to decode them again, not as tensors.

An op handed a decoded weight (the routed experts' grouped GEMMs, a fused MLP or attention reading `weight_of`)
saves it for its backward like any input; kept so, every layer's decoded weights would stay alive until the
backward reached them: a bf16 copy of the stored model. Inside `redecoding()` (runtime/model/stored.py runs each
layer part holding stored weights in it), a saved tensor that is (a view of) a weight registered by `redecodable`
is packed as its recipe and decoded again when the backward unpacks it. Every other saved tensor goes to the
saved-tensor hooks that were active outside (activation offload, checkpointing, the saved-bytes count) or is kept
as it is.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch

# one registry per active redecoding() context: storage address -> (the decoded tensor, its recipe); the
# tensor is held so its address cannot be reused by another tensor while the context lasts
_REGISTRIES: list[dict[int, tuple[torch.Tensor, Callable[[], torch.Tensor]]]] = []


@dataclass
class Redecode:
    """A saved decoded weight (or a view of it): decode again, then take the same view."""
    recipe: Callable[[], torch.Tensor]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def rebuild(self) -> torch.Tensor:
        with torch.no_grad():
            return self.recipe().as_strided(self.size, self.stride, self.offset)


@dataclass
class _Outer:
    packed: object


def redecodable(decoded: torch.Tensor, recipe: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Register `decoded` (a freshly made contiguous tensor) so that saving it keeps `recipe` instead; a no-op outside
    redecoding(). Returns `decoded`."""
    if _REGISTRIES:
        _REGISTRIES[-1][decoded.untyped_storage().data_ptr()] = (decoded, recipe)
    return decoded


def recipe_for(t: torch.Tensor) -> Redecode | None:
    """The Redecode of a registered decoded weight or view of one; None for any other tensor."""
    if not _REGISTRIES or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
        return None
    ptr = t.untyped_storage().data_ptr()
    for registry in reversed(_REGISTRIES):
        if ptr in registry and registry[ptr][0].dtype == t.dtype:
            return Redecode(registry[ptr][1], tuple(t.shape), tuple(t.stride()), t.storage_offset())
    return None


def _pack(outer, t: torch.Tensor):
    recipe = recipe_for(t)
    if recipe is not None:
        return recipe
    return _Outer(outer[0](t)) if outer else t


def _unpack(outer, packed):
    if isinstance(packed, Redecode):
        return packed.rebuild()
    return outer[1](packed.packed) if isinstance(packed, _Outer) else packed


@contextlib.contextmanager
def redecoding():
    """Within: decoded weights registered by redecodable are saved as recipes; they are released at the exit."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
    _REGISTRIES.append({})
    try:
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(_pack, outer), functools.partial(_unpack, outer)):
            yield
    finally:
        _REGISTRIES.pop()
