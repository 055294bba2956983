"""Cross-entropy over rows of logits in the runtime (torch, fp32 compute): the fused kernel's torch form.

Shape legend: C rows (tokens of a chunk), X vocabulary.
"""

from __future__ import annotations

import torch


def cross_entropy_rows(logits_CX: torch.Tensor, labels_C: torch.Tensor, grad: bool = True,
                       ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss_C fp32, dlogits_CX in logits' dtype or None), as reference_ops.loss.cross_entropy_rows.
    With grad, dlogits is written over logits_CX (the caller's chunk of logits is not needed after)."""
    logits = logits_CX.float()
    valid_C = labels_C != ignore_index
    label_C = labels_C.clamp(min=0)[:, None]
    lse_C = torch.logsumexp(logits, dim=-1)
    loss_C = (lse_C - logits.gather(1, label_C)[:, 0]) * valid_C
    if not grad:
        return loss_C, None
    probs_CX = (logits - lse_C[:, None]).exp_()
    probs_CX.scatter_add_(1, label_C, torch.full_like(label_C, -1.0, dtype=probs_CX.dtype))
    probs_CX *= valid_C[:, None]
    return loss_C, logits_CX.copy_(probs_CX)
