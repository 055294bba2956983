"""The cross-entropy rows kernel (runtime/ops/loss/kernel.py) under TRITON_INTERPRET=1 vs the fp64 reference:
loss and softmax - onehot written over the logits, ignored rows, a vocabulary that is not a multiple of
the column block (the last block masked) and one under a block; NaN-prefilled loss buffer.

Shape legend: C rows, X vocabulary. fp32 inputs (the interpreter's reach).
"""
import pytest
import torch

from reference_ops import loss as ref
from runtime.ops.loss import kernel as kernels
from runtime.tolerances import assert_close

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("nan_buffers")]

IGNORE = -100
# X=37 < one block of 64; X=150 spans three blocks, the last masked
CASES = {"C5-X37": (5, 37), "C9-X150": (9, 150)}


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(kernels, "BLOCK_X", 64)


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "loss-only"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case, grad):
    rows, vocab = CASES[case]
    gen = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[1] = IGNORE
    labels[-1] = vocab - 1
    expected_loss, expected_grad = ref.cross_entropy_rows(logits, labels, ignore_index=IGNORE)
    buffer = logits.clone()
    loss, dlogits = kernels.cross_entropy_rows(buffer, labels, grad=grad, ignore_index=IGNORE)
    assert_close(loss, expected_loss, "cross_entropy_rows", torch.float32)
    if grad:
        assert dlogits.data_ptr() == buffer.data_ptr()
        assert_close(dlogits, expected_grad, "cross_entropy_rows", torch.float32, kind="grad")
    else:
        assert dlogits is None and torch.equal(buffer, logits)
