"""Argument types and the argument groups several commands share."""
from __future__ import annotations

import argparse
import math

from onboard.errors import BadInput
from runtime import defaults

# Far above any real use (a 1M-token sequence, a rank-65536 adapter), low enough that no
# estimate built from an argument overflows or allocates by it.
ARG_LIMIT = 1 << 31


def positive_int(text: str) -> int:
    value = int(text)
    if not 1 <= value <= ARG_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {ARG_LIMIT}], got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value) and value <= ARG_LIMIT):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def add_budget_args(p: argparse.ArgumentParser) -> None:
    """The memory-budget inputs shared by inspect, new-model and plan."""
    p.add_argument("--gpu-mem-gib", type=positive_float, default=defaults.GPU_MEM_GIB,
                   help=f"memory of one GPU (default {defaults.GPU_MEM_GIB:g})")
    p.add_argument("--lora-rank", type=positive_int, default=defaults.LORA_RANK)
    p.add_argument("--seq-len", type=positive_int, default=defaults.SEQ_LEN, help="training sequence length for activations")


def add_cluster_args(p: argparse.ArgumentParser, required: bool) -> None:
    """The cluster a plan is for (plan, new-model)."""
    p.add_argument("--gpus", type=positive_int, required=required, default=None if required else defaults.GPUS,
                   help="GPUs to plan for" + ("" if required else f" (default {defaults.GPUS})"))
    p.add_argument("--gpus-per-node", type=positive_int, default=defaults.GPUS_PER_NODE,
                   help=f"GPUs per node (default {defaults.GPUS_PER_NODE})")


def tier_list(text: str) -> list[int]:
    try:
        tiers = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise BadInput(None, "--tiers", f"expected a comma-separated list of tier numbers, got {text!r}")
    if not tiers or any(t not in (0, 1, 2, 3, 4) for t in tiers):
        raise BadInput(None, "--tiers", f"tiers 0 to 4 are available, got {text!r}")
    return tiers
