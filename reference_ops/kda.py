"""Reference KDA (Kimi delta attention: gated delta rule with a per-channel decay) in fp64, token by token.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim, N packed sequences.
"""
from __future__ import annotations

import torch

from reference_ops.gated_delta import delta_rule_recurrence


def kda(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    scale: float | None = None,
    initial_state_BHKV: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BTHV, final_state_BHKV) in fp64 of S = diag(exp(g_t)) S; S += beta_t k_t (v_t - S^T k_t)^T; o_t = scale S^T q_t."""
    return delta_rule_recurrence(
        q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale, initial_state_BHKV, use_qk_l2norm, cu_seqlens
    )
