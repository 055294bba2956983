"""DeepSeek-V3.2 sparse attention (DSA), torch form: runs everywhere, any dtype.

Shape legend: B batch, T tokens, H heads, K key width, V value width, S selected keys,
Q queries in one block.

Long sequences are processed by query blocks so that no [T, T] score matrix exists at once:
`indexer_topk` scores one block of queries against its causal keys and keeps the top-k;
`sparse_attention` gathers the selected kv rows per block and recomputes them in backward.
`indexer_scores` / `topk_indices` keep the reference contract (which returns [T, T]) for short T.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _block_scores(q_BQHK, k_BTK, weights_BQH, scale, first) -> torch.Tensor:
    """Indexer scores of queries first..first+Q-1 against keys 0..T-1 in fp32, future = -inf."""
    logits_BQHT = torch.einsum("bqhk,btk->bqht", q_BQHK.float(), k_BTK.float())
    scores_BQT = torch.einsum("bqh,bqht->bqt", weights_BQH.float(), logits_BQHT.relu_()) * scale
    Q, T = scores_BQT.shape[1:]
    query_Q1 = torch.arange(first, first + Q, device=k_BTK.device)[:, None]
    future_QT = torch.arange(T, device=k_BTK.device)[None, :] > query_Q1
    return scores_BQT.masked_fill_(future_QT, float("-inf"))


def indexer_scores(q_BTHK, k_BTK, weights_BTH, scale) -> torch.Tensor:
    """scale * sum_h w_h relu(q_h . k), causal; [B, T, T] fp32 (short T only: see indexer_topk)."""
    return _block_scores(q_BTHK, k_BTK, weights_BTH, scale, 0)


def topk_indices(scores_BTT, topk) -> torch.Tensor:
    """Top-min(topk, T) key indices per query, -1 where fewer keys are visible. -> [B, T, S] int64."""
    S = min(topk, scores_BTT.shape[-1])
    values_BTS, idx_BTS = scores_BTT.topk(S, dim=-1)
    return idx_BTS.masked_fill_(values_BTS == float("-inf"), -1)


@torch.no_grad()
def indexer_topk(q_BTHK, k_BTK, weights_BTH, scale, topk, block_size=64) -> torch.Tensor:
    """topk_indices(indexer_scores(...)) one query block at a time (the indexer has no backward).

    q_BTHK [B, T, H, K], k_BTK [B, T, K], weights_BTH [B, T, H] -> idx_BTS [B, T, min(topk, T)]
    int64, each row in descending score order, -1 padded.
    """
    B, T = k_BTK.shape[:2]
    S = min(topk, T)
    idx_BTS = torch.full((B, T, S), -1, dtype=torch.int64, device=k_BTK.device)
    for first in range(0, T, block_size):
        last = min(first + block_size, T)
        # keys after the block's last query are future for every query of the block
        scores_BQT = _block_scores(q_BTHK[:, first:last], k_BTK[:, :last], weights_BTH[:, first:last], scale, first)
        block_BQS = topk_indices(scores_BQT, S)
        idx_BTS[:, first:last, : block_BQS.shape[-1]] = block_BQS
    return idx_BTS


def _attend_block(q_BQHK, kv_BTK, idx_BQS, scale, v_dim) -> torch.Tensor:
    """Sparse attention of one query block, fp32 math, output in q's dtype."""
    B = kv_BTK.shape[0]
    valid_BQS = idx_BQS >= 0
    batch_B11 = torch.arange(B, device=kv_BTK.device).view(B, 1, 1)
    kv_BQSK = kv_BTK[batch_B11, idx_BQS.clamp(min=0).long()].float()
    logits_BQHS = torch.einsum("bqhk,bqsk->bqhs", q_BQHK.float(), kv_BQSK) * scale
    logits_BQHS = logits_BQHS.masked_fill(~valid_BQS[:, :, None, :], float("-inf"))
    # a row with no valid key softmaxes to NaN; it gets zero weight instead
    probs_BQHS = torch.where(valid_BQS.any(-1)[:, :, None, None], F.softmax(logits_BQHS, -1), 0.0)
    o_BQHV = torch.einsum("bqhs,bqsv->bqhv", probs_BQHS, kv_BQSK[..., :v_dim])
    return o_BQHV.to(q_BQHK.dtype)


def sparse_attention(q_BTHK, kv_BTK, idx_BTS, scale, v_dim, block_size=64) -> torch.Tensor:
    """Every head of query t attends over kv rows idx[b, t, :] (-1 = none); MQA, shared latent kv.

    q_BTHK [B, T, H, K], kv_BTK [B, T, K], idx_BTS [B, T, S] -> o_BTHV [B, T, H, v_dim].
    Each query block is checkpointed: backward regathers its kv rows instead of keeping
    [T, S, K] gathered copies alive.
    """
    blocks = []
    for first in range(0, q_BTHK.shape[1], block_size):
        q_BQHK, idx_BQS = q_BTHK[:, first : first + block_size], idx_BTS[:, first : first + block_size]
        if torch.is_grad_enabled() and (q_BTHK.requires_grad or kv_BTK.requires_grad):
            blocks.append(checkpoint(_attend_block, q_BQHK, kv_BTK, idx_BQS, scale, v_dim, use_reentrant=False))
        else:
            blocks.append(_attend_block(q_BQHK, kv_BTK, idx_BQS, scale, v_dim))
    return torch.cat(blocks, dim=1)
