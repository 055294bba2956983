"""The model's own implementation of an op the runtime lacks: the truth a generated candidate is
validated against, the source its prompt shows, and the reference alignment compares with.

Only transformers' implementations are used (never code from the release folder, which would have to be
trusted to run), found by the name the config gives: an activation by its `hidden_act` through
transformers' ACT2FN, and a router scoring by its `scoring_func` through ACT2FN too, which is how
transformers' routers that read `scoring_func` compute their scores (DeepseekV4TopKRouter, Inkling2TopKRouter).
A family whose transformers router ignores the key is caught by tier 1 (its layer vs transformers').
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable, Optional

import yaml

from onboard import package_io
from onboard.release.model_source import ModelSource, fenced

BY_ACT2FN = ("activation", "router_scoring")


def reference(kind: str, name: str) -> Optional[Callable]:
    """The model's own function for (kind, name), or None when there is none to compare with."""
    if kind in BY_ACT2FN:
        from transformers.activations import ACT2FN

        return ACT2FN[name] if name in ACT2FN else None
    return None


def describe(kind: str, name: str) -> str:
    if kind in BY_ACT2FN:
        return f"transformers.activations:ACT2FN[{name!r}]"
    return "none"


def source(kind: str, name: str) -> Optional[ModelSource]:
    """The reference's code, for the prompt (None when there is no reference)."""
    fn = reference(kind, name)
    if fn is None:
        return None
    code = fn if inspect.isfunction(fn) else type(fn)
    return fenced(describe(kind, name), {code.__qualname__: inspect.getsource(code)})


def register_references(pkg: Path) -> list[str]:
    """Put the model's own function for each generated op of the package into reference_ops' tables."""
    from reference_ops.mlp import ACTIVATIONS
    from reference_ops.moe import SCORINGS

    tables = {"activation": ACTIVATIONS, "router_scoring": SCORINGS}
    for kind, functions in package_references(pkg).items():
        if kind in tables:
            tables[kind].update(functions)
    return [f"{e['kind']}:{e['name']}" for e in _generated_entries(pkg)]


def package_references(pkg: Path) -> dict[str, dict[str, Callable]]:
    """kind -> name -> the model's own function, for each generated op of the package that has one."""
    found: dict[str, dict[str, Callable]] = {}
    for entry in _generated_entries(pkg):
        fn = reference(entry["kind"], entry["name"])
        if fn is not None:
            found.setdefault(entry["kind"], {})[entry["name"]] = fn
    return found


def _generated_entries(pkg: Path) -> list[dict]:
    return yaml.safe_load(package_io.read_text(Path(pkg), Path(pkg) / "package.yaml")).get("generated_ops") or []
