"""`onboard export RUN --peft DIR | --merge DIR`: a run's adapter in PEFT's format, or the release with it merged."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onboard.exit_codes import Exit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN", help="run folder written by `onboard train`")
    dest = p.add_mutually_exclusive_group(required=True)
    dest.add_argument("--peft", help="write adapter_config.json + adapter_model.safetensors here")
    dest.add_argument("--merge", help="write the merged release (names, shards, config, tokenizer) here")


def run(args) -> Exit:
    from onboard.package.export import export
    from onboard.package.peft_format import ExportGap

    try:
        out = export(Path(args.run_dir), args.peft and Path(args.peft), args.merge and Path(args.merge))
    except ExportGap as gap:
        print(f"onboard: not supported: {gap}", file=sys.stderr)
        return Exit.GAPS
    print(f"wrote {'PEFT adapter' if args.peft else 'merged release'} to {out}")
    return Exit.OK
