"""Where metrics lines go besides RUN/metrics.jsonl: TensorBoard event files and Weights & Biases.

Each sink takes the lines MetricsLog writes (rank 0 only) and logs their scalars by step: a train line's numbers
as `train/<key>`, per-MoE-layer numbers as `train/<key>/layer<L>`, an eval line's loss as `eval/loss`; lists
(per-expert counts, biases) stay in metrics.jsonl and its plots. Both packages are optional (pyproject's `logging`
extra): `available` says which is missing before any work starts.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

TENSORBOARD_DIR = "tensorboard"


def available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def scalars(record: dict) -> dict[str, float]:
    """The line's scalars under their logged names (booleans as 0/1, nulls left out)."""
    prefix = record.get("kind", "train")
    out = {}
    for key, value in record.items():
        if key in ("kind", "step"):
            continue
        name = f"{prefix}/{'loss' if key == 'eval_loss' else key}"
        if isinstance(value, dict):
            out.update({f"{name}/layer{layer}": float(v) for layer, v in value.items() if _number(v)})
        elif _number(value):
            out[name] = float(value)
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and value is not None


class TensorBoardSink:
    """RUN/tensorboard/events.out.tfevents.*; on resume the events past the resumed step are purged (a killed run
    logged steps its checkpoint does not hold), so the curve shows each step once."""

    def __init__(self, run_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=purge)

    def write(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One Weights & Biases run per run folder (its id derived from the folder's path, so a resume continues the
    same W&B run); files under RUN/wandb. WANDB_MODE=offline logs there without a network (`wandb sync` later)."""

    def __init__(self, project: str, run_dir: Path, config: dict):
        import wandb

        run_dir = Path(run_dir).resolve()
        run_id = f"{run_dir.name}-{hashlib.sha256(str(run_dir).encode()).hexdigest()[:8]}"
        self.run = wandb.init(project=project, dir=str(run_dir), id=run_id, name=run_dir.name, config=config,
                              resume="allow")

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()
