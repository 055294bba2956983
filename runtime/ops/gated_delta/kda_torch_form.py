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


def kda_log_decay(gate_in_BTHK: torch.Tensor, A_log_H: torch.Tensor, lower_bound: float | None = None) -> torch.Tensor:
    """g_BTHK in fp32 (contract: reference_ops/kda.py): -exp(A_log) softplus(gate_in) (Kimi Linear), or Kimi K3's
    lower-bounded lower_bound * sigmoid(exp(A_log) gate_in)."""
    decay_H1 = A_log_H.float().exp()[:, None]
    if lower_bound is None:
        return -decay_H1 * torch.nn.functional.softplus(gate_in_BTHK.float())
    return lower_bound * torch.sigmoid(decay_H1 * gate_in_BTHK.float())
