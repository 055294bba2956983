"""Load a package's generated operators (PKG/ops/*.py) and register them where the runtime looks them up.

Each generated file is plain torch that passed validation: it declares KIND (what it extends), NAME (the
name the spec uses for it, e.g. a config's `hidden_act`) and `op`, the function. Registering puts `op`
into the runtime's table for that kind, so tiers 0-2 and training run exactly the validated code: eagerly
on CPU, through `torch.compile` on CUDA (a new op has no fused kernel yet; compiling fuses its elementwise
math). Its unit test sits beside it as `test_<file>.py` and is not loaded.
"""
from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Callable, Iterator

import torch

from runtime.errors import GeneratedOpMismatch
from runtime.ops.gated_delta import DECAYS
from runtime.ops.mlp import ACTIVATIONS
from runtime.ops.moe import SCORINGS
from runtime.ops.norms import NORMS
from runtime.ops.residual import MIXINGS
from runtime.ops.rope import ROPES
from runtime.tolerances import compare, tolerance_for

# Kind -> the table its runtime layer looks the op up in, by the name the spec gives it: hidden_act, router
# scoring, norm kind, rope_type, gated-delta decay, residual mixing. A free-form candidate declares one of
# these kinds too; a kind outside them has no slot to go into.
TABLES = {"activation": ACTIVATIONS, "router_scoring": SCORINGS, "norm": NORMS, "rope": ROPES,
          "linear_attention_decay": DECAYS, "residual_mixing": MIXINGS}


class PackageOpError(ValueError):
    """A file in PKG/ops/ is not a generated operator the runtime can register."""


class CompiledOnCuda:
    """A generated op as the runtime calls it: eager on CPU, `torch.compile`d (once, at first use) on CUDA.
    Armed with its reference (arm_spot_checks), its first call is also compared with the reference on those
    very inputs: an op that behaves only under validation (in a sandbox) is caught where it runs."""

    def __init__(self, op: Callable):
        self.op = op
        self._compiled: Callable | None = None
        self._spot_check: tuple[str, Callable] | None = None

    def __call__(self, *args, **kwargs):
        out = self.for_device(_device_type(args, kwargs))(*args, **kwargs)
        if self._spot_check is not None:
            (label, reference), self._spot_check = self._spot_check, None
            _spot_check(label, reference, args, kwargs, out)
        return out

    def check_first_call_against(self, label: str, reference: Callable) -> None:
        self._spot_check = (label, reference)

    def for_device(self, device_type: str) -> Callable:
        if device_type != "cuda":
            return self.op
        if self._compiled is None:
            # dynamic: token counts change every step; one graph serves them all instead of one per shape
            self._compiled = torch.compile(self.op, dynamic=True)
        return self._compiled


def arm_spot_checks(references: dict[str, dict[str, Callable]]) -> list[str]:
    """Every registered generated op that has a reference (kind -> name -> the model's own function) compares
    its first call with it; returns "kind:name" for each armed op."""
    armed = []
    for kind, table in TABLES.items():
        for name, fn in table.items():
            reference = references.get(kind, {}).get(name)
            if isinstance(fn, CompiledOnCuda) and reference is not None:
                fn.check_first_call_against(f"{kind}:{name}", reference)
                armed.append(f"{kind}:{name}")
    return armed


def _spot_check(label: str, reference: Callable, args: tuple, kwargs: dict, out) -> None:
    """The reference in fp64 on the same inputs; raises GeneratedOpMismatch outside the tolerance."""
    with torch.no_grad():
        expected = reference(*map(_fp64, args), **{k: _fp64(v) for k, v in kwargs.items()})
    if not isinstance(out, torch.Tensor) or not isinstance(expected, torch.Tensor) or out.shape != expected.shape:
        raise GeneratedOpMismatch(f"generated op {label} returned {type(out).__name__} "
                                  f"{tuple(getattr(out, 'shape', ()))}, its reference a tensor of "
                                  f"{tuple(getattr(expected, 'shape', ()))}")
    if not torch.isfinite(expected).all():
        return  # the reference itself overflowed on these inputs: nothing to judge against
    result = compare(out.detach(), expected, tolerance_for(label.split(":")[0], out.dtype, "out"))
    if not result.passed:
        raise GeneratedOpMismatch(
            f"generated op {label} disagrees with its reference on the first step's inputs: relative RMS error "
            f"{result.rel_rms:.3e} (tolerance {result.tolerance.rel_rms:.0e})")


def _fp64(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float64)
    return value


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


@contextlib.contextmanager
def tables_restored() -> Iterator[None]:
    """The op tables as they were when the block began, whatever it registered: one process may align
    several packages (the graph's trial packages, refused candidates among them)."""
    before = {kind: dict(table) for kind, table in TABLES.items()}
    try:
        yield
    finally:
        for kind, table in TABLES.items():
            table.clear()
            table.update(before[kind])


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(f"package_ops.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
