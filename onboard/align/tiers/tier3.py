"""Tier 3: the distributed runtime (FSDP2 x expert parallel, gloo on CPU, real processes) equals one process.

The trainer runs 4 LoRA steps (fp32) on the same packed rows at world 1 and on the meshes dp2, ep2 (2
processes) and ep4, dp2 x ep2 (4 processes): every step's loss must match the one-process run, and every LoRA
gradient of every step (captured before the optimizer step, gathered whole) the one-process run whose forwards
hold the rows that meet in one expert GEMM there (ep x rows per rank; 1, 2 or 4 rows). Against a run with other
forwards, later steps' gradients differ by fp32 rounding amplified by AdamW's first update (about lr * sign(g):
elements with |g| near its eps move by a large fraction of lr on a 1e-7 change): one process with 2 rows per
forward differs from 1 row per forward by 1.65e-5 at step 2, as ep2 does (bench/NOTES.md). Then the ep2 run's
step-2 checkpoint is resumed at ep1 (one process) and at ep4: steps 3 and 4 must repeat the straight losses
(DCP reshards the expert factors and their AdamW state). The routed experts are trained (as in tier 2).
Load balancing (runtime/train/balance.py): one process, ep2 and ep4 train with the aux loss and, where the routers
have a correction bias, its update on, one micro-batch of all 4 rows over all ranks (the aux loss is per
micro-batch over all ranks): losses, aux losses, gradients and biases of every step must match.
Each world size is one torch.multiprocessing spawn running its meshes in turn.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.optim.optimizer import register_optimizer_step_pre_hook

from onboard.align.progress import Progress
from onboard.align.reference import load_runtime
from onboard.align.report import Check
from onboard.align.tiers.tier2_training import alignment_lora_config
from runtime.lora.factors import apply_lora
from runtime.parallel.placement import MeshShape
from runtime.spec import ModelSpec
from runtime.tolerances import tolerance_for
from runtime.train.data import Document, pack
from runtime.train.loop import TrainConfig, TrainData, train
from runtime.train.metrics import read_metrics

CONFIG = TrainConfig(steps=4, batch_size=1, lr=1e-3, warmup_steps=1, eval_every=4, checkpoint_every=2, keep_last=2)
# rows per optimizer step over all ranks (world 1: 4 micro-batches; world 4: one each)
ROWS_PER_STEP = 4
MESHES = {2: [MeshShape(2, 1), MeshShape(1, 2)], 4: [MeshShape(1, 4), MeshShape(2, 2)]}
SEQ_LEN = 32
# larger than releases' (1e-3): the aux gradient and the bias updates must weigh in 4 steps
BALANCE = dict(aux_loss_coef=0.1, correction_bias_rate=1e-2)
BALANCE_MESHES = {2: MeshShape(1, 2), 4: MeshShape(1, 4)}


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    mesh: MeshShape
    run_dir: Path
    rows: int = 1  # packed rows per micro-batch on each rank
    resume: bool = False
    balance: bool = False  # BALANCE on

    @property
    def rows_per_gemm(self) -> int:
        """Rows whose tokens meet in one expert GEMM: those of a micro-batch of every rank of an EP group."""
        return self.mesh.ep * self.rows

    @property
    def reference(self) -> str:
        """The one-process run with those rows per forward."""
        return "world1-balance" if self.balance else f"world1-rows{self.rows_per_gemm}"


def _data(spec: ModelSpec) -> TrainData:
    gen = torch.Generator().manual_seed(5)
    docs = [Document(torch.randint(3, spec.vocab_size, (int(n),), generator=gen).tolist(), [True] * int(n))
            for n in torch.randint(8, 40, (24,), generator=gen)]
    return TrainData(pack(docs[:20], SEQ_LEN, 0), pack(docs[20:], SEQ_LEN, 0))


def _capture_grads(model, into: list) -> object:
    """Record every LoRA gradient (whole) before each optimizer step; returns the hook's handle."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}

    def hook(optimizer, args, kwargs):
        grads = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                grads[names[id(p)]] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        into.append(grads)

    return register_optimizer_step_pre_hook(hook)


def _train(model, spec: ModelSpec, job: Job, world: int) -> list[dict]:
    grads: list[dict] = []
    handle = _capture_grads(model, grads)
    cfg = dataclasses.replace(CONFIG, batch_size=job.rows, grad_accum=ROWS_PER_STEP // (world * job.rows),
                              **(BALANCE if job.balance else {}))
    try:
        train(model, _data(spec), cfg, job.run_dir, resume=job.resume, progress=False)
    finally:
        handle.remove()
    return grads


def _one_process(inputs: dict, job: Job) -> list[dict]:
    spec, weight_map, source, lora = inputs["spec"], inputs["weight_map"], inputs["source"], inputs["lora"]
    model = load_runtime(spec, weight_map, source, torch.float32)
    apply_lora(model, lora)
    # one intra-op thread, as every worker runs: the thread count splits a GEMM's sums differently
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(model.train(), spec, job, 1)
    finally:
        torch.set_num_threads(threads)


def _worker(rank: int, world: int, port: int, jobs: list[Job], inputs: dict, out: Path) -> None:
    from runtime.parallel.load import build_sharded_model
    from runtime.parallel.parallelize import ParallelConfig, device_mesh
    from runtime.parallel.process import exit_without_teardown

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for job in jobs:
            plan = ParallelConfig(job.mesh)
            model = build_sharded_model(inputs["spec"], inputs["weight_map"], inputs["source"], inputs["lora"], plan,
                                        device_mesh(job.mesh, "cpu"), rank, torch.device("cpu"), torch.float32)
            grads = _train(model, inputs["spec"], job, world)
            if rank == 0:
                torch.save(grads, out / f"{job.name}.pt")
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, jobs: list[Job], inputs: dict, out: Path) -> dict[str, list[dict]]:
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_worker, args=(world, _free_port(), jobs, inputs, out), nprocs=world)
    return {job.name: torch.load(out / f"{job.name}.pt") for job in jobs}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float(a.norm())


def _check(name: str, value: float, detail: str = "") -> Check:
    tol = tolerance_for("parallel_train", torch.float32).rel_rms
    return Check(tier=3, name=name, metric="rel_diff", value=value, tolerance=tol,
                 verdict="pass" if value <= tol else "fail", detail=detail)


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")[0]]


def _balance_checks(name: str, run_dir: Path, ref_dir: Path) -> list[Check]:
    """Every step's aux loss and correction biases (each layer's, norm-relative) against the one-process run's."""
    got, want = read_metrics(run_dir / "metrics.jsonl")[0], read_metrics(ref_dir / "metrics.jsonl")[0]
    checks = []
    for step, (a, b) in enumerate(zip(got, want), 1):
        checks.append(_check(f"{name}/step{step}/aux_loss", abs(a["aux_loss"] - b["aux_loss"]) / abs(b["aux_loss"]),
                             f"{a['aux_loss']:.8f} vs one process {b['aux_loss']:.8f}"))
        for layer, bias in b["correction_bias"].items():
            checks.append(_check(f"{name}/step{step}/correction_bias/layer{layer}",
                                 _rel(torch.tensor(a["correction_bias"][layer]), torch.tensor(bias))))
    return checks


def _loss_checks(name: str, losses: list[float], ref: list[float]) -> list[Check]:
    checks = [_check(f"{name}/step{s}/loss", abs(a - b) / abs(b), f"{a:.8f} vs one process {b:.8f}")
              for s, (a, b) in enumerate(zip(losses, ref), 1)]
    if len(losses) != len(ref):
        checks.append(_check(f"{name}/steps", float("inf"), f"{len(losses)} steps, one process {len(ref)}"))
    return checks


def _grad_checks(name: str, grads: list[dict], ref_grads: list[dict], reference: str) -> list[Check]:
    """Every step's worst LoRA factor (norm-relative over the whole tensor)."""
    checks = []
    for step, (got, want) in enumerate(zip(grads, ref_grads), 1):
        worst = max(want, key=lambda n: _rel(got[n], want[n]))
        checks.append(_check(f"{name}/step{step}/lora_grads", _rel(got[worst], want[worst]),
                             f"worst of {len(want)} factors: {worst}; vs {reference}"))
    return checks


def _resumed(from_dir: Path, to_dir: Path) -> Path:
    """A copy of a finished run folder cut back to its step-2 checkpoint."""
    shutil.copytree(from_dir, to_dir)
    for folder in (to_dir / "checkpoints").glob("step-*"):
        if folder.name != "step-00000002":
            shutil.rmtree(folder)
    return to_dir


def _mesh_jobs(world: int, tmp: Path) -> list[Job]:
    plain = [Job(str(m), m, tmp / str(m)) for m in MESHES[world]]
    name = f"{BALANCE_MESHES[world]}-balance"
    return plain + [Job(name, BALANCE_MESHES[world], tmp / name, rows=ROWS_PER_STEP // world, balance=True)]


def _references(jobs: list[Job], tmp: Path) -> list[Job]:
    """The one-process runs the meshes' gradients are held to (world1-rows1 is also every loss's reference)."""
    refs = {1: Job("world1-rows1", MeshShape(1, 1), tmp / "world1-rows1")}
    for job in jobs:
        if not job.balance:
            refs[job.rows_per_gemm] = Job(job.reference, MeshShape(1, 1), tmp / job.reference, rows=job.rows_per_gemm)
    balance = Job("world1-balance", MeshShape(1, 1), tmp / "world1-balance", rows=ROWS_PER_STEP, balance=True)
    return list(refs.values()) + [balance]


def tier3(spec: ModelSpec, weight_map: dict, source: Path, lora_plan: Path, progress: Progress | None = None) -> list[Check]:
    progress = progress or Progress()
    progress.plan(3)
    inputs = dict(spec=spec, weight_map=weight_map, source=Path(source),
                  lora=alignment_lora_config(Path(lora_plan), weight_map, spec))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        jobs = {world: _mesh_jobs(world, tmp) for world in MESHES}
        refs = _references(jobs[2] + jobs[4], tmp)
        progress.group(f"world 1: the one-process runs ({', '.join(r.name for r in refs)})")
        ref_grads = {r.name: _one_process(inputs, r) for r in refs}
        progress.group(f"world 2: {', '.join(j.name for j in jobs[2])}")
        runs = _spawn(2, jobs[2], inputs, tmp)
        resume_ep1 = _resumed(tmp / "dp1xep2", tmp / "resume-ep1")
        _one_process(inputs, Job("resume-ep1", MeshShape(1, 1), resume_ep1, resume=True))
        progress.group(f"world 4: {', '.join(j.name for j in jobs[4])}, the ep2 checkpoint resumed at ep4")
        resume_ep4 = _resumed(tmp / "dp1xep2", tmp / "resume-ep4")
        runs |= _spawn(4, jobs[4] + [Job("resume-ep4", MeshShape(1, 4), resume_ep4, resume=True)], inputs, tmp)
        checks = []
        for job in jobs[2] + jobs[4]:
            # losses against the one-row-per-forward run (load-balanced: the one it has)
            loss_ref = tmp / (job.reference if job.balance else "world1-rows1")
            checks += _loss_checks(job.name, _losses(job.run_dir), _losses(loss_ref))
            checks += _grad_checks(job.name, runs[job.name], ref_grads[job.reference], job.reference)
            if job.balance:
                checks += _balance_checks(job.name, job.run_dir, tmp / job.reference)
        for name in ("resume-ep1", "resume-ep4"):
            checks += _loss_checks(name, _losses(tmp / name), _losses(tmp / "world1-rows1"))
    return checks
