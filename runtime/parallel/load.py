"""A sharded runtime model: built on the meta device, parallelized, then each rank fills only its slices.

No rank ever holds the whole model: the parameters exist as shapes until parallelize() has cut them,
then each rank allocates its own shards, reads from the release exactly the rows placement.py assigns
it (safetensors get_slice), and writes its slice of every LoRA factor's starting value.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from runtime.lora.factors import LoraConfig, apply_lora, initial_value, is_lora_name
from runtime.model.decoder import HybridDecoder
from runtime.model.stored import apply_stored, stored_targets
from runtime.parallel.parallelize import ParallelConfig, local_part, parallelize
from runtime.parallel.placement import moe_layers, rows_held
from runtime.spec import ModelSpec
from runtime.model.weights import load_release


def build_sharded_model(spec: ModelSpec | dict, weight_map: dict, release: Path, lora_config: LoraConfig, plan: ParallelConfig,
                        mesh, rank: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                        skip_prefixes=(), num_layers: int | None = None) -> nn.Module:
    """The model of `spec` (a ModelSpec or spec.json's data) with LoRA, parallelized by `plan` over `mesh`, holding only rank `rank`'s slices."""
    with torch.device("meta"):
        model = HybridDecoder(spec, num_layers).to(dtype)
        # weights the release stores quantized are held so (codes + scales, sharded alike), before any is allocated
        apply_stored(model, stored_targets(weight_map))
        apply_lora(model, lora_config)
    parallelize(model, mesh, plan)
    model.to_empty(device=device)
    rows = _held_rows(model, plan, rank)
    local = {name: local_part(t) for name, t in _tensors(model).items()}
    load_release(model, release, weight_map, skip_prefixes, select=lambda name: (slice(*rows[name]),),
                 tensors={n: t for n, t in local.items() if not is_lora_name(n)})
    with torch.no_grad():
        for name, t in local.items():
            if is_lora_name(name):
                lo, hi = rows[name]
                t.copy_(initial_value(name, tuple(_tensors(model)[name].shape), lora_config)[lo:hi])
    return model


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


def _held_rows(model: nn.Module, plan: ParallelConfig, rank: int) -> dict[str, tuple[int, int]]:
    """name -> rows placement.py assigns this rank; checked against the shard FSDP actually gave it."""
    num_experts = moe_layers(model.config)
    buffers = dict(model.named_buffers())
    rows = {}
    for name, t in _tensors(model).items():
        rows[name] = rows_held(name, tuple(t.shape), name in buffers, num_experts, plan.mesh, rank)
        held = local_part(t).shape[0] if t.dim() else 1
        if held != rows[name][1] - rows[name][0]:
            raise RuntimeError(f"{name}: FSDP gave rank {rank} {held} rows, placement says {rows[name]}")
    return rows
