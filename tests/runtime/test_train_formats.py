"""`onboard train` from every data format and file kind a user brings (a few steps each, qwen3_moe), which tokens
the chat-like formats train, --epochs, --eval-data and --no-eval, and a malformed record refused at once."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from onboard.cli import main
from onboard.commands.data import GREEN, RESET, marked
from onboard.package.trainer_build import load_tokenizer, prepare_data
from runtime.data.sources import read_sources
from runtime.train.data import IGNORE
from runtime.train.metrics import read_metrics

N = 6


def records(fmt: str) -> list[dict]:
    """N records of the format; each answer mentions "bridge", no question does."""
    make = {
        "text": lambda i: {"text": f"The river runs past mill {i} and under the stone bridge."},
        "chat": lambda i: {"messages": [{"role": "user", "content": f"Where is mill {i}?"},
                                        {"role": "assistant", "content": f"Mill {i} is by the bridge."}]},
        "alpaca": lambda i: {"instruction": f"Say where mill {i} is.", "input": "", "output": f"By the bridge, {i}."},
        "sharegpt": lambda i: {"conversations": [{"from": "human", "value": f"Where is mill {i}?"},
                                                 {"from": "gpt", "value": f"Mill {i} is by the bridge."}]},
        "prompt-completion": lambda i: {"prompt": f"Where is mill {i}? ", "completion": f"By the bridge, {i}."},
    }[fmt]
    return [make(i) for i in range(N)]


def write(tmp_path: Path, kind: str) -> Path:
    """A data path of each kind: a jsonl file per format, a parquet file (alpaca), a folder (JSON array + jsonl)."""
    if kind == "parquet":
        path = tmp_path / "alpaca.parquet"
        pq.write_table(pa.Table.from_pylist(records("alpaca")), path)
        return path
    if kind == "folder":
        folder = tmp_path / "folder"
        folder.mkdir()
        (folder / "chat.json").write_text(json.dumps(records("chat"), indent=2))
        (folder / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records("sharegpt")))
        return folder
    path = tmp_path / f"{kind}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records(kind)))
    return path


def release_of(pkg: Path) -> Path:
    return Path(yaml.safe_load((pkg / "package.yaml").read_text())["source"]["absolute"])


@pytest.mark.parametrize("kind", ["text", "chat", "alpaca", "sharegpt", "prompt-completion", "parquet", "folder"])
def test_train_a_few_steps_from_each_kind_of_data(example_package, tmp_path, kind):
    pkg, data = example_package("qwen3_moe"), write(tmp_path, kind)
    run = tmp_path / "run"
    assert main(["train", str(pkg), "--data", str(data), "--steps", "2", "--seq-len", "16", "--eval-every", "1",
                 "--out", str(run), "--no-progress", "--no-cuda-graph"]) == 0
    train_lines, eval_lines = read_metrics(run / "metrics.jsonl")
    assert len(train_lines) == 2 and all(math.isfinite(r["loss"]) and not r["skipped"] for r in train_lines)
    assert [e["step"] for e in eval_lines] == [1, 2]
    # which tokens train: every one of text, only the answers of the chat-like formats
    tokenizer = load_tokenizer(release_of(pkg))
    # one row holds them all: no piece boundary cuts an answer
    rows = prepare_data(read_sources(data, no_eval=True), tokenizer, 2048, 0.0, 0).train
    labels = rows.labels_NL[rows.labels_NL != IGNORE].tolist()
    trained = tokenizer.decode(labels).replace(" ", "")
    assert trained.count("bridge") == N * (2 if kind == "folder" else 1), trained
    if kind == "text":
        # a label is the next token: a document's first token is no target
        assert trained.count("riverrunspastmill") == N
    else:
        assert "Where" not in trained and "Say" not in trained, trained


def test_epochs_eval_data_and_no_eval(example_package, tmp_path):
    pkg = example_package("qwen3_moe")
    data, held = write(tmp_path, "text"), tmp_path / "eval.jsonl"
    held.write_text(json.dumps({"text": "The bridge is old."}) + "\n")
    run = tmp_path / "run"
    # 6 documents of ~17 tokens in rows of 32: 4 rows; 2 epochs of 2-row steps = 4 steps
    assert main(["train", str(pkg), "--data", str(data), "--epochs", "2", "--batch-size", "2", "--seq-len", "32",
                 "--eval-data", str(held), "--out", str(run), "--no-progress"]) == 0
    rows = prepare_data(read_sources(data, no_eval=True), load_tokenizer(release_of(pkg)), 32, 0.0, 0).train
    train_lines, eval_lines = read_metrics(run / "metrics.jsonl")
    assert len(train_lines) == math.ceil(2 * len(rows) / 2) and [e["step"] for e in eval_lines] == [len(train_lines)]
    assert json.loads((run / "run.json").read_text())["eval_data"] == str(held)
    quiet = tmp_path / "quiet"
    assert main(["train", str(pkg), "--data", str(data), "--steps", "2", "--seq-len", "16", "--no-eval",
                 "--out", str(quiet), "--no-progress"]) == 0
    assert read_metrics(quiet / "metrics.jsonl")[1] == []
    with pytest.raises(SystemExit) as refused:
        main(["train", str(pkg), "--data", str(data), "--steps", "2", "--epochs", "1"])
    assert refused.value.code == 2


def test_a_malformed_record_exits_2_before_torch_or_the_package_load(example_package, tmp_path):
    """The refusal comes from the record check alone: the process never imports torch (which the package read, the
    tokenizer and the model need), so it cannot come after them."""
    data = write(tmp_path, "alpaca")
    data.write_text(data.read_text() + json.dumps({"instruction": "no answer"}) + "\n")
    probe = ("import sys, onboard.cli as cli; code = cli.main(sys.argv[1:]); "
             "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", probe, "train", str(example_package("qwen3_moe")), "--data", str(data),
                             "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"onboard: error: {data}: line {N + 1}: expected \"text\", "
                                                  "\"messages\", \"conversations\", \"instruction\" and \"output\", or "
                                                  "\"prompt\" and \"completion\" (keys found: instruction)"]
    assert not (tmp_path / "run").exists()


def test_onboard_data_prints_samples_with_the_trained_tokens_marked(example_package, tmp_path, capsys):
    pkg, data = example_package("qwen3_moe"), write(tmp_path, "folder")
    assert main(["data", str(pkg), "--data", str(data), "--n", "2", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("--- ")]
    assert headers[0].startswith(f"--- {data / 'chat.json'}: line 2 (chat): ") and len(headers) == 2
    marked = [piece.split("]]")[0] for piece in out.split("[[")[1:]]
    assert len(marked) == 2 and all("bridge" in m and "Where" not in m for m in marked), out
    assert "Where is mill 0?" in out.split("[[")[0]
    assert out.strip().splitlines()[-1].startswith(f"{2 * N} records (chat {N}, sharegpt {N}): ")
    (data / "bad.jsonl").write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n')
    assert main(["data", str(pkg), "--data", str(data)]) == 2
    assert "bad.jsonl: line 1: conversations has no assistant turn" in capsys.readouterr().err


def test_marks_are_colour_on_a_terminal_and_brackets_elsewhere(example_package):
    tokenizer = load_tokenizer(release_of(example_package("qwen3_moe")))
    ids = tokenizer("Where is the mill? By the bridge.")["input_ids"]
    trained = [i >= len(ids) // 2 for i in range(len(ids))]
    plain, coloured = marked(tokenizer, ids, trained, False), marked(tokenizer, ids, trained, True)
    assert plain.count("[[") == 1 and plain.endswith("]]") and GREEN not in plain
    assert coloured.replace(GREEN, "[[").replace(RESET, "]]") == plain
    assert plain.replace("[[", "").replace("]]", "") == tokenizer.decode(ids, skip_special_tokens=False)
