"""Reference softmax attention in fp64: GQA, causal, sliding window, per-head sink logits.

Shape legend: B batch, T tokens (queries and keys), H query heads, G kv heads, K key dim, V value dim.
"""

from __future__ import annotations

import torch


def softmax_attention(
    q_BTHK: torch.Tensor,
    k_BTGK: torch.Tensor,
    v_BTGV: torch.Tensor,
    scale: float,
    causal: bool = True,
    window: int | None = None,
    sinks_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """o_BTHV. Query head h reads kv head h // (H/G). A query at t sees keys s with s <= t (causal)
    and t - window < s (window). sinks_H[h] joins the softmax denominator of head h only.
    """
    num_heads, num_kv_heads = q_BTHK.shape[2], k_BTGK.shape[2]
    k_BTHK = k_BTGK.double().repeat_interleave(num_heads // num_kv_heads, dim=2)
    v_BTHV = v_BTGV.double().repeat_interleave(num_heads // num_kv_heads, dim=2)
    logits_BHTT = torch.einsum("bthk,bshk->bhts", q_BTHK.double(), k_BTHK) * scale
    visible_TT = visible_mask(q_BTHK.shape[1], causal, window, q_BTHK.device)
    logits_BHTT = logits_BHTT.masked_fill(~visible_TT, float("-inf"))
    if sinks_H is None:
        probs_BHTT = torch.softmax(logits_BHTT, dim=-1)
    else:
        # the sink is one more logit in each row whose probability is dropped afterwards
        sink_BHT1 = sinks_H.double()[None, :, None, None].expand(*logits_BHTT.shape[:3], 1)
        probs_BHTT = torch.softmax(torch.cat([logits_BHTT, sink_BHT1], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhts,bshv->bthv", probs_BHTT, v_BTHV)


def visible_mask(num_tokens: int, causal: bool, window: int | None, device: torch.device) -> torch.Tensor:
    """visible_TT[t, s]: may query t attend to key s."""
    t_T1 = torch.arange(num_tokens, device=device)[:, None]
    s_1T = torch.arange(num_tokens, device=device)[None, :]
    visible = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device)
    if causal:
        visible = visible & (s_1T <= t_T1)
    if window is not None:
        visible = visible & (s_1T > t_T1 - window)
    return visible
