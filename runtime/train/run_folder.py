"""The run folder `onboard train` writes and `onboard export` reads.

    RUN/run.json                       {"package": PKG path, "release": release folder path, ...}
    RUN/adapter/adapter.safetensors    the LoRA factors under runtime names (lora_state_dict), fp32
    RUN/adapter/lora_config.json       the LoraConfig they were trained with (targets as runtime names)
    RUN/adapter/correction_bias.safetensors   the routers' updated correction biases (runtime buffer names,
                                       fp32), only from a run that updated them: the factors alone do not
                                       reproduce that run

run.json may carry more keys (the trainer's settings); readers take the two they need. The adapter
folder is written aside and renamed into place, so a reader never sees half of one.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors.torch import load_file, save_file

from runtime.errors import InputFileError
from runtime.lora.factors import LoraConfig

ADAPTER, WEIGHTS, CONFIG, BIASES = "adapter", "adapter.safetensors", "lora_config.json", "correction_bias.safetensors"


class RunInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    package: str
    release: str


class LoraConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rank: int
    alpha: float
    dropout: float
    use_rslora: bool
    targets: list[str]
    experts: bool
    router: bool
    seed: int


def write_run_json(run: Path, package: Path, release: Path, **settings) -> None:
    run = Path(run)
    run.mkdir(parents=True, exist_ok=True)
    info = RunInfo(package=str(Path(package).resolve()), release=str(Path(release).resolve()), **settings)
    (run / "run.json").write_text(info.model_dump_json(indent=2))


def _validated(model: type[BaseModel], path: Path):
    if not path.exists():
        raise InputFileError(path, None, "missing: not a run folder written by `onboard train`")
    try:
        return model.model_validate_json(path.read_text())
    except ValidationError as err:
        first = err.errors()[0]
        raise InputFileError(path, ".".join(str(p) for p in first["loc"]) or None, first["msg"]) from None


def read_run(run: Path) -> RunInfo:
    return _validated(RunInfo, Path(run) / "run.json")


def save_adapter(run: Path, state: dict[str, torch.Tensor], config: LoraConfig,
                 biases: dict[str, torch.Tensor] | None = None) -> None:
    """The factors and their config; biases (runtime name -> tensor) when the run updated them."""
    folder = Path(run) / ADAPTER
    tmp = folder.with_name(ADAPTER + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(_host_fp32(state), tmp / WEIGHTS)
    if biases:
        save_file(_host_fp32(biases), tmp / BIASES)
    (tmp / CONFIG).write_text(json.dumps(dataclasses.asdict(config), indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def _host_fp32(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().contiguous().cpu() for n, t in tensors.items()}


def read_biases(run: Path) -> dict[str, torch.Tensor]:
    """The updated correction biases a run saved (runtime name -> fp32 tensor); empty if it updated none."""
    path = Path(run) / ADAPTER / BIASES
    return load_file(path) if path.exists() else {}


def read_adapter(run: Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    folder = Path(run) / ADAPTER
    config = _validated(LoraConfigFile, folder / CONFIG)
    if not (folder / WEIGHTS).exists():
        raise InputFileError(folder / WEIGHTS, None, "missing: the run saved no adapter")
    fields = config.model_dump() | {"targets": tuple(config.targets)}
    return LoraConfig(**fields), load_file(folder / WEIGHTS)
