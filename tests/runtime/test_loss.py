"""The chunked LM head + cross-entropy against the plain one: loss and gradients within fp32 rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.model.loss import IGNORE, chunked_cross_entropy
from runtime.tolerances import compare, tolerance_for


@pytest.mark.parametrize("num_tokens,chunk,softcap", [(63, 16, None), (64, 64, None), (40, 1000, None), (63, 16, 3.0)],
                         ids=["T63-c16", "T64-c64", "T40-one", "T63-c16-softcap3"])
def test_chunked_equals_plain(num_tokens, chunk, softcap):
    """softcap: logits c * tanh(z / c) (final_logit_softcapping), here binding (|z| reaches about 15)."""
    gen = torch.Generator().manual_seed(num_tokens)
    h = torch.randn(num_tokens, 24, generator=gen, requires_grad=True)
    w = torch.randn(101, 24, generator=gen, requires_grad=True)
    labels = torch.randint(0, 101, (num_tokens,), generator=gen)
    labels[::5] = IGNORE
    ours = chunked_cross_entropy(h, w, labels, chunk_size=chunk, softcap=softcap)
    (ours * 0.5).backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits = F.linear(h64, w64)
    logits = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    plain = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    (plain * 0.5).backward()
    for name, a, b in (("loss", ours, plain), ("grad_h", h.grad, h64.grad), ("grad_w", w.grad, w64.grad)):
        result = compare(a, b, tolerance_for("chunked_cross_entropy", torch.float32, "out" if name == "loss" else "grad"))
        assert result.passed, (name, result)


def test_frozen_head_gets_no_gradient_and_ignored_tokens_none():
    h = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(30, 8)
    labels = torch.full((10,), IGNORE)
    labels[3] = 7
    chunked_cross_entropy(h, w, labels, chunk_size=4).backward()
    assert w.grad is None
    assert torch.count_nonzero(h.grad.abs().sum(-1)) == 1 and h.grad[3].abs().sum() > 0


def test_no_grad_gives_the_same_loss_and_forms_no_gradient():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(21, 8, generator=gen, requires_grad=True)
    w = torch.randn(30, 8, generator=gen)
    labels = torch.randint(0, 30, (21,), generator=gen)
    with_grad = chunked_cross_entropy(h, w, labels, chunk_size=8)
    with torch.no_grad():
        without = chunked_cross_entropy(h, w, labels, chunk_size=8)
    assert without.grad_fn is None and torch.equal(without, with_grad.detach())
