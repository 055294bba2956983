"""Expert parallelism: each MoE layer's routed experts split E/ep per EP rank, tokens moved to them and back.

Applied from outside the model: the Experts module keeps its name and parameter names; its expert
tensors become DTensors Shard(0) over the EP mesh (global shape [E, ...], so checkpoints reshard to
any ep) and its forward becomes dispatch -> compute -> combine:
1. the (token, choice) pairs sorted by expert (expert order is destination-rank order), optionally cut to
   a capacity per expert; per-expert counts exchanged with all_to_all_single, then the rows themselves
   with variable splits (autograd all_to_all: gradients travel back the same way);
2. the received rows (rank-major, expert-sorted within each source) through the ordinary moe_experts op
   with k = 1 and unit weights, on this rank's E/ep experts (the op sorts them into expert order);
3. the outputs sent back, put in pair order, times the router weights, summed over each token's k.
Shape legend: T tokens, D width, E experts, k top-k, S = T*k pairs (expert-sorted), N received rows.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from runtime.dispatch import op
from runtime.formats.weight import StoredWeight
from runtime.model.layers.ffn import Experts, MoE
from runtime.ops.moe.torch_form import sort_by_expert
from runtime.parallel.placement import experts_per_rank

EXPERT_TENSORS = ("w_gate_up", "w_down", "b_gate_up", "b_down",
                  "lora_gate_up_A", "lora_gate_up_B", "lora_down_A", "lora_down_B")


def apply_expert_parallel(model: torch.nn.Module, ep_mesh: DeviceMesh, capacity_factor: float | None) -> int:
    """Give every MoE layer's experts their EP slice and the dispatching forward; returns the layers done."""
    done = 0
    for layer in model.layers:
        if isinstance(layer.ffn, MoE):
            experts = layer.ffn.experts
            num_experts = experts.w_gate_up.shape[0]
            _shard_experts(experts, ep_mesh, experts_per_rank(num_experts, ep_mesh.size()))
            experts.last_dropped = None
            experts.forward = functools.partial(_ep_forward, experts, ep_mesh.get_group(), num_experts,
                                                capacity_factor)
            done += 1
    return done


def _shard_experts(experts: Experts, ep_mesh: DeviceMesh, per_rank: int) -> None:
    first = ep_mesh.get_local_rank() * per_rank
    for name in EXPERT_TENSORS:
        p = getattr(experts, name)
        # a stored expert weight's codes and scales are cut alike, on the expert dim
        held = [(p, "codes"), (p, "scale")] if isinstance(p, StoredWeight) else [(experts, name)] if p is not None else []
        for module, leaf in held:
            _shard_one(module, leaf, ep_mesh, first, per_rank)


def _shard_one(module: torch.nn.Module, leaf: str, ep_mesh: DeviceMesh, first: int, per_rank: int) -> None:
    p = getattr(module, leaf)
    local = p.detach()[first:first + per_rank]
    sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
    setattr(module, leaf, torch.nn.Parameter(sharded, requires_grad=p.requires_grad))


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _ep_forward(experts: Experts, group, num_experts: int, capacity_factor: float | None,
                x_TD: torch.Tensor, weights_Tk: torch.Tensor, idx_Tk: torch.Tensor) -> torch.Tensor:
    T, k = idx_Tk.shape
    sort = sort_by_expert(idx_Tk, num_experts)
    keep_S, counts_E = _capacity(sort, num_experts, capacity_factor, T * k)
    experts.last_dropped = torch.bincount(sort.expert_S[~keep_S], minlength=num_experts).detach()
    ep = dist.get_world_size(group)
    recv_counts_R = _exchange_counts(counts_E, group, ep)
    send_splits = counts_E.view(ep, -1).sum(1).tolist()
    recv_splits = recv_counts_R.view(ep, -1).sum(1).tolist()
    x_ND = _all_to_all(x_TD[sort.token_S[keep_S]], recv_splits, send_splits, group)
    y_ND = _compute(experts, x_ND, recv_counts_R.view(ep, -1))
    y_kept = _all_to_all(y_ND, send_splits, recv_splits, group)
    y_PD = y_kept.new_zeros(T * k, y_kept.shape[1]).index_put((sort.pair_S[keep_S],), y_kept)
    y_PD = y_PD * weights_Tk.reshape(-1, 1).to(y_PD.dtype)
    return y_PD.view(T, k, -1).sum(dim=1).to(x_TD.dtype)


def _capacity(sort, num_experts: int, capacity_factor: float | None, num_pairs: int):
    """(keep_S: pairs within their expert's capacity, kept counts per expert [E]); dropless without a factor."""
    counts_E = torch.diff(sort.offsets_E, prepend=sort.offsets_E.new_zeros(1)).long()
    if capacity_factor is None:
        return torch.ones_like(sort.pair_S, dtype=torch.bool), counts_E
    capacity = math.ceil(capacity_factor * num_pairs / num_experts)
    starts_E = sort.offsets_E.long() - counts_E
    # pairs of one expert are in token order: the first `capacity` of them are kept
    position_S = torch.arange(len(sort.pair_S), device=sort.pair_S.device) - starts_E[sort.expert_S]
    return position_S < capacity, counts_E.clamp(max=capacity)


def _exchange_counts(counts_E: torch.Tensor, group, ep: int) -> torch.Tensor:
    """Rows this rank receives per (source rank, local expert), flattened [ep * E/ep]."""
    if ep == 1:
        return counts_E
    received = torch.empty_like(counts_E)
    dist.all_to_all_single(received, counts_E, group=group)
    return received


def _all_to_all(x_SD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    if len(in_splits) == 1:
        return x_SD
    # autograd's all_to_all: the backward sends the gradients back with the splits swapped
    moved = funcol.all_to_all_single_autograd(x_SD.contiguous(), out_splits, in_splits, group)
    return funcol.wait_tensor(moved)


def _compute(experts: Experts, x_ND: torch.Tensor, counts_RL: torch.Tensor) -> torch.Tensor:
    """This rank's experts on the received rows (counts_RL: rows per source rank and local expert)."""
    num_local = counts_RL.shape[1]
    local_N = torch.arange(num_local, device=x_ND.device).repeat(counts_RL.shape[0])
    local_N = local_N.repeat_interleave(counts_RL.reshape(-1))
    rows = x_ND.shape[0]
    if rows == 0:
        # one zero row through the op so every expert parameter still gets a (zero) gradient: the ranks of
        # an FSDP group must all reduce the same gradients
        x_ND, local_N = x_ND.new_zeros(1, x_ND.shape[1]), local_N.new_zeros(1)
    weights = torch.ones(x_ND.shape[0], 1, dtype=torch.float32, device=x_ND.device)
    if experts.stored_format() is not None:
        return experts.run_stored(x_ND, weights, local_N[:, None], _local)[:rows]
    w_gate_up, w_down = experts.op_weights(x_ND.dtype, _local)
    y_ND = op("moe_experts", x_ND.device)(
        x_ND, weights, local_N[:, None], w_gate_up, w_down,
        b_gate_up_E2F=_local(experts.b_gate_up), b_down_ED=_local(experts.b_down), **experts.options,
        **experts._lora_args(x_ND.dtype, _local))
    return y_ND[:rows]

