"""Memory budget of LoRA fine-tuning a ModelSpec, and the smallest GPU count that holds it.

Estimates, per the usual accounting: frozen base weights as the release stores them (its dtype, or a
quantized release's codes and scales: spec.stored_groups), sharded over every GPU (FSDP x EP); LoRA parameters, gradients and AdamW moments in fp32 (16 bytes per parameter);
activations per token per GPU (what autograd keeps, per layer part, counted on the runtime model:
runtime/train/saved_bytes.py), the attention state a sequence carries; one chunk of the chunked loss's fp32 logits.
bench/bench_plan_memory.py compares the total with a measured peak.
"""
from __future__ import annotations

import math
import re

from pydantic import BaseModel

from onboard.recognize.weight_layout import attention_tensors
from runtime import defaults
from runtime.spec import DenseFFN, ModelSpec, MoEFFN, own_tensors

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
    weights_gib: float  # as stored: a quantized release's codes and scales
    weights_stored_as: str = ""  # the release's stored format, empty for a bf16/fp32 release
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


def weight_bytes_per_param(spec: ModelSpec) -> tuple[float, float, float]:
    """Bytes per parameter the frozen base takes as stored: (routed experts, vision tower, everything else); the
    release dtype's for an unquantized release."""
    b = DTYPE_BYTES.get(spec.dtype, 2)
    if not spec.stored_groups:
        return b, b, b
    rest = [g for name, g in spec.stored_groups.items() if name not in ("experts_routed", "vision")]
    rest_params = sum(g.params for g in rest)
    return (group_bytes_per_param(spec, "experts_routed"), group_bytes_per_param(spec, "vision"),
            sum(g.bytes for g in rest) / rest_params if rest_params else b)


def group_bytes_per_param(spec: ModelSpec, group: str) -> float:
    """Bytes per parameter of one ParamCounts category as stored (the release dtype's when not quantized)."""
    stored = (spec.stored_groups or {}).get(group)
    return stored.bytes / stored.params if stored and stored.params else DTYPE_BYTES.get(spec.dtype, 2)


def stored_weight_bytes(spec: ModelSpec) -> int:
    """Bytes of the whole frozen base as stored (buffers included)."""
    if spec.stored_groups:
        return sum(group.bytes for group in spec.stored_groups.values())
    return (spec.params.total + spec.params.buffers) * DTYPE_BYTES.get(spec.dtype, 2)


def lora_params(spec: ModelSpec, rank: int, targets: str = DEFAULT_LORA_TARGETS) -> int:
    rx = re.compile(targets)
    total = 0
    for layer in spec.layers:
        for name, shape in _attention_shapes(layer, spec).items():
            if len(shape) == 2 and rx.search(name):
                total += rank * (shape[0] + shape[1])
    return total


def _part_bytes(spec: ModelSpec, layer, b: int, lora_rank: int) -> tuple[int, int, int]:
    """Per token: (attention saved, attention ctx-held tiles, FFN saved) of one layer."""
    attn, tiles = _attention_saved(spec, layer, b, lora_rank), _chunk_kernel_bytes(layer.attention, b)
    return attn, tiles, _ffn_saved(spec.hidden_size, layer.ffn, b)


def _lora_saved(spec: ModelSpec, layer, b: int, lora_rank: int) -> int:
    """Each adapted projection keeps x @ A [r] (runtime/model/layers/lora_linear.py)."""
    rx = re.compile(DEFAULT_LORA_TARGETS)
    return b * lora_rank * sum(len(s) == 2 and bool(rx.search(n)) for n, s in _attention_shapes(layer, spec).items())


def _attention_saved(spec: ModelSpec, layer, b: int, lora_rank: int) -> int:
    """What the attention part saves per token. Softmax and gated delta: counted from the runtime (the
    tensor list in tests/runtime/test_saved_bytes.py); other kinds: every projection's input and output."""
    a, d = layer.attention, spec.hidden_size
    lora = _lora_saved(spec, layer, b, lora_rank)
    if a.kind == "softmax":
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        # qk norms keep their inputs and an fp32 rstd per head (runtime/ops/norm/kernel.py); rope keeps fp32 cos and
        # sin; lse is fp32
        norms = _norms(q + kv, b, a.num_heads + a.num_kv_heads) if a.qk_norm != "none" else 0
        # x, q, k, v, the output (and its gate), o_proj's input
        kept = b * (d + q + 2 * kv + (2 if a.output_gate else 1) * q + q)
        return kept + norms + 4 * a.num_heads + 8 * a.rope.rotary_dim + lora
    if a.kind == "gated_delta":
        H, J, K, V = a.num_v_heads, a.num_k_heads, a.head_k_dim, a.head_v_dim
        conv = 2 * J * K + H * V
        # x, the conv's input, q k (per value head) v, beta, o_proj's input; the gated norm's input and gate and
        # its rstd per head; two fp32 [H] of the decay's softplus and exp
        return b * (d + conv + 2 * H * K + H * V + H + H * V) + _norms(H * V, b, H) + b * H * V + 8 * H + lora
    widths = sum(s[0] for s in _attention_shapes(layer, spec).values() if len(s) == 2)
    return b * (d + widths) + lora


def _ffn_saved(d: int, ffn, b: int) -> int:
    """What the FFN part saves per token: its input, then the fused kernels' (runtime/ops/moe/experts.py,
    runtime/ops/mlp/kernel.py): per routed choice the fp32 weight, int64 index, gate-up [2F] and h [F]; the
    shared or dense MLP's gate-up rows (with the shared gate's one, padded to 8) and h."""
    if isinstance(ffn, MoEFFN):
        routed = ffn.top_k * (12 + 3 * b * ffn.expert_intermediate_size)
        fs = ffn.shared_intermediate_size
        shared = b * (_pad8(2 * fs + ffn.shared_expert_gate) + fs) if fs else 0
        return b * d + routed + shared
    if isinstance(ffn, DenseFFN):
        return b * (d + _pad8(2 * ffn.intermediate_size) + ffn.intermediate_size)
    # an own module's structure is unknown: every matmul output kept, experts as if all active
    return b * (d + sum(s[0] for s in own_tensors(ffn).values() if len(s) == 2))


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _chunk_kernel_bytes(a, b: int) -> int:
    """Per token: the tiles the chunked GDN kernel holds on its ctx for backward
    (the gated-delta op's function.py: w and v_new, P and Tinv in the activation dtype; u, the norms and qg's
    and kbar's factors by row in fp32; every chunk's state h [H, K, V]). Held on ctx, so recompute does not drop
    them."""
    if a.kind != "gated_delta":
        return 0
    H, K, V, C = a.num_v_heads, a.head_k_dim, a.head_v_dim, LINEAR_CHUNK
    return b * (H * K + H * V + 2 * H * C) + 4 * (H * V + 2 * H + 2 * H) + b * H * K * V // C


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


# Activation policies: keep everything; recompute each layer part in backward from its kept input; recompute with
# the layer inputs offloaded to host memory (the current and the next one in flight stay on the GPU).
POLICIES = ("none", "recompute", "offload")
# Chunked linear attention's chunk: the kernel's intra-chunk products span this many tokens (the planner's cost
# model reads it too; tests/onboard/test_budget.py checks it is the kernel's)
LINEAR_CHUNK = 64
# The trainer's LM-head chunk (runtime/train/loop.py TrainConfig.loss_chunk): the [chunk, vocab] fp32 logits and
# their gradient are the only logits alive (runtime/model/loss.py)
LOSS_CHUNK = 1024
# Tokens per chunk of the sparse attention backward (runtime/ops/dsa/attention.py BWD_CHUNK_TOKENS): its
# probabilities and score gradients are two [chunk, H, top-k] buffers, alive while one layer's backward runs
DSA_BWD_CHUNK = 2048


def _norms(d: int, b: int, rows: int = 1) -> int:
    """Per token, RMSNorms over `rows` rows of d // rows: their input (b bytes an element) and an fp32 rstd per row
    (runtime/ops/norm/kernel.py)."""
    return b * d + 4 * rows


def _kept_and_backward(spec: ModelSpec, policy: str, lora_rank: int) -> tuple[int, int]:
    """Per token: (kept from the forward to the backward, what the backward adds at its peak), all layers.
    The terms are what autograd keeps, counted on the runtime model (runtime/train/saved_bytes.py;
    tests/runtime/test_saved_bytes.py recounts them on a tiny config): without recompute every part's saved
    tensors; with it each part's input, the norms (outside the parts) and the GDN tiles held on ctx, and in
    backward one part rebuilt (the largest). Autograd frees a node's saved tensors once it has run, so the
    backward adds the gradients in flight, a layer input's and output's (2 widths D)."""
    b, d = DTYPE_BYTES.get(spec.dtype, 2), spec.hidden_size
    parts = [_part_bytes(spec, layer, b, lora_rank) for layer in spec.layers]
    in_flight = 2 * b * d
    if policy == "none":
        return sum(2 * _norms(d, b) + sum(p) for p in parts), in_flight
    kept_layers = spec.num_layers if policy == "recompute" else min(2, spec.num_layers)
    kept = kept_layers * (2 * _norms(d, b) + 2 * b * d) + sum(tiles for _, tiles, _ in parts)
    rebuilt = max((max(attn + tiles, ffn) for attn, tiles, ffn in parts), default=0)
    return kept, rebuilt + in_flight


def activation_bytes_per_token(spec: ModelSpec, policy: str, lora_rank: int = defaults.LORA_RANK) -> int:
    """What backward needs per token under `policy`, all layers, at its peak (_kept_and_backward)."""
    return sum(_kept_and_backward(spec, policy, lora_rank))


def activations(spec: ModelSpec, seq_len: int, policy: str = "recompute", lora_rank: int = defaults.LORA_RANK) -> int:
    """Bytes one sequence of seq_len needs on a GPU at the step's peak: what the forward keeps (activations,
    attention state, the loss's gradient of its input, the final norm), plus the larger of the loss's one chunk
    of logits (alive only in the forward: runtime/model/loss.py forms the gradient there) and the backward's peak."""
    b, d = DTYPE_BYTES.get(spec.dtype, 2), spec.hidden_size
    per_token_state, per_sequence_state = _state_bytes(spec, b)
    kept, backward = _kept_and_backward(spec, policy, lora_rank)
    # fp32 logits of one chunk and their gradient
    logits = 8 * spec.vocab_size * min(seq_len, LOSS_CHUNK)
    # the loss keeps its input's gradient [T, D] for backward; the final norm its input and rstd
    head = b * d + _norms(d, b)
    return (seq_len * (kept + per_token_state + head) + per_sequence_state
            + max(logits, seq_len * backward + _dsa_backward_workspace(spec, b, seq_len)))


def _dsa_backward_workspace(spec: ModelSpec, b: int, seq_len: int) -> int:
    """The sparse attention backward's p and ds buffers of one chunk of tokens, for the widest DSA layer."""
    chunk = min(seq_len, DSA_BWD_CHUNK)
    return max((2 * b * chunk * layer.attention.num_heads * min(layer.attention.indexer.topk, seq_len)
                for layer in spec.layers if layer.attention.kind == "mla" and layer.attention.indexer), default=0)


def stored_as(spec: ModelSpec) -> str:
    """The formats the base ships in per tensor group, e.g. "experts_routed: MXFP4 (gpt-oss blocks); attention: bf16";
    empty for an unquantized release."""
    if not spec.stored_groups:
        return ""
    return "; ".join(f"{name}: {' + '.join(group.formats)}" for name, group in spec.stored_groups.items())


def budget(spec: ModelSpec, gpu_mem_gib: float = defaults.GPU_MEM_GIB, lora_rank: int = defaults.LORA_RANK,
           seq_len: int = defaults.SEQ_LEN) -> MemoryBudget:
    b = DTYPE_BYTES.get(spec.dtype, 2)
    weights = stored_weight_bytes(spec)
    n_lora = lora_params(spec, lora_rank)
    lora_states = LORA_STATE_BYTES * n_lora
    per_token_state, per_sequence_state = _state_bytes(spec, b)
    per_gpu = activations(spec, seq_len, lora_rank=lora_rank)
    capacity = gpu_mem_gib * GIB * USABLE_FRACTION - per_gpu - WORKSPACE_GIB * GIB
    min_gpus = math.ceil((weights + lora_states) / capacity) if capacity > 0 else -1
    return MemoryBudget(
        dtype_bytes=b, weights_gib=weights / GIB, weights_stored_as=stored_as(spec), lora_rank=lora_rank, lora_params=n_lora,
        lora_states_gib=lora_states / GIB,
        activation_bytes_per_token=activation_bytes_per_token(spec, "none", lora_rank),
        activation_bytes_per_token_recompute=activation_bytes_per_token(spec, "recompute", lora_rank),
        state_bytes_per_token=per_token_state, recurrent_state_bytes_per_sequence=per_sequence_state,
        seq_len=seq_len, gpu_mem_gib=gpu_mem_gib, per_gpu_activations_gib=per_gpu / GIB,
        min_gpus=max(min_gpus, 1) if min_gpus > 0 else -1)
