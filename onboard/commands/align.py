"""`onboard align PKG [--tiers 0,1,2] [--check]`: the alignment tiers against the model's own implementation."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onboard.commands.args import positive_float, positive_int, tier_list
from onboard.exit_codes import Exit
from runtime import defaults


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pkg")
    p.add_argument("--tiers", default="0,1,2", help="comma-separated, e.g. 0,1,2")
    p.add_argument("--check", action="store_true",
                   help="fail on a regression against alignment/baseline.json (exit 2 when there is none)")
    p.add_argument("--model-dir", default=None,
                   help="the release folder, when it is no longer where package.yaml records it (another machine)")
    p.add_argument("--max-layers", type=positive_int, default=8,
                   help="align a prefix of at most this many layers (extended to hold every distinct layer kind)")
    p.add_argument("--gpus", type=positive_int, default=None, help="tier 4: GPUs of the target cluster")
    p.add_argument("--gpu-mem-gib", type=positive_float, default=None, help="tier 4: memory of one GPU")
    p.add_argument("--gpus-per-node", type=positive_int, default=defaults.GPUS_PER_NODE,
                   help=f"tier 4: GPUs per node (default {defaults.GPUS_PER_NODE})")
    p.add_argument("--mesh", default=None, help="tier 4: check this mesh (e.g. dp2xep64) instead of the plan's choice")


def run(args) -> Exit:
    from onboard.align import read_baseline, regressions, run_alignment
    from onboard.align.progress import progress_on_stderr
    from onboard.plan.search import Cluster, parse_mesh

    tiers = tier_list(args.tiers)
    # read first: a missing baseline is refused before any tier runs (and before one is written)
    baseline = read_baseline(Path(args.pkg)) if args.check else None
    model_dir = Path(args.model_dir) if args.model_dir else None
    cluster = Cluster(args.gpus, args.gpu_mem_gib, args.gpus_per_node) if args.gpus and args.gpu_mem_gib else None
    mesh = parse_mesh(args.mesh, args.gpus) if args.mesh and args.gpus else None
    report = run_alignment(Path(args.pkg), tiers, model_dir=model_dir, progress=progress_on_stderr(),
                           max_layers=args.max_layers, cluster=cluster, mesh=mesh)
    print(report.summary_line())
    if baseline is not None:
        regressed = regressions(baseline, report)
        for regression in regressed:
            print(f"regression vs alignment/baseline.json: {regression}", file=sys.stderr)
        if regressed:
            return Exit.GAPS
    return Exit.OK if report.passed else Exit.GAPS
