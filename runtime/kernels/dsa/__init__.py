"""Fused Triton kernels for DeepSeek-V3.2 sparse attention (DSA), MLA absorbed layout.

- `indexer_topk(q_BTHK, k_BTK, weights_BTH, scale, topk) -> idx_BTS`: fused lightning-indexer
  scoring, one query block at a time (no [T, T] tensor), then top-k. Forward only.
- `sparse_attention(q_BTHK, kv_BTK, idx_BTS, scale, v_dim) -> o_BTHV`: autograd op with Triton
  forward and backward (dq, dkv).
Contracts are those of reference_ops/dsa.py.
"""
from runtime.kernels.dsa.attention import sparse_attention
from runtime.kernels.dsa.indexer import indexer_topk

__all__ = ["indexer_topk", "sparse_attention"]
