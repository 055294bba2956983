"""The `onboard` command. Exit codes: 0 ok, 1 a bug (one line, trace in a file), 2 bad input (one line), 3 gaps remain."""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import sys
from pathlib import Path

from onboard import bench, demo, train_cli
from onboard.config_view import NotRecognized
from onboard.errors import BadInput, printable, report_internal_error
from runtime import defaults
from runtime.errors import GeneratedOpMismatch, InputFileError, PackageOpRefused
from runtime.spec import SpecError

EXIT_BUG = 1
EXIT_BAD_INPUT = 2
EXIT_GAPS = 3
EXIT_INTERRUPTED = 130


def _inspect(args) -> int:
    from onboard.gap import analyze
    from onboard.manifest import read_manifest
    from onboard.recognize import recognize
    from onboard.render import gap_markdown, print_gap_report

    manifest = read_manifest(args.model_dir)
    report = analyze(recognize(manifest), manifest, args.gpu_mem_gib, args.lora_rank, args.seq_len)
    if args.json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    elif args.markdown:
        sys.stdout.write(gap_markdown(report))
    else:
        print_gap_report(report)
    return EXIT_GAPS if report.summary["gaps_remain"] else 0


def _example_model(args) -> int:
    from onboard.example_models import write_example_model

    out = write_example_model(args.family, Path(args.out), args.layers, args.shards, args.seed)
    print(f"wrote {args.family} example to {out}")
    return 0


def _new_model(args) -> int:
    """The onboarding graph (agents/graph.py); exit 0 only for a package without gaps that passes tiers 0-2."""
    from agents.graph import run
    from agents.state import RunOptions
    from onboard.git_commit import branch_for, check_repo, commit_package
    from onboard.workflow import model_slug

    if (args.llm_url is None) != (args.llm_model is None):
        raise BadInput(None, "--llm-model" if args.llm_url else "--llm-url", "--llm-url and --llm-model go together")
    model = model_slug(Path(args.model_dir).resolve())
    if args.git:
        check_repo(Path(args.git), model)
    options = RunOptions(model_dir=str(Path(args.model_dir).resolve()), out=str(Path(args.out).absolute()),
                         gpu_mem_gib=args.gpu_mem_gib, lora_rank=args.lora_rank, seq_len=args.seq_len, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                         llm_url=args.llm_url, llm_model=args.llm_model, max_attempts=args.max_attempts,
                         align_tiers=_tier_list(args.tiers))
    state = run(options, resume=args.resume, progress=lambda line: print(line, file=sys.stderr))
    counts = state["report"].summary["ops"]
    print(f"wrote {state['package']}: {counts['covered']} ops covered, {counts['variant']} variant, "
          f"{counts['generated']} generated, {counts['fallback']} fallback, {counts['missing']} missing; "
          f"{len(state['report'].weights.missing)} weights missing")
    if state.get("alignment"):
        print(f"alignment: {state['alignment'].summary}")
    if args.git:
        status = "trainable" if state["exit_code"] == 0 else "gaps or alignment open"
        commit = commit_package(Path(args.git), Path(state["package"]), model, f"onboard {model}: {status}")
        print(f"committed the package to {args.git} on branch {branch_for(model)} ({commit[:12]})")
    return state["exit_code"]


def _plan(args) -> int:
    from onboard.manifest import read_manifest
    from onboard.plan import Cluster, Workload, parse_mesh, search
    from onboard.plan_render import plan_yaml, print_plan
    from onboard.recognize import recognize

    spec = recognize(read_manifest(args.model_dir))
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
    return 0 if plan.chosen else EXIT_GAPS


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


def _align(args) -> int:
    from onboard.align import read_baseline, regressions, run_alignment
    from onboard.align.progress import progress_on_stderr
    from onboard.plan import Cluster, parse_mesh

    tiers = _tier_list(args.tiers)
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
            return EXIT_GAPS
    return 0 if report.passed else EXIT_GAPS


def _approve(args) -> int:
    """Record the sha256 of every file under PKG/ops/ as approved by this user (after they reviewed them)."""
    from onboard.approved_ops import approve_files, store_path
    from runtime.package_ops import read_op_files

    pkg = Path(args.pkg)
    if not pkg.is_dir():
        raise BadInput(pkg, None, "not a package folder")
    files = read_op_files(pkg)
    approved = approve_files(files, pkg, by="onboard approve")
    for f in files:
        state = f"sha256 {f.sha256}" if f in approved else "not approved"
        note = f" ({f.problem}; it will not load)" if f.problem else ""
        print(printable(f"{f.path}: {state}{note}"))
    print(f"approved {len(approved)} file(s) of {pkg / 'ops'} in {store_path()}")
    return 0


def _export(args) -> int:
    from onboard.export import export
    from onboard.peft_format import ExportGap

    try:
        out = export(Path(args.run_dir), args.peft and Path(args.peft), args.merge and Path(args.merge))
    except ExportGap as gap:
        print(f"onboard: not supported: {gap}", file=sys.stderr)
        return EXIT_GAPS
    print(f"wrote {'PEFT adapter' if args.peft else 'merged release'} to {out}")
    return 0


def _tier_list(text: str) -> list[int]:
    try:
        tiers = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise BadInput(None, "--tiers", f"expected a comma-separated list of tier numbers, got {text!r}")
    if not tiers or any(t not in (0, 1, 2, 3, 4) for t in tiers):
        raise BadInput(None, "--tiers", f"tiers 0 to 4 are available, got {text!r}")
    return tiers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onboard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="gap report of a released model folder (writes nothing)")
    p.add_argument("model_dir")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="the GapReport as JSON")
    fmt.add_argument("--markdown", action="store_true", help="the GapReport as Markdown")
    _add_budget_args(p)
    p.set_defaults(run=_inspect)
    p = sub.add_parser("example-model", help="write a tiny random-weight release of a real family")
    p.add_argument("family")
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=_positive_int, default=None, help="text layers (default: the family's pattern)")
    p.add_argument("--shards", type=_positive_int, default=1, help="split into about this many safetensors shards")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_example_model)
    p = sub.add_parser("new-model", help="onboard a release: the package, generated ops for its gaps, alignment")
    p.add_argument("model_dir")
    p.add_argument("--out", required=True)
    _add_budget_args(p)
    _add_cluster_args(p, required=False)
    p.add_argument("--llm-url", help="OpenAI-compatible endpoint (e.g. http://localhost:8000/v1); key: OPENAI_API_KEY")
    p.add_argument("--llm-model", help="model name the endpoint serves")
    p.add_argument("--max-attempts", type=_positive_int, default=3, help="candidates per missing op (default 3)")
    p.add_argument("--resume", action="store_true", help="continue the interrupted run of this --out")
    p.add_argument("--git", metavar="REPO", help="commit the package into this git work tree on a new branch onboard/<model>")
    p.add_argument("--tiers", default="0,1,2", help="alignment tiers: 0-2 always; add 3 (gloo processes) and 4 "
                   "(the --gpus cluster, on paper), e.g. 0,1,2,4")
    p.set_defaults(run=_new_model)
    p = sub.add_parser("plan", help="search dp_shard x ep meshes, activation policies and micro-batches for a cluster")
    p.add_argument("model_dir")
    _add_cluster_args(p, required=True)
    _add_budget_args(p)
    p.add_argument("--micro-batch", type=_positive_int, default=None, help="sequences per rank per step (default: searched)")
    p.add_argument("--mesh", default=None, help="evaluate only this mesh, e.g. dp2xep64 (every policy and micro-batch)")
    p.add_argument("--json", action="store_true", help="the ParallelPlan (every candidate) as JSON")
    p.add_argument("--out", default=None, help="also write the plan as YAML (the package's plan.yaml format)")
    p.set_defaults(run=_plan)
    p = sub.add_parser("align", help="run the alignment tiers against the model's own implementation")
    p.add_argument("pkg")
    p.add_argument("--tiers", default="0,1,2", help="comma-separated, e.g. 0,1,2")
    p.add_argument("--check", action="store_true",
                   help="fail on a regression against alignment/baseline.json (exit 2 when there is none)")
    p.add_argument("--model-dir", default=None,
                   help="the release folder, when it is no longer where package.yaml records it (another machine)")
    p.add_argument("--max-layers", type=_positive_int, default=8,
                   help="align a prefix of at most this many layers (extended to hold every distinct layer kind)")
    p.add_argument("--gpus", type=_positive_int, default=None, help="tier 4: GPUs of the target cluster")
    p.add_argument("--gpu-mem-gib", type=_positive_float, default=None, help="tier 4: memory of one GPU")
    p.add_argument("--gpus-per-node", type=_positive_int, default=defaults.GPUS_PER_NODE,
                   help=f"tier 4: GPUs per node (default {defaults.GPUS_PER_NODE})")
    p.add_argument("--mesh", default=None, help="tier 4: check this mesh (e.g. dp2xep64) instead of the plan's choice")
    p.set_defaults(run=_align)
    p = sub.add_parser("approve", help="approve the package's op files (PKG/ops/) after review: align and train "
                       "run them in this process only then")
    p.add_argument("pkg")
    p.set_defaults(run=_approve)
    p = sub.add_parser("train", help="train the package's LoRA on a jsonl file (run folder: checkpoints, metrics, plots)")
    train_cli.add_arguments(p, _positive_int)
    p.set_defaults(run=train_cli.run)
    p = sub.add_parser("export", help="a run's adapter in PEFT's format, or the release with it merged")
    p.add_argument("run_dir", metavar="RUN", help="run folder written by `onboard train`")
    dest = p.add_mutually_exclusive_group(required=True)
    dest.add_argument("--peft", help="write adapter_config.json + adapter_model.safetensors here")
    dest.add_argument("--merge", help="write the merged release (names, shards, config, tokenizer) here")
    p.set_defaults(run=_export)
    p = sub.add_parser("bench", help="tokens/s, MFU, step latency, peak memory and per-op time of the package's LoRA step")
    bench.add_arguments(p, _positive_int)
    p.set_defaults(run=bench.run)
    p = sub.add_parser("demo", help="the whole loop on a tiny hybrid MoE on CPU: release, package, training, PEFT adapter")
    demo.add_arguments(p, _positive_int)
    p.set_defaults(run=demo.run)
    return parser


def _add_budget_args(p: argparse.ArgumentParser) -> None:
    """The memory-budget inputs shared by inspect and new-model."""
    p.add_argument("--gpu-mem-gib", type=_positive_float, default=defaults.GPU_MEM_GIB,
                   help=f"memory of one GPU (default {defaults.GPU_MEM_GIB:g})")
    p.add_argument("--lora-rank", type=_positive_int, default=defaults.LORA_RANK)
    p.add_argument("--seq-len", type=_positive_int, default=defaults.SEQ_LEN, help="training sequence length for activations")


# Far above any real use (a 1M-token sequence, a rank-65536 adapter), low enough that no
# estimate built from an argument overflows or allocates by it.
ARG_LIMIT = 1 << 31


def _add_cluster_args(p: argparse.ArgumentParser, required: bool) -> None:
    """The cluster a plan is for (plan, new-model; align tier 4)."""
    p.add_argument("--gpus", type=_positive_int, required=required, default=None if required else defaults.GPUS,
                   help="GPUs to plan for" + ("" if required else " (default 8)"))
    p.add_argument("--gpus-per-node", type=_positive_int, default=defaults.GPUS_PER_NODE,
                   help=f"GPUs per node (default {defaults.GPUS_PER_NODE})")


def _positive_int(text: str) -> int:
    value = int(text)
    if not 1 <= value <= ARG_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {ARG_LIMIT}], got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value) and value <= ARG_LIMIT):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # a name that slipped past the checks must not turn printing into a crash
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        return args.run(args)
    except (BadInput, InputFileError) as err:
        print(f"onboard: error: {err.one_line()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PackageOpRefused as refused:
        print(f"onboard: refused: {printable(refused.one_line())}", file=sys.stderr)
        return EXIT_GAPS
    # a package's generated op that train's spot check caught disagreeing with its reference
    except GeneratedOpMismatch as err:
        print(f"onboard: error: {err}", file=sys.stderr)
        return EXIT_GAPS
    except NotRecognized as gap:
        # a valid release whose basic widths are not recognized: nothing to report per component
        print(f"onboard: gap: config.json: {gap}: not recognized", file=sys.stderr)
        return EXIT_GAPS
    # a package's spec.json the runtime cannot read (the message names the key path)
    except SpecError as err:
        print(f"onboard: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("onboard: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader (`| head`) went away; point stdout at devnull so the exit-time flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    # the one place a bug is caught: the user gets one line, the trace goes to a file
    except Exception as exc:  # noqa: BLE001
        print(f"onboard: {report_internal_error(exc)}", file=sys.stderr)
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
