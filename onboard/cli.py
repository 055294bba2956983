"""The `onboard` command. Exit codes: 0 ok, 2 bad input (one line on stderr), 3 gaps remain."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onboard.config_view import NotRecognized
from onboard.errors import OnboardError

EXIT_BAD_INPUT = 2
EXIT_GAPS = 3


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
    """Exit 0 only for a package without gaps that passes alignment tiers 0-2."""
    from onboard.align import run_alignment
    from onboard.align.progress import progress_on_stderr
    from onboard.package import write_package

    pkg, report = write_package(Path(args.model_dir), Path(args.out), args.gpu_mem_gib, args.lora_rank, args.seq_len)
    counts = report.summary["ops"]
    print(f"wrote {pkg}: {counts['covered']} ops covered, {counts['variant']} variant, {counts['fallback']} fallback, "
          f"{counts['missing']} missing; {len(report.weights.missing)} weights missing")
    if report.summary["gaps_remain"]:
        return EXIT_GAPS
    aligned = run_alignment(pkg, [0, 1, 2], progress=progress_on_stderr())
    print(f"alignment: {aligned.summary_line()}")
    return 0 if aligned.passed else EXIT_GAPS


def _align(args) -> int:
    from onboard.align import read_baseline, regressions, run_alignment
    from onboard.align.progress import progress_on_stderr

    tiers = _tier_list(args.tiers)
    # read first: a missing baseline is refused before any tier runs (and before one is written)
    baseline = read_baseline(Path(args.pkg)) if args.check else None
    model_dir = Path(args.model_dir) if args.model_dir else None
    report = run_alignment(Path(args.pkg), tiers, model_dir=model_dir, progress=progress_on_stderr(),
                           max_layers=args.max_layers)
    print(report.summary_line())
    if baseline is not None:
        regressed = regressions(baseline, report)
        if regressed:
            print(f"regressions vs baseline: {', '.join(regressed[:10])}", file=sys.stderr)
            return EXIT_GAPS
    return 0 if report.passed else EXIT_GAPS


def _tier_list(text: str) -> list[int]:
    try:
        tiers = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise OnboardError(None, "--tiers", f"expected a comma-separated list of tier numbers, got {text!r}")
    if not tiers or any(t not in (0, 1, 2) for t in tiers):
        raise OnboardError(None, "--tiers", f"tiers 0, 1 and 2 are available, got {text!r}")
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
    p = sub.add_parser("new-model", help="write the package (spec, weight map, gap report) for a release")
    p.add_argument("model_dir")
    p.add_argument("--out", required=True)
    _add_budget_args(p)
    p.set_defaults(run=_new_model)
    p = sub.add_parser("align", help="run the alignment tiers against the model's own implementation")
    p.add_argument("pkg")
    p.add_argument("--tiers", default="0,1,2", help="comma-separated, e.g. 0,1,2")
    p.add_argument("--check", action="store_true",
                   help="fail on a regression against alignment/baseline.json (exit 2 when there is none)")
    p.add_argument("--model-dir", default=None,
                   help="the release folder, when it is no longer where package.yaml records it (another machine)")
    p.add_argument("--max-layers", type=_positive_int, default=8,
                   help="align a prefix of at most this many layers (extended to hold every distinct layer kind)")
    p.set_defaults(run=_align)
    return parser


def _add_budget_args(p: argparse.ArgumentParser) -> None:
    """The memory-budget inputs shared by inspect and new-model."""
    p.add_argument("--gpu-mem-gib", type=_positive_float, default=80.0, help="memory of one GPU (default 80)")
    p.add_argument("--lora-rank", type=_positive_int, default=16)
    p.add_argument("--seq-len", type=_positive_int, default=4096, help="training sequence length for activations")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except OnboardError as err:
        print(f"onboard: error: {err.one_line()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NotRecognized as gap:
        # a valid release whose basic widths are not recognized: nothing to report per component
        print(f"onboard: gap: config.json: {gap}: not recognized", file=sys.stderr)
        return EXIT_GAPS


if __name__ == "__main__":
    sys.exit(main())


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
