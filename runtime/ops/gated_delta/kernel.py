"""Fused Triton kernels for the gated delta rule (GDN, scalar decay) and KDA (per-channel decay).

Same signatures and return values as reference_ops/gated_delta.py and reference_ops/kda.py:
o in q's dtype, final state in fp32. Inputs bf16 or fp32; accumulation and state in fp32.
function.py launches the kernels of forward.py, diagonal.py and backward.py (helpers in common.py).
"""
import torch

from runtime.ops.gated_delta.function import gated_delta_rule

__all__ = ["gated_delta_rule", "kda"]


def kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale=None, initial_state_BHKV=None, use_qk_l2norm=True,
        cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BTHV, final_state_BHKV); g_BTHK log decay per head, token and key channel."""
    return gated_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale, initial_state_BHKV, use_qk_l2norm,
                            cu_seqlens)
