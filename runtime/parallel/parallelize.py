"""parallelize(model, mesh, plan): the single-device model made distributed from outside, in one fixed order.

1. expert parallelism (runtime/parallel/expert_parallel.py): each MoE layer keeps its E/ep experts and
   dispatches tokens to the others' with all_to_all;
2. the memory policy (runtime/memory.py): recompute / offload per op kind;
3. FSDP2 fully_shard: each MoE layer's experts over the dp_shard dim (the ranks sharing one EP rank's
   experts), each decoder layer and then the root over the whole mesh flattened (placement.py's rules),
   each layer prefetching the next one's gathers.
Gradients are summed, never averaged, over ranks: the trainer already divides the loss by the trained
tokens of all ranks, and expert and dense gradients reduce over groups of different sizes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

from runtime.model.layers.ffn import MoE
from runtime.memory import MemoryPolicy, apply_memory_policy
from runtime.parallel.expert_parallel import apply_expert_parallel
from runtime.parallel.placement import MeshShape, check_mesh

MESH_DIMS = ("dp_shard", "ep")


@dataclass(frozen=True)
class ParallelConfig:
    """How the runtime parallelizes one job (onboard's ParallelPlan is the search that chooses its mesh)."""

    mesh: MeshShape
    memory: MemoryPolicy = field(default_factory=MemoryPolicy)
    # tokens per expert per rank at most capacity_factor * (pairs / experts); None: dropless
    capacity_factor: float | None = None


def device_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    """The dp_shard x ep mesh over the initialized process group (ep innermost, as placement.py numbers ranks)."""
    return init_device_mesh(device_type, (shape.dp_shard, shape.ep), mesh_dim_names=MESH_DIMS)


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: ParallelConfig) -> nn.Module:
    """EP, then the memory policy, then FSDP2, applied in place to `model` (on the meta device or real)."""
    check_mesh(model.config, plan.mesh)
    apply_expert_parallel(model, mesh["ep"], plan.capacity_factor)
    apply_memory_policy(model, plan.memory)
    apply_fsdp(model, mesh)
    return model


def apply_fsdp(model: nn.Module, mesh: DeviceMesh) -> None:
    world = mesh._flatten("world")
    for layer in model.layers:
        if isinstance(layer.ffn, MoE):
            fully_shard(layer.ffn.experts, mesh=mesh["dp_shard"])
        fully_shard(layer, mesh=world)
    # the trainer reads the LM head's weight outside any forward (chunked loss): the root's parameters
    # stay gathered from its forward to the end of backward
    fully_shard(model, mesh=world, reshard_after_forward=False)
    register_fsdp_forward_method(model, "hidden_states")
    _prefetch_one_layer_ahead(list(model.layers))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # a plain SUM reduce (no pre-multiplied sum, which gloo lacks); dividing by 1.0 after it is exact
            module.set_force_sum_reduction_for_comms(True)


def _prefetch_one_layer_ahead(layers: list[nn.Module]) -> None:
    """Each layer's forward gathers the next layer's weights (its experts too) and each backward the previous
    one's: explicit, since the dispatch's host sync for split sizes stalls FSDP's implicit prefetch (torchtitan)."""
    def units(layer):
        return [layer] + ([layer.ffn.experts] if isinstance(layer.ffn, MoE) else [])

    for before, after in zip(layers, layers[1:]):
        before.set_modules_to_forward_prefetch(units(after))
        after.set_modules_to_backward_prefetch(units(before))


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writes land in the parameter); other tensors as they are."""
    return t.to_local() if hasattr(t, "to_local") else t
