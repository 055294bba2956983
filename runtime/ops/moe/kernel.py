"""Fused Triton kernels for MoE: the router (router.py) and the routed experts over grouped GEMMs (experts.py), with
base weights as tensors or, frozen, in their released format (stored_swiglu_experts). The dense MLP and shared
expert are runtime/ops/mlp/kernel.py. Contracts are those of reference_ops/moe.py and reference_ops/stored.py."""
from runtime.ops.moe.experts import stored_swiglu_experts, swiglu_experts
from runtime.ops.moe.router import route

__all__ = ["route", "stored_swiglu_experts", "swiglu_experts"]
