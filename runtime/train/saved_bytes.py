"""What autograd keeps for backward, by layer part: the measurement onboard/gap/budget.py's activation terms follow.

Two ways a forward keeps tensors for its backward: through save_for_backward (seen by saved_tensors_hooks) and
as attributes of a custom Function's ctx (the chunked linear-attention kernels keep their tiles on ctx.kept);
both are counted, each storage once, parameters (counted as weights) never. A part is a layer's `attn` or
`ffn`; what is kept outside them (the norms) counts under "other". Storage sizes, so views count whole.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn


class SavedBytes:
    """bytes: kept per part name ("0.attn", "0.ffn", ..., "other"), each storage counted once, by the first."""

    def __init__(self, model: nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}
        self.current = "other"

    def keep(self, tensor: torch.Tensor, part: str | None = None) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.params | self.seen:
            self.seen.add(storage.data_ptr())
            part = part or self.current
            self.bytes[part] = self.bytes.get(part, 0) + storage.nbytes()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.keep(tensor)
        return tensor


def _tensors(value):
    """Tensors inside a ctx attribute (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _count_ctx(counter: SavedBytes, output: torch.Tensor, part: str) -> None:
    """Tensors the custom Functions of this part's graph hold on their ctx (up to the part's input)."""
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for value in getattr(node, "__dict__", {}).values():
            for t in _tensors(value):
                counter.keep(t, part)
        stack.extend(fn for fn, _ in node.next_functions)


def _counted(counter: SavedBytes, part: str, forward, *args, **kwargs):
    counter.current = part
    out = forward(*args, **kwargs)
    counter.current = "other"
    if isinstance(out, torch.Tensor) and out.grad_fn is not None:
        _count_ctx(counter, out, part)
    return out


@contextlib.contextmanager
def counting(model: nn.Module):
    """Inside, a forward of `model` (a runtime HybridDecoder) records what it keeps into the SavedBytes yielded.
    Ctx-held tensors are attributed to the first part whose graph reaches them (later layers' graphs reach
    earlier ones, but storages counted once stay with the earliest part)."""
    counter = SavedBytes(model)
    originals = []
    for i, layer in enumerate(model.layers):
        for part in ("attn", "ffn"):
            module = getattr(layer, part)
            originals.append((module, module.forward))
            module.forward = functools.partial(_counted, counter, f"{i}.{part}", module.forward)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            yield counter
    finally:
        for module, forward in originals:
            module.forward = forward
