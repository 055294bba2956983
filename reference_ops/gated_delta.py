"""Reference gated delta rule (GDN) in fp64, token by token.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim, N packed sequences.

Per head, with the state S of shape [K, V]:
  S = diag(exp(g_t)) S;  S += beta_t k_t (v_t - S^T k_t)^T;  o_t = scale * S^T q_t
GDN uses one decay per head and token (g_BTH); KDA (kda.py) one per channel (g_BTHK).
The loop below takes the per-channel form; GDN broadcasts its scalar over K.
"""
from __future__ import annotations

import torch


def gated_delta_rule(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    scale: float | None = None,
    initial_state_BHKV: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BTHV, final_state_BHKV) in fp64; final_state is [N, H, K, V] when cu_seqlens packs N sequences."""
    g_BTHK = g_BTH[..., None].expand(q_BTHK.shape)
    return delta_rule_recurrence(
        q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale, initial_state_BHKV, use_qk_l2norm, cu_seqlens
    )


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: fla adds eps inside the root rather than clamping."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_recurrence(
    q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale, initial_state_BHKV, use_qk_l2norm, cu_seqlens
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared token loop of GDN and KDA, per-channel log decay g_BTHK."""
    q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH = (
        t.double() for t in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH)
    )
    if use_qk_l2norm:
        q_BTHK, k_BTHK = l2norm(q_BTHK), l2norm(k_BTHK)
    scale = q_BTHK.shape[-1] ** -0.5 if scale is None else scale
    batch, num_tokens = q_BTHK.shape[:2]
    bounds = [0, num_tokens] if cu_seqlens is None else cu_seqlens.tolist()
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"cu_seqlens needs batch 1, got q of shape {tuple(q_BTHK.shape)}")
    outputs, finals = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = _initial_state(initial_state_BHKV, q_BTHK, v_BTHV, n, cu_seqlens is not None)
        for t in range(start, end):
            state = state * g_BTHK[:, t, :, :, None].exp()
            k_BHK, beta_BH = k_BTHK[:, t], beta_BTH[:, t]
            delta_BHV = beta_BH[..., None] * (v_BTHV[:, t] - torch.einsum("bhkv,bhk->bhv", state, k_BHK))
            state = state + k_BHK[..., None] * delta_BHV[:, :, None, :]
            outputs.append(scale * torch.einsum("bhkv,bhk->bhv", state, q_BTHK[:, t]))
        finals.append(state)
    return torch.stack(outputs, dim=1), torch.cat(finals, dim=0)


def _initial_state(initial_state_BHKV, q_BTHK, v_BTHV, n: int, packed: bool) -> torch.Tensor:
    """State [B, H, K, V] a sequence starts from: zeros, or its slice of initial_state."""
    if initial_state_BHKV is None:
        batch, _, num_heads, key_dim = q_BTHK.shape
        return q_BTHK.new_zeros(batch, num_heads, key_dim, v_BTHV.shape[-1])
    initial_state_BHKV = initial_state_BHKV.double()
    return initial_state_BHKV[n : n + 1] if packed else initial_state_BHKV
