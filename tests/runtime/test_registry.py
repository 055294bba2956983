"""Every implementation the registry names exists and imports: gap analysis trusts `exists()`
(a file check that imports nothing) to mean `resolve()` finds the function."""
from __future__ import annotations

import pytest

from runtime.registry import OPS


@pytest.mark.parametrize("name", sorted(OPS))
def test_named_implementations_resolve(name):
    op = OPS[name]
    for which in ("reference", "torch_form", "kernel"):
        if getattr(op, which) is not None:
            assert op.exists(which) and callable(op.resolve(which)), (name, which, getattr(op, which))


def test_a_missing_module_does_not_exist():
    op = OPS["rms_norm"]
    assert not type(op)(op.name, op.covers, op.reference, "runtime.ops.nowhere:rms_norm", None, op.supports).exists("torch_form")


def test_the_registry_names_the_activations_and_scorings_the_runtime_has():
    """runtime.registry names them without importing torch; they must be ops/mlp.py's and ops/moe.py's own."""
    import subprocess
    import sys

    probe = ("import runtime.registry as r, runtime.ops.mlp.torch_form as m, runtime.ops.moe.torch_form as moe; import sys; "
             "sys.exit(0 if set(r.BUILTIN_ACTIVATIONS) == set(m.ACTIVATIONS) "
             "and set(r.BUILTIN_SCORINGS) == set(moe.SCORINGS) else 1)")
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0
