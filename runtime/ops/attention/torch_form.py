"""Softmax attention in the runtime: SDPA when there are no sinks, an explicit fp32 softmax with sinks.

Shape legend: B batch, T tokens (queries and keys), H query heads, G kv heads, K key dim, V value dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softmax_attention(
    q_BTHK: torch.Tensor,
    k_BTGK: torch.Tensor,
    v_BTGV: torch.Tensor,
    scale: float,
    causal: bool = True,
    window: int | None = None,
    sinks_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """o_BTHV in q's dtype. Query head h reads kv head h // (H/G); a query at t sees keys in
    (t - window, t] (causal) and sinks_H[h] joins the softmax denominator of head h only (gpt-oss).
    """
    if sinks_H is not None:
        return _attention_with_sinks(q_BTHK, k_BTGK, v_BTGV, scale, causal, window, sinks_H)
    q_BHTK, k_BGTK, v_BGTV = (t.transpose(1, 2) for t in (q_BTHK, k_BTGK, v_BTGV))
    is_gqa = q_BTHK.shape[2] != k_BTGK.shape[2]
    if window is None:
        o_BHTV = F.scaled_dot_product_attention(
            q_BHTK, k_BGTK, v_BGTV, is_causal=causal, scale=scale, enable_gqa=is_gqa
        )
    else:
        visible_TT = visible_mask(q_BTHK.shape[1], causal, window, q_BTHK.device)
        o_BHTV = F.scaled_dot_product_attention(
            q_BHTK, k_BGTK, v_BGTV, attn_mask=visible_TT, scale=scale, enable_gqa=is_gqa
        )
    return o_BHTV.transpose(1, 2)


def visible_mask(num_tokens: int, causal: bool, window: int | None, device: torch.device) -> torch.Tensor:
    """visible_TT[t, s] (bool): may query t attend to key s."""
    offset_TT = torch.arange(num_tokens, device=device)[:, None] - torch.arange(num_tokens, device=device)[None, :]
    visible_TT = offset_TT >= 0 if causal else torch.ones_like(offset_TT, dtype=torch.bool)
    if window is not None:
        visible_TT = visible_TT & (offset_TT < window)
    return visible_TT


def _attention_with_sinks(q_BTHK, k_BTGK, v_BTGV, scale, causal, window, sinks_H) -> torch.Tensor:
    """Explicit fp32 softmax: SDPA has no way to add a per-head logit to the denominator."""
    num_heads, num_kv_heads = q_BTHK.shape[2], k_BTGK.shape[2]
    k_BTHK = k_BTGK.float().repeat_interleave(num_heads // num_kv_heads, dim=2)
    v_BTHV = v_BTGV.float().repeat_interleave(num_heads // num_kv_heads, dim=2)
    logits_BHTT = torch.einsum("bthk,bshk->bhts", q_BTHK.float(), k_BTHK) * scale
    visible_TT = visible_mask(q_BTHK.shape[1], causal, window, q_BTHK.device)
    logits_BHTT = logits_BHTT.masked_fill(~visible_TT, float("-inf"))
    sink_BHT1 = sinks_H.float()[None, :, None, None].expand(*logits_BHTT.shape[:3], 1)
    # normalizer over keys and the sink together; the sink's own probability is never formed
    log_normalizer_BHT1 = torch.logsumexp(torch.cat([logits_BHTT, sink_BHT1], dim=-1), dim=-1, keepdim=True)
    probs_BHTT = torch.exp(logits_BHTT - log_normalizer_BHT1)
    return torch.einsum("bhts,bshv->bthv", probs_BHTT, v_BTHV).to(q_BTHK.dtype)
