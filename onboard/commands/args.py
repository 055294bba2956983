"""Argument types and the argument groups several commands share."""
from __future__ import annotations

import argparse
import math

from onboard.errors import BadInput, printable
from runtime import defaults

# Far above any real use (a 1M-token sequence, a rank-65536 adapter), low enough that no
# estimate built from an argument overflows or allocates by it.
ARG_LIMIT = 1 << 31


def positive_int(text: str) -> int:
    value = int(text)
    if not 1 <= value <= ARG_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {ARG_LIMIT}], got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if not 0 <= value <= ARG_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {ARG_LIMIT}], got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value) and value <= ARG_LIMIT):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value) and value <= ARG_LIMIT):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def open_fraction(text: str) -> float:
    """A share strictly between 0 and 1 (a held-out fraction: 0 or 1 leaves one side empty)."""
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction strictly between 0 and 1, got {text}")
    return value


class OnboardParser(argparse.ArgumentParser):
    """argparse with the house's one-line refusal: a bad flag is exit 2 with one stderr line naming it (argparse's
    own error prints the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {printable(message)} (`{self.prog} --help` lists the flags)\n")


class DefaultsFormatter(argparse.HelpFormatter):
    """--help shows each flag's default, unless its help text already says it or there is no value to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # `is`: a default of 0 is shown, False (a switch) and None (nothing set) are not
        if "default" in text or not action.option_strings or any(action.default is v for v in (None, False)) \
                or action.default == argparse.SUPPRESS:
            return text
        return f"{text} (default %(default)s)".strip()


def add_budget_args(p: argparse.ArgumentParser) -> None:
    """The memory-budget inputs shared by inspect, new-model and plan."""
    p.add_argument("--gpu-mem-gib", type=positive_float, default=defaults.GPU_MEM_GIB,
                   help=f"memory of one GPU (default {defaults.GPU_MEM_GIB:g})")
    p.add_argument("--lora-rank", type=positive_int, default=defaults.LORA_RANK, help="LoRA rank of the adapters")
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
