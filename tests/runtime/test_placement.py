"""runtime/parallel/placement.py: expert ownership, FSDP dim-0 slices as fully_shard cuts them, and every
released tensor of a real release read by the ranks that hold it, once per element."""
from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from onboard.package.weight_map import build_weight_map
from onboard.recognize.recognizer import recognize
from onboard.release.manifest import read_manifest
from runtime.model.decoder import HybridDecoder
from runtime.spec import read_spec
from runtime.parallel.placement import (MeshShape, PlacementError, check_mesh, experts_per_rank, fsdp_rows,
                                        loads_by_rank, model_targets, moe_layers, owned_experts)


@pytest.mark.parametrize("num_rows,group", [(5, 4), (8, 4), (3, 8), (63, 8), (1, 2), (896, 128)],
                         ids=lambda v: str(v))
def test_fsdp_rows_are_fully_shards_chunks(num_rows, group):
    # FSDP2 cuts dim 0 with this helper (torch.chunk, then empty chunks for the members left over)
    chunks = _chunk_with_empty(torch.arange(num_rows), group, dim=0)
    for index, chunk in enumerate(chunks):
        lo, hi = fsdp_rows(num_rows, group, index)
        assert torch.equal(torch.arange(num_rows)[lo:hi], chunk)


def test_uneven_experts_name_both_numbers():
    with pytest.raises(PlacementError, match=r"\b10\b.*ep=4"):
        experts_per_rank(10, 4)


def test_groups_tile_the_mesh():
    mesh = MeshShape(dp_shard=3, ep=4)
    for rank in range(mesh.world):
        assert mesh.rank(*mesh.coords(rank)) == rank
        assert set(mesh.ep_group(rank)) & set(mesh.dp_group(rank)) == {rank}
        assert len(mesh.ep_group(rank)) == 4 and len(mesh.dp_group(rank)) == 3
    assert sorted(r for g in {tuple(mesh.ep_group(r)) for r in range(12)} for r in g) == list(range(12))


@pytest.mark.parametrize("ep,dp", [(1, 1), (2, 1), (4, 2), (8, 3)])
def test_every_expert_held_once(ep, dp):
    mesh = MeshShape(dp_shard=dp, ep=ep)
    held = [e for rank in range(mesh.world) for e in range(*owned_experts(8, mesh, rank))]
    assert sorted(held) == list(range(8))


@pytest.fixture(scope="module")
def release(example_release):
    """A real qwen3_moe release (per-expert tensors) and gpt_oss (fused [E, ...] expert tensors)."""
    def make(family):
        spec = recognize(read_manifest(example_release(family)))
        with torch.device("meta"):
            model = HybridDecoder(json.loads(spec.model_dump_json()))
        return build_weight_map(spec), model_targets(model), moe_layers(model.config)
    return make


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dp,ep", [(1, 2), (2, 2), (3, 4)])
def test_released_elements_read_once(release, family, dp, ep):
    weight_map, targets, experts = release(family)
    mesh = MeshShape(dp, ep)
    loads = loads_by_rank(weight_map, targets, experts, mesh)
    reads: dict[tuple[str, int], int] = {}
    for rank_loads in loads.values():
        for load in rank_loads:
            for row in range(*load.rows):
                reads[load.name, row] = reads.get((load.name, row), 0) + 1
    for name, entry in weight_map.items():
        shape, is_buffer = targets[entry["target"]]
        rows = [entry["expert"]] if entry["expert"] is not None else range(shape[0])
        # buffers stay whole on every rank; parameters' rows are read by exactly one rank
        assert all(reads[name, row] == (mesh.world if is_buffer else 1) for row in rows), name


def test_a_rank_reads_only_its_share(release):
    weight_map, targets, experts = release("qwen3_moe")
    mesh = MeshShape(2, 4)
    loads = loads_by_rank(weight_map, targets, experts, mesh)
    expert_loads = [load for load in loads[5] if ".experts." in load.target]
    lo, hi = owned_experts(8, mesh, 5)
    assert expert_loads and all(lo <= load.rows[0] < hi for load in expert_loads)


def test_check_mesh_rejects_uneven_ep(example_spec):
    config = read_spec(example_spec("qwen3_moe"))
    check_mesh(config, MeshShape(2, 4))
    with pytest.raises(PlacementError, match="ep=3"):
        check_mesh(config, MeshShape(1, 3))
