"""A data path read into rows, each with the file and line (or table row) it came from.

- `.jsonl`: one JSON object per line (blank lines skipped);
- `.json`: a JSON array of objects (each named by the line it starts on), or JSON lines as in `.jsonl`;
- `.parquet`, `.arrow`: a table, one row per record (rows named from 0, as `datasets` indexes them); `.arrow`
  is Arrow's IPC file or stream format, the latter what `datasets`' save_to_disk writes;
- a folder: every such file below it, in name order. Where file or folder names carry split names (Hugging Face
  layouts: `train-00000-of-00001.parquet`, `data/test.jsonl`, save_to_disk's `train/`), the training data is
  the train split and the eval data the validation split (else test); metadata files of save_to_disk are skipped.
pyarrow is imported only for parquet and Arrow files.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import InputFileError

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
# what `datasets`' save_to_disk writes beside its .arrow files
METADATA = {"dataset_info.json", "state.json", "dataset_dict.json", "dataset_infos.json"}
TRAIN_SPLIT = ("train",)
EVAL_SPLITS = (("validation", "valid", "val", "dev"), ("test", "eval"))
_WHITESPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class Row:
    record: Any
    path: Path
    where: str  # "line 3", "row 0"


def data_error(path: Path, where: str | None, message: str) -> InputFileError:
    return InputFileError(path, where, message)


def read_rows(path: Path, split: str = "train") -> list[Row]:
    """Every row of a file, or of the `split` ("train" or "eval") files of a folder; bad input names file and line."""
    path = Path(path)
    if path.is_dir():
        files = split_files(path, split)
        if not files:
            raise data_error(path, None, f"no data files ({', '.join(SUFFIXES)}) in this folder")
        return [row for f in files for row in read_file(f)]
    if not path.is_file():
        raise data_error(path, None, "does not exist (expected a data file or a folder of them)")
    return read_file(path)


def folder_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in SUFFIXES and p.name not in METADATA
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def _names_split(path: Path, names: tuple[str, ...]) -> bool:
    words = re.split(r"[^a-z0-9]+", path.as_posix().lower())
    return any(name in words for name in names)


def split_files(folder: Path, split: str) -> list[Path]:
    """The folder's files of one split; a folder without split names is all train data (and no eval data)."""
    files = folder_files(folder)
    relative = {f: f.relative_to(folder) for f in files}
    named = [f for f in files if _names_split(relative[f], TRAIN_SPLIT + sum(EVAL_SPLITS, ()))]
    if not named:
        return files if split == "train" else []
    if split == "train":
        return [f for f in files if _names_split(relative[f], TRAIN_SPLIT)]
    for names in EVAL_SPLITS:
        chosen = [f for f in files if _names_split(relative[f], names) and not _names_split(relative[f], TRAIN_SPLIT)]
        if chosen:
            return chosen
    return []


def read_file(path: Path) -> list[Row]:
    if path.suffix in (".parquet", ".arrow"):
        rows = _table_rows(path)
    else:
        rows = _json_rows(path)
    if not rows:
        raise data_error(path, None, "no data records")
    return rows


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise data_error(path, None, f"cannot read ({err})") from None


def _json_rows(path: Path) -> list[Row]:
    text = _text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return _array_rows(path, text)
    return [Row(_parse(line, path, n), path, f"line {n}") for n, line in enumerate(text.splitlines(), start=1)
            if line.strip()]


def _parse(text: str, path: Path, line: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise data_error(path, f"line {line}", f"not valid JSON ({err.msg} at column {err.colno})") from None


def _array_rows(path: Path, text: str) -> list[Row]:
    """A JSON array's items, each named by the line it starts on (the whole file parsed first, so a syntax error
    names its own line)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as err:
        raise data_error(path, f"line {err.lineno}", f"not valid JSON ({err.msg} at column {err.colno})") from None
    decoder, rows, line, counted = json.JSONDecoder(), [], 1, 0
    pos = _WHITESPACE.match(text, text.index("[") + 1).end()
    for _ in items:
        line, counted = line + text.count("\n", counted, pos), pos
        item, end = decoder.raw_decode(text, pos)
        rows.append(Row(item, path, f"line {line}"))
        # past the comma (or onto the closing bracket)
        pos = _WHITESPACE.match(text, _WHITESPACE.match(text, end).end() + 1).end()
    return rows


def _table_rows(path: Path) -> list[Row]:
    import pyarrow as pa

    try:
        table = _parquet(path) if path.suffix == ".parquet" else _arrow(path)
    except (pa.ArrowException, OSError) as err:
        raise data_error(path, None, f"not a readable {path.suffix[1:]} table ({err})") from None
    return [Row(record, path, f"row {n}") for n, record in enumerate(table.to_pylist())]


def _parquet(path: Path):
    import pyarrow.parquet as pq

    return pq.read_table(path)


def _arrow(path: Path):
    """Arrow's IPC file format, else its stream format (what `datasets`' save_to_disk writes)."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all()
