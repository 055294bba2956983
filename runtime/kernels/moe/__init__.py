"""Fused Triton kernels for MoE.

- `route(...)`: the router; top-k and the softmax over the k picked in one pass forward and one
  backward where the routing rule allows it, else the torch form (runtime/ops/moe.py).
- `swiglu_experts(...)`: autograd op over grouped GEMMs with the token gather, the GLU, the routing
  weight and the scatter-combine fused into the GEMMs, optional expert LoRA in the same passes.
The dense MLP and shared expert are runtime/kernels/mlp.py. Contracts are those of reference_ops/moe.py.
"""
from runtime.kernels.moe.experts import swiglu_experts
from runtime.kernels.moe.router import route

__all__ = ["route", "swiglu_experts"]
