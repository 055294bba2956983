"""`onboard export RUN --peft DIR | --merge DIR [--requantize]`: a run's adapter in PEFT's format, or the release with it
merged (a release stored quantized: merged in bf16, or with --requantize in its stored format again)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onboard.errors import BadInput
from onboard.exit_codes import Exit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN", help="run folder written by `onboard train`")
    dest = p.add_mutually_exclusive_group(required=True)
    dest.add_argument("--peft", help="write adapter_config.json + adapter_model.safetensors here")
    dest.add_argument("--merge", help="write the merged release (names, shards, config, tokenizer) here")
    p.add_argument("--requantize", action="store_true",
                   help="with --merge, for a release stored quantized (FP8, MXFP4): write the merged weights in that "
                        "format again (default: bf16) and report the merge's error on a probe batch")


def run(args) -> Exit:
    from onboard.package.export import export
    from onboard.package.peft_format import ExportGap

    if args.requantize and not args.merge:
        raise BadInput(None, "--requantize", "re-quantizes a merged release: give it with --merge DIR")
    try:
        out, notes = export(Path(args.run_dir), args.peft and Path(args.peft), args.merge and Path(args.merge),
                            requantize=args.requantize)
    except ExportGap as gap:
        print(f"onboard: not supported: {gap}", file=sys.stderr)
        return Exit.GAPS
    print(f"wrote {'PEFT adapter' if args.peft else 'merged release'} to {out}")
    for note in notes:
        print(note)
    return Exit.OK
