"""Data as users have it: every format (text, chat with tool calls, alpaca, ShareGPT, prompt/completion), every file
kind (jsonl, JSON array, parquet, Arrow, folders with splits), and which tokens each format trains."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from onboard.examples.tokenizer import write_example_tokenizer
from runtime.data.files import read_rows
from runtime.data.formats import samples
from runtime.data.sources import read_sources
from runtime.errors import InputFileError
from runtime.train.data import ALPACA_PROMPT, read_jsonl, tokenize

# A template that renders tool schemas and tool calls (as Qwen's and Hermes' do), for the tool-call cases
TOOL_TEMPLATE = (
    "{%- if tools -%}{{ '<|im_start|>system\n' }}{%- for t in tools -%}{{ t | tojson }}{%- endfor -%}"
    "{{ '<|im_end|>\n' }}{%- endif -%}"
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{%- if m.get('content') -%}{{ m['content'] }}{%- endif -%}"
    "{%- for c in m.get('tool_calls', []) -%}{{ '<tool_call>' + c['function'] | tojson + '</tool_call>' }}{%- endfor -%}"
    "{{ '<|im_end|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
CHAT = {"messages": [{"role": "user", "content": "What is two plus two?"},
                     {"role": "assistant", "content": "Four, the river said."}]}
ALPACA = {"instruction": "Name the mill.", "input": "It stands by the bridge.", "output": "The stone mill."}
SHAREGPT = {"conversations": [{"from": "human", "value": "Where is the mill?"}, {"from": "gpt", "value": "By the bridge."}]}
COMPLETION = {"prompt": "The river runs past ", "completion": "the old stone mill."}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
TOOL_CHAT = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather at the mill?"},
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"at": "mill"}}}]},
    {"role": "tool", "content": "rain all day"},
    {"role": "assistant", "content": "It rains at the mill."}]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    write_example_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def trained_and_not(tokenizer, doc) -> tuple[str, str]:
    pick = lambda want: tokenizer.decode([i for i, t in zip(doc.ids, doc.trained) if t == want])  # noqa: E731
    return pick(True), pick(False)


def one_document(tokenizer, tmp_path, record, data_format="auto"):
    records = read_jsonl(jsonl(tmp_path / "d.jsonl", [record]), data_format)
    return records[0].format, tokenize(records, tokenizer)[0]


def test_each_format_is_detected_and_trains_only_its_answer(tokenizer, tmp_path):
    cases = {"chat": (CHAT, "Four, the river said.", "two plus two"),
             "alpaca": (ALPACA, "The stone mill.", "Name the mill"),
             "sharegpt": (SHAREGPT, "By the bridge.", "Where is the mill"),
             "prompt-completion": (COMPLETION, "the old stone mill.", "The river runs past")}
    for fmt, (record, answer, question) in cases.items():
        detected, doc = one_document(tokenizer, tmp_path, record)
        trained, untrained = trained_and_not(tokenizer, doc)
        assert detected == fmt
        assert answer.replace(" ", "") in trained.replace(" ", ""), (fmt, trained)
        assert question.replace(" ", "") in untrained.replace(" ", "") and question not in trained, (fmt, trained)
    detected, doc = one_document(tokenizer, tmp_path, {"text": "The mill turns."})
    assert detected == "text" and all(doc.trained) and doc.ids[-1] == tokenizer.eos_token_id


def test_prompt_completion_trains_the_completion_tokens_and_the_end(tokenizer, tmp_path):
    _, doc = one_document(tokenizer, tmp_path, COMPLETION)
    prompt_ids = tokenizer(COMPLETION["prompt"])["input_ids"]
    # the prompt's tokens are the document's first ones (BPE may merge across the boundary: a token overlapping
    # the completion trains), the end of sequence is trained
    assert not any(doc.trained[:len(prompt_ids) - 1]) and doc.trained[-1] and doc.ids[-1] == tokenizer.eos_token_id


def test_sharegpt_and_alpaca_render_as_the_equivalent_chat(tokenizer, tmp_path):
    chat = {"messages": [{"role": "user", "content": "Where is the mill?"}, {"role": "assistant", "content": "By the bridge."}]}
    assert one_document(tokenizer, tmp_path, SHAREGPT)[1] == one_document(tokenizer, tmp_path, chat)[1]
    as_chat = {"messages": [{"role": "user", "content": "Name the mill.\n\nIt stands by the bridge."},
                            {"role": "assistant", "content": "The stone mill."}]}
    assert one_document(tokenizer, tmp_path, ALPACA)[1] == one_document(tokenizer, tmp_path, as_chat)[1]


def test_alpaca_without_a_chat_template_takes_the_alpaca_prompt(tokenizer, tmp_path):
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        _, doc = one_document(tokenizer, tmp_path, ALPACA)
        with pytest.raises(ValueError, match="ships no chat template"):
            one_document(tokenizer, tmp_path, CHAT)
    finally:
        tokenizer.chat_template = template
    trained, untrained = trained_and_not(tokenizer, doc)
    assert "### Response:" in tokenizer.decode(doc.ids) and ALPACA_PROMPT[:20] in tokenizer.decode(doc.ids)
    assert "stone mill" in trained and "Instruction" in untrained and "Instruction" not in trained


def test_tool_calls_render_through_the_template_and_train_only_the_assistant(tokenizer, tmp_path):
    template, tokenizer.chat_template = tokenizer.chat_template, TOOL_TEMPLATE
    try:
        _, doc = one_document(tokenizer, tmp_path, TOOL_CHAT)
    finally:
        tokenizer.chat_template = template
    trained, untrained = trained_and_not(tokenizer, doc)
    flat = trained.replace(" ", "")
    assert '<tool_call>{"name":"weather","arguments":{"at":"mill"}}</tool_call>' in flat
    assert "Itrainsatthemill." in flat
    # the tool schemas (system), the user and the tool's answer are context
    assert "parameters" in untrained and "rainallday" in untrained.replace(" ", "") and "rainallday" not in flat


def test_message_list_prompt_completion_trains_only_the_completion_turns(tokenizer, tmp_path):
    record = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
                         {"role": "user", "content": "Where is the mill?"}],
              "completion": [{"role": "assistant", "content": "By the bridge."}]}
    _, doc = one_document(tokenizer, tmp_path, record)
    trained, untrained = trained_and_not(tokenizer, doc)
    assert "bridge" in trained and "Hello" in untrained and "Hello" not in trained


def test_a_forced_format_needs_its_keys_and_an_ambiguous_record_needs_one(tokenizer, tmp_path):
    record = {**ALPACA, "text": "### Instruction: Name the mill."}
    assert one_document(tokenizer, tmp_path, record)[0] == "alpaca"
    assert one_document(tokenizer, tmp_path, record, "text")[0] == "text"
    with pytest.raises(InputFileError, match=r"line 1: --data-format chat: no 'messages'"):
        one_document(tokenizer, tmp_path, ALPACA, "chat")
    with pytest.raises(InputFileError, match=r"line 1: fits both chat and prompt-completion: choose one"):
        one_document(tokenizer, tmp_path, {**CHAT, **COMPLETION})


@pytest.mark.parametrize("record,needle", [
    ({"instruction": "x"}, 'expected "text", "messages"'),
    ({"conversations": [{"from": "narrator", "value": "x"}]}, '"from" \'narrator\' is none of'),
    ({"conversations": [{"from": "human", "value": "x"}]}, "no assistant turn"),
    ({"instruction": "x", "output": 3}, '"output" must be a non-empty string'),
    ({"prompt": "x", "completion": ""}, '"completion" must be a non-empty string'),
    ({"messages": [{"role": "assistant", "tool_calls": "f()"}]}, "tool_calls must be a list"),
], ids=["unknown-keys", "sharegpt-role", "sharegpt-no-answer", "alpaca-output", "empty-completion", "tool-calls"])
def test_a_malformed_record_names_its_file_and_line(tmp_path, record, needle):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n\n" + json.dumps(record) + "\n")
    with pytest.raises(InputFileError) as err:
        read_jsonl(path)
    assert err.value.one_line().startswith(f"{path}: line 3: ") and needle in err.value.one_line()


def test_a_json_array_names_each_records_first_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[\n  {"text": "one"},\n  {\n    "text": ""\n  }\n]\n')
    with pytest.raises(InputFileError, match=r"data.json: line 3: \"text\" must be a non-empty string"):
        read_jsonl(path)
    path.write_text('[\n  {"text": "one"},\n  {"text": "two",}\n]\n')
    with pytest.raises(InputFileError, match=r"data.json: line 3: not valid JSON"):
        read_jsonl(path)
    path.write_text(json.dumps([CHAT, ALPACA], indent=2))
    assert [s.format for s in read_jsonl(path)] == ["chat", "alpaca"]


def test_parquet_and_arrow_tables_read_as_rows(tmp_path):
    table = pa.Table.from_pylist([ALPACA, {"instruction": "Count.", "input": None, "output": "Three."}])
    pq.write_table(table, tmp_path / "a.parquet")
    # the stream format is what `datasets`' save_to_disk writes; the file format what pyarrow.feather writes
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    for name in ("a.parquet", "stream.arrow", "file.arrow"):
        records = read_jsonl(tmp_path / name)
        assert [r.fields["output"] for r in records] == ["The stone mill.", "Three."] and records[1].where == "row 1"
    pq.write_table(pa.Table.from_pylist([{"instruction": "x", "output": ""}]), tmp_path / "bad.parquet")
    with pytest.raises(InputFileError, match=r"bad.parquet: row 0: \"output\" must be"):
        read_jsonl(tmp_path / "bad.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputFileError, match=r"junk.parquet: not a readable parquet table"):
        read_jsonl(tmp_path / "junk.parquet")


def test_a_folder_with_splits_trains_on_train_and_evaluates_on_validation(tmp_path):
    folder = tmp_path / "dataset"
    (folder / "data").mkdir(parents=True)
    jsonl(folder / "data" / "train-00000-of-00002.jsonl", [{"text": "a"}])
    pq.write_table(pa.Table.from_pylist([{"text": "b"}]), folder / "data" / "train-00001-of-00002.parquet")
    jsonl(folder / "data" / "test.jsonl", [{"text": "t"}])
    jsonl(folder / "data" / "validation.jsonl", [{"text": "v"}])
    (folder / "README.md").write_text("# a dataset card\n")
    (folder / "dataset_info.json").write_text("{}")
    sources = read_sources(folder)
    assert [s.fields["text"] for s in sources.train] == ["a", "b"] and [s.fields["text"] for s in sources.eval] == ["v"]
    (folder / "data" / "validation.jsonl").unlink()
    assert [s.fields["text"] for s in read_sources(folder).eval] == ["t"]
    assert read_sources(folder, no_eval=True).eval is None
    plain = tmp_path / "plain"
    plain.mkdir()
    jsonl(plain / "x.jsonl", [{"text": "x"}])
    jsonl(plain / "y.jsonl", [CHAT])
    sources = read_sources(plain)
    assert [s.format for s in sources.train] == ["text", "chat"] and sources.eval is None and sources.hold_out
    assert [s.format for s in read_sources(folder, eval_data=plain).eval] == ["text", "chat"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputFileError, match="no data files"):
        read_rows(tmp_path / "empty")


def test_samples_keep_their_origin(tmp_path):
    rows = read_rows(jsonl(tmp_path / "d.jsonl", [{"text": "a"}, CHAT]))
    assert [s.origin for s in samples(rows)] == [f"{tmp_path / 'd.jsonl'}: line 1", f"{tmp_path / 'd.jsonl'}: line 2"]
