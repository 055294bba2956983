"""The family sweep in CI: two of the installed transformers' MoE families a day, in rotation, through the
real build and CLI path (bench/family_sweep.py runs them all and writes docs/families.md)."""
from __future__ import annotations

import datetime

import pytest

from onboard.examples.tiny_config import shrink
from onboard.family_sweep import moe_families, run_family


def todays_families() -> list[str]:
    families, _ = moe_families()
    day = datetime.date.today().toordinal()
    return sorted({families[day % len(families)], families[(7 * day + 3) % len(families)]})


# a family whose default config cannot be shrunk generically is passed over for the next one in the rotation
# (it must say why); the test never ends without onboarding one
MAX_PASSED_OVER = 12


def first_buildable(start: str, tmp_path):
    families, _ = moe_families()
    at = families.index(start)
    for step in range(MAX_PASSED_OVER):
        family = families[(at + step) % len(families)]
        result = run_family(family, tmp_path / family)
        if result.built:
            return family, result
        assert result.not_built_reason, family
    pytest.fail(f"{MAX_PASSED_OVER} families from {start} on could not be built tiny")


@pytest.mark.parametrize("index", [0, 1])
def test_a_family_of_the_day_is_onboarded_honestly(index, tmp_path):
    family, result = first_buildable(todays_families()[min(index, len(todays_families()) - 1)], tmp_path)
    tracebacks = {step: s.traceback for step, s in result.steps.items() if s.exit_code is None}
    assert not tracebacks, (family, tracebacks)
    # a tiny release save_pretrained wrote is valid by construction: never bad input
    assert {s.exit_code for s in result.steps.values()} <= {0, 3}, (family, result.steps)
    if result.steps["new-model"].exit_code == 0:
        assert result.tiers_passed == [0, 1, 2], (family, result.failed_checks)
        # an exit-0 package trains: 4 LoRA steps through `onboard train`
        assert result.steps["train"].exit_code == 0, (family, result.steps["train"])


def test_shrink_keeps_switches_patterns_and_relations():
    config = {
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 64,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "n_shared_experts": 0, "n_routed_experts": 256,
        "num_experts_per_tok": 8, "vocab_size": 150000, "eos_token_id": 149999, "num_hidden_layers": 12,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 8,
        "moe_layers": [5, 6, 7], "text_config": {"hidden_size": 2048, "num_hidden_layers": 2},
    }
    small = shrink(config)
    assert small["hidden_size"] == 64 and small["n_routed_experts"] == 8 and small["num_experts_per_tok"] == 2
    assert small["n_shared_experts"] == 0  # zero switches a feature off: kept
    assert small["num_key_value_heads"] == small["num_attention_heads"]  # equal in the default: kept equal
    assert small["head_dim"] == small["qk_rope_head_dim"] == 8
    assert small["eos_token_id"] < small["vocab_size"] == 512
    # every distinct layer pattern survives, and the index list is renumbered onto the kept layers
    kept = small["num_hidden_layers"]
    assert kept <= 4 and set(small["layer_types"]) == {"linear_attention", "full_attention"}
    assert len(small["layer_types"]) == kept and all(0 <= i < kept for i in small["moe_layers"])
    assert small["text_config"]["hidden_size"] == 64


def test_a_null_experts_per_token_beside_experts_takes_its_cap_and_other_nulls_stay():
    """A default that leaves experts-per-token null (DeepSeek-V2's) cannot route; a null elsewhere switches off."""
    small = shrink({"n_routed_experts": 64, "num_experts_per_tok": None, "n_group": None, "hidden_size": 4096})
    assert small["num_experts_per_tok"] == 2 and small["n_group"] is None
    assert shrink({"hidden_size": 4096, "num_experts_per_tok": None})["num_experts_per_tok"] is None


def test_a_tiny_model_transformers_cannot_run_is_not_built_and_says_why(tmp_path):
    """Step3p7's model builds a sliding-window mask its default config (sliding_window null) cannot give:
    transformers itself fails on the tiny release, so it is listed as not built with that reason."""
    result = run_family("step3p7", tmp_path)
    assert not result.built and "does not run in transformers" in result.not_built_reason
    assert "sliding_window" in result.not_built_reason and not result.steps
