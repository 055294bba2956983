"""Reference cross-entropy over rows of logits in fp64: the truth the runtime forms are tested against.

Shape legend: C rows (tokens of a chunk), X vocabulary.
"""

from __future__ import annotations

import torch


def cross_entropy_rows(logits_CX: torch.Tensor, labels_C: torch.Tensor, grad: bool = True,
                       ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss_C = logsumexp(logits) - logits[label], 0 where the label is ignore_index;
    dlogits_CX = d sum(loss_C) / d logits = softmax - onehot, 0 on ignored rows, or None without grad)."""
    logits = logits_CX.double()
    valid_C = labels_C != ignore_index
    label_C = labels_C.clamp(min=0)
    lse_C = torch.logsumexp(logits, dim=-1)
    loss_C = (lse_C - logits.gather(1, label_C[:, None])[:, 0]) * valid_C
    if not grad:
        return loss_C, None
    onehot_CX = torch.nn.functional.one_hot(label_C, logits.shape[1]).double()
    return loss_C, (torch.softmax(logits, dim=-1) - onehot_CX) * valid_C[:, None]
