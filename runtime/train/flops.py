"""FLOPs of one training step, for MFU: forward plus input-gradient FLOPs of every matmul and attention
product, plus the weight gradients of what trains (LoRA); recompute is not counted.

Projections are counted from the model's own weights (2 FLOPs per multiply-add, per token): a frozen
weight costs forward + input gradient (2 passes), a trained one also its weight gradient (3 passes),
the DSA indexer (no graph) its forward only. Routed experts count top_k of their E experts per token.
Token mixing is counted per packed segment of n tokens from the model's config (forward; backward 2x):
  softmax (causal, window w): 2 (K_qk + K_v) H sum_t min(t + 1, w)
  MLA: K_qk = N + R, K_v = V; DSA: each query over min(t + 1, topk) keys in the latent (L + R, L),
       plus the indexer's 2 I J n(n+1)/2 (forward only)
  GDN / KDA (chunk C = 64, per token and head): 6 K V (state read, correction, update) + C (2 K + V)
  lightning (per token and head): 4 K V + C (K + V)
  own modules (transformers' code, no formula known here): token mixing not counted, so the MFU of a
  package with own attention is a lower bound; their projections are counted from their weights as above.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.formats.weight import StoredWeight
from runtime.spec import Attention
from runtime.model.layers.ffn import Experts, MoE, Router

CHUNK = 64
# Dense bf16 matmul peak per device, FLOP/s: the H200's is the measured 8192^3 ceiling of TARGETS.md
# rounded down to the bar the issue sets; the others are vendor dense bf16 figures.
PEAK_BF16 = {"H200": 790e12, "H100": 790e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    """The table's peak for this device; None on CPU or an unlisted GPU (MFU is then reported as null)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def _passes(weight: torch.Tensor, in_indexer: bool) -> int:
    if in_indexer:
        return 1
    return 3 if weight.requires_grad else 2


def _per_token(module: nn.Module, pname: str, weight: torch.Tensor, top_k: int | None) -> float:
    """Multiply-add FLOPs per token of one weight read as a matmul; 0 for weights that are not."""
    if isinstance(module, nn.Linear) and pname == "weight" or isinstance(module, Router) and pname == "weight":
        return 2.0 * weight.numel()
    if isinstance(module, Experts) and pname.startswith("w_") or pname.startswith("lora") and weight.dim() == 3:
        return 2.0 * weight[0].numel() * top_k
    if pname.startswith("lora") and weight.dim() == 2:
        return 2.0 * weight.numel()
    return 0.0


def _stored_per_token(name: str, weight: StoredWeight, top_k: int | None) -> float:
    """As _per_token, for a weight held stored (runtime/formats/weight.py) under module name `name`."""
    if ".experts." in f".{name}.":
        return 2.0 * weight.shape[1:].numel() * top_k
    return 2.0 * weight.shape.numel()


def projection_flops_per_token(model: nn.Module) -> float:
    """Every projection weight's matmul FLOPs per token, the LM head included."""
    total, top_k = 0.0, None
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            top_k = module.router.top_k
        in_indexer = ".indexer" in f".{name}"
        if isinstance(module, StoredWeight):
            # frozen: a forward and an input-gradient matmul of its decoded form
            total += _stored_per_token(name, module, top_k) * (1 if in_indexer else 2)
        for pname, weight in module.named_parameters(recurse=False):
            total += _per_token(module, pname, weight, top_k) * _passes(weight, in_indexer)
    # tied head: the embedding matrix read as a matmul (a model run whole as transformers' own counts its head as a linear)
    if model.lm_head is None and model.embed_tokens is not None:
        total += 2 * 2 * model.embed_tokens.weight.numel()
    return total


def _pairs(n: int, limit: int | None) -> int:
    """sum over t < n of min(t + 1, limit): causal query-key pairs, capped per query."""
    if limit is None or limit >= n:
        return n * (n + 1) // 2
    return limit * (limit + 1) // 2 + (n - limit) * limit


def mixing_flops(a: Attention, n: int) -> tuple[float, float]:
    """(forward FLOPs with a backward, forward-only FLOPs) of one layer's token mixing over n tokens."""
    if a.kind == "softmax":
        return 2 * 2 * a.head_dim * a.num_heads * _pairs(n, a.sliding_window), 0.0
    if a.kind == "mla" and a.indexer is None:
        return 2 * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * a.num_heads * _pairs(n, None), 0.0
    if a.kind == "mla":
        index = a.indexer
        return (2 * (2 * a.kv_lora_rank + a.qk_rope_head_dim) * a.num_heads * _pairs(n, index.topk),
                2 * index.num_heads * index.head_dim * _pairs(n, None))
    if a.kind == "gated_delta":
        K, V = a.head_k_dim, a.head_v_dim
        return float(n * a.num_v_heads * (6 * K * V + CHUNK * (2 * K + V))), 0.0
    if a.kind == "kda":
        K = a.head_dim
        return float(n * a.num_heads * (6 * K * K + CHUNK * 3 * K)), 0.0
    if a.kind == "lightning":
        K = a.head_dim
        return float(n * a.num_heads * (4 * K * K + CHUNK * 2 * K)), 0.0
    if a.kind == "own_module":
        return 0.0, 0.0
    raise ValueError(f"no FLOP count for attention kind {a.kind!r}")


def step_flops(model: nn.Module, segment_lengths: list[int]) -> float:
    """Training FLOPs (forward + backward as defined above) of a step over these packed segments."""
    total = projection_flops_per_token(model) * sum(segment_lengths)
    for layer in model.config.layers[: len(model.layers)]:
        for n in segment_lengths:
            with_grad, forward_only = mixing_flops(layer.attention, n)
            total += 3 * with_grad + forward_only
    return total
