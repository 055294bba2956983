"""Cross-entropy rows: the runtime's torch form vs the fp64 reference (loss and softmax - onehot), and
the reference vs torch's own cross_entropy and its autograd gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reference_ops import loss as ref
from runtime.ops.loss import torch_form as run
from runtime.tolerances import assert_close

IGNORE = -100
CASES = {"C7-X5": (7, 5), "C33-X1000": (33, 1000), "C1-X2": (1, 2)}


def _inputs(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 4
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[::3] = IGNORE
    return logits, labels


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_torch_cross_entropy(case):
    logits, labels = _inputs(*CASES[case], seed=0)
    leaf = logits.clone().requires_grad_()
    expected = F.cross_entropy(leaf, labels, ignore_index=IGNORE, reduction="none")
    expected.sum().backward()
    loss, dlogits = ref.cross_entropy_rows(logits, labels, ignore_index=IGNORE)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dlogits, leaf.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_runtime_form_matches_reference(case, dtype):
    logits, labels = _inputs(*CASES[case], seed=1)
    logits = logits.to(dtype)
    expected_loss, expected_grad = ref.cross_entropy_rows(logits, labels, ignore_index=IGNORE)
    only_loss, no_grad = run.cross_entropy_rows(logits.clone(), labels, grad=False, ignore_index=IGNORE)
    buffer = logits.clone()
    loss, dlogits = run.cross_entropy_rows(buffer, labels, ignore_index=IGNORE)
    assert no_grad is None and dlogits.data_ptr() == buffer.data_ptr() and dlogits.dtype == dtype
    assert_close(only_loss, expected_loss, "cross_entropy_rows", torch.float32)
    assert_close(loss, expected_loss, "cross_entropy_rows", torch.float32)
    assert_close(dlogits, expected_grad, "cross_entropy_rows", dtype, kind="grad")
