"""How a block's output joins the residual stream: skip * alpha + sublayer * beta, or a form a package generated.

Shape legend: B batch, T tokens, D model width.
"""
from __future__ import annotations

from typing import Callable

import torch

# Mixings a package generated, by the spec's residual `mixing` name: op(skip_BTD, sublayer_BTD) -> h_BTD, its
# scales inside the op (runtime/package_ops.py adds them when the package loads)
MIXINGS: dict[str, Callable] = {}
BUILTIN = "weighted_sum"


def mix(name: str, skip_BTD: torch.Tensor, sublayer_BTD: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    if name == BUILTIN:
        return skip_BTD * alpha + sublayer_BTD * beta
    return MIXINGS[name](skip_BTD, sublayer_BTD)
