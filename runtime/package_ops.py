"""Load a package's generated operators (PKG/ops/*.py) and register them where the runtime looks them up.

Each generated file is plain torch that passed validation: it declares KIND (what it extends), NAME (the
name the spec uses for it, e.g. a config's `hidden_act`) and `op`, the function. Registering puts `op`
into the runtime's table for that kind, so tiers 0-2 and training run exactly the validated code: eagerly
on CPU, through `torch.compile` on CUDA (a new op has no fused kernel yet; compiling fuses its elementwise
math). Its unit test sits beside it as `test_<file>.py` and is not loaded.

A package is untrusted input (it travels as a pull request), so nothing under PKG/ops/ runs unless the
caller passes the file's sha256 among the ones the user approved. Each file is read once: those bytes are
hashed, checked and compiled, so the file cannot change between the check and the import.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import types
from dataclasses import dataclass
from pathlib import Path
from typing import AbstractSet, Callable, Iterator

import torch

from runtime.errors import GeneratedOpMismatch, PackageOpRefused
from runtime.ops.gated_delta.torch_form import DECAYS
from runtime.ops.mlp.torch_form import ACTIVATIONS
from runtime.ops.moe.torch_form import SCORINGS
from runtime.ops.norm.torch_form import NORMS
from runtime.ops.residual.torch_form import MIXINGS
from runtime.ops.rope.torch_form import ROPES
from runtime.tolerances import compare, tolerance_for

# Kind -> the table its runtime layer looks the op up in, by the name the spec gives it: hidden_act, router
# scoring, norm kind, rope_type, gated-delta decay, residual mixing. A free-form candidate declares one of
# these kinds too; a kind outside them has no slot to go into.
TABLES = {"activation": ACTIVATIONS, "router_scoring": SCORINGS, "norm": NORMS, "rope": ROPES,
          "linear_attention_decay": DECAYS, "residual_mixing": MIXINGS}


# The names each table holds before any package loads: a package may add ops, never replace one (an op
# registered as `silu` would silently change every model that uses silu).
BUILTIN_NAMES = {kind: frozenset(table) for kind, table in TABLES.items()}
# Generated ops are a few kilobytes; a bigger file is not one, and is never read past this.
MAX_OP_BYTES = 1 << 20
# Bytecode caches Python writes when the user runs the ops' unit tests. Never loaded: ops are compiled from
# their hashed source bytes, nothing imports PKG/ops by path.
BYTECODE_CACHE = "__pycache__"


@dataclass(frozen=True)
class OpFile:
    """One entry of PKG/ops/ as read once: its bytes (None when it is not a regular file) and what keeps it
    from loading (None for a generated op's Python file)."""
    path: Path
    data: bytes | None
    problem: str | None

    @property
    def sha256(self) -> str | None:
        return None if self.data is None else hashlib.sha256(self.data).hexdigest()

    @property
    def is_test(self) -> bool:
        return self.path.name.startswith("test_")


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


def read_op_files(pkg: Path) -> list[OpFile]:
    """Every entry of PKG/ops/ (none when there is no ops/), read without following links."""
    folder = Path(pkg) / "ops"
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise PackageOpRefused(folder, "is not a folder: a package's ops/ holds its generated operators")
    if not folder.exists():
        return []
    return [_read_entry(folder / name) for name in sorted(os.listdir(folder)) if name != BYTECODE_CACHE]


def _read_entry(path: Path) -> OpFile:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return OpFile(path, None, _not_regular(path))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return OpFile(path, None, _not_regular(path))
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_OP_BYTES + 1)
    if len(data) > MAX_OP_BYTES:
        return OpFile(path, None, f"is over {MAX_OP_BYTES >> 20} MiB: not a generated operator")
    if path.suffix != ".py":
        return OpFile(path, data, "is not a Python file: a package's ops/ holds generated operators (*.py) only")
    return OpFile(path, data, None)


def _not_regular(path: Path) -> str:
    what = "a symbolic link" if path.is_symlink() else "a folder" if path.is_dir() else "not a regular file"
    return f"is {what}: a package's ops/ holds generated operators (*.py files) only"


def unapproved(files: list[OpFile], approved: AbstractSet[str]) -> list[OpFile]:
    """The files whose bytes the user has not approved (every entry counts, tests and non-Python files too)."""
    return [f for f in files if f.sha256 is None or f.sha256 not in approved]


def check_loadable(files: list[OpFile]) -> None:
    """Refuse the first entry that is no generated operator's Python file (it needs no code to run to say so)."""
    for f in files:
        if f.problem is not None:
            raise PackageOpRefused(f.path, f.problem)


def load_package_ops(pkg: Path, approved: AbstractSet[str]) -> list[str]:
    """Register every generated op of the package, when the sha256 of every file under PKG/ops/ is in
    `approved`; returns "kind:name" for each. Raises PackageOpRefused before any of it runs otherwise."""
    files = read_op_files(pkg)
    check_approved(pkg, files, approved)
    return register_op_files(files)


def check_approved(pkg: Path, files: list[OpFile], approved: AbstractSet[str]) -> None:
    """Refuse the first entry that is not loadable, then the first the user has not approved; runs nothing."""
    check_loadable(files)
    for f in unapproved(files, approved):
        raise PackageOpRefused(f.path, f"is not approved: review it, then run `onboard approve {pkg}`")


def register_op_files(files: list[OpFile]) -> list[str]:
    """Run the op files (not their tests) from the bytes read and register each `op`: only for files the
    user approved, or inside the sandbox that confines unapproved ones."""
    check_loadable(files)
    loaded: dict[tuple[str, str], Path] = {}
    for f in files:
        if f.is_test:
            continue
        kind, name, op = _run_op_file(f)
        if name in BUILTIN_NAMES[kind]:
            raise PackageOpRefused(f.path, f"declares NAME {name!r}, a built-in {kind}: a package may add ops, "
                                           "not replace the runtime's")
        if (kind, name) in loaded:
            raise PackageOpRefused(f.path, f"declares {kind} {name!r}, which {loaded[kind, name].name} declares too")
        TABLES[kind][name] = CompiledOnCuda(op)
        loaded[kind, name] = f.path
    return [f"{kind}:{name}" for kind, name in loaded]


def _run_op_file(f: OpFile) -> tuple[str, str, Callable]:
    module = types.ModuleType(f"package_ops.{f.path.stem}")
    module.__file__ = str(f.path)
    try:
        exec(compile(f.data, str(f.path), "exec"), module.__dict__)
    except Exception as err:  # the op's own code failed: the file is refused, never a traceback
        raise PackageOpRefused(f.path, f"failed to load: {type(err).__name__}: {str(err)[:200]}") from None
    kind, name, op = (getattr(module, key, None) for key in ("KIND", "NAME", "op"))
    if kind not in TABLES or not isinstance(name, str) or not callable(op):
        raise PackageOpRefused(f.path, f"is not a generated operator: expected KIND in {sorted(TABLES)}, "
                                       "a NAME string and a function `op`")
    return kind, name, op


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
