"""`onboard example-model FAMILY --out DIR`: a tiny random-weight release of a real family, made by transformers;
or, for `kimi_k3`, a tiny custom-code release of Kimi K3's shape (its own modeling code, written by it)."""
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", default="bf16", help="kimi_k3 only: bf16, or mxfp4 routed experts as released")


def run(args) -> Exit:
    from onboard.errors import BadInput
    from onboard.examples.models import write_example_model

    if args.family == "kimi_k3":
        from onboard.examples.kimi_k3.writer import write_kimi_k3_release

        if args.layers is not None:
            raise BadInput(None, "--layers", "the kimi_k3 example has a fixed pattern of 5 layers")
        out = write_kimi_k3_release(Path(args.out), args.shards, args.seed, args.weights)
    elif args.weights != "bf16":
        raise BadInput(None, "--weights", f"only the kimi_k3 example takes --weights, not {args.family}")
    else:
        out = write_example_model(args.family, Path(args.out), args.layers, args.shards, args.seed)
    print(f"wrote {args.family} example to {out}")
    return Exit.OK
