"""`onboard plan`: search dp_shard x ep meshes, activation policies and micro-batches for a cluster, estimate each
candidate (plan_cost.py), reject what does not fit with the reason, rank the rest by cluster tokens per second;
when nothing fits, find the smallest GPU count that does."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Optional

from pydantic import BaseModel

from onboard.errors import BadInput
from onboard.gap.budget import GIB, POLICIES, USABLE_FRACTION, WORKSPACE_GIB, activations, stored_as
from onboard.plan.cost import (ASSUMPTIONS, Cluster, Memory, ModelSummary, StepTime, estimate_memory,
                               estimate_time)
from onboard.recognize.experts import experts_per_layer
from runtime.parallel.placement import MeshShape, PlacementError, experts_per_rank
from runtime.spec import ModelSpec

MICRO_BATCHES = (1, 2, 4, 8)


class PlanCandidate(BaseModel):
    dp_shard: int
    ep: int
    experts_per_rank: int
    policy: str
    micro_batch: int
    fits: bool
    reason: str  # why rejected, or the headroom left
    memory: Optional[Memory] = None  # None when the mesh cannot hold the experts at all
    time: Optional[StepTime] = None

    @property
    def mesh(self) -> str:
        return f"dp{self.dp_shard}xep{self.ep}"


class ParallelPlan(BaseModel):
    model: str
    gpus: int
    gpus_per_node: int
    gpu_mem_gib: float
    seq_len: int
    lora_rank: int
    assumptions: dict[str, float]
    chosen: Optional[PlanCandidate]
    candidates: list[PlanCandidate]  # ranked: fitting ones fastest first, then the rejected
    reason: str  # why nothing fits, or empty
    smallest_gpus: Optional[int] = None  # when nothing fits: the smallest whole-node count that does
    weights_as: str = ""  # the base weights as counted: a quantized release's stored formats, else its dtype


@dataclass(frozen=True)
class Workload:
    seq_len: int
    lora_rank: int
    micro_batch: Optional[int]  # None: search MICRO_BATCHES


def evaluate(m: ModelSummary, mesh: MeshShape, policy: str, micro_batch: int, cluster: Cluster,
             seq_len: int) -> PlanCandidate:
    memory = estimate_memory(m, mesh, policy, micro_batch, cluster, seq_len)
    fits = memory.total <= memory.capacity
    experts = max((l.num_experts for l in m.layers), default=0)
    return PlanCandidate(dp_shard=mesh.dp_shard, ep=mesh.ep, experts_per_rank=experts // mesh.ep, policy=policy,
                     micro_batch=micro_batch, fits=fits, reason=_memory_reason(memory, fits), memory=memory,
                     time=estimate_time(m, mesh, policy, micro_batch, cluster, seq_len))


def _memory_reason(memory: Memory, fits: bool) -> str:
    if fits:
        return f"fits: {memory.total:.1f} of {memory.capacity:.1f} GiB usable"
    parts = {name: getattr(memory, name) for name in ("weights", "activations", "all_gather", "all_to_all", "lora")}
    largest = sorted(parts.items(), key=lambda kv: -kv[1])[:2]
    return (f"needs {memory.total:.1f} GiB per rank, over the {memory.capacity:.1f} GiB usable ("
            + ", ".join(f"{name} {gib:.1f}" for name, gib in largest) + ")")


def parse_mesh(text: str, gpus: int) -> MeshShape:
    """'dp2xep64' -> MeshShape(2, 64); BadInput (bad input) unless it has that form and uses `gpus` GPUs."""
    match = re.fullmatch(r"dp(\d+)xep(\d+)", text)
    if not match or int(match.group(1)) * int(match.group(2)) != gpus:
        raise BadInput(None, "--mesh", f"expected dp<N>xep<M> with N*M = --gpus {gpus}, got {text!r}")
    return MeshShape(int(match.group(1)), int(match.group(2)))


def meshes(gpus: int) -> list[MeshShape]:
    return [MeshShape(gpus // ep, ep) for ep in range(1, gpus + 1) if gpus % ep == 0]


def mesh_candidates(m: ModelSummary, mesh: MeshShape, cluster: Cluster, workload: Workload) -> list[PlanCandidate]:
    """Every policy and micro-batch on one mesh, or one rejected row saying why the mesh cannot hold the experts."""
    try:
        for layer in m.layers:
            if layer.num_experts:
                experts_per_rank(layer.num_experts, mesh.ep)
        if mesh.ep > 1 and not any(layer.num_experts for layer in m.layers):
            raise PlacementError(_no_placed_experts(m.spec, mesh.ep))
    except PlacementError as error:
        return [PlanCandidate(dp_shard=mesh.dp_shard, ep=mesh.ep, experts_per_rank=0, policy="-", micro_batch=0,
                          fits=False, reason=str(error))]
    micro_batches = (workload.micro_batch,) if workload.micro_batch else MICRO_BATCHES
    return [evaluate(m, mesh, policy, mb, cluster, workload.seq_len) for policy in POLICIES for mb in micro_batches]


def _rank_key(c: PlanCandidate):
    return (not c.fits, -(c.time.tokens_per_s if c.time and c.fits else 0.0), c.memory.total if c.memory else math.inf)


def search(spec: ModelSpec, cluster: Cluster, workload: Workload, progress: Callable[[int, int], None] | None = None,
           find_smallest: bool = True, only: Optional[MeshShape] = None) -> ParallelPlan:
    """Rank every candidate on the cluster (or on mesh `only`); when none fits, also the smallest whole-node
    GPU count where some mesh fits."""
    m = ModelSummary.of(spec, workload.seq_len, workload.lora_rank)
    shapes = [only] if only else meshes(cluster.gpus)
    candidates = sorted((c for mesh in shapes for c in mesh_candidates(m, mesh, cluster, workload)), key=_rank_key)
    chosen = candidates[0] if candidates and candidates[0].fits else None
    nothing = chosen is None
    return ParallelPlan(model=spec.architecture, gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node,
                        gpu_mem_gib=cluster.gpu_mem_gib, seq_len=workload.seq_len, lora_rank=workload.lora_rank,
                        assumptions=ASSUMPTIONS, weights_as=stored_as(spec) or spec.dtype, chosen=chosen, candidates=candidates,
                        reason=_nothing_fits(candidates, cluster) if nothing else "",
                        smallest_gpus=smallest_gpus(m, cluster, workload, progress) if nothing and find_smallest else None)


def package_plan(spec: ModelSpec, cluster: Cluster, seq_len: int, lora_rank: int) -> ParallelPlan:
    """plan.yaml's plan: every micro-batch searched (the onboarding graph's plan node and `write_package` both)."""
    return search(spec, cluster, Workload(seq_len, lora_rank, None))


def _nothing_fits(candidates: list[PlanCandidate], cluster: Cluster) -> str:
    sized = [c for c in candidates if c.memory]
    if not sized:
        return f"no dp_shard x ep split of {cluster.gpus} GPUs can hold the experts: {candidates[0].reason}"
    least = min(sized, key=lambda c: c.memory.total)
    return (f"nothing fits {cluster.gpus} GPUs of {cluster.gpu_mem_gib:g} GiB: the smallest footprint, {least.mesh} "
            f"{least.policy} micro-batch {least.micro_batch}, {least.reason}")


def smallest_gpus(m: ModelSummary, cluster: Cluster, workload: Workload,
                  progress: Callable[[int, int], None] | None = None, limit: int = 1 << 16) -> Optional[int]:
    """Smallest GPU count above cluster.gpus (whole nodes once past one node) where some candidate fits;
    None when none up to `limit` does."""
    k = cluster.gpus_per_node
    # no GPU count shrinks a rank below one sequence's offloaded activations plus the workspace, and the
    # weights need at least their whole size spread over the room left: start the search there
    room = cluster.gpu_mem_gib * USABLE_FRACTION * GIB - activations(m.spec, workload.seq_len, "offload")
    room -= WORKSPACE_GIB * GIB
    if room <= 0:
        return None
    start = max(cluster.gpus + 1, math.ceil(m.weight_bytes(m.dense, sum(_all_experts(m)), m.vision) / room))
    # up to one node any count; past it whole nodes
    counts = list(range(start, k + 1)) + list(range((max(start - 1, k) // k + 1) * k, limit + 1, k))
    for done, gpus in enumerate(counts):
        if progress:
            progress(done, len(counts))
        bigger = Cluster(gpus, cluster.gpu_mem_gib, k)
        if any(c.fits for mesh in meshes(gpus) for c in mesh_candidates(m, mesh, bigger, workload)):
            return gpus
    return None


def _all_experts(m: ModelSummary) -> list[int]:
    return [layer.num_experts * layer.expert for layer in m.layers]




def _no_placed_experts(spec: ModelSpec, ep: int) -> str:
    """Why expert parallelism has nothing to place: no experts, or experts only inside own modules (which run whole
    on every rank: expert parallelism splits the runtime's MoE op)."""
    own = experts_per_layer(spec)
    if own:
        return (f"ep={ep} splits the experts of the runtime's MoE op; this model's {len(own)} MoE layers "
                f"({max(own.values())} routed experts each) run as own modules, whole on every rank")
    return f"ep={ep} needs routed experts; the model has none"
