"""The data path: jsonl checks, chat loss masks by the release's own template, packing into rows."""
from __future__ import annotations

import json

import pytest
import torch

from onboard.examples.tokenizer import write_example_tokenizer
from runtime.errors import InputFileError
from runtime.train.data import IGNORE, Document, chat_document, cu_seqlens_of, pack, read_jsonl, text_document

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "How many legs does a spider have?"},
    {"role": "assistant", "content": "Eight legs."},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    write_example_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def test_chat_mask_matches_the_templates_generation_blocks_token_by_token(tokenizer):
    """Our prefix-rendering mask (which needs no generation tags) against transformers' own
    return_assistant_tokens_mask on the example template (which has them)."""
    ours = chat_document(tokenizer, CONVERSATION)
    theirs = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
    assert ours.ids == list(theirs["input_ids"])
    assert ours.trained == [bool(m) for m in theirs["assistant_masks"]]
    trained_text = tokenizer.decode([i for i, t in zip(ours.ids, ours.trained) if t])
    assert "Paris" in trained_text and "Eight" in trained_text and "spider" not in trained_text


def test_labels_are_next_tokens_where_trained_and_rows_restart_positions():
    docs = [Document([5, 6, 7, 8], [False, False, True, True]), Document([9, 10, 11], [True] * 3)]
    rows = pack(docs, seq_len=5, pad_id=0)
    # row 0: doc0 (4 tokens) + first token of doc1; row 1: the rest of doc1 + 3 pad
    assert rows.tokens_NL.tolist() == [[5, 6, 7, 8, 9], [10, 11, 0, 0, 0]]
    assert rows.labels_NL.tolist() == [[IGNORE, 7, 8, IGNORE, IGNORE], [11, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert rows.positions_NL.tolist() == [[0, 1, 2, 3, 0], [0, 1, 0, 1, 2]]
    assert cu_seqlens_of(rows.segments_NL).tolist() == [0, 4, 5, 7, 10]


def test_text_document_ends_with_eos(tokenizer):
    doc = text_document(tokenizer, "The river runs.")
    assert doc.ids[-1] == tokenizer.eos_token_id and all(doc.trained)


@pytest.mark.parametrize("line,needle", [
    ('{"text": "ok"', "not valid JSON"),
    ('["text"]', 'expected a JSON object, got list'),
    ('{"text": ""}', "non-empty string"),
    ('{"messages": [{"role": "user"}]}', "messages[0]"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
], ids=["json", "shape", "empty", "message", "no-assistant"])
def test_malformed_line_names_file_and_line(tmp_path, line, needle):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n\n" + line + "\n")
    with pytest.raises(InputFileError) as err:
        read_jsonl(path)
    assert err.value.one_line().startswith(f"{path}: line 3: ") and needle in err.value.one_line()


def test_cu_seqlens_starts_a_segment_at_every_row():
    segments = torch.tensor([[0, 0, 1], [1, 1, 1]])
    assert cu_seqlens_of(segments).tolist() == [0, 2, 3, 6]
