"""Fused kernels for DeepSeek-V3.2 sparse attention (DSA), MLA absorbed layout: the lightning indexer's top-k
(forward only) and the sparse attention (forward and backward), in Triton, the attention's forward and dkv pass in
Gluon on Hopper. Contracts of reference_ops/dsa.py."""
from runtime.ops.dsa.attention import sparse_attention
from runtime.ops.dsa.indexer import indexer_topk

__all__ = ["indexer_topk", "sparse_attention"]
