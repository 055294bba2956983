"""Fused Triton kernels for MoE experts.

- `swiglu_experts(...)`: autograd op over grouped GEMMs with the token gather, the GLU, the routing
  weight and the scatter-combine fused into the GEMMs, optional expert LoRA in the same passes.
- `Tuning`: the kernel variants under measurement (all off by default).
- `route(...)`: the router; the torch form is used (top-k over [T, E] is a small share of the block).
Contracts are those of reference_ops/moe.py.
"""
from runtime.kernels.moe.experts import Tuning, swiglu_experts
from runtime.ops.moe import route

__all__ = ["Tuning", "route", "swiglu_experts"]
