"""Fused Triton kernels for MoE: the router (router.py) and the routed experts over grouped GEMMs (experts.py).
The dense MLP and shared expert are runtime/ops/mlp/kernel.py. Contracts are those of reference_ops/moe.py."""
from runtime.ops.moe.experts import swiglu_experts
from runtime.ops.moe.router import route

__all__ = ["route", "swiglu_experts"]
