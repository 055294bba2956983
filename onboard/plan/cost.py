"""Per-rank memory and step time of one parallel-plan candidate (a mesh, a policy, a micro-batch) for a spec.

Memory: the weight shard (placement.py's rules) as the release stores it (a quantized release's codes and scales), LoRA parameters, grads and AdamW moments (fp32, sharded over
every rank), activations under the policy (memory.py), the all-to-all send/receive buffers of one MoE layer,
FSDP all-gather buffers (the layer computing and the one prefetched ahead), a fixed workspace. Step time:
compute at a stated fraction of peak; all-to-all, all-gather and reduce-scatter volumes over the intra- or
inter-node bandwidth of the group they run in; what hides behind compute is `overlapped`, the rest `exposed`
and added to the step. Every figure the model assumes is a named constant below.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel

from onboard.gap.budget import (
    DTYPE_BYTES, GIB, LINEAR_CHUNK, LORA_STATE_BYTES, USABLE_FRACTION, WORKSPACE_GIB, activations, group_bytes_per_param,
    lora_params, weight_bytes_per_param,
)
from onboard.recognize.weight_layout import attention_tensors, ffn_tensors
from runtime.parallel.placement import MeshShape, experts_per_rank, padded_rows
from runtime.spec import LayerSpec, ModelSpec, MoEFFN

# H200 dense bf16 ceiling measured in TARGETS.md; the fraction of it a step sustains (recompute included).
PEAK_TFLOPS = 790.0
MFU = 0.35
FLOPS = PEAK_TFLOPS * 1e12 * MFU
# Per GPU, one direction: NVLink 4 (900 GB/s both ways) and one 400 Gb/s NIC per GPU; host offload over PCIe 5.
INTRA_NODE_GBPS = 450.0
INTER_NODE_GBPS = 50.0
HOST_GBPS = 50.0
# The busiest EP rank receives this many times the mean token count (dropless routing is never even).
EXPERT_IMBALANCE = 1.25


class Memory(BaseModel):
    """Per-rank GiB."""
    weights: float
    experts: float  # the routed experts' part of weights
    lora: float
    activations: float
    all_to_all: float
    all_gather: float
    workspace: float
    total: float
    capacity: float  # usable part of the GPU


class StepTime(BaseModel):
    """Seconds per step on one rank (all ranks run in lockstep), and the GiB each collective moves for it."""
    compute: float
    all_to_all: float
    all_gather: float
    reduce_scatter: float
    offload: float
    all_to_all_gib: float  # sent by the busiest rank, dispatch and combine, every pass
    all_gather_gib: float  # received: dense weights and its dp_shard group's experts, forward and backward
    reduce_scatter_gib: float  # LoRA gradients, fp32
    overlapped: float  # communication hidden behind compute
    exposed: float  # communication on the critical path
    step: float
    tokens_per_s: float  # whole cluster


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_mem_gib: float
    gpus_per_node: int


@dataclass(frozen=True)
class LayerParams:
    dense: int  # attention, norms, router, shared expert, dense MLP
    expert: int  # one routed expert
    num_experts: int
    top_k: int
    shared_width: int


def layer_params(spec: ModelSpec, layer: LayerSpec) -> LayerParams:
    d = spec.hidden_size
    dense = 2 * d + sum(math.prod(s) for s in attention_tensors(layer.attention, d, spec.naming).values())
    ffn, routed = layer.ffn, 0
    for name, shape in ffn_tensors(ffn, d, spec.naming).items():
        if name.startswith("experts."):
            routed += math.prod(shape)
        else:
            dense += math.prod(shape)
    if not isinstance(ffn, MoEFFN):
        return LayerParams(dense, 0, 0, 0, 0)
    return LayerParams(dense, routed // ffn.num_experts, ffn.num_experts, ffn.top_k, ffn.shared_intermediate_size)


@dataclass(frozen=True)
class ModelSummary:
    """What the estimates read from a spec, computed once per search."""
    spec: ModelSpec
    layers: tuple[LayerParams, ...]
    dense: int  # every parameter but the routed experts and the vision tower
    vision: int  # the frozen vision tower, whole on every rank
    matmul_active: int  # parameters a token multiplies with (the embedding lookup is no matmul)
    attention_flops: float  # forward FLOPs per token of every layer's attention products
    lora: int
    dtype_bytes: int  # of activations and of an unquantized base
    # bytes per parameter of the frozen base as stored (spec.stored_groups), per part the plan places apart
    expert_bytes: float
    vision_bytes: float
    dense_bytes: float

    @classmethod
    def of(cls, spec: ModelSpec, seq_len: int, lora_rank: int) -> ModelSummary:
        layers = tuple(layer_params(spec, layer) for layer in spec.layers)
        d, p = spec.hidden_size, spec.params
        lookup = 0 if spec.tie_word_embeddings else spec.vocab_size * d
        return cls(spec, layers, p.total - p.experts_routed - p.vision, p.vision, p.active - p.vision - lookup,
                   sum(attention_flops_per_token(layer, seq_len) for layer in spec.layers),
                   lora_params(spec, lora_rank), DTYPE_BYTES.get(spec.dtype, 2), *weight_bytes_per_param(spec))

    def weight_bytes(self, dense: float, experts: float, vision: float = 0) -> float:
        """Stored bytes of that many dense, routed-expert and vision parameters."""
        return dense * self.dense_bytes + experts * self.expert_bytes + vision * self.vision_bytes


def attention_flops_per_token(layer: LayerSpec, seq_len: int) -> float:
    """Forward FLOPs of the attention products (not the projections) per token, causal."""
    a, ctx = layer.attention, seq_len / 2
    # an own module (the model's own transformers code) has no widths in the spec: its products are not counted
    if a.kind == "own_module":
        return 0.0
    if a.kind == "softmax":
        return 4 * a.num_heads * a.head_dim * min(ctx, a.sliding_window or ctx)
    if a.kind == "mla":
        width = a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim
        if a.indexer is None:
            return 2 * a.num_heads * width * ctx
        # the indexer scores every earlier key; attention then reads its top-k
        return 2 * a.num_heads * width * min(ctx, a.indexer.topk) + 2 * a.indexer.num_heads * a.indexer.head_dim * ctx
    heads, dk, dv = ((a.num_v_heads, a.head_k_dim, a.head_v_dim) if a.kind == "gated_delta"
                     else (a.num_heads, a.head_dim, a.head_dim))
    return 4 * heads * dk * dv + 2 * LINEAR_CHUNK * heads * (dk + dv)


def _local_experts(layer: LayerParams, mesh: MeshShape) -> int:
    """Parameters of one EP rank's expert stack in this layer."""
    return experts_per_rank(layer.num_experts, mesh.ep) * layer.expert if layer.num_experts else 0


def estimate_memory(m: ModelSummary, mesh: MeshShape, policy: str, micro_batch: int, cluster: Cluster,
                    seq_len: int) -> Memory:
    b, world, spec = m.dtype_bytes, mesh.world, m.spec
    experts = sum(padded_rows(experts_per_rank(l.num_experts, mesh.ep), mesh.dp_shard) * l.expert
                  for l in m.layers if l.num_experts)
    weights = m.weight_bytes(math.ceil(m.dense / world), experts, m.vision)
    lora = math.ceil(m.lora / world) * LORA_STATE_BYTES
    acts = micro_batch * activations(spec, seq_len, policy)
    top_k = max((l.top_k for l in m.layers), default=0)
    # one MoE layer's dispatch send buffer and the (busiest rank's) receive buffer; combine reuses them
    a2a = micro_batch * seq_len * top_k * spec.hidden_size * b * (1 + EXPERT_IMBALANCE) if mesh.ep > 1 else 0
    gib = [x / GIB for x in (weights, lora, acts, a2a, _gather_buffers(m, mesh))] + [WORKSPACE_GIB]
    return Memory(weights=gib[0], experts=m.weight_bytes(0, experts) / GIB, lora=gib[1], activations=gib[2], all_to_all=gib[3],
                  all_gather=gib[4], workspace=gib[5], total=sum(gib), capacity=cluster.gpu_mem_gib * USABLE_FRACTION)


def _gather_buffers(m: ModelSummary, mesh: MeshShape) -> int:
    """Bytes of unsharded parameters alive at once: the layer computing and the one prefetched (or the LM head
    and a layer); LoRA parameters gathered with their layer in fp32."""
    lora_per_layer = 4 * m.lora // max(1, len(m.layers))
    dense_gathered = mesh.world > 1
    per_layer = [(m.weight_bytes(l.dense, 0) + lora_per_layer) * dense_gathered
                 + m.weight_bytes(0, _local_experts(l, mesh)) * (mesh.dp_shard > 1) for l in m.layers]
    largest = max(per_layer, default=0)
    # the LM head is stored as the embedding category is (bf16 in the quantized releases)
    head = m.spec.vocab_size * m.spec.hidden_size * group_bytes_per_param(m.spec, "embedding") * dense_gathered
    return max(2 * largest, head + largest)


def _group_spans_nodes(group: list[int], gpus_per_node: int) -> bool:
    return len({rank // gpus_per_node for rank in group}) > 1


def _ring_seconds(num_bytes: float, group: list[int], gpus_per_node: int) -> float:
    """A ring collective (all-gather, reduce-scatter) runs at its slowest link."""
    gbps = INTER_NODE_GBPS if _group_spans_nodes(group, gpus_per_node) else INTRA_NODE_GBPS
    return num_bytes / (gbps * 1e9)


def _all_to_all_seconds(num_bytes: float, group: list[int], gpus_per_node: int) -> float:
    """num_bytes leave rank group[0], spread evenly over its peers; in-node and off-node parts run concurrently."""
    peers = [rank for rank in group if rank != group[0]]
    if not peers:
        return 0.0
    local = sum(rank // gpus_per_node == group[0] // gpus_per_node for rank in peers) / len(peers)
    return max(num_bytes * local / (INTRA_NODE_GBPS * 1e9), num_bytes * (1 - local) / (INTER_NODE_GBPS * 1e9))


def estimate_time(m: ModelSummary, mesh: MeshShape, policy: str, micro_batch: int, cluster: Cluster,
                  seq_len: int) -> StepTime:
    tokens, world, k = micro_batch * seq_len, mesh.world, cluster.gpus_per_node
    # forward, backward (input gradients only: the base is frozen), and the recompute's second forward
    passes = 2 if policy == "none" else 3
    compute = (passes * tokens * (2 * m.matmul_active + m.attention_flops) + 6 * m.lora * tokens) / FLOPS
    a2a_bytes, a2a, shared = _all_to_all_time(m, mesh, tokens, passes, k)
    gather_bytes, gather = _all_gather_time(m, mesh, k)
    rs_bytes = 4 * m.lora * (world - 1) / world
    reduce_scatter = _ring_seconds(rs_bytes, list(range(world)), k)
    layer_inputs = m.spec.num_layers * m.spec.hidden_size * m.dtype_bytes * tokens
    offload = 2 * layer_inputs / (HOST_GBPS * 1e9) if policy == "offload" else 0.0
    # prefetch hides all but the first layer's gather behind compute, as far as compute lasts
    background = gather + reduce_scatter + offload
    hidden = min(a2a, shared) + min(background * (1 - 1 / max(1, m.spec.num_layers)), compute)
    exposed = a2a + background - hidden
    step = compute + exposed
    return StepTime(compute=compute, all_to_all=a2a, all_gather=gather, reduce_scatter=reduce_scatter,
                    offload=offload, all_to_all_gib=a2a_bytes / GIB, all_gather_gib=gather_bytes / GIB,
                    reduce_scatter_gib=rs_bytes / GIB, overlapped=hidden, exposed=exposed, step=step,
                    tokens_per_s=world * tokens / step)


def _all_to_all_time(m: ModelSummary, mesh: MeshShape, tokens: int, passes: int, k: int) -> tuple[float, float, float]:
    """(bytes and seconds of dispatch + combine over the step, seconds of shared-expert compute hiding them)."""
    moe = [layer for layer in m.layers if layer.num_experts]
    # dispatch and combine per pass, each the busiest rank's share of top_k copies of its tokens
    sent = [2 * passes * tokens * layer.top_k * m.spec.hidden_size * m.dtype_bytes * EXPERT_IMBALANCE
            * (mesh.ep - 1) / mesh.ep for layer in moe]
    seconds = sum(_all_to_all_seconds(x, mesh.ep_group(0), k) for x in sent)
    shared = sum(passes * 6 * m.spec.hidden_size * layer.shared_width * tokens for layer in moe) / FLOPS
    return sum(sent), seconds, shared


def _all_gather_time(m: ModelSummary, mesh: MeshShape, k: int) -> tuple[float, float]:
    """(bytes, seconds): dense weights gathered over every rank, experts over their dp_shard group, in forward
    and again in backward."""
    dense = 2 * m.weight_bytes(m.dense, 0) * (mesh.world - 1) / mesh.world
    experts = 2 * m.weight_bytes(0, sum(_local_experts(layer, mesh) for layer in m.layers))
    experts *= (mesh.dp_shard - 1) / mesh.dp_shard
    return dense + experts, _ring_seconds(dense, list(range(mesh.world)), k) + _ring_seconds(experts, mesh.dp_group(0), k)


ASSUMPTIONS = {"peak_tflops": PEAK_TFLOPS, "mfu": MFU, "intra_node_gbps": INTRA_NODE_GBPS,
               "inter_node_gbps": INTER_NODE_GBPS, "host_gbps": HOST_GBPS, "expert_imbalance": EXPERT_IMBALANCE,
               "usable_fraction": USABLE_FRACTION, "workspace_gib": WORKSPACE_GIB}
