"""Which run folder `onboard train` writes, and whether it may: a run folder holds one run.

- No --out: a new folder PKG/runs/YYYYMMDD-HHMMSS (UTC start time) per run, so two runs never share one;
  `--resume` without --out continues the newest of them.
- --out RUN that already holds anything: exit 2 without --resume (a second run there would delete the first's
  checkpoints and leave a later resume continuing the wrong one).
- --resume: RUN must hold a run (its run.json), else exit 2, nothing to resume; the settings that change what
  the run computes (MATH_FLAGS) must equal those run.json records, each changed one named, else exit 2; --steps
  may extend the run (the cosine schedule is then stretched from the resumed step on), not cut below the step it
  reached. A run with no complete checkpoint yet starts again from step 0, said on stderr.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import re
from pathlib import Path

from onboard import package_io
from onboard.errors import BadInput

RUNS = "runs"
STAMP = "%Y%m%d-%H%M%S"
STAMPED = re.compile(r"^\d{8}-\d{6}(-\d+)?$")

# the recorded settings a resume must keep, and the flag that sets each: a change to any of them makes the resumed
# run compute something the checkpoint's steps did not (other rows, another update, another model)
MATH_FLAGS = {
    "data_sha256": "--data",  # the documents (the file's bytes: a moved file may resume, an edited one not)
    "seq_len": "--seq-len",  # rows are packed at this length: other rows, other batches
    "batch_size": "--batch-size",  # tokens per step
    "grad_accum": "--grad-accum",
    "world_size": "--nproc x --nnodes",  # data-parallel ranks read disjoint rows: tokens per step
    "eval_fraction": "--eval-fraction",  # which documents train and which are held out
    "data_format": "--data-format",  # how each record renders, so which tokens train
    "eval_data_sha256": "--eval-data",  # held-out documents from their own file: --data's all train
    "no_eval": "--no-eval",  # no held-out draw: every document trains
    "seed": "--seed",  # data order and the held-out draw
    "lr": "--lr",
    "warmup_steps": "--warmup-steps",
    "weight_decay": "--weight-decay",
    "aux_loss_coef": "--aux-loss-coef",
    "correction_bias_rate": "--bias-update-rate",
    "capacity_factor": "--capacity-factor",  # tokens over an expert's capacity are dropped
    "min_lr_ratio": "min_lr_ratio (TrainConfig)",
    "betas": "betas (TrainConfig)",
    "grad_clip": "grad_clip (TrainConfig)",
    "loss_chunk": "loss_chunk (TrainConfig)",
    "spec_hash": "the package (spec.json)",  # another model
    "lora": "the package's lora.yaml",  # another adapter: the checkpoint's factors do not fit it
}


def choose_folder(pkg: Path, out: str | None, resume: bool) -> Path:
    """--out; else the newest run of PKG/runs when resuming, else a new one there named by the start time. In the
    package, no symlink on the way; either way a folder holding no symlink, so the trainer's writes stay inside."""
    if out is not None:
        folder = Path(out)
    else:
        folder = newest_run(pkg) if resume else _new_run(pkg)
        package_io.check_folder(pkg, folder)
    if folder.is_symlink():
        raise BadInput(folder, None, "a symlink: the run folder must be a folder `onboard train` writes into itself")
    if folder.is_dir():
        package_io.refuse_links_below(folder)
    return folder


def _new_run(pkg: Path) -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime(STAMP)
    folder, n = pkg / RUNS / stamp, 1
    while folder.exists():
        n += 1
        folder = pkg / RUNS / f"{stamp}-{n}"
    return folder


def newest_run(pkg: Path) -> Path:
    runs = pkg / RUNS
    stamped = [p for p in runs.iterdir() if STAMPED.match(p.name) and p.is_dir()] if runs.is_dir() else []
    if not stamped:
        raise BadInput(runs, None, "nothing to resume: no run folder here; train without --resume to start one, "
                                   "or name the run with --out RUN")
    return max(stamped, key=lambda p: tuple(int(x) for x in p.name.replace("-", " ").split()))


def require_fresh(folder: Path) -> None:
    """Without --resume: the folder is new or empty."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    if (folder / "run.json").exists():
        raise BadInput(folder, None, f"holds a run already (last checkpoint: step {last_checkpoint_step(folder)}): "
                                     "pass --resume to continue it, or another --out for a new run (a run folder "
                                     "holds one run)")
    raise BadInput(folder, None, "not empty and not a run folder: pass an empty or new --out for the run")


def last_checkpoint_step(folder: Path) -> int:
    """The step of the run's last complete checkpoint, 0 when it has none."""
    from runtime.train.checkpoint import complete_steps

    steps = complete_steps(folder / "checkpoints") if (folder / "checkpoints").is_dir() else []
    return int(steps[-1].name.split("-")[1]) if steps else 0


def check_resume(folder: Path, math: dict, steps: int) -> int:
    """The step a resume of `folder` starts from, after refusing what it may not change; exit 2 when it holds no
    run, when a setting of MATH_FLAGS changed (each named) or --steps is below the step it reached."""
    recorded = recorded_math(folder)
    changed = [key for key in MATH_FLAGS if _json(math.get(key)) != _json(recorded.get(key))]
    if changed:
        listed = "; ".join(f"{MATH_FLAGS[k]} {_show(math.get(k))} where the run has {_show(recorded.get(k))}"
                           for k in changed)
        raise BadInput(folder / "run.json", None, f"--resume with other settings: {listed}: each changes what the "
                                                  "run computes (resume with the run's own, or start a new run)")
    step = last_checkpoint_step(folder)
    if steps < step:
        raise BadInput(None, "--steps", f"{steps} is below step {step} that {folder} reached: a resume continues a "
                                        "run, it cannot shorten it")
    return step


def recorded_math(folder: Path) -> dict:
    """The settings run.json records that a resume must keep; exit 2 when the folder holds no run."""
    path = folder / "run.json"
    if not path.is_file():
        raise BadInput(folder, None, "nothing to resume: no run.json (not a run folder written by `onboard train`); "
                                     "train without --resume to start the run")
    try:
        recorded = json.loads(path.read_text()).get("math")
    except (ValueError, AttributeError):
        raise BadInput(path, None, "not the JSON object `onboard train` writes") from None
    if not isinstance(recorded, dict):
        raise BadInput(path, "math", "missing: the settings the run trained with are not recorded (a run of an "
                                     "older onboard), so a resume cannot check them; start a new run")
    return recorded


def _json(value):
    return json.loads(json.dumps(value))


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def data_digest(path: Path) -> str:
    """sha256 of the data: a file's bytes, or a folder's files (names relative to it, and their bytes) in order."""
    digest = hashlib.sha256()
    files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else [Path(path)]
    for file in files:
        if Path(path).is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
