"""`onboard new-model MODEL_DIR --out PKG`: the onboarding graph (agents/graph.py) writes the package."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onboard.commands.args import add_budget_args, add_cluster_args, positive_int, tier_list
from onboard.errors import BadInput
from onboard.exit_codes import Exit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir")
    p.add_argument("--out", required=True)
    add_budget_args(p)
    add_cluster_args(p, required=False)
    p.add_argument("--llm-url", help="OpenAI-compatible endpoint (e.g. http://localhost:8000/v1); key: OPENAI_API_KEY")
    p.add_argument("--llm-model", help="model name the endpoint serves")
    p.add_argument("--max-attempts", type=positive_int, default=3, help="candidates per missing op (default 3)")
    p.add_argument("--resume", action="store_true", help="continue the interrupted run of this --out")
    p.add_argument("--git", metavar="REPO", help="commit the package into this git work tree on a new branch onboard/<model>")
    p.add_argument("--tiers", default="0,1,2", help="alignment tiers: 0-2 always; add 3 (gloo processes) and 4 "
                   "(the --gpus cluster, on paper), e.g. 0,1,2,4")


def run(args) -> Exit:
    """Exit 0 only for a package without gaps that passes tiers 0-2."""
    from agents.graph import run as run_graph
    from agents.state import RunOptions
    from onboard.package.git_commit import branch_for, check_repo, commit_package
    from onboard.package.workflow import model_slug

    if (args.llm_url is None) != (args.llm_model is None):
        raise BadInput(None, "--llm-model" if args.llm_url else "--llm-url", "--llm-url and --llm-model go together")
    model = model_slug(Path(args.model_dir).resolve())
    if args.git:
        check_repo(Path(args.git), model)
    options = RunOptions(model_dir=str(Path(args.model_dir).resolve()), out=str(Path(args.out).absolute()),
                         gpu_mem_gib=args.gpu_mem_gib, lora_rank=args.lora_rank, seq_len=args.seq_len, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                         llm_url=args.llm_url, llm_model=args.llm_model, max_attempts=args.max_attempts,
                         align_tiers=tier_list(args.tiers))
    state = run_graph(options, resume=args.resume, progress=lambda line: print(line, file=sys.stderr))
    counts = state["report"].summary["ops"]
    print(f"wrote {state['package']}: {counts['covered']} ops covered, {counts['variant']} variant, "
          f"{counts['generated']} generated, {counts['own']} own, {counts['missing']} missing; "
          f"{len(state['report'].weights.missing)} weights missing")
    if state.get("alignment"):
        print(f"alignment: {state['alignment'].summary}")
    if args.git:
        status = "trainable" if state["exit_code"] == Exit.OK else "gaps or alignment open"
        commit = commit_package(Path(args.git), Path(state["package"]), model, f"onboard {model}: {status}")
        print(f"committed the package to {args.git} on branch {branch_for(model)} ({commit[:12]})")
    return Exit(state["exit_code"])
