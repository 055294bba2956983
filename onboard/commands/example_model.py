"""`onboard example-model FAMILY --out DIR`: a tiny random-weight release of a real family, made by transformers;
or, for `kimi_k3`, a tiny custom-code release of Kimi K3's shape (its own modeling code, written by it)."""
from __future__ import annotations

import argparse
from pathlib import Path

from onboard.commands.args import positive_int
from onboard.examples import WEIGHT_FORMATS
from onboard.exit_codes import Exit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("family")
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=positive_int, default=None, help="text layers (default: the family's pattern)")
    p.add_argument("--shards", type=positive_int, default=1, help="split into about this many safetensors shards")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16",
                   help="stored format, as the family's real release ships it: fp8 (deepseek_v3, deepseek_v32, "
                        "qwen3_next), mxfp4 (gpt_oss; kimi_k3's routed experts); default bf16")


def run(args) -> Exit:
    from onboard.errors import BadInput
    from onboard.examples.models import write_example_model

    if args.family == "kimi_k3":
        from onboard.examples.kimi_k3.writer import write_kimi_k3_release

        if args.layers is not None:
            raise BadInput(None, "--layers", "the kimi_k3 example has a fixed pattern of 5 layers")
        out = write_kimi_k3_release(Path(args.out), args.shards, args.seed, args.weights)
    else:
        out = write_example_model(args.family, Path(args.out), args.layers, args.shards, args.seed, args.weights)
    stored = "" if args.weights == "bf16" else f" ({args.weights} weights, as the family's release ships them)"
    print(f"wrote {args.family} example to {out}{stored}")
    return Exit.OK
