"""Expert-sorted order of the (token, choice) pairs and the row-tile schedule of the grouped GEMMs.

One torch sort, then one Triton launch that finds each expert's rows in the sorted ids and cuts
them into row tiles (instead of some twenty tiny torch launches, each a host-side dispatch at
the start of the forward, when the GPU waits on the host). No host sync: the grid is sized by an
upper bound on the number of row tiles (cdiv(S, block_m) + E) and tiles past the real count
carry expert id E, which the kernels skip. The kernels read a sorted row's token as pair // k and
its routing weight at the pair, so neither is materialized in sorted order.

Shape legend: T tokens, k top-k, E experts, S = T * k pairs in expert-sorted order.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime.ops.common.launch import fast
from runtime.ops.common import buffers


@dataclass(frozen=True)
class Schedule:
    pair_S: torch.Tensor  # int64: index of the sorted row's pair in the flattened [T * k] routing
    expert_S: torch.Tensor  # int16 (int32 past 32767 experts): the sorted row's expert
    ends_E: torch.Tensor  # int32: one past each expert's last sorted row
    tile_expert: torch.Tensor  # int32 [num_tiles]: expert of each row tile, E for unused tiles
    tile_start: torch.Tensor  # int32 [num_tiles]: first sorted row of each tile
    block_m: int
    num_experts: int
    top_k: int  # a sorted row's token is pair_S // top_k

    @property
    def num_tiles(self) -> int:
        return self.tile_expert.numel()

    @functools.cached_property
    def token_S(self) -> torch.Tensor:
        """int64: the sorted row's token, pair_S // top_k, made once a schedule for the kernels that gather rows
        by token every step (an integer division by a runtime k is a dozen instructions a row there)."""
        return self.pair_S // self.top_k


@triton.jit
def _count_at_most(sorted_ptr, num_rows, values, search_steps):
    """For each of `values`, how many of the sorted ids are <= it (an upper-bound binary search)."""
    lo = tl.zeros_like(values)
    hi = tl.zeros_like(values) + num_rows
    for _ in range(search_steps):
        open_ = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(sorted_ptr + mid, mask=open_, other=0)
        right = open_ & (v <= values)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(open_ & ~right, mid, hi)
    return lo


@triton.jit
def row_tiles_kernel(expert_S_ptr, num_rows, search_steps, ends_ptr, tile_expert_ptr, tile_start_ptr,
                     num_experts, num_tiles,
                     BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TILES: tl.constexpr):
    """Program i fills row tiles [i * BLOCK_TILES, (i + 1) * BLOCK_TILES); each finds every
    expert's rows itself (a few hundred binary searches), program 0 also stores their ends."""
    experts = tl.arange(0, BLOCK_E)
    e_ok = experts < num_experts
    ends = _count_at_most(expert_S_ptr, num_rows, experts, search_steps)
    starts = _count_at_most(expert_S_ptr, num_rows, experts - 1, search_steps)
    # (a vector compare: the interpreter rejects a scalar bool in a store mask)
    tl.store(ends_ptr + experts, ends, mask=e_ok & (tl.zeros_like(experts) == tl.program_id(0)))
    tiles = tl.where(e_ok, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_ends = tl.cumsum(tiles, 0)
    first_tile = tile_ends - tiles
    t = tl.program_id(0) * BLOCK_TILES + tl.arange(0, BLOCK_TILES)
    # a tile's expert: how many experts' tiles end at or before it (E past the last used tile)
    owner_of = (tile_ends[None, :] <= t[:, None]) & e_ok[None, :]
    tile_e = tl.sum(owner_of.to(tl.int32), axis=1)
    mine = experts[None, :] == tl.minimum(tile_e, num_experts - 1)[:, None]
    first = tl.sum(tl.where(mine, first_tile[None, :], 0), axis=1)
    start = tl.sum(tl.where(mine, starts[None, :], 0), axis=1)
    t_ok = t < num_tiles
    tl.store(tile_expert_ptr + t, tile_e, mask=t_ok)
    tl.store(tile_start_ptr + t, start + (t - first) * BLOCK_M, mask=t_ok)


def _row_tiles(expert_S: torch.Tensor, num_experts: int, block_m: int):
    """(ends_E, tile_expert, tile_start), int32, from the sorted expert ids (one launch)."""
    num_rows, device = expert_S.numel(), expert_S.device
    num_tiles = triton.cdiv(num_rows, block_m) + num_experts
    ends_E = buffers.empty(num_experts, dtype=torch.int32, device=device)
    tile_expert, tile_start = (buffers.empty(num_tiles, dtype=torch.int32, device=device) for _ in range(2))
    block_e = triton.next_power_of_2(num_experts)
    # each program compares its tiles against every expert: about 8192 (tile, expert) pairs a program
    block_tiles = max(16, 8192 // block_e)
    fast(row_tiles_kernel)[(triton.cdiv(num_tiles, block_tiles),)](
        expert_S, num_rows, num_rows.bit_length() + 1, ends_E, tile_expert, tile_start, num_experts, num_tiles,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_TILES=block_tiles, num_warps=4)
    return ends_E, tile_expert, tile_start


def build_schedule(idx_Tk: torch.Tensor, num_experts: int, block_m: int) -> Schedule:
    # the radix sort takes a pass per 8 key bits: int16 expert ids two, the router's int64 ids eight
    key_dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
    expert_S, pair_S = torch.sort(idx_Tk.reshape(-1).to(key_dtype), stable=True)
    ends_E, tile_expert, tile_start = _row_tiles(expert_S, num_experts, block_m)
    return Schedule(pair_S=pair_S, expert_S=expert_S, ends_E=ends_E, tile_expert=tile_expert,
                    tile_start=tile_start, block_m=block_m, num_experts=num_experts, top_k=idx_Tk.shape[1])

