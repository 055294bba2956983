"""The plan's per-rank memory estimate against the measured peak of one LoRA step (issue 13's done-when: within 15%).

The TARGETS.md slice (Qwen3-Next widths, 4 layers) as bench_lora_step.py prepares it (release and package); for
seq 4096 and 16384 under the plan's policies `none` and `recompute` (every attention, linear-attention, MoE and
MLP part recomputed: bench_lora_step.POLICIES), each case in its own process: the model as `onboard train` builds
it with LoRA r16 on the package's attention targets, one warm-up step (AdamW's moments exist from then on), the
peak statistics reset, one measured step. measured_gib is torch.cuda.max_memory_allocated of that step;
estimate_total_gib is onboard/plan_cost.estimate_memory's total for the same spec, policy, seq len, micro-batch 1
and a mesh of 1 (its breakdown in `estimate`), estimate_gib that total less its fixed workspace (a reserve for the
CUDA context, fragmentation and NCCL buffers, none of which the allocator's peak counts); rel_err compares
estimate_gib, rel_err_total the total. --tiny: the tiny qwen3_next example on the CPU at seq 64 and 128, one
step per case (a test runs it): the CPU has no allocator peak to compare, so measured_gib and rel_err are null.

    python bench/bench_plan_memory.py --out bench/results [--work /tmp/lora-slice]
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_lora_step  # noqa: E402

SEQ_LENS, TINY_SEQ_LENS = (4096, 16384), (64, 128)
POLICIES = ("none", "recompute")
GIB = 2**30


def prepare_tiny(work: Path) -> None:
    """The tiny qwen3_next example release and its package, on the CPU."""
    from onboard.examples.models import write_example_model
    from onboard.package.writer import write_package

    write_example_model("qwen3_next", work / "release")
    write_package(work / "release", work / "pkg")


def measure(work: Path, seq_len: int, policy: str, device: str) -> dict:
    """One warm-up step, then the peak allocated memory of one more (CUDA; on the CPU one step, no peak)."""
    import torch

    bench_lora_step.DEVICE = device
    steps, _, params = bench_lora_step.ours_setup(work, False, seq_len, policy)
    step = steps[False]
    step()
    if device != "cuda":
        return dict(measured_gib=None, reserved_gib=None, trainable=sum(p.numel() for p in params))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return dict(measured_gib=torch.cuda.max_memory_allocated() / GIB, reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                trainable=sum(p.numel() for p in params))


def estimate(work: Path, seq_len: int, policy: str) -> dict:
    """plan_cost's per-rank memory (GiB by part) for the package's spec on a mesh of 1, micro-batch 1."""
    from onboard.plan.cost import Cluster, ModelSummary, estimate_memory
    from runtime.parallel.placement import MeshShape
    from runtime.spec import ModelSpec

    spec = ModelSpec.model_validate_json((work / "pkg" / "spec.json").read_text())
    summary = ModelSummary.of(spec, seq_len, bench_lora_step.RANK)
    return estimate_memory(summary, MeshShape(1, 1), policy, 1, Cluster(1, 141.0, 1), seq_len).model_dump()


def case_in_subprocess(work: Path, seq_len: int, policy: str, device: str) -> dict:
    """measure() in a fresh process (a clean peak); its result, or the error it ended with."""
    args = [sys.executable, __file__, "--case", "--work", str(work), "--seq-len", str(seq_len), "--policy", policy,
            "--device", device]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-3000:])
        return dict(measured_gib=None, error=(result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1])
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_cases(work: Path, seq_lens, device: str) -> list[dict]:
    # on the GPU each case in its own process (a clean peak); on the CPU there is no peak to keep clean
    run = case_in_subprocess if device == "cuda" else measure
    cases = []
    for seq_len in seq_lens:
        for policy in POLICIES:
            row = dict(seq_len=seq_len, policy=policy, **run(work, seq_len, policy, device))
            row["estimate"] = estimate(work, seq_len, policy)
            row["estimate_total_gib"] = row["estimate"]["total"]
            row["estimate_gib"] = row["estimate_total_gib"] - row["estimate"]["workspace"]
            measured = row["measured_gib"]
            for key, value in (("rel_err", row["estimate_gib"]), ("rel_err_total", row["estimate_total_gib"])):
                row[key] = None if measured is None else (value - measured) / measured
            cases.append(row)
    return cases


def table(cases: list[dict]) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    pct = lambda v: "-" if v is None else f"{100 * v:+.1f}%"  # noqa: E731
    lines = [f"{'seq':>6} {'policy':>10} {'estimate GiB':>13} {'+workspace':>11} {'measured GiB':>13} {'rel err':>8} "
             f"{'rel err total':>14}"]
    for c in cases:
        lines.append(f"{c['seq_len']:>6} {c['policy']:>10} {fmt(c['estimate_gib']):>13} {fmt(c['estimate_total_gib']):>11} "
                     f"{fmt(c['measured_gib']):>13} {pct(c['rel_err']):>8} {pct(c['rel_err_total']):>14}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help="folder for plan-memory.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lora-slice"))
    parser.add_argument("--tiny", action="store_true", help="the tiny qwen3_next example on the CPU (no comparison)")
    parser.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--policy")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(measure(args.work, args.seq_len, args.policy, args.device)))
        return
    device = "cpu" if args.tiny else "cuda"
    if not (args.work / "pkg").exists():
        (prepare_tiny if args.tiny else bench_lora_step.prepare)(args.work)
    cases = run_cases(args.work, TINY_SEQ_LENS if args.tiny else SEQ_LENS, device)
    print(table(cases))
    measured = [abs(c["rel_err"]) for c in cases if c["rel_err"] is not None]
    result = dict(name="plan-memory", device=_device_name(device), date=datetime.date.today().isoformat(),
                  shape="tiny qwen3_next example" if args.tiny else
                  "Qwen3-Next widths, 4 layers (3 GDN + 1 full attention), 512 experts top-10, batch 1",
                  lora=f"r{bench_lora_step.RANK} alpha{bench_lora_step.ALPHA} on the package's attention targets",
                  command="python bench/bench_plan_memory.py --out $OUT" + (" --tiny" if args.tiny else ""),
                  max_rel_err=max(measured) if measured else None, within_15pct=all(m <= 0.15 for m in measured)
                  if measured else None, cases=cases)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan-memory.json").write_text(json.dumps(result, indent=1))


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


if __name__ == "__main__":
    main()
