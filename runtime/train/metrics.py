"""Training metrics: RUN/metrics.jsonl (one line per step, eval lines apart), expert load, PNG plots.

Expert load is read from each MoE layer's routing of the last forward (`MoE.last_routing`, already
kept for alignment), so counting changes nothing in the numerics and a recomputed forward (activation
checkpointing) is not counted twice. Imbalance is max over mean tokens per expert (1 = even); counts and drops are summed over ranks.
"""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from runtime.model.layers.ffn import MoE


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    return {i: layer.ffn for i, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)}


def expert_counts(model: nn.Module) -> dict[int, torch.Tensor]:
    """layer index -> tokens routed to each expert in the last forward (int64, [E])."""
    out = {}
    for i, moe in moe_layers(model).items():
        num_experts = moe.router.weight.shape[0]
        out[i] = torch.bincount(moe.last_routing.flatten().cpu(), minlength=num_experts)
    return out


def expert_drops(model: nn.Module) -> dict[int, torch.Tensor]:
    """layer index -> (token, choice) pairs each expert dropped in the last forward for capacity ([E];
    zeros when dropless or not expert-parallel)."""
    out = {}
    for i, moe in moe_layers(model).items():
        dropped = getattr(moe.experts, "last_dropped", None)
        out[i] = torch.zeros(moe.router.weight.shape[0], dtype=torch.int64) if dropped is None else dropped.cpu()
    return out


def imbalance(counts_E: torch.Tensor) -> float:
    mean = counts_E.float().mean()
    return float(counts_E.max() / mean) if mean > 0 else 0.0


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class MetricsLog:
    """Appends JSON lines (rank 0 only); on resume drops the lines of steps after the checkpoint resumed from. Each
    line also goes to the sinks (runtime/train/sinks.py)."""

    def __init__(self, path: Path, resume_step: int | None, sinks=()):
        self.path = Path(path)
        self.sinks = tuple(sinks)
        self.enabled = not dist.is_initialized() or dist.get_rank() == 0
        if not self.enabled:
            return
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.write(record)


# A layer's busiest expert at this many times the mean load (summed over the last third of the run) is a collapse
# worth a reader's look: the demo's layer 3 reached 3.9 (5 of 8 experts nearly idle) while its other layers stayed
# under 1.4; an even router is 1.
COLLAPSE_IMBALANCE = 3.0


def load_collapses(train: list[dict]) -> list[dict]:
    """MoE layers whose routing concentrated over the last third of the train lines: {layer, expert, share,
    imbalance, idle (experts under a quarter of an even share), experts, first_step, last_step}."""
    window = train[-max(1, len(train) // 3):]
    found = []
    for layer in sorted(window[0]["expert_counts"] if window else [], key=int):
        counts = torch.tensor([r["expert_counts"][layer] for r in window], dtype=torch.float64).sum(0)
        total = float(counts.sum())
        if total == 0 or imbalance(counts) < COLLAPSE_IMBALANCE:
            continue
        share = counts / total
        found.append({"layer": int(layer), "expert": int(share.argmax()), "share": float(share.max()),
                      "imbalance": imbalance(counts), "idle": int((share < 0.25 / len(share)).sum()),
                      "experts": len(share), "first_step": window[0]["step"], "last_step": window[-1]["step"]})
    return found


def collapse_line(c: dict) -> str:
    return (f"layer {c['layer']}: expert {c['expert']} took {100 * c['share']:.0f}% of the routed pairs over steps "
            f"{c['first_step']}-{c['last_step']} ({c['imbalance']:.1f}x the mean; {c['idle']} of {c['experts']} experts "
            "under a quarter of an even share)")


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(train step lines, eval lines) of a metrics.jsonl."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [r for r in lines if r.get("kind") == "train"], [r for r in lines if r.get("kind") == "eval"]


def plot(run_dir: Path) -> list[Path]:
    """loss.png (train and eval loss), grad_norm.png, expert_load.png (per MoE layer: expert x step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    train, evals = read_metrics(run_dir / "metrics.jsonl")
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax.set(xlabel="step", ylabel="loss"), ax.legend()
    written.append(_save(fig, run_dir / "loss.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in train], [r["grad_norm"] for r in train])
    ax.set(xlabel="step", ylabel="grad norm (before clipping)")
    written.append(_save(fig, run_dir / "grad_norm.png"))
    if train and train[0]["expert_counts"]:
        written.append(_expert_heatmaps(plt, train, run_dir / "expert_load.png"))
    return written


def _expert_heatmaps(plt, train: list[dict], path: Path) -> Path:
    layers = sorted(train[0]["expert_counts"], key=int)
    fig, axes = plt.subplots(len(layers), 1, figsize=(7, 1.8 * len(layers) + 0.6), squeeze=False)
    for ax, layer in zip(axes[:, 0], layers):
        load = torch.tensor([r["expert_counts"][layer] for r in train], dtype=torch.float32)
        share = load / load.sum(-1, keepdim=True).clamp(min=1)
        image = ax.imshow(share.T.numpy(), aspect="auto", interpolation="nearest",
                          extent=(train[0]["step"] - 0.5, train[-1]["step"] + 0.5, share.shape[1] - 0.5, -0.5))
        ax.set(ylabel=f"layer {layer}\nexpert")
        fig.colorbar(image, ax=ax, label="token share")
    axes[-1, 0].set(xlabel="step")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
