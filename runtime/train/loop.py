"""The LoRA training loop: frozen base weights, fp32 LoRA factors trained by AdamW, packed batches.

Per step: `grad_accum` micro-batches of `batch_size` packed rows (flattened into one sequence with
cu_seqlens), the chunked LM-head loss summed and divided by the trained tokens of the whole step,
gradient clipping, cosine schedule with warmup. A step whose loss or gradient norm is not finite is
skipped (no update) and `max_bad_steps` of them in a row abort. Eval loss every `eval_every` steps,
a checkpoint every `checkpoint_every` steps and at the end; metrics.jsonl and plots in the run folder.
Data order, schedule and RNG are functions of the step, so a resumed run repeats a straight one.
Data-parallel ranks (torch.distributed, when initialized) read disjoint rows and sum token counts;
one process is the same code with a group of one.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from runtime.train import balance, checkpoint
from runtime.train.data import IGNORE, PackedRows, batch_rows, cu_seqlens_of
from runtime.train.flops import peak_flops, step_flops
from runtime.lora.factors import lora_parameters
from runtime.model.loss import chunked_cross_entropy
from runtime.train.metrics import MetricsLog, expert_counts, expert_drops, imbalance, peak_memory_gib, plot
from runtime.train.progress import TrainProgress
from runtime.parallel.grads import clip_grad_norm
from runtime.train.step_graph import MicroStep, graph_allowed


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 1  # packed rows per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0  # max global grad norm
    eval_every: int = 50
    checkpoint_every: int = 50
    keep_last: int = 2  # step folders kept besides the best
    max_bad_steps: int = 3  # non-finite steps in a row before aborting
    loss_chunk: int = 1024  # tokens per LM-head chunk
    seed: int = 0  # data order
    aux_loss_coef: float = 0.0  # weight of the auxiliary load-balancing loss (runtime/train/balance.py); 0: off
    correction_bias_rate: float = 0.0  # loss-free balancing: routers' correction-bias step per update; 0: off
    cuda_graph: bool = True  # replay forward+backward as a CUDA graph where legal (runtime/train/step_graph.py)


class TrainingAborted(RuntimeError):
    pass


@dataclass
class TrainData:
    train: PackedRows
    eval: PackedRows | None  # None: no eval (--no-eval); no eval loss, no best checkpoint


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine from lr down to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps - 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _rank_and_size() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(value)
    return value


def micro_batch(rows: PackedRows, indices: list[int], device: torch.device) -> dict:
    """Rows flattened into one packed sequence: input_ids [1, B*L], labels [B*L], positions, cu_seqlens."""
    take = lambda t: t[indices].to(device)  # noqa: E731
    return {"input_ids": take(rows.tokens_NL).reshape(1, -1), "labels": take(rows.labels_NL).reshape(-1),
            "positions": take(rows.positions_NL).reshape(1, -1),
            "cu_seqlens": cu_seqlens_of(rows.segments_NL[indices]).to(device)}


def loss_sum(model: nn.Module, batch: dict, chunk: int) -> torch.Tensor:
    h_BTD = model.hidden_states(batch["input_ids"], batch["positions"], cu_seqlens=batch["cu_seqlens"])
    cap = model.config.final_logit_softcapping
    return chunked_cross_entropy(h_BTD[0], model.head_weight(), batch["labels"], chunk, cap)


@torch.no_grad()
def evaluate(model: nn.Module, rows: PackedRows, cfg: TrainConfig, device: torch.device) -> float:
    """Mean loss over every trained token of the eval rows (this rank's share, summed over ranks)."""
    rank, size = _rank_and_size()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    # every rank runs the same number of forwards (expert dispatch and FSDP gathers are collectives);
    # a rank past the last row repeats row 0 and counts nothing
    for first in range(rank * cfg.batch_size, _round_up(len(rows), size * cfg.batch_size), size * cfg.batch_size):
        indices = list(range(first, min(first + cfg.batch_size, len(rows))))
        batch = micro_batch(rows, indices or [0], device)
        total[0] += loss_sum(model, batch, cfg.loss_chunk).double() * bool(indices)
        total[1] += (batch["labels"] != IGNORE).sum() * bool(indices)
    total = _sum_over_ranks(total)
    return float(total[0] / total[1].clamp(min=1))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def micro_step_for(model, params, cfg: TrainConfig, device, offload: bool) -> MicroStep:
    """The forward+backward of one micro-batch this trainer runs: graphed where runtime/train/step_graph.py allows."""
    allowed = cfg.cuda_graph and graph_allowed(device, cfg.aux_loss_coef, offload)
    return MicroStep(lambda batch: loss_sum(model, batch, cfg.loss_chunk), params, allowed)


def optimizer_for(params, cfg: TrainConfig, device) -> torch.optim.Optimizer:
    # one fused kernel per step on CUDA instead of a handful of foreach launches per parameter group
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                             fused=device.type == "cuda")


def train_step(model, optimizer, params, data: TrainData, cfg: TrainConfig, step: int, device,
               micro_step: MicroStep) -> dict:
    """One optimizer step (or a skipped one); returns its measurements."""
    rank, size = _rank_and_size()
    micro = [micro_batch(data.train, batch_rows(len(data.train), step * cfg.grad_accum + m, cfg.batch_size,
                                                cfg.seed, rank, size), device) for m in range(cfg.grad_accum)]
    trained = _sum_over_ranks(sum((b["labels"] != IGNORE).sum() for b in micro).to(torch.float32))
    total, aux, load, segments = torch.zeros((), device=device), torch.zeros((), device=device), {}, []
    for batch in micro:
        if cfg.aux_loss_coef:
            loss = loss_sum(model, batch, cfg.loss_chunk) / trained.clamp(min=1)
            total += loss.detach()
            counts = expert_counts(model)
            if counts:
                share = balance.aux_loss_share(model, balance.global_counts(counts, device))
                aux += share.detach() / cfg.grad_accum
                loss = loss + cfg.aux_loss_coef / cfg.grad_accum * share
            loss.backward()
        else:
            total += micro_step(batch, 1 / trained.clamp(min=1))
        counts, drops = expert_counts(model), expert_drops(model)
        for layer, c in counts.items():
            load[layer] = load.get(layer, 0) + torch.stack([c, drops[layer]])
        segments += torch.diff(batch["cu_seqlens"]).tolist()
    total, aux = _sum_over_ranks(torch.stack([total, aux]))
    load = {layer: _sum_over_ranks(v.to(device)).cpu() for layer, v in load.items()}
    grad_norm = clip_grad_norm(params, cfg.grad_clip)
    finite = bool(torch.isfinite(total) and torch.isfinite(aux) and torch.isfinite(grad_norm))
    if finite:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        optimizer.step()
        if cfg.correction_bias_rate:
            balance.update_correction_bias(model, {layer: v[0] for layer, v in load.items()}, cfg.correction_bias_rate)
    optimizer.zero_grad(set_to_none=not micro_step.keeps_grads)
    return {"loss": float(total), "aux_loss": float(aux) if cfg.aux_loss_coef else None, "grad_norm": float(grad_norm),
            "finite": finite, "load": load, "tokens": sum(segments) * size, "segments": segments,
            "correction_bias": {k: b.tolist() for k, b in balance.correction_biases(model).items()}}


def _record(step: int, result: dict, seconds: float, flops: float, cfg: TrainConfig, device) -> dict:
    """The metrics line of (1-based) step `step`."""
    peak = peak_flops(device)
    return {"kind": "train", "step": step, "loss": result["loss"], "lr": lr_at(step - 1, cfg),
            "grad_norm": result["grad_norm"], "skipped": not result["finite"], "tokens": result["tokens"],
            "tokens_per_s": result["tokens"] / seconds, "mfu": None if peak is None else flops / seconds / peak,
            "peak_mem_gib": peak_memory_gib(device),
            "expert_counts": {str(k): v[0].tolist() for k, v in result["load"].items()},
            "expert_imbalance": {str(k): imbalance(v[0]) for k, v in result["load"].items()},
            "expert_drop_rate": {str(k): float(v[1].sum() / v[0].sum().clamp(min=1)) for k, v in result["load"].items()},
            "aux_loss": result["aux_loss"], "aux_loss_coef": cfg.aux_loss_coef,
            "correction_bias_rate": cfg.correction_bias_rate,
            "correction_bias": {str(k): b for k, b in result["correction_bias"].items()}}


def _stats(record: dict) -> str:
    mfu = "-" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
    return (f"loss {record['loss']:.4f}  gnorm {record['grad_norm']:.3g}  {record['tokens_per_s']:.0f} tok/s  "
            f"MFU {mfu}  peak {record['peak_mem_gib']:.2f} GiB")


def _start(model, optimizer, run_dir: Path, resume: bool) -> dict:
    """The train state to start from: the last complete checkpoint when resuming, else step 0."""
    root = run_dir / "checkpoints"
    checkpoint.clear_partial(root)
    steps = checkpoint.complete_steps(root)
    if resume and steps:
        return checkpoint.load(steps[-1], model, optimizer)
    return {"step": 0, "bad_in_a_row": 0, "eval_loss": None, "best_eval_loss": None, "best_step": None}


def _evaluate_into(state: dict, model, data: TrainData, cfg: TrainConfig, device, log: MetricsLog) -> None:
    model.eval()
    state["eval_loss"] = evaluate(model, data.eval, cfg, device)
    model.train()
    if state["best_eval_loss"] is None or state["eval_loss"] < state["best_eval_loss"]:
        state["best_eval_loss"], state["best_step"] = state["eval_loss"], state["step"]
    log.write({"kind": "eval", "step": state["step"], "eval_loss": state["eval_loss"]})


def train(model: nn.Module, data: TrainData, cfg: TrainConfig, run_dir: Path, resume: bool = False,
          progress: bool = True, sinks: tuple = ()) -> dict:
    """Train the LoRA factors of `model` (already loaded and adapted); returns the final train state. `sinks` get
    every metrics line too (runtime/train/sinks.py: TensorBoard, Weights & Biases)."""
    run_dir = Path(run_dir)
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    device = next(iter(lora_parameters(model))).device
    params = lora_parameters(model)
    optimizer = optimizer_for(params, cfg, device)
    micro_step = micro_step_for(model, params, cfg, device, offload=model.offloads_activations)
    balance.track_router_probs(model, cfg.aux_loss_coef != 0)
    if cfg.correction_bias_rate:
        balance.keep_bias_fp32(model)
    state = _start(model, optimizer, run_dir, resume)
    log = MetricsLog(run_dir / "metrics.jsonl", state["step"] if resume else None, sinks)
    model.train()
    with TrainProgress(progress, cfg.steps, state["step"]) as bar:
        while state["step"] < cfg.steps:
            started = time.perf_counter()
            result = train_step(model, optimizer, params, data, cfg, state["step"], device, micro_step)
            state["step"] += 1
            record = _record(state["step"], result, time.perf_counter() - started,
                             step_flops(model, result["segments"]), cfg, device)
            log.write(record)
            if not result["finite"]:
                bar.note(f"step {state['step']}: loss {result['loss']}, grad norm {result['grad_norm']}: "
                         "not finite, step skipped")
            _check_finite(state, result, cfg)
            if data.eval is not None and (state["step"] % cfg.eval_every == 0 or state["step"] == cfg.steps):
                _evaluate_into(state, model, data, cfg, device, log)
            if state["step"] % cfg.checkpoint_every == 0 or state["step"] == cfg.steps:
                checkpoint.save(run_dir / "checkpoints", model, optimizer, state, cfg.keep_last)
            bar.update(state["step"], _stats(record))
    if log.enabled:
        plot(run_dir)
    return state


def _check_finite(state: dict, result: dict, cfg: TrainConfig) -> None:
    state["bad_in_a_row"] = 0 if result["finite"] else state["bad_in_a_row"] + 1
    if state["bad_in_a_row"] >= cfg.max_bad_steps:
        raise TrainingAborted(f"step {state['step']}: loss {result['loss']}, grad norm {result['grad_norm']}: "
                              f"{state['bad_in_a_row']} non-finite steps in a row, aborting")
