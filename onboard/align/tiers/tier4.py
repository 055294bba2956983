"""Tier 4, full scale on paper: the runtime model built on the meta device (no memory), the plan's mesh for the
target cluster, and runtime/parallel/placement.py's answers for every rank, checked without starting processes:
every expert held by exactly one rank, every released tensor read once per element (buffers whole on every
rank), every runtime tensor filled, each rank's memory within the GPU, the EP and dp_shard groups consistent.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import yaml

from onboard import package_io
from onboard.align.progress import Progress
from onboard.align.report import Check
from onboard.errors import BadInput
from onboard.gap.budget import GIB, weight_bytes_per_param
from onboard.plan.search import Cluster, Workload, search
from runtime import defaults
from runtime.model.decoder import HybridDecoder
from runtime.spec import ModelSpec
from runtime.parallel.placement import (EXPERT_TARGET, MeshShape, loads_by_rank, model_targets, moe_layers,
                                        owned_experts, shard_numel)
from runtime.model.weights import shard_order

TIER = 4


@dataclass(frozen=True)
class Target:
    """The cluster tier 4 checks the package for."""
    cluster: Cluster
    workload: Workload  # sequence length and LoRA rank of the package's plan.yaml
    mesh: Optional[MeshShape] = None  # None: the plan's best candidate


def tier4_target(pkg: Path, cluster: Cluster | None, mesh: MeshShape | None) -> Target:
    if cluster is None:
        raise BadInput(None, "--tiers", "tier 4 needs the target cluster: --gpus N --gpu-mem-gib G")
    return Target(cluster, plan_workload(Path(pkg) / "plan.yaml"), mesh)


def plan_workload(path: Path) -> Workload:
    """The sequence length and LoRA rank plan.yaml was made for (the planner's defaults without one)."""
    if not path.exists():
        return Workload(defaults.SEQ_LEN, defaults.LORA_RANK, None)
    workload = yaml.safe_load(package_io.read_text(path.parent, path))
    workload = workload.get("workload") if isinstance(workload, dict) else None
    if not isinstance(workload, dict) or not all(isinstance(workload.get(k), int) for k in ("seq_len", "lora_rank")):
        raise BadInput(path, "workload", "expected integer seq_len and lora_rank (a plan written by `onboard plan`)")
    return Workload(workload["seq_len"], workload["lora_rank"], None)


def tier4(spec: ModelSpec, weight_map: dict, source: Path, goal: Target, progress: Progress | None = None) -> list[Check]:
    """Checks for the plan's best candidate on the target cluster (or for the target's mesh)."""
    progress = progress or Progress()
    plan = search(spec, goal.cluster, goal.workload, find_smallest=False, only=goal.mesh)
    if plan.chosen is None:
        return [_check("plan", 0, 1, False, "fitting_candidates", plan.reason)]
    mesh, cluster = MeshShape(plan.chosen.dp_shard, plan.chosen.ep), goal.cluster
    progress.note(f"tier 4: {mesh} ({plan.chosen.experts_per_rank} experts/rank, {plan.chosen.policy}, micro-batch "
                  f"{plan.chosen.micro_batch}) on {cluster.gpus} GPUs")
    progress.plan(2)
    progress.group("runtime model on the meta device")
    with torch.device("meta"):
        model = HybridDecoder(spec)
    targets, experts = model_targets(model), moe_layers(model.config)
    progress.group(f"placement of every rank ({mesh.world})")
    loads = loads_by_rank(weight_map, targets, experts, mesh)
    released = list(name for names in shard_order(Path(source)).values() for name in names)
    return [_experts_once(experts, mesh), _released_once(released, weight_map, targets, loads, mesh),
            _targets_filled(targets, loads), _memory(spec, targets, experts, mesh, plan.chosen),
            _groups(experts, mesh)]


def _check(name: str, value: float, tolerance: float, passed: bool, metric: str, detail: str) -> Check:
    return Check(tier=TIER, name=f"placement/{name}", metric=metric, value=value, tolerance=tolerance,
                 verdict="pass" if passed else "fail", detail=detail)


def _experts_once(experts: dict[int, int], mesh: MeshShape) -> Check:
    bad = 0
    for num_experts in experts.values():
        held = [0] * num_experts
        for rank in range(mesh.world):
            for e in range(*owned_experts(num_experts, mesh, rank)):
                held[e] += 1
        bad += sum(count != 1 for count in held)
    sizes = sorted(set(experts.values()))
    return _check("experts_placed_once", bad, 0, bad == 0, "experts_misplaced",
                  f"{len(experts)} MoE layers x {sizes} experts over {mesh} ({mesh.world} ranks)")


def _released_once(released: list[str], weight_map: dict, targets: dict, loads: dict, mesh: MeshShape) -> Check:
    """Per released tensor: its dim-0 rows read once over all ranks (a buffer: whole, on every rank)."""
    reads: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for rank_loads in loads.values():
        for load in rank_loads:
            reads[load.name].append(load.rows)
    bad, outside = [], [name for name in released if name not in weight_map]
    for name, entry in weight_map.items():
        if entry["target"] not in targets:
            bad.append(name)
            continue
        shape, is_buffer = targets[entry["target"]]
        expected = [(entry["expert"], entry["expert"] + 1)] if entry["expert"] is not None else [(0, shape[0] if shape else 1)]
        if not _covers(reads[name], expected, mesh.world if is_buffer else 1):
            bad.append(name)
    detail = f"{len(weight_map)} mapped tensors, {sum(map(len, loads.values()))} reads"
    if outside:
        detail += (f"; {len(outside)} released tensors the decoder does not load (e.g. {outside[0]}; a vision "
                   "tower is kept whole on every rank)")
    return _check("released_tensors_owned_once", len(bad), 0, not bad, "tensors_misread",
                  detail + (f"; misread: {bad[:3]}" if bad else ""))


def _covers(spans: list[tuple[int, int]], expected: list[tuple[int, int]], times: int) -> bool:
    """spans tile each expected range exactly `times` times (row by row)."""
    if times > 1:
        return sorted(spans) == sorted(expected * times)
    pos, end = expected[0]
    for lo, hi in sorted(spans):
        if lo != pos:
            return False
        pos = hi
    return pos == end


def _targets_filled(targets: dict, loads: dict) -> Check:
    """Every runtime tensor's dim-0 rows are written by some load (no parameter left uninitialized)."""
    rows: dict[str, set[int]] = defaultdict(set)
    for rank_loads in loads.values():
        for load in rank_loads:
            rows[load.target].update(range(*load.rows))
    empty = [n for n, (shape, _) in targets.items() if len(rows[n]) != (shape[0] if shape else 1)]
    return _check("runtime_tensors_filled", len(empty), 0, not empty, "tensors_unfilled",
                  f"{len(targets)} runtime tensors" + (f"; unfilled: {empty[:3]}" if empty else ""))


def _memory(spec: ModelSpec, targets: dict, experts: dict, mesh: MeshShape, chosen) -> Check:
    """The exact per-rank weight shard (padded, from the meta model) in place of the plan's estimate, at the bytes
    per parameter the release stores each part in (a quantized release's codes and scales)."""
    expert_b, vision_b, dense_b = weight_bytes_per_param(spec)
    shard = sum(shard_numel(shape, name, buf, experts, mesh) * (expert_b if EXPERT_TARGET.match(name) else dense_b)
                for name, (shape, buf) in targets.items())
    vision = (spec.vision.num_params if spec.vision else 0) * vision_b
    m = chosen.memory
    total = m.total - m.weights + (shard + vision) / GIB
    return _check("memory_within_capacity", total, m.capacity, total <= m.capacity, "gib_per_rank",
                  f"weights {(shard + vision) / GIB:.2f} GiB exact (plan estimate {m.weights:.2f}); activations "
                  f"{m.activations:.2f}, all-to-all {m.all_to_all:.2f}, all-gather {m.all_gather:.2f}, LoRA {m.lora:.3f}, "
                  f"workspace {m.workspace:.1f}")


def _groups(experts: dict[int, int], mesh: MeshShape) -> Check:
    """EP groups and dp_shard groups each partition the ranks and meet in one rank; a dp_shard group holds exactly
    its EP rank's experts; with dp_shard 1 an EP group holds every expert once."""
    problems = 0
    for groups, size in ((mesh.ep_group, mesh.ep), (mesh.dp_group, mesh.dp_shard)):
        distinct = {tuple(groups(rank)) for rank in range(mesh.world)}
        problems += sorted(r for g in distinct for r in g) != list(range(mesh.world))
        problems += any(len(g) != size for g in distinct)
    for rank in range(mesh.world):
        problems += set(mesh.ep_group(rank)) & set(mesh.dp_group(rank)) != {rank}
        for num_experts in set(experts.values()):
            per_rank = num_experts // mesh.ep
            held = {e for r in mesh.dp_group(rank) for e in range(*owned_experts(num_experts, mesh, r))}
            start = mesh.coords(rank)[1] * per_rank
            problems += held != set(range(start, start + per_rank))
            in_ep = sorted(e for r in mesh.ep_group(rank) for e in range(*owned_experts(num_experts, mesh, r)))
            problems += mesh.dp_shard == 1 and in_ep != list(range(num_experts))
    return _check("groups_consistent", problems, 0, problems == 0, "inconsistencies",
                  f"{mesh.dp_shard} EP groups of {mesh.ep} ranks, {mesh.ep} dp_shard groups of {mesh.dp_shard}")
