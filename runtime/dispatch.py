"""Pick each op's implementation through its backend selector: the fused kernel where the selector says so, the
torch form elsewhere.

Every layer gets its ops through `op(name)`. An op with a kernel has its selector in backend.py beside its kernel
module (runtime/ops/<op>/backend.py); `runtime.ops.common.backend.force` pins every selector at once, which is how
alignment tier 0 runs the whole model through the torch forms or the kernels.
"""
from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch

from runtime.ops.common.backend import Selector
from runtime.registry import OPS, OpFamily


def op(name: str, device: torch.device | None = None) -> Callable:
    family = OPS[name]
    if family.kernel is not None and selector(family).choose(device) != "torch":
        kernel = family.resolve("kernel")
        if kernel is not None:
            return kernel
    torch_form = family.resolve("torch_form")
    if torch_form is None:
        raise RuntimeError(f"op {name}: runtime implementation {family.torch_form} is not importable")
    return torch_form


@functools.cache
def selector(family: OpFamily) -> Selector:
    """The SELECTOR of the backend.py beside the family's kernel module."""
    folder = family.kernel.split(":")[0].rsplit(".", 1)[0]
    return importlib.import_module(f"{folder}.backend").SELECTOR
