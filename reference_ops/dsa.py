"""DeepSeek-V3.2 sparse attention (DSA), fp64 reference: indexer, top-k, sparse MLA attention.

Shape legend: B batch, T tokens, H heads, K key width, V value width, S selected keys,
D model width, R rotary width, L latent (kv_lora_rank), Q q_lora_rank, I indexer heads,
J indexer head width.

The attention runs in the MLA "absorbed" layout: every head of a query token attends over one
shared latent kv row per key token; `sparse_attention` is that op, `dsa_mla_attention` is the
whole attention layer as transformers' DeepseekV32Attention computes it.
"""
from __future__ import annotations

import torch


def indexer_scores(q_BTHK, k_BTK, weights_BTH, scale) -> torch.Tensor:
    """scores[b, t, s] = scale * sum_h weights[b, t, h] * relu(q[b, t, h] . k[b, s]); s > t is -inf.

    q_BTHK [B, T, H, K], k_BTK [B, T, K], weights_BTH [B, T, H] -> scores_BTT [B, T, T].
    """
    q_BTHK, k_BTK, weights_BTH = (x.double() for x in (q_BTHK, k_BTK, weights_BTH))
    logits_BTHT = torch.einsum("bthk,bsk->bths", q_BTHK, k_BTK)
    scores_BTT = torch.einsum("bth,bths->bts", weights_BTH, logits_BTHT.relu()) * scale
    T = scores_BTT.shape[1]
    future_TT = torch.ones(T, T, dtype=torch.bool, device=scores_BTT.device).triu(1)
    return scores_BTT.masked_fill(future_TT, float("-inf"))


def topk_indices(scores_BTT, topk) -> torch.Tensor:
    """Indices of the `topk` best keys per query, best first; S = min(topk, T).

    scores_BTT [B, T, T] with -inf at masked keys -> idx_BTS [B, T, S] int64, -1 where a
    query has fewer than S visible keys.
    """
    S = min(topk, scores_BTT.shape[-1])
    values_BTS, idx_BTS = scores_BTT.topk(S, dim=-1)
    return idx_BTS.masked_fill(values_BTS == float("-inf"), -1)


def indexer_topk(q_BTHK, k_BTK, weights_BTH, scale, topk) -> torch.Tensor:
    """topk_indices(indexer_scores(...)): the fused runtime op's contract, idx_BTS [B, T, min(topk, T)]."""
    return topk_indices(indexer_scores(q_BTHK, k_BTK, weights_BTH, scale), topk)


def sparse_attention(q_BTHK, kv_BTK, idx_BTS, scale, v_dim) -> torch.Tensor:
    """Softmax attention of every head of query t over the kv rows idx[b, t, :] (-1 = none).

    q_BTHK [B, T, H, K], kv_BTK [B, T, K] (values are kv[..., :v_dim]), idx_BTS [B, T, S]
    -> o_BTHV [B, T, H, V]. A query with no valid index gets zeros.
    """
    q_BTHK, kv_BTK = q_BTHK.double(), kv_BTK.double()
    B, T, S = idx_BTS.shape
    valid_BTS = idx_BTS >= 0
    rows_BTS = idx_BTS.clamp(min=0).long()
    batch_B11 = torch.arange(B, device=idx_BTS.device).view(B, 1, 1)
    kv_BTSK = kv_BTK[batch_B11, rows_BTS]
    logits_BTHS = torch.einsum("bthk,btsk->bths", q_BTHK, kv_BTSK) * scale
    logits_BTHS = logits_BTHS.masked_fill(~valid_BTS[:, :, None, :], float("-inf"))
    # rows with no valid key would softmax to NaN; give them zero weight instead
    any_valid_BT11 = valid_BTS.any(-1)[:, :, None, None]
    probs_BTHS = torch.where(any_valid_BT11, logits_BTHS.softmax(-1), 0.0)
    return torch.einsum("bths,btsv->bthv", probs_BTHS, kv_BTSK[..., :v_dim])


def _rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _layer_norm(x, weight, bias, eps):
    centered = x - x.mean(-1, keepdim=True)
    return centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps) * weight + bias


def _rope_half(x_BTHR, cos_BTR, sin_BTR):
    """Half-split rotation (the indexer's layout): pairs (i, i + R/2)."""
    x1, x2 = x_BTHR.chunk(2, dim=-1)
    rotated_BTHR = torch.cat((-x2, x1), dim=-1)
    return x_BTHR * cos_BTR[:, :, None] + rotated_BTHR * sin_BTR[:, :, None]


def _rope_interleaved(x_BTHR, cos_BTR, sin_BTR):
    """DeepSeek pairwise rotation of pairs (2i, 2i+1); the result is laid out [evens, odds],
    as transformers does: a fixed permutation shared by q and k leaves their dot products alone."""
    R = x_BTHR.shape[-1]
    cos_BT1F, sin_BT1F = cos_BTR[:, :, None, : R // 2], sin_BTR[:, :, None, : R // 2]
    even, odd = x_BTHR[..., 0::2], x_BTHR[..., 1::2]
    return torch.cat((even * cos_BT1F - odd * sin_BT1F, odd * cos_BT1F + even * sin_BT1F), dim=-1)


def indexer_inputs(x_BTD, q_resid_BTQ, params, *, num_heads, head_dim, rope_dim, cos_BTR, sin_BTR):
    """The indexer's q_BTIJ, k_BTJ and per-head weights_BTI, from the layer input and q residual.

    Rope covers the first `rope_dim` channels, half-split layout. The heads^-0.5 factor of
    transformers is folded into the weights; the head_dim^-0.5 factor is the `scale` argument.
    """
    B, T, _ = x_BTD.shape
    q_BTIJ = (q_resid_BTQ @ params["indexer.wq_b"].T).view(B, T, num_heads, head_dim)
    k_BTJ = _layer_norm(x_BTD @ params["indexer.wk"].T, params["indexer.k_norm.weight"],
                        params["indexer.k_norm.bias"], 1e-6)
    q_BTIJ = torch.cat((_rope_half(q_BTIJ[..., :rope_dim], cos_BTR, sin_BTR), q_BTIJ[..., rope_dim:]), -1)
    k_rot_BT1R = _rope_half(k_BTJ[:, :, None, :rope_dim], cos_BTR, sin_BTR)
    k_BTJ = torch.cat((k_rot_BT1R[:, :, 0], k_BTJ[..., rope_dim:]), -1)
    weights_BTI = (x_BTD @ params["indexer.weights_proj"].T) * num_heads**-0.5
    return q_BTIJ, k_BTJ, weights_BTI


def dsa_mla_attention(
    x_BTD, params: dict, *, num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim, cos_BTR, sin_BTR, scale, eps,
    index_num_heads, index_head_dim, index_topk,
) -> torch.Tensor:
    """DeepseekV32Attention in fp64: MLA projections, indexer top-k, sparse attention in the
    absorbed layout, value up-projection and o_proj.

    x_BTD [B, T, D]; params by release weight names (nn.Linear layout [out, in]); cos/sin_BTR
    [B, T, qk_rope_head_dim] (halves duplicated, as transformers); scale as the module's
    `scaling` (yarn mscale included). -> o_BTD [B, T, D].
    """
    p = {name: w.double() for name, w in params.items()}
    x_BTD, cos_BTR, sin_BTR = x_BTD.double(), cos_BTR.double(), sin_BTR.double()
    B, T, _ = x_BTD.shape
    N, R, L, V = qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim
    q_resid_BTQ = _rms_norm(x_BTD @ p["q_a_proj"].T, p["q_a_layernorm"], eps)
    q_BTHK = (q_resid_BTQ @ p["q_b_proj"].T).view(B, T, num_heads, N + R)
    latent_BTK = x_BTD @ p["kv_a_proj_with_mqa"].T
    c_BTL = _rms_norm(latent_BTK[..., :L], p["kv_a_layernorm"], eps)
    k_rot_BTR = _rope_interleaved(latent_BTK[:, :, None, L:], cos_BTR, sin_BTR)[:, :, 0]
    q_rot_BTHR = _rope_interleaved(q_BTHK[..., N:], cos_BTR, sin_BTR)
    # absorb the key up-projection into the query: q_nope . (W_uk c) = (W_uk^T q_nope) . c
    w_kv_HXL = p["kv_b_proj"].view(num_heads, N + V, L)
    q_lat_BTHL = torch.einsum("bthn,hnl->bthl", q_BTHK[..., :N], w_kv_HXL[:, :N])
    q_abs_BTHK = torch.cat((q_lat_BTHL, q_rot_BTHR), -1)
    kv_abs_BTK = torch.cat((c_BTL, k_rot_BTR), -1)
    iq_BTIJ, ik_BTJ, iw_BTI = indexer_inputs(
        x_BTD, q_resid_BTQ, p, num_heads=index_num_heads, head_dim=index_head_dim,
        rope_dim=R, cos_BTR=cos_BTR, sin_BTR=sin_BTR)
    scores_BTT = indexer_scores(iq_BTIJ, ik_BTJ, iw_BTI, index_head_dim**-0.5)
    idx_BTS = topk_indices(scores_BTT, index_topk)
    o_lat_BTHL = sparse_attention(q_abs_BTHK, kv_abs_BTK, idx_BTS, scale, L)
    # the value up-projection, applied after attention (absorbed layout)
    o_BTHV = torch.einsum("bthl,hvl->bthv", o_lat_BTHL, w_kv_HXL[:, N:])
    return o_BTHV.reshape(B, T, num_heads * V) @ p["o_proj"].T
