"""`onboard example-model FAMILY --out DIR`: a tiny random-weight release of a real family, made by transformers."""
from __future__ import annotations

import argparse
from pathlib import Path

from onboard.commands.args import positive_int
from onboard.exit_codes import Exit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("family")
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=positive_int, default=None, help="text layers (default: the family's pattern)")
    p.add_argument("--shards", type=positive_int, default=1, help="split into about this many safetensors shards")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")


def run(args) -> Exit:
    from onboard.examples.models import write_example_model

    out = write_example_model(args.family, Path(args.out), args.layers, args.shards, args.seed)
    print(f"wrote {args.family} example to {out}")
    return Exit.OK
