"""Which rank owns which experts and loads which slice of every released tensor, for a dp_shard x ep mesh.

Pure functions of the mesh shape, the model config and the weight map (no processes, no torch.distributed),
shared by the distributed runtime (which builds the mesh and loads from these answers) and by planning.
Rank layout: rank = dp * ep_size + ep (ep innermost, so an EP group is consecutive ranks on few nodes).
- Routed experts: statically E/ep per EP rank (EP rank j owns experts [j*E/ep, (j+1)*E/ep)); the owner's
  local stack [E/ep, ...] is FSDP-sharded on dim 0 over its dp_shard group: one rank per expert.
- Every other parameter: fully_shard over the whole mesh flattened (dp_shard x ep, as torchtitan shards
  dense weights over all data-parallel ranks), dim 0 in torch.chunk pieces padded to ceil(n / world).
- Buffers (e.g. a router's correction bias): FSDP leaves them whole on every rank.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from runtime.formats.entry import stored_parts
from runtime.spec import ModelSpec

EXPERT_TARGET = re.compile(r"^layers\.(\d+)\.ffn\.experts\.")


class PlacementError(ValueError):
    """The mesh cannot hold the model as asked (e.g. experts not divisible by ep)."""


@dataclass(frozen=True)
class MeshShape:
    dp_shard: int  # FSDP degree of the experts (ranks sharing one EP rank's experts)
    ep: int  # expert-parallel degree (ranks the routed experts are spread over)

    @property
    def world(self) -> int:
        return self.dp_shard * self.ep

    def rank(self, dp: int, ep: int) -> int:
        return dp * self.ep + ep

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp index, ep index) of a rank."""
        return divmod(rank, self.ep)

    def ep_group(self, rank: int) -> list[int]:
        """The ranks experts are dispatched over (same dp index)."""
        dp, _ = self.coords(rank)
        return [self.rank(dp, j) for j in range(self.ep)]

    def dp_group(self, rank: int) -> list[int]:
        """The ranks sharing one EP rank's experts (same ep index)."""
        _, ep = self.coords(rank)
        return [self.rank(i, ep) for i in range(self.dp_shard)]

    def __str__(self) -> str:
        return f"dp{self.dp_shard}xep{self.ep}"


@dataclass(frozen=True)
class Load:
    """One released tensor (or a dim-0 slice of it) that one rank reads."""
    name: str  # released tensor
    target: str  # runtime tensor it lands in
    rows: tuple[int, int]  # the runtime tensor's dim-0 rows it fills on this rank (global indices)
    whole: bool  # read whole; otherwise rows of it (after the entry's transpose/flatten, which keep dim 0's role)


def experts_per_rank(num_experts: int, ep: int) -> int:
    if num_experts % ep:
        raise PlacementError(f"{num_experts} routed experts cannot be split evenly over ep={ep} ranks")
    return num_experts // ep


def fsdp_rows(num_rows: int, group_size: int, index: int) -> tuple[int, int]:
    """Dim-0 rows member `index` of a group holds, as fully_shard chunks them (torch.chunk: ceil-sized
    pieces, so trailing members may hold fewer rows or none; their shards are padded)."""
    size = math.ceil(num_rows / group_size)
    return min(index * size, num_rows), min((index + 1) * size, num_rows)


def padded_rows(num_rows: int, group_size: int) -> int:
    """Rows of every member's (padded) shard."""
    return math.ceil(num_rows / group_size)


def owned_experts(num_experts: int, mesh: MeshShape, rank: int) -> tuple[int, int]:
    """[first, last) of the experts whose weights this rank holds (its dp slice of its EP rank's stack)."""
    per_rank = experts_per_rank(num_experts, mesh.ep)
    dp, ep = mesh.coords(rank)
    lo, hi = fsdp_rows(per_rank, mesh.dp_shard, dp)
    return ep * per_rank + lo, ep * per_rank + hi


def expert_owner_ep(num_experts: int, ep: int, expert: int) -> int:
    """The EP rank whose experts include `expert`."""
    return expert // experts_per_rank(num_experts, ep)


def moe_layers(config: ModelSpec) -> dict[int, int]:
    """MoE layer index -> routed experts."""
    return {i: layer.ffn.num_experts for i, layer in enumerate(config.layers) if layer.ffn.kind == "moe"}


def check_mesh(config: ModelSpec, mesh: MeshShape) -> None:
    """PlacementError unless every MoE layer's experts split evenly over ep (ep 1 for a dense model)."""
    if mesh.dp_shard < 1 or mesh.ep < 1:
        raise PlacementError(f"mesh {mesh} needs positive dp_shard and ep")
    experts = set(moe_layers(config).values())
    if not experts and mesh.ep > 1:
        raise PlacementError(f"ep={mesh.ep} needs routed experts; the model has none")
    for num_experts in sorted(experts):
        experts_per_rank(num_experts, mesh.ep)


def model_targets(model) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Runtime tensor name -> (shape, is_buffer) of a model (built on the meta device: no memory)."""
    params = {n: (tuple(p.shape), False) for n, p in model.named_parameters()}
    return params | {n: (tuple(b.shape), True) for n, b in model.named_buffers()}


def holders(entry: dict, shape: tuple[int, ...], is_buffer: bool, num_experts: dict[int, int],
            mesh: MeshShape) -> list[tuple[int, tuple[int, int], bool]]:
    """(rank, dim-0 rows of the runtime tensor, whole) for every rank that reads this weight-map entry."""
    num_rows = shape[0] if shape else 1
    if is_buffer:
        return [(rank, (0, num_rows), True) for rank in range(mesh.world)]
    m = EXPERT_TARGET.match(entry["target"])
    if m and entry["expert"] is not None:
        return [(_expert_holder(num_experts[int(m.group(1))], mesh, entry["expert"]), (entry["expert"], entry["expert"] + 1), True)]
    # a fused expert tensor (gpt-oss [E, ...]): each rank reads its experts' rows of it
    spans = [rows_held(entry["target"], shape, False, num_experts, mesh, rank) for rank in range(mesh.world)]
    return [(rank, rows, rows == (0, num_rows)) for rank, rows in enumerate(spans) if rows[1] > rows[0]]


def rows_held(target: str, shape: tuple[int, ...], is_buffer: bool, num_experts: dict[int, int], mesh: MeshShape,
              rank: int) -> tuple[int, int]:
    """Dim-0 rows [lo, hi) of runtime tensor `target` (a parameter or buffer) that `rank` holds."""
    num_rows = shape[0] if shape else 1
    if is_buffer:
        return 0, num_rows
    m = EXPERT_TARGET.match(target)
    if m:
        return owned_experts(num_experts[int(m.group(1))], mesh, rank)
    return fsdp_rows(num_rows, mesh.world, rank)


def _expert_holder(num_experts: int, mesh: MeshShape, expert: int) -> int:
    """The one rank holding `expert`: its EP owner's dp member whose FSDP chunk of the local stack has it."""
    per_rank = experts_per_rank(num_experts, mesh.ep)
    ep, local = divmod(expert, per_rank)
    return mesh.rank(local // padded_rows(per_rank, mesh.dp_shard), ep)


def loads_by_rank(weight_map: dict[str, dict], targets: dict[str, tuple[tuple[int, ...], bool]],
                  num_experts: dict[int, int], mesh: MeshShape) -> dict[int, list[Load]]:
    """Every released tensor (or slice) each rank reads. targets: runtime name -> (shape, is_buffer);
    weight-map entries whose target the model lacks (a truncated model) are skipped."""
    loads: dict[int, list[Load]] = {rank: [] for rank in range(mesh.world)}
    for name, entry in weight_map.items():
        # a stored weight is read as its codes and its scale tensors, each into its own runtime tensor
        parts = stored_parts(entry) if entry.get("stored") is not None and entry["target"] else [(name, entry)]
        for released, part in parts:
            if part["target"] in targets:
                shape, is_buffer = targets[part["target"]]
                for rank, rows, whole in holders(part, shape, is_buffer, num_experts, mesh):
                    loads[rank].append(Load(released, part["target"], rows, whole))
    return loads


def shard_numel(shape: tuple[int, ...], target: str, is_buffer: bool, num_experts: dict[int, int],
                mesh: MeshShape) -> int:
    """Elements of one rank's (padded) shard of a runtime tensor: the same on every rank."""
    row = math.prod(shape[1:])
    if is_buffer:
        return math.prod(shape)
    m = EXPERT_TARGET.match(target)
    if m:
        return padded_rows(experts_per_rank(num_experts[int(m.group(1))], mesh.ep), mesh.dp_shard) * row
    return padded_rows(shape[0] if shape else 1, mesh.world) * row
