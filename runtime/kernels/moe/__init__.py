"""Fused Triton kernels for MoE.

- `route(...)`: the router; top-k and the softmax over the k picked in one pass forward and one
  backward where the routing rule allows it, else the torch form (runtime/ops/moe.py).
- `swiglu_experts(...)`: autograd op over grouped GEMMs with the token gather, the GLU, the routing
  weight and the scatter-combine fused into the GEMMs, optional expert LoRA in the same passes.
- `swiglu_mlp(...)`: the dense gated MLP and the shared expert: gate/up (and the shared-expert gate)
  in one GEMM, a Triton activation pass each way, the gate and the add to the routed output folded in.
- `Tuning`: the settings under measurement (defaults: the measured best).
Contracts are those of reference_ops/moe.py.
"""
from runtime.kernels.moe.experts import Tuning, swiglu_experts
from runtime.kernels.moe.gated_mlp import swiglu_mlp
from runtime.kernels.moe.router import route

__all__ = ["Tuning", "route", "swiglu_experts", "swiglu_mlp"]
