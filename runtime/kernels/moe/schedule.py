"""Expert-sorted order of the (token, choice) pairs and the row-tile schedule of the grouped GEMMs.

Built with torch ops on the device, without a host sync: the grid is sized by an upper bound on
the number of row tiles (cdiv(S, block_m) + E) and tiles past the real count carry expert id E,
which the kernels skip.

Shape legend: T tokens, k top-k, E experts, S = T * k pairs in expert-sorted order.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Schedule:
    pair_S: torch.Tensor  # int32: index of the sorted row's pair in the flattened [T * k] routing
    token_S: torch.Tensor  # int32: the sorted row's token
    expert_S: torch.Tensor  # int64: the sorted row's expert
    ends_E: torch.Tensor  # int32: one past each expert's last sorted row
    tile_expert: torch.Tensor  # int32 [num_tiles]: expert of each row tile, E for unused tiles
    tile_start: torch.Tensor  # int32 [num_tiles]: first sorted row of each tile
    block_m: int
    num_experts: int

    @property
    def num_tiles(self) -> int:
        return self.tile_expert.numel()


def build_schedule(idx_Tk: torch.Tensor, num_experts: int, block_m: int) -> Schedule:
    flat_S = idx_Tk.reshape(-1)
    expert_S, pair_S = torch.sort(flat_S, stable=True)
    # From the sorted ids rather than torch.bincount, whose CUDA form syncs with the host.
    ends_E = torch.searchsorted(expert_S, torch.arange(num_experts, device=idx_Tk.device), right=True)
    tile_expert, tile_start = _row_tiles(ends_E, flat_S.numel(), block_m)
    return Schedule(
        pair_S=pair_S.to(torch.int32),
        token_S=(pair_S // idx_Tk.shape[1]).to(torch.int32),
        expert_S=expert_S,
        ends_E=ends_E.to(torch.int32),
        tile_expert=tile_expert,
        tile_start=tile_start,
        block_m=block_m,
        num_experts=num_experts,
    )


def retiled(sched: Schedule, block_m: int) -> Schedule:
    """The same sorted rows cut into row tiles of another height, for a GEMM that runs best with
    its own tile (a few small launches, still without a host sync)."""
    tile_expert, tile_start = _row_tiles(sched.ends_E.long(), sched.pair_S.numel(), block_m)
    return replace(sched, tile_expert=tile_expert, tile_start=tile_start, block_m=block_m)


def _row_tiles(ends_E: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_expert, tile_start), int32 [cdiv(num_rows, block_m) + E], from int64 ends_E."""
    num_experts = ends_E.numel()
    counts_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    tiles_E = (counts_E + block_m - 1) // block_m
    tile_ends_E = torch.cumsum(tiles_E, 0)
    num_tiles = (num_rows + block_m - 1) // block_m + num_experts
    tile_T = torch.arange(num_tiles, device=ends_E.device)
    tile_expert = torch.searchsorted(tile_ends_E, tile_T, right=True)
    owner = tile_expert.clamp(max=num_experts - 1)
    first_tile = (tile_ends_E - tiles_E)[owner]
    tile_start = (ends_E - counts_E)[owner] + (tile_T - first_tile) * block_m
    return tile_expert.to(torch.int32), tile_start.to(torch.int32)
