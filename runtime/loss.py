"""LM head and cross-entropy in chunks of tokens: the [T, X] fp32 logits never exist at once.

Forward keeps only the per-token log-normalizer; backward recomputes each chunk's logits and turns
them into softmax - onehot in place, so the peak is one [chunk, X] fp32 block whatever T is.
Shape legend: T tokens, D model width, X vocabulary, C tokens in a chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.data import IGNORE


def _chunk_logits(h_CD: torch.Tensor, w_XD: torch.Tensor) -> torch.Tensor:
    return F.linear(h_CD, w_XD).float()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, w_XD, labels_T, chunk_size: int):
        lse_T = torch.zeros(h_TD.shape[0], dtype=torch.float32, device=h_TD.device)
        total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        for start in range(0, h_TD.shape[0], chunk_size):
            logits_CX = _chunk_logits(h_TD[start:start + chunk_size], w_XD)
            labels_C = labels_T[start:start + chunk_size]
            valid_C = labels_C != IGNORE
            lse_T[start:start + chunk_size] = torch.logsumexp(logits_CX, dim=-1)
            target_C = logits_CX.gather(1, labels_C.clamp(min=0)[:, None])[:, 0]
            total += ((lse_T[start:start + chunk_size] - target_C) * valid_C).sum()
        ctx.save_for_backward(h_TD, w_XD, labels_T, lse_T)
        ctx.chunk_size = chunk_size
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h_TD, w_XD, labels_T, lse_T = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(h_TD) if want_h else None
        grad_w = torch.zeros(w_XD.shape, dtype=torch.float32, device=w_XD.device) if want_w else None
        for start in range(0, h_TD.shape[0], ctx.chunk_size):
            h_CD, labels_C = h_TD[start:start + ctx.chunk_size], labels_T[start:start + ctx.chunk_size]
            # d(lse - logit[label]) / d logits = softmax - onehot, zero on ignored tokens
            dlogits_CX = (_chunk_logits(h_CD, w_XD) - lse_T[start:start + ctx.chunk_size, None]).exp_()
            valid_C = labels_C != IGNORE
            rows = torch.arange(labels_C.shape[0], device=labels_C.device)
            dlogits_CX[rows, labels_C.clamp(min=0)] -= 1.0
            dlogits_CX *= (valid_C * grad_total)[:, None]
            if want_h:
                grad_h[start:start + ctx.chunk_size] = dlogits_CX.to(w_XD.dtype) @ w_XD
            if want_w:
                grad_w += dlogits_CX.transpose(0, 1) @ h_CD.float()
        return grad_h, None if grad_w is None else grad_w.to(w_XD.dtype), None, None


def chunked_cross_entropy(h_TD: torch.Tensor, w_XD: torch.Tensor, labels_T: torch.Tensor,
                          chunk_size: int = 1024) -> torch.Tensor:
    """Summed next-token cross-entropy of logits h_TD @ w_XD^T over tokens whose label is not IGNORE
    (fp32 scalar; divide by the number of trained tokens of the whole step outside)."""
    return _ChunkedLinearCrossEntropy.apply(h_TD, w_XD, labels_T, chunk_size)
