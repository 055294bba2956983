"""Reference lightning attention (MiniMax linear attention with a fixed per-head decay) in fp64, token by token.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim.
"""

from __future__ import annotations

import torch


def lightning_attention(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    slope_H: torch.Tensor,
    initial_state_BHKV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BTHV, final_state_BHKV) of S_t = exp(-slope) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t.

    No scale and no normalization: the layer applies its own norm and gate.
    """
    q_BTHK, k_BTHK, v_BTHV = q_BTHK.double(), k_BTHK.double(), v_BTHV.double()
    batch, num_tokens, num_heads, key_dim = q_BTHK.shape
    decay_H11 = torch.exp(-slope_H.double())[:, None, None]
    if initial_state_BHKV is None:
        state_BHKV = q_BTHK.new_zeros(batch, num_heads, key_dim, v_BTHV.shape[-1])
    else:
        state_BHKV = initial_state_BHKV.double()
    outputs = []
    for t in range(num_tokens):
        state_BHKV = decay_H11 * state_BHKV + k_BTHK[:, t, :, :, None] * v_BTHV[:, t, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_BTHK[:, t], state_BHKV))
    return torch.stack(outputs, dim=1), state_BHKV
