"""Memory budget of LoRA fine-tuning a ModelSpec, and the smallest GPU count that holds it.

Estimates, per the usual accounting: frozen base weights in the release dtype, sharded over every
GPU (FSDP x EP); LoRA parameters, gradients and AdamW moments in fp32 (16 bytes per parameter);
activations per token per GPU (matmul inputs and outputs, the router's fp32 scores, the chunked linear-
attention kernels' tiles and states, and the backward's working set of one layer); the attention state a
sequence carries; one chunk of the chunked loss's fp32 logits. bench/bench_plan_memory.py compares the total
with a measured peak.
"""
from __future__ import annotations

import math
import re

from pydantic import BaseModel

from onboard.spec import DenseFFN, ModelSpec, MoEFFN, own_tensors
from onboard.weight_layout import attention_tensors

GIB = 1 << 30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
# Released projection names LoRA targets by default: attention in/out projections of every kind.
DEFAULT_LORA_TARGETS = (r"(^|\.)(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|"
                        r"in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|out_proj|qkv_proj)\.weight$")
# Headroom for the CUDA context, allocator fragmentation and NCCL buffers.
USABLE_FRACTION = 0.9
WORKSPACE_GIB = 4.0
# fp32 LoRA parameter, its gradient and AdamW's two moments
LORA_STATE_BYTES = 16


class MemoryBudget(BaseModel):
    dtype_bytes: int
    weights_gib: float
    lora_rank: int
    lora_params: int
    lora_states_gib: float  # params + grads + AdamW moments, fp32
    activation_bytes_per_token: int  # no recompute: everything backward needs, all layers
    activation_bytes_per_token_recompute: int  # layer inputs kept, one layer rebuilt at a time
    state_bytes_per_token: int  # softmax/MLA KV and DSA indexer keys, all layers
    recurrent_state_bytes_per_sequence: int  # linear-attention states, all layers, fp32
    seq_len: int
    gpu_mem_gib: float
    per_gpu_activations_gib: float  # recompute on, one sequence of seq_len
    min_gpus: int


def lora_params(spec: ModelSpec, rank: int, targets: str = DEFAULT_LORA_TARGETS) -> int:
    rx = re.compile(targets)
    total = 0
    for layer in spec.layers:
        for name, shape in _attention_shapes(layer, spec).items():
            if len(shape) == 2 and rx.search(name):
                total += rank * (shape[0] + shape[1])
    return total


def _layer_activation_bytes(spec: ModelSpec, layer, b: int) -> int:
    """Per token: what autograd keeps for one layer (inputs of every matmul, norms, gates, chunk-kernel tiles)."""
    d = spec.hidden_size
    attn_widths = sum(s[0] for s in _attention_shapes(layer, spec).values() if len(s) == 2)
    per_token = 4 * d + 2 * attn_widths  # norms in/out, projections' inputs and outputs
    ffn = layer.ffn
    if isinstance(ffn, MoEFFN):
        per_token += ffn.top_k * (d + 3 * ffn.expert_intermediate_size)
        per_token += 3 * ffn.shared_intermediate_size
    elif isinstance(ffn, DenseFFN):
        per_token += 3 * ffn.intermediate_size
    else:
        # an own module's structure is unknown: every matmul output kept, experts as if all active
        per_token += sum(s[0] for s in own_tensors(ffn).values() if len(s) == 2)
    # the router's logits and scores, fp32 (routing is computed in fp32)
    router = 8 * ffn.num_experts if isinstance(ffn, MoEFFN) else 0
    return per_token * b + router + _chunk_kernel_bytes(layer.attention, b)


def _chunk_kernel_bytes(a, b: int) -> int:
    """Per token: what the chunked GDN/KDA kernels keep for backward (runtime/kernels/gated_delta/function.py):
    q and k repeated to the value heads, v, the tiles qg, kbar, w and v_new in the activation dtype, u and Tinv
    in fp32, P, and every chunk's state h [H, K, V]."""
    if a.kind == "gated_delta":
        heads, dk, dv = a.num_v_heads, a.head_k_dim, a.head_v_dim
    elif a.kind == "kda":
        heads, dk, dv = a.num_heads, a.head_dim, a.head_dim
    else:
        return 0
    tiles = (5 * heads * dk + 2 * heads * dv + heads * LINEAR_CHUNK) * b + (heads * dv + heads * LINEAR_CHUNK) * 4
    return tiles + heads * dk * dv * b // LINEAR_CHUNK


def _attention_shapes(layer, spec: ModelSpec) -> dict:
    own = own_tensors(layer.attention)
    return {n: tuple(s) for n, s in own.items()} if own else attention_tensors(layer.attention, spec.hidden_size, spec.naming)


def _state_bytes(spec: ModelSpec, b: int) -> tuple[int, int]:
    per_token, per_sequence = 0, 0
    for layer in spec.layers:
        a = layer.attention
        if a.kind == "softmax":
            per_token += 2 * a.num_kv_heads * a.head_dim * b
        elif a.kind == "mla":
            per_token += (a.kv_lora_rank + a.qk_rope_head_dim) * b
            per_token += a.indexer.head_dim * b if a.indexer else 0
        elif a.kind == "gated_delta":
            per_sequence += a.num_v_heads * a.head_k_dim * a.head_v_dim * 4
        elif a.kind in ("kda", "lightning"):
            per_sequence += a.num_heads * a.head_dim * a.head_dim * 4
    return per_token, per_sequence


# Activation policies: keep everything; recompute each layer in backward from its kept input; recompute with
# the layer inputs offloaded to host memory (the current and the next one in flight stay on the GPU).
POLICIES = ("none", "recompute", "offload")
# What a recomputed layer keeps per token, in widths D: its two norms' inputs and its two parts' (checkpointed
# attention and FFN) inputs (runtime/model.py, runtime/memory.py)
KEPT_PER_LAYER = 4
# Chunked linear attention's chunk (runtime/kernels/gated_delta/function.py CHUNK_SIZE)
LINEAR_CHUNK = 64
# The trainer's LM-head chunk (runtime/train.py TrainConfig.loss_chunk): the [chunk, vocab] fp32 logits and
# their gradient are the only logits alive (runtime/loss.py)
LOSS_CHUNK = 1024


def activation_bytes_per_token(spec: ModelSpec, policy: str) -> int:
    """What backward needs per token under `policy`, all layers: without recompute every layer's activations and
    one layer's again (the gradients and kernel scratch of the layer in backward); with it the kept inputs and
    one layer twice (rebuilt, and its backward). The slice's measured peaks fit this (bench/NOTES.md)."""
    b = DTYPE_BYTES.get(spec.dtype, 2)
    per_layer = [_layer_activation_bytes(spec, layer, b) for layer in spec.layers]
    one_layer = max(per_layer, default=0)
    if policy == "none":
        return sum(per_layer) + one_layer
    kept_inputs = spec.num_layers if policy == "recompute" else min(2, spec.num_layers)
    return KEPT_PER_LAYER * kept_inputs * spec.hidden_size * b + 2 * one_layer


def activations(spec: ModelSpec, seq_len: int, policy: str = "recompute") -> int:
    """Bytes one sequence of seq_len needs on a GPU: activations, attention state, one chunk of the loss's logits."""
    b = DTYPE_BYTES.get(spec.dtype, 2)
    per_token_state, per_sequence_state = _state_bytes(spec, b)
    # fp32 logits of one chunk and their gradient (forward: bf16 product and fp32 copy; backward: two fp32)
    logits = 8 * spec.vocab_size * min(seq_len, LOSS_CHUNK)
    return seq_len * (activation_bytes_per_token(spec, policy) + per_token_state) + per_sequence_state + logits


def budget(spec: ModelSpec, gpu_mem_gib: float = 80.0, lora_rank: int = 16, seq_len: int = 4096) -> MemoryBudget:
    b = DTYPE_BYTES.get(spec.dtype, 2)
    weights = (spec.params.total + spec.params.buffers) * b
    n_lora = lora_params(spec, lora_rank)
    lora_states = LORA_STATE_BYTES * n_lora
    per_token_state, per_sequence_state = _state_bytes(spec, b)
    per_gpu = activations(spec, seq_len)
    capacity = gpu_mem_gib * GIB * USABLE_FRACTION - per_gpu - WORKSPACE_GIB * GIB
    min_gpus = math.ceil((weights + lora_states) / capacity) if capacity > 0 else -1
    return MemoryBudget(
        dtype_bytes=b, weights_gib=weights / GIB, lora_rank=lora_rank, lora_params=n_lora,
        lora_states_gib=lora_states / GIB, activation_bytes_per_token=activation_bytes_per_token(spec, "none"),
        activation_bytes_per_token_recompute=activation_bytes_per_token(spec, "recompute"),
        state_bytes_per_token=per_token_state, recurrent_state_bytes_per_sequence=per_sequence_state,
        seq_len=seq_len, gpu_mem_gib=gpu_mem_gib, per_gpu_activations_gib=per_gpu / GIB,
        min_gpus=max(min_gpus, 1) if min_gpus > 0 else -1)
