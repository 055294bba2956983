"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) in the runtime: latents expanded per head, SDPA.

Shape legend: B batch, T tokens, D model width, H heads, N = qk_nope_head_dim, P = qk_rope_head_dim (= R),
V = v_head_dim, Q = q_lora_rank, L = kv_lora_rank.
Weights are nn.Linear layout [out, in] under the release's names; the two latent norms are RMSNorms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.ops.attention.torch_form import softmax_attention
from runtime.ops.norm.torch_form import rms_norm
from runtime.ops.rope.torch_form import apply_rope, yarn_mscale


def mla_softmax_scale(qk_head_dim: int, scaling: dict | None) -> float:
    """(N + P)^-0.5, times mscale(factor, mscale_all_dim)^2 for scaled rope (DeepSeek-V3 yarn), as transformers."""
    scale = qk_head_dim**-0.5
    scaling = scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


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
    """o_BTD in x's dtype; causal. scale is the full softmax scale (see mla_softmax_scale). params["g_proj"], when
    given: Kimi K3's output gate, sigmoid(x @ g_proj^T) times the heads' output before o_proj."""
    batch, num_tokens = x_BTD.shape[:2]
    q_BTHK = _queries(x_BTD, params, num_heads, q_lora_rank, qk_nope_head_dim + qk_rope_head_dim, eps)
    q_nope_BTHN, q_rope_BTHP = q_BTHK.split([qk_nope_head_dim, qk_rope_head_dim], dim=-1)
    q_rope_BTHP = apply_rope(q_rope_BTHP, cos_BTR, sin_BTR, interleaved_rope)

    latent_BTL, k_rope_BTP = F.linear(x_BTD, params["kv_a_proj_with_mqa"]).split(
        [kv_lora_rank, qk_rope_head_dim], dim=-1
    )
    k_rope_BT1P = apply_rope(k_rope_BTP.unsqueeze(2), cos_BTR, sin_BTR, interleaved_rope)
    kv_BTX = F.linear(rms_norm(latent_BTL, params["kv_a_layernorm"], eps), params["kv_b_proj"])
    kv_BTHX = kv_BTX.view(batch, num_tokens, num_heads, qk_nope_head_dim + v_head_dim)
    k_nope_BTHN, v_BTHV = kv_BTHX.split([qk_nope_head_dim, v_head_dim], dim=-1)

    q_BTHK = torch.cat([q_nope_BTHN, q_rope_BTHP], dim=-1)
    k_BTHK = torch.cat([k_nope_BTHN, k_rope_BT1P.expand(-1, -1, num_heads, -1)], dim=-1)
    o_BTHV = softmax_attention(q_BTHK, k_BTHK, v_BTHV, scale, causal=True)
    return F.linear(output_gated(o_BTHV.reshape(batch, num_tokens, num_heads * v_head_dim), x_BTD, params),
                    params["o_proj"])


def output_gated(o_BTX: torch.Tensor, x_BTD: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """o * sigmoid(x @ g_proj^T) where the release has Kimi K3's MLA output gate; o as it is otherwise."""
    gate = params.get("g_proj")
    return o_BTX if gate is None else o_BTX * torch.sigmoid(F.linear(x_BTD, gate))


def _queries(x_BTD, params, num_heads, q_lora_rank, qk_head_dim, eps) -> torch.Tensor:
    """q_BTHK, through the low-rank path q_b(norm(q_a(x))) when the release has one."""
    if q_lora_rank is None:
        q_BTX = F.linear(x_BTD, params["q_proj"])
    else:
        q_BTX = F.linear(
            rms_norm(F.linear(x_BTD, params["q_a_proj"]), params["q_a_layernorm"], eps), params["q_b_proj"]
        )
    return q_BTX.view(*x_BTD.shape[:2], num_heads, qk_head_dim)
