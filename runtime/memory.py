"""Memory policy, applied from outside the model: selective recompute and CPU offload by op kind.

Op kinds: "attention" (softmax, MLA, DSA), "linear_attention" (gated delta, KDA, lightning), "moe",
"mlp"; a layer's own attention kind ("gated_delta", "mla", ...) selects that kind alone. A module
chosen for recompute keeps only its inputs and runs its forward again in backward; one chosen for
offload moves what autograd saves to pinned host memory on a side stream and back when backward
needs it. Module names and numerics are unchanged (the forward is wrapped, not the module).
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.spec import LayerSpec

LINEAR_ATTENTION = ("gated_delta", "kda", "lightning")
OP_KINDS = ("attention", "linear_attention", "moe", "mlp")
# smaller saved tensors are not worth a copy
OFFLOAD_MIN_BYTES = 1 << 16


ATTENTION_KINDS = ("softmax", "mla") + LINEAR_ATTENTION


@dataclass(frozen=True)
class MemoryPolicy:
    recompute: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = sorted(set(self.recompute + self.offload) - set(OP_KINDS + ATTENTION_KINDS))
        if unknown:
            raise ValueError(f"memory policy: unknown op kinds {unknown}; known: {', '.join(OP_KINDS + ATTENTION_KINDS)}")


def _kinds(layer: LayerSpec, part: str) -> set[str]:
    """The names a policy entry may use for this layer's attention or FFN."""
    if part == "ffn":
        return {"moe"} if layer.ffn.kind == "moe" else {"mlp"}
    kind = layer.attention.kind
    return {kind, "linear_attention" if kind in LINEAR_ATTENTION else "attention"}


def _parts(layer: nn.Module, config: LayerSpec) -> list[tuple[str, nn.Module, set[str]]]:
    """(name, module, kinds) of the layer's wrappable parts; an own layer is one part, named by all its kinds."""
    if layer.own is not None:
        return [("own", layer.own, _kinds(config, "attn") | _kinds(config, "ffn"))]
    return [(part, getattr(layer, part), _kinds(config, part)) for part in ("attn", "ffn")]


def apply_memory_policy(model: nn.Module, policy: MemoryPolicy) -> list[str]:
    """Wrap the forward of every layer part the policy names; returns 'name: recompute|offload' lines."""
    offload = CpuOffload() if policy.offload else None
    applied = []
    for i, layer in enumerate(model.layers):
        for part, module, kinds in _parts(layer, model.config.layers[i]):
            if kinds & set(policy.recompute):
                module.forward = functools.partial(_recomputed, module.forward)
                applied.append(f"layers.{i}.{part}: recompute")
            elif offload is not None and kinds & set(policy.offload):
                module.forward = functools.partial(_offloaded, offload, module.forward)
                applied.append(f"layers.{i}.{part}: offload")
    # offload's pinned buffers live for one step only, so a captured step (runtime/train/step_graph.py) may not hold them
    model.offloads_activations = offload is not None and any(line.endswith("offload") for line in applied)
    return applied


def _recomputed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _offloaded(offload: "CpuOffload", forward, *args, **kwargs):
    with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack):
        return forward(*args, **kwargs)


class CpuOffload:
    """saved_tensors_hooks moving saved CUDA activations to pinned host buffers on a side stream."""

    def __init__(self):
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        if self.stream is None:
            warnings.warn("activation offload: no CUDA device, activations already live in host memory (no-op)")

    def pack(self, t: torch.Tensor):
        # parameters, and views of them (a stored weight's codes seen in their release dtype), are saved by
        # reference and stay where they are
        if t.device.type != "cuda" or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        if t.numel() * t.element_size() < OFFLOAD_MIN_BYTES:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        # the device copy may be freed only once the side stream has read it
        t.record_stream(self.stream)
        return (t.device, host, done)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, done = packed
        torch.cuda.current_stream(device).wait_event(done)
        return host.to(device, non_blocking=True)
