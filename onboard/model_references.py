"""The model's own implementation of an op the runtime lacks: the truth a generated candidate is
validated against, the source its prompt shows, and the reference alignment compares with.

Only transformers' implementations are used (never code from the release folder, which would have to be
trusted to run): an activation by its `hidden_act` name through transformers' ACT2FN.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable, Optional

import yaml


def reference(kind: str, name: str) -> Optional[Callable]:
    """The model's own function for (kind, name), or None when there is none to compare with."""
    if kind == "activation":
        from transformers.activations import ACT2FN

        return ACT2FN[name] if name in ACT2FN else None
    return None


def describe(kind: str, name: str) -> str:
    if kind == "activation":
        return f"transformers.activations:ACT2FN[{name!r}]"
    return "none"


def source(kind: str, name: str) -> Optional[str]:
    """The reference's code, for the prompt (None when there is no reference)."""
    fn = reference(kind, name)
    if fn is None:
        return None
    return inspect.getsource(fn if inspect.isfunction(fn) else type(fn))


def register_references(pkg: Path) -> list[str]:
    """Put the model's own function for each generated op of the package into reference_ops' tables."""
    from reference_ops.mlp import ACTIVATIONS

    tables = {"activation": ACTIVATIONS}
    entries = yaml.safe_load((Path(pkg) / "package.yaml").read_text()).get("generated_ops") or []
    for entry in entries:
        fn = reference(entry["kind"], entry["name"])
        if fn is not None and entry["kind"] in tables:
            tables[entry["kind"]][entry["name"]] = fn
    return [f"{e['kind']}:{e['name']}" for e in entries]
