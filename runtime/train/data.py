"""Training data: Samples (runtime/data/: every format read and checked) tokenized offline with the release's
tokenizer, packed into rows.

Which tokens train, per format: text, all of them (and end-of-sequence); chat and ShareGPT, what each assistant
turn adds (tool calls included), as the release's own chat template renders the conversation (with its tools);
alpaca, the output (as the assistant's turn after the instruction through the chat template; with no template,
after the Stanford Alpaca prompt); prompt/completion, the completion (strings: the text after the prompt, and
end-of-sequence; message lists: the completion's assistant turns through the template).
Documents are concatenated and cut into rows of seq_len; each cut piece is its own segment: its
positions restart at 0, its last token predicts nothing, and `segments_NL` tells the model where
segments start so no token attends to or carries state from another segment.
Shape legend: N rows, L seq_len, B rows in a batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.data.files import data_error, read_rows
from runtime.data.formats import Sample, samples

IGNORE = -100
# Stanford Alpaca's prompt (its repository's train.py), for releases without a chat template
ALPACA_PROMPT = ("Below is an instruction that describes a task{context}. Write a response that appropriately "
                 "completes the request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n")


class ChatTemplateError(ValueError):
    """The release's chat template cannot say which tokens are the assistant's (a gap, not bad data)."""


@dataclass
class Document:
    ids: list[int]
    trained: list[bool]  # per token: is this token a training target


def read_jsonl(path: Path, data_format: str = "auto") -> list[Sample]:
    """Every record of a data file or folder, checked (the name kept from when jsonl was the one format)."""
    return samples(read_rows(Path(path)), data_format)


def _render(tokenizer, messages, tools=None, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages, tools=None, first: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """(rendered conversation, character spans of what each assistant turn from `first` on adds after its prompt
    header).

    Turn i's span runs from the end of the conversation up to i rendered with the generation prompt to the
    end of the conversation through turn i; this needs a template that renders turns as prefixes.
    """
    full = _render(tokenizer, messages, tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < first:
            continue
        prompt, upto = _render(tokenizer, messages[:i], tools, True), _render(tokenizer, messages[: i + 1], tools)
        if not (full.startswith(upto) and upto.startswith(prompt)):
            raise ChatTemplateError(f"the chat template does not render turn {i} as a prefix of the conversation")
        spans.append((len(prompt), len(upto)))
    return full, spans


def _trained_spans(tokenizer, full: str, spans: list[tuple[int, int]], special_tokens: bool = False) -> Document:
    """The text's tokens; trained = the token overlaps one of the character spans."""
    encoded = tokenizer(full, add_special_tokens=special_tokens, return_offsets_mapping=True)
    trained = [any(s < span_end and e > span_start for span_start, span_end in spans)
               for s, e in encoded["offset_mapping"]]
    return Document(list(encoded["input_ids"]), trained)


def chat_document(tokenizer, messages, tools=None, first: int = 0) -> Document:
    """The conversation's tokens; trained = the token overlaps an assistant span (turns from `first` on)."""
    if not tokenizer.chat_template:
        raise ChatTemplateError("the release ships no chat template to render chat, ShareGPT or message-list "
                                "prompt/completion data (text, alpaca and string prompt/completion data need none)")
    full, spans = assistant_spans(tokenizer, messages, tools, first)
    return _trained_spans(tokenizer, full, spans)


def _with_eos(tokenizer, doc: Document) -> Document:
    """The document ending in end-of-sequence, trained (appended unless the tokenizer added it)."""
    if tokenizer.eos_token_id is None:
        return doc
    if doc.ids[-1:] == [tokenizer.eos_token_id]:
        return Document(doc.ids, doc.trained[:-1] + [True])
    return Document(doc.ids + [tokenizer.eos_token_id], doc.trained + [True])


def text_document(tokenizer, text: str) -> Document:
    """The text's tokens (with the tokenizer's own special tokens) and end-of-sequence, all trained."""
    ids = list(tokenizer(text)["input_ids"])
    return _with_eos(tokenizer, Document(ids, [True] * len(ids)))


def completion_document(tokenizer, prompt: str, completion: str) -> Document:
    """prompt + completion as one text (with the tokenizer's special tokens) and end-of-sequence; trained = the
    tokens overlapping the completion, and the end."""
    full = prompt + completion
    return _with_eos(tokenizer, _trained_spans(tokenizer, full, [(len(prompt), len(full))], special_tokens=True))


def alpaca_messages(fields: dict) -> list[dict]:
    user = fields["instruction"] + (f"\n\n{fields['input']}" if fields["input"] else "")
    system = [{"role": "system", "content": fields["system"]}] if fields["system"] else []
    return [*system, {"role": "user", "content": user}, {"role": "assistant", "content": fields["output"]}]


def alpaca_prompt(fields: dict) -> str:
    context = ", paired with an input that provides further context" if fields["input"] else ""
    given = f"### Input:\n{fields['input']}\n\n" if fields["input"] else ""
    return (fields["system"] + "\n\n" if fields["system"] else "") + ALPACA_PROMPT.format(
        context=context, instruction=fields["instruction"], input=given)


def sample_document(tokenizer, sample: Sample) -> Document:
    f = sample.fields
    if sample.format == "text":
        return text_document(tokenizer, f["text"])
    if sample.format in ("chat", "sharegpt"):
        return chat_document(tokenizer, f["messages"], f["tools"])
    if sample.format == "alpaca":
        if tokenizer.chat_template:
            return chat_document(tokenizer, alpaca_messages(f))
        return completion_document(tokenizer, alpaca_prompt(f), f["output"])
    if isinstance(f["prompt"], list):
        return chat_document(tokenizer, f["prompt"] + f["completion"], first=len(f["prompt"]))
    return completion_document(tokenizer, f["prompt"], f["completion"])


def tokenize(records: list[Sample], tokenizer) -> list[Document]:
    """Every sample's document; a sample the release's chat template refuses (its own raise_exception, a key it
    needs) is bad input naming the sample's file and line."""
    from jinja2 import TemplateError

    documents = []
    for sample in records:
        try:
            documents.append(sample_document(tokenizer, sample))
        except (TemplateError, TypeError) as err:
            raise data_error(sample.path, sample.where, f"the release's chat template cannot render it ({err})") from None
        if not any(documents[-1].trained):
            raise data_error(sample.path, sample.where, "no token to train on once rendered")
    return documents


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
