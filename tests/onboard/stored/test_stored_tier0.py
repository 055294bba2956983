"""Tier 0 of the decoding ops on a stored release's own bytes (onboard/align/tiers/stored_cases.py): the codes and
scales put together as the runtime holds them, every distinct stored shape once, each check naming the scale
tensors it read; op and fp64 twin decode the same bytes."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from onboard.align.tiers.stored_cases import stored_cases
from onboard.align.tiers.tier0_ops import tier0
from onboard.package.writer import write_package
from runtime.spec import read_spec
from tests.onboard.formats.stored_release import fp8_release

EXPERTS = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def fp8_package(example_release, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-tier0")
    release = fp8_release(example_release("deepseek_v3"), root / "release")
    pkg, _ = write_package(release, root / "pkg")
    return release, read_spec(json.loads((pkg / "spec.json").read_text())), json.loads((pkg / "weight_map.json").read_text())


def test_per_expert_tensors_are_stacked_as_the_runtime_holds_them(fp8_package):
    release, spec, weight_map = fp8_package
    cases = {(c.op, c.label): c for c in stored_cases(spec, weight_map, release, T=5)}
    experts = cases["moe_experts_stored", "layers.1.ffn.experts"]
    kwargs = experts.make(0, torch.float32).kwargs
    tensors = load_file(str(release / "model.safetensors"))
    F = tensors[f"{EXPERTS}.0.gate_proj.weight"].shape[0]
    for e in range(spec.layers[1].ffn.num_experts):
        gate_up = kwargs["gate_up_codes"][e].view(torch.uint8)
        assert torch.equal(gate_up[:F], tensors[f"{EXPERTS}.{e}.gate_proj.weight"].view(torch.uint8))
        assert torch.equal(gate_up[F:], tensors[f"{EXPERTS}.{e}.up_proj.weight"].view(torch.uint8))
        assert torch.equal(kwargs["down_scale"][e], tensors[f"{EXPERTS}.{e}.down_proj.weight_scale_inv"])
    assert experts.scales == [f"{EXPERTS}.{{0..7}}.{p}.weight_scale_inv" for p in ("down_proj", "gate_proj", "up_proj")]
    # the 40-row kv_a_proj_with_mqa (a partial last block) is one of the linears, at its own widths
    kv = cases["stored_linear", "layers.0.attn.kv_a_proj_with_mqa.weight"].make(0, torch.float32).kwargs
    assert kv["codes"].shape == (40, 64) and kv["scale"].shape == (3, 4)


def test_tier0_checks_the_decoding_ops_on_the_release_bytes_naming_their_scales(fp8_package):
    release, spec, weight_map = fp8_package
    checks = tier0(spec, T=5, weight_map=weight_map, source=release)
    stored = [c for c in checks if c.op in ("stored_linear", "moe_experts_stored")]
    assert stored and all(c.scales for c in stored)
    assert {c.verdict for c in stored if "/fallback/" in c.name} == {"pass"}
    assert any(c.name.startswith("stored_linear:layers.0.attn.kv_a_proj_with_mqa.weight/fallback/bfloat16") for c in stored)
    # the plain experts op is not the package's: its experts are stored
    assert not any(c.op == "moe_experts" for c in checks)
