"""LM head and cross-entropy in chunks of tokens: the [T, X] fp32 logits never exist at once.

When a gradient is wanted the forward forms it too, chunk by chunk while each chunk's logits are at
hand (the row op writes softmax - onehot over them), and the backward only scales it by the upstream
gradient: the logits are made once per step and never kept, the peak is one [chunk, X] block.
Shape legend: T tokens, D model width, X vocabulary, C tokens in a chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.train.data import IGNORE
from runtime.dispatch import op


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, w_XD, labels_T, chunk_size: int, grad: bool, softcap: float | None):
        want_h, want_w = (grad and wanted for wanted in ctx.needs_input_grad[:2])
        rows = op("cross_entropy_rows", h_TD.device)
        total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        grad_h = torch.empty_like(h_TD) if want_h else None
        grad_w = torch.zeros(w_XD.shape, dtype=torch.float32, device=w_XD.device) if want_w else None
        for start in range(0, h_TD.shape[0], chunk_size):
            h_CD = h_TD[start:start + chunk_size]
            logits_CX, squashed_CX = capped(F.linear(h_CD, w_XD), softcap)
            loss_C, dlogits_CX = rows(logits_CX, labels_T[start:start + chunk_size], want_h or want_w, IGNORE)
            total += loss_C.sum()
            if dlogits_CX is not None and squashed_CX is not None:
                # d(c tanh(z / c)) / dz = 1 - tanh(z / c)^2
                dlogits_CX = (dlogits_CX.float() * (1 - squashed_CX.square())).to(h_CD.dtype)
            if want_h:
                torch.mm(dlogits_CX, w_XD, out=grad_h[start:start + chunk_size])
            if want_w:
                grad_w += (dlogits_CX.transpose(0, 1) @ h_CD).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = w_XD.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            # in fp32: the upstream gradient (1 / tokens) rounded to bf16 would scale the whole gradient off
            grad_h = (grad_h.float() * grad_total).to(grad_h.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_total).to(ctx.w_dtype)
        return grad_h, grad_w, None, None, None, None


def capped(logits_CX: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(c * tanh(z / c) in z's dtype, tanh(z / c) in fp32) for a cap c; (z, None) without one."""
    if softcap is None:
        return logits_CX, None
    squashed_CX = torch.tanh(logits_CX.float() / softcap)
    return (softcap * squashed_CX).to(logits_CX.dtype), squashed_CX


def chunked_cross_entropy(h_TD: torch.Tensor, w_XD: torch.Tensor, labels_T: torch.Tensor,
                          chunk_size: int = 1024, softcap: float | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy of logits h_TD @ w_XD^T (capped to softcap * tanh(z / softcap) when
    given) over tokens whose label is not IGNORE (fp32 scalar; divide by the number of trained tokens of the
    whole step outside)."""
    grad = torch.is_grad_enabled() and (h_TD.requires_grad or w_XD.requires_grad)
    return _ChunkedLinearCrossEntropy.apply(h_TD, w_XD, labels_T, chunk_size, grad, softcap)
