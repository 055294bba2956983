"""Reference multi-head latent attention (DeepSeek-V2/V3, Kimi K2) in fp64, causal.

Shape legend: B batch, T tokens, D model width, H heads, N = qk_nope_head_dim, P = qk_rope_head_dim (= R),
V = v_head_dim, Q = q_lora_rank, L = kv_lora_rank.
Weights are nn.Linear layout [out, in] under the release's names; the two latent norms are RMSNorms.
"""

from __future__ import annotations

import torch

from reference_ops.attention import softmax_attention
from reference_ops.norms import rms_norm
from reference_ops.rope import apply_rope


def mla_attention(
    x_BTD: torch.Tensor,
    params: dict[str, torch.Tensor],
    *,
    num_heads: int,
    q_lora_rank: int | None,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    cos_BTR: torch.Tensor,
    sin_BTR: torch.Tensor,
    scale: float,
    eps: float,
    interleaved_rope: bool,
) -> torch.Tensor:
    """o_BTD. Each head's query is [nope N | rope P]; keys are [per-head nope N | one shared rope P];
    values per head V, all decompressed from one latent of width L. scale is the full softmax scale
    (for yarn releases it already includes mscale^2, see runtime.ops.mla.mla_softmax_scale). NoPE MLA (Kimi)
    passes cos 1 and sin 0: the rope part used unrotated. With params["g_proj"] [H * V, D] (Kimi K3's output gate)
    the heads' output is multiplied by sigmoid(x @ g_proj^T) before o_proj.
    """
    weight = {name: w.double() for name, w in params.items()}
    x_BTD = x_BTD.double()
    batch, num_tokens = x_BTD.shape[:2]
    q_BTHK = _queries(x_BTD, weight, num_heads, q_lora_rank, qk_nope_head_dim + qk_rope_head_dim, eps)
    q_nope_BTHN, q_rope_BTHP = q_BTHK.split([qk_nope_head_dim, qk_rope_head_dim], dim=-1)
    q_rope_BTHP = apply_rope(q_rope_BTHP, cos_BTR, sin_BTR, interleaved_rope)

    kv_a_BTX = x_BTD @ weight["kv_a_proj_with_mqa"].T
    latent_BTL, k_rope_BTP = kv_a_BTX.split([kv_lora_rank, qk_rope_head_dim], dim=-1)
    k_rope_BT1P = apply_rope(k_rope_BTP.unsqueeze(2), cos_BTR, sin_BTR, interleaved_rope)
    kv_BTX = rms_norm(latent_BTL, weight["kv_a_layernorm"], eps) @ weight["kv_b_proj"].T
    kv_BTHX = kv_BTX.view(batch, num_tokens, num_heads, qk_nope_head_dim + v_head_dim)
    k_nope_BTHN, v_BTHV = kv_BTHX.split([qk_nope_head_dim, v_head_dim], dim=-1)

    q_BTHK = torch.cat([q_nope_BTHN, q_rope_BTHP], dim=-1)
    k_BTHK = torch.cat([k_nope_BTHN, k_rope_BT1P.expand(-1, -1, num_heads, -1)], dim=-1)
    o_BTHV = softmax_attention(q_BTHK, k_BTHK, v_BTHV, scale, causal=True)
    o_BTX = o_BTHV.reshape(batch, num_tokens, num_heads * v_head_dim)
    if "g_proj" in weight:
        o_BTX = o_BTX * torch.sigmoid(x_BTD @ weight["g_proj"].T)
    return o_BTX @ weight["o_proj"].T


def _queries(x_BTD, weight, num_heads, q_lora_rank, qk_head_dim, eps) -> torch.Tensor:
    """q_BTHK, through the low-rank path q_b(norm(q_a(x))) when the release has one."""
    if q_lora_rank is None:
        q_BTX = x_BTD @ weight["q_proj"].T
    else:
        q_BTX = rms_norm(x_BTD @ weight["q_a_proj"].T, weight["q_a_layernorm"], eps) @ weight["q_b_proj"].T
    return q_BTX.view(*x_BTD.shape[:2], num_heads, qk_head_dim)
