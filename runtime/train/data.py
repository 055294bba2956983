"""Training data: jsonl read and checked, tokenized offline with the release's tokenizer, packed into rows.

A line is {"text": str} (every token trained) or {"messages": [{"role", "content"}, ...]} (loss only on
the assistant turns, as the release's own chat template renders them). Every line is checked and
tokenized before a step runs; a bad one raises InputFileError naming the file and line.
Documents are concatenated and cut into rows of seq_len; each cut piece is its own segment: its
positions restart at 0, its last token predicts nothing, and `segments_NL` tells the model where
segments start so no token attends to or carries state from another segment.
Shape legend: N rows, L seq_len, B rows in a batch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.errors import InputFileError

IGNORE = -100


def DataError(path: Path, line: int | None, message: str) -> InputFileError:
    """A malformed data line: file, line number, what was expected."""
    return InputFileError(path, None if line is None else f"line {line}", message)


class ChatTemplateError(ValueError):
    """The release's chat template cannot say which tokens are the assistant's (a gap, not bad data)."""


@dataclass
class Document:
    ids: list[int]
    trained: list[bool]  # per token: is this token a training target


def _check_messages(messages, path: Path, line: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(path, line, '"messages" must be a non-empty list')
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(path, line, f'messages[{i}] must be {{"role": str, "content": str}}')
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(path, line, "messages has no assistant turn to train on")


def _parse_line(text: str, path: Path, line: int) -> dict:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(path, line, f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict) or ("text" in record) == ("messages" in record):
        raise DataError(path, line, 'expected an object with exactly one of "text" or "messages"')
    if "text" in record and not (isinstance(record["text"], str) and record["text"]):
        raise DataError(path, line, '"text" must be a non-empty string')
    if "messages" in record:
        _check_messages(record["messages"], path, line)
    return record


def read_jsonl(path: Path) -> list[dict]:
    """Every non-blank line of the file, checked."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(path, None, f"cannot read ({err})") from None
    records = [_parse_line(text, path, n) for n, text in enumerate(lines, start=1) if text.strip()]
    if not records:
        raise DataError(path, None, "no data lines")
    return records


def _render(tokenizer, messages, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    """(rendered conversation, character spans of what each assistant turn adds after its prompt header).

    Turn i's span runs from the end of the conversation up to i rendered with the generation prompt to the
    end of the conversation through turn i; this needs a template that renders turns as prefixes.
    """
    full = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, upto = _render(tokenizer, messages[:i], True), _render(tokenizer, messages[: i + 1])
        if not (full.startswith(upto) and upto.startswith(prompt)):
            raise ChatTemplateError(f"the chat template does not render turn {i} as a prefix of the conversation")
        spans.append((len(prompt), len(upto)))
    return full, spans


def chat_document(tokenizer, messages) -> Document:
    """The conversation's tokens; trained = the token overlaps an assistant span."""
    full, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    trained = [any(s < span_end and e > span_start for span_start, span_end in spans)
               for s, e in encoded["offset_mapping"]]
    return Document(list(encoded["input_ids"]), trained)


def text_document(tokenizer, text: str) -> Document:
    """The text's tokens (with the tokenizer's own special tokens) and end-of-sequence, all trained."""
    ids = list(tokenizer(text)["input_ids"])
    if tokenizer.eos_token_id is not None and ids[-1:] != [tokenizer.eos_token_id]:
        ids.append(tokenizer.eos_token_id)
    return Document(ids, [True] * len(ids))


def tokenize(records: list[dict], tokenizer) -> list[Document]:
    return [text_document(tokenizer, r["text"]) if "text" in r else chat_document(tokenizer, r["messages"])
            for r in records]


@dataclass
class PackedRows:
    """Token rows: input ids, next-token labels (IGNORE where nothing is trained), positions, segment ids."""

    tokens_NL: torch.Tensor
    labels_NL: torch.Tensor
    positions_NL: torch.Tensor
    segments_NL: torch.Tensor

    def __len__(self) -> int:
        return self.tokens_NL.shape[0]


def _labels(piece: Document) -> list[int]:
    """labels[t] = ids[t+1] where that token is trained; the piece's last token predicts nothing."""
    nxt = [i if t else IGNORE for i, t in zip(piece.ids[1:], piece.trained[1:])]
    return nxt + [IGNORE]


def pack(documents: list[Document], seq_len: int, pad_id: int) -> PackedRows:
    """Concatenate and cut into rows of seq_len; the last row is padded with an untrained segment."""
    rows: list[list[Document]] = [[]]
    room = seq_len
    for doc in documents:
        start = 0
        while start < len(doc.ids):
            take = min(room, len(doc.ids) - start)
            rows[-1].append(Document(doc.ids[start:start + take], doc.trained[start:start + take]))
            start, room = start + take, room - take
            if room == 0:
                rows.append([])
                room = seq_len
    if room < seq_len:
        rows[-1].append(Document([pad_id] * room, [False] * room))
    else:
        rows.pop()
    return _to_tensors(rows)


def _to_tensors(rows: list[list[Document]]) -> PackedRows:
    def column(per_piece) -> torch.Tensor:
        return torch.tensor([sum((per_piece(n, p) for n, p in enumerate(row)), []) for row in rows], dtype=torch.int64)

    return PackedRows(column(lambda n, p: p.ids), column(lambda n, p: _labels(p)),
                      column(lambda n, p: list(range(len(p.ids)))), column(lambda n, p: [n] * len(p.ids)))


def batch_rows(num_rows: int, micro_step: int, batch_size: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
    """Row indices of one rank's micro-batch number `micro_step`: a reshuffle of all rows every epoch,
    read as one stream by every rank in turn. Stateless: resuming needs only the micro-step count."""
    first = (micro_step * dp_size + dp_rank) * batch_size
    indices = []
    for p in range(first, first + batch_size):
        epoch, offset = divmod(p, num_rows)
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        indices.append(int(order[offset]))
    return indices


def cu_seqlens_of(segments_BL: torch.Tensor) -> torch.Tensor:
    """Segment boundaries of B rows flattened into one sequence of B*L tokens: [0, ..., B*L] int32."""
    flat = segments_BL.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    # a row boundary always starts a segment, even when two rows' segment ids happen to match
    starts.view(segments_BL.shape)[:, 0] = True
    bounds = torch.nonzero(starts).flatten()
    return torch.cat([bounds, bounds.new_tensor([flat.numel()])]).to(torch.int32)


def split_eval(documents: list[Document], fraction: float, seed: int) -> tuple[list[Document], list[Document]]:
    """(train, eval) documents: a seeded shuffle, the first `fraction` (at least one) held out."""
    if len(documents) < 2:
        raise ValueError(f"need at least 2 documents to hold one out for eval, got {len(documents)}")
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed)).tolist()
    num_eval = min(len(documents) - 1, max(1, round(fraction * len(documents))))
    held = set(order[:num_eval])
    return ([d for i, d in enumerate(documents) if i not in held], [d for i, d in enumerate(documents) if i in held])
