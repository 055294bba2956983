"""What one run trains and evaluates on: `--data`, and `--eval-data`, the eval split of a `--data` folder, a
held-out share of the training documents, or nothing (`--no-eval`). Read and checked whole, torch-free."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.data.files import read_rows, split_files
from runtime.data.formats import Sample, samples


@dataclass(frozen=True)
class DataSources:
    train: list[Sample]
    eval: list[Sample] | None  # None: hold out a share of train (hold_out) or evaluate nothing
    hold_out: bool


def read_sources(data: Path, data_format: str = "auto", eval_data: Path | None = None,
                 no_eval: bool = False) -> DataSources:
    data = Path(data)
    train = samples(read_rows(data, "train"), data_format)
    if no_eval:
        return DataSources(train, None, hold_out=False)
    if eval_data is not None:
        return DataSources(train, samples(read_rows(Path(eval_data), _eval_split(Path(eval_data))), data_format),
                           hold_out=False)
    if data.is_dir() and split_files(data, "eval"):
        return DataSources(train, samples(read_rows(data, "eval"), data_format), hold_out=False)
    return DataSources(train, None, hold_out=True)


def _eval_split(path: Path) -> str:
    """An --eval-data folder's validation (or test) split where it names splits, else all of it."""
    return "eval" if path.is_dir() and split_files(path, "eval") else "train"
