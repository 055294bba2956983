"""Load a package's generated operators (PKG/ops/*.py) and register them where the runtime looks them up.

Each generated file is plain torch that passed validation: it declares KIND (what it extends), NAME (the
name the spec uses for it, e.g. a config's `hidden_act`) and `op`, the function. Registering puts `op`
into the runtime's table for that kind, so tiers 0-2 and training run exactly the validated code: eagerly
on CPU, through `torch.compile` on CUDA (a new op has no fused kernel yet; compiling fuses its elementwise
math). Its unit test sits beside it as `test_<file>.py` and is not loaded.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

import torch

from runtime.ops.gated_delta import DECAYS
from runtime.ops.mlp import ACTIVATIONS
from runtime.ops.moe import SCORINGS
from runtime.ops.norms import NORMS
from runtime.ops.residual import MIXINGS
from runtime.ops.rope import ROPES

# Kind -> the table its runtime layer looks the op up in, by the name the spec gives it: hidden_act, router
# scoring, norm kind, rope_type, gated-delta decay, residual mixing. A free-form candidate declares one of
# these kinds too; a kind outside them has no slot to go into.
TABLES = {"activation": ACTIVATIONS, "router_scoring": SCORINGS, "norm": NORMS, "rope": ROPES,
          "linear_attention_decay": DECAYS, "residual_mixing": MIXINGS}


class PackageOpError(ValueError):
    """A file in PKG/ops/ is not a generated operator the runtime can register."""


class CompiledOnCuda:
    """A generated op as the runtime calls it: eager on CPU, `torch.compile`d (once, at first use) on CUDA."""

    def __init__(self, op: Callable):
        self.op = op
        self._compiled: Callable | None = None

    def __call__(self, *args, **kwargs):
        return self.for_device(_device_type(args, kwargs))(*args, **kwargs)

    def for_device(self, device_type: str) -> Callable:
        if device_type != "cuda":
            return self.op
        if self._compiled is None:
            # dynamic: token counts change every step; one graph serves them all instead of one per shape
            self._compiled = torch.compile(self.op, dynamic=True)
        return self._compiled


def _device_type(args: tuple, kwargs: dict) -> str:
    tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return "cpu" if tensor is None else tensor.device.type


def load_package_ops(pkg: Path) -> list[str]:
    """Register every generated op of the package; returns "kind:name" for each."""
    loaded = []
    for path in sorted((Path(pkg) / "ops").glob("*.py")):
        if path.name.startswith("test_"):
            continue
        module = _import(path)
        kind, name = getattr(module, "KIND", None), getattr(module, "NAME", None)
        if kind not in TABLES or not isinstance(name, str) or not callable(getattr(module, "op", None)):
            raise PackageOpError(f"{path}: expected KIND in {sorted(TABLES)}, a NAME string and a function `op`")
        TABLES[kind][name] = CompiledOnCuda(module.op)
        loaded.append(f"{kind}:{name}")
    return loaded


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(f"package_ops.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
