"""Packing boundaries: a document's logits and loss do not depend on what it is packed with, for every
attention kind (softmax and gated delta: qwen3_next; KDA and MLA: kimi_linear; DSA: deepseek_v32;
lightning: minimax), with the release's weights in fp32."""
from __future__ import annotations

import json

import pytest
import torch

from runtime.train.data import IGNORE, Document, cu_seqlens_of, pack
from runtime.model.loss import chunked_cross_entropy
from runtime.model.decoder import HybridDecoder
from runtime.tolerances import compare, tolerance_for
from runtime.model.weights import load_release


def runtime_model(package) -> HybridDecoder:
    import yaml

    spec = json.loads((package / "spec.json").read_text())
    release = yaml.safe_load((package / "package.yaml").read_text())["source"]["absolute"]
    model = HybridDecoder(spec)
    load_release(model, release, json.loads((package / "weight_map.json").read_text()))
    return model.eval()


def _document_loss(model, rows, indices, first: int, last: int):
    """(logits of tokens first:last of the flattened rows, summed loss over them)."""
    tokens, labels = rows.tokens_NL[indices].reshape(1, -1), rows.labels_NL[indices].reshape(-1)
    h = model.hidden_states(tokens, rows.positions_NL[indices].reshape(1, -1),
                            cu_seqlens=cu_seqlens_of(rows.segments_NL[indices]))[0, first:last]
    return h @ model.head_weight().T, chunked_cross_entropy(h, model.head_weight(), labels[first:last])


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear", "deepseek_v32", "minimax"])
def test_document_unchanged_by_its_neighbours(example_package, family):
    model = runtime_model(example_package(family))
    gen = torch.Generator().manual_seed(0)
    doc = lambda n: Document(torch.randint(3, 200, (n,), generator=gen).tolist(), [True] * n)  # noqa: E731
    target, before, after = doc(70), doc(45), doc(30)
    alone = pack([target], seq_len=70, pad_id=0)
    packed = pack([before, target, after], seq_len=160, pad_id=0)
    with torch.no_grad():
        logits_alone, loss_alone = _document_loss(model, alone, [0], 0, 70)
        logits_packed, loss_packed = _document_loss(model, packed, [0], 45, 115)
    assert (packed.labels_NL[0, 45:115] != IGNORE).sum() == 69
    assert compare(logits_packed, logits_alone, tolerance_for("model_logits", torch.float32)).passed
    assert compare(loss_packed, loss_alone, tolerance_for("model_loss", torch.float32)).passed
