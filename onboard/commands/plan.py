"""`onboard plan MODEL_DIR --gpus N --gpu-mem-gib G`: the parallel plan search for a cluster, printed or as JSON/YAML."""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from onboard.commands.args import add_budget_args, add_cluster_args, positive_int
from onboard.exit_codes import Exit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir")
    add_cluster_args(p, required=True)
    add_budget_args(p)
    p.add_argument("--micro-batch", type=positive_int, default=None, help="sequences per rank per step (default: searched)")
    p.add_argument("--mesh", default=None, help="evaluate only this mesh, e.g. dp2xep64 (every policy and micro-batch)")
    p.add_argument("--json", action="store_true", help="the ParallelPlan (every candidate) as JSON")
    p.add_argument("--out", default=None, help="also write the plan as YAML (the package's plan.yaml format)")
    p.add_argument("--weights", choices=("stored", "bf16"), default="stored",
                   help="count the frozen base as the release stores it (default; FP8 or MXFP4 codes and scales for a "
                        "quantized release) or as if it were bf16")


def run(args) -> Exit:
    from onboard.plan.render import plan_yaml, print_plan
    from onboard.plan.search import Cluster, Workload, parse_mesh, search
    from onboard.recognize.recognizer import recognize
    from onboard.recognize.stored import as_bf16
    from onboard.release.manifest import read_manifest

    spec = recognize(read_manifest(args.model_dir))
    if args.weights == "bf16":
        spec = as_bf16(spec)
    cluster = Cluster(args.gpus, args.gpu_mem_gib, args.gpus_per_node)
    with _search_progress(args.json) as progress:
        only = parse_mesh(args.mesh, args.gpus) if args.mesh else None
        plan = search(spec, cluster, Workload(args.seq_len, args.lora_rank, args.micro_batch), progress, only=only)
    if args.out:
        Path(args.out).write_text(plan_yaml(plan))
    if args.json:
        sys.stdout.write(plan.model_dump_json(indent=2) + "\n")
    else:
        print_plan(plan)
    return Exit.OK if plan.chosen else Exit.GAPS


@contextlib.contextmanager
def _search_progress(quiet: bool):
    """A rich progress bar on stderr for the smallest-GPU-count search (silent under --json)."""
    if quiet:
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("searching larger GPU counts", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)
