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


def test_situ_is_exact_with_its_betas_and_unsupported_without():
    """Kimi K3's SiTU-GLU: the experts' epilogue fuses it, given the betas the spec carries."""
    from runtime.spec import DenseFFN, MoEFFN, RouterSpec

    judge = OPS["swiglu_mlp"].supports
    assert judge(DenseFFN(intermediate_size=8, activation="situ", situ_beta=4.0, situ_linear_beta=25.0)) == "exact"
    assert judge(DenseFFN(intermediate_size=8, activation="situ")) == "unsupported"
    moe = MoEFFN(num_experts=4, top_k=2, expert_intermediate_size=8, activation="situ", situ_beta=4.0,
                 router=RouterSpec(scoring="sigmoid", norm_topk_prob=True))
    assert moe.situ_betas == (4.0, None)
    assert OPS["moe_experts"].supports(moe) == "exact"


def test_situ_fields_stay_out_of_specs_that_do_not_use_them():
    """Fields added late are dumped only when set, so earlier packages' spec.json and hash read as they did."""
    from runtime.spec import DenseFFN

    assert "situ_beta" not in DenseFFN(intermediate_size=8).model_dump()
    situ = DenseFFN(intermediate_size=8, activation="situ", situ_beta=4.0, situ_linear_beta=25.0)
    assert DenseFFN.model_validate_json(situ.model_dump_json()) == situ
