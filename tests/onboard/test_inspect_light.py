"""`inspect` of an index-only release imports neither torch, triton nor transformers (they cost
seconds), and the report says whether the fused kernels can run here and why."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from runtime.ops.common.available import kernels_available

PROBE = """
import sys
from onboard.cli import main
code = main(["inspect", sys.argv[1], "--json"])
heavy = sorted(m for m in ("torch", "triton", "transformers") if m in sys.modules)
print("HEAVY", heavy, code, file=sys.stderr)
"""


def test_seed_index_inspect_stays_light(seed_dir):
    result = subprocess.run([sys.executable, "-c", PROBE, str(seed_dir)], capture_output=True, text=True, timeout=300)
    assert "HEAVY [] 0" in result.stderr, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["kernels"] == dict(zip(("available", "reason"), kernels_available()))
    weights = report["weights"]
    # the 331 vision tensors are counted, not dropped: together they are the whole index
    assert weights["present"] + weights["vision_tensors"] == 157_437 and weights["vision_tensors"] == 331


def test_kernels_available_says_why():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = "from runtime.ops.common.available import kernels_available as k; print(*k(), sep='|')"
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120).stdout
    interpreted = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                                 env={**env, "TRITON_INTERPRET": "1"}).stdout
    assert interpreted.startswith("True|TRITON_INTERPRET=1")
    # this machine has no GPU driver, or has one: either way the answer names the reason
    assert plain.startswith(("False|no CUDA GPU", "True|on the CUDA GPU")), plain


def test_the_light_gate_never_hides_a_family_transformers_knows():
    """transformers_may_know reads transformers' sources instead of importing it: it must pass every family
    transformers maps to a model class, and refuse one it does not know (the seed's hybrid_moe_vl)."""
    from onboard.release.transformers_classes import transformers_may_know
    from runtime.model.own_modules import transformers_class_names

    assert [f for f in transformers_class_names() if not transformers_may_know(f)] == []
    assert not transformers_may_know("hybrid_moe_vl")
