"""`onboard inspect MODEL_DIR [--json | --markdown]`: the gap report of a release, to stdout; writes nothing."""
from __future__ import annotations

import argparse
import sys

from onboard.commands.args import add_budget_args
from onboard.exit_codes import Exit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="the GapReport as JSON")
    fmt.add_argument("--markdown", action="store_true", help="the GapReport as Markdown")
    add_budget_args(p)


def run(args) -> Exit:
    from onboard.gap.render import gap_markdown, print_gap_report
    from onboard.gap.report import analyze
    from onboard.recognize.recognizer import recognize
    from onboard.release.manifest import read_manifest

    manifest = read_manifest(args.model_dir)
    report = analyze(recognize(manifest), manifest, args.gpu_mem_gib, args.lora_rank, args.seq_len)
    if args.json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    elif args.markdown:
        sys.stdout.write(gap_markdown(report))
    else:
        print_gap_report(report)
    return Exit.GAPS if report.summary["gaps_remain"] else Exit.OK
