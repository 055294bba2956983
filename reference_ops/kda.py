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


def kda_log_decay(gate_in_BTHK: torch.Tensor, A_log_H: torch.Tensor, lower_bound: float | None = None) -> torch.Tensor:
    """g_BTHK in fp64, the log decay KDA's state takes from the forget gate's output gate_in (f_b(f_a(x)) + dt_bias):
    Kimi Linear's -exp(A_log) softplus(gate_in), or with lower_bound Kimi K3's lower_bound sigmoid(exp(A_log) gate_in),
    in (lower_bound, 0). A_log_H: one per head."""
    decay_H1 = A_log_H.double().exp()[:, None]
    gate_in_BTHK = gate_in_BTHK.double()
    if lower_bound is None:
        return -decay_H1 * torch.nn.functional.softplus(gate_in_BTHK)
    return lower_bound * torch.sigmoid(decay_H1 * gate_in_BTHK)
