"""KDA (Kimi Delta Attention) in the runtime: the gated delta rule's chunked torch form
(runtime/ops/gated_delta/torch_form.py, where the algebra is) with a per-channel decay, differentiable by autograd.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim.
"""
from __future__ import annotations

import torch

from runtime.ops.gated_delta.torch_form import chunked_delta_rule


def kda(
    q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale=None, initial_state_BHKV=None, use_qk_l2norm=True, cu_seqlens=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BTHV in q's dtype, final_state_BHKV in fp32) of KDA: GDN with a per-channel decay g_BTHK."""
    return chunked_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale, initial_state_BHKV, use_qk_l2norm,
                              cu_seqlens)
