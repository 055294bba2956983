"""Cross-entropy over rows of logits in one kernel: the loss and softmax - onehot of each row, in place.

Per row: one pass for the log-normalizer (online max and sum in fp32), one pass writing the gradient
over the logits in their own dtype. torch's form (runtime/ops/loss/torch_form.py) makes fp32 copies and runs a
pass per elementwise step over the [C, X] block, which at a 150k vocabulary is most of the LM head's time.
Shape legend: C rows (tokens of a chunk), X vocabulary.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.ops.common import buffers
from runtime.ops.common.launch import fast

# columns per step of a row's loop: wide loads, a few values per thread at 16 warps
BLOCK_X = 4096


@triton.jit
def cross_entropy_rows_kernel(logits_ptr, labels_ptr, loss_ptr, X, ignore_index, GRAD: tl.constexpr,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * X
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    for start in range(0, X, BLOCK):
        x = tl.load(row_ptr + start + cols, mask=start + cols < X, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    target = tl.load(row_ptr + tl.where(valid, label, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
    if GRAD:
        for start in range(0, X, BLOCK):
            ok = start + cols < X
            x = tl.load(row_ptr + start + cols, mask=ok, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(start + cols == label, 1.0, 0.0)
            tl.store(row_ptr + start + cols, tl.where(valid, g, 0.0).to(logits_ptr.dtype.element_ty), mask=ok)


def cross_entropy_rows(logits_CX: torch.Tensor, labels_C: torch.Tensor, grad: bool = True,
                       ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss_C fp32, dlogits_CX or None), as reference_ops.loss.cross_entropy_rows; logits_CX contiguous.
    With grad, dlogits is written over logits_CX."""
    C, X = logits_CX.shape
    loss_C = buffers.empty(C, dtype=torch.float32, device=logits_CX.device)
    block = min(BLOCK_X, triton.next_power_of_2(X))
    fast(cross_entropy_rows_kernel)[(C,)](logits_CX, labels_C, loss_C, X, ignore_index, GRAD=grad, BLOCK=block,
                                          num_warps=16)
    return loss_C, logits_CX if grad else None
