"""Training checkpoints with torch.distributed.checkpoint (one process needs no process group).

RUN/checkpoints/step-NNNNNNNN/ holds the trainable parameters, the optimizer state and the train
state (step, counters, RNG). A folder is written as .step-N.partial and renamed when complete, so a
folder named step-N is always whole; resume takes the highest one and ignores partial ones. The last
`keep_last` folders and the one with the best eval loss are kept.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

OPTIONS = StateDictOptions(ignore_frozen_params=True)
# the template loaded into holds exactly the trainable keys (DCP fails on any it cannot fill); the frozen
# base weights come from the release, not from here
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
STATE_FILE = "train_state.json"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def _one_process_quiet():
    """DCP warns that it runs in one process when no process group exists: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def complete_steps(root: Path) -> list[Path]:
    """Committed step folders, oldest first."""
    return sorted(p for p in Path(root).glob("step-*") if p.is_dir())


def save(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict, keep_last: int) -> Path:
    """Write step train_state["step"] aside, commit it by a rename, then prune; returns the folder."""
    root = Path(root)
    final = _step_dir(root, train_state["step"])
    partial = root / f".{final.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    with _one_process_quiet():
        dcp.save({"model": model_sd, "optim": optim_sd, "rng": _rng_state()}, checkpoint_id=partial)
    # every rank has written its shards (dcp.save returns after its collective finish): one rank commits
    if not dist.is_initialized() or dist.get_rank() == 0:
        (partial / STATE_FILE).write_text(json.dumps(train_state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        _prune(root, keep_last)
    if dist.is_initialized():
        dist.barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    steps = complete_steps(root)
    evals = {p: json.loads((p / STATE_FILE).read_text()).get("eval_loss") for p in steps}
    scored = [p for p in steps if evals[p] is not None]
    keep = set(steps[-keep_last:]) | ({min(scored, key=lambda p: evals[p])} if scored else set())
    for p in steps:
        if p not in keep:
            shutil.rmtree(p)


def load(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore parameters, optimizer state and RNG from a committed folder; returns its train state."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": model_sd, "optim": optim_sd, "rng": _rng_state()}
    with _one_process_quiet():
        dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=LOAD_OPTIONS)
    _set_rng_state(state["rng"])
    return json.loads((Path(folder) / STATE_FILE).read_text())


def clear_partial(root: Path) -> None:
    """Folders of saves that never finished (a killed process): removed before training goes on."""
    for p in Path(root).glob(".step-*.partial"):
        shutil.rmtree(p)
