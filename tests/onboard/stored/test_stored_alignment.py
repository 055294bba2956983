"""`onboard new-model` on a stored-format example release (`example-model --weights`) aligns against the release's
own semantics: tiers 0-2 pass, and every check that read stored weights names the scale tensors it read, in
report.json and in PR.md."""
from __future__ import annotations

import json

import pytest

from tests.onboard.conftest import run_onboard


@pytest.mark.parametrize("family, weights", [("gpt_oss", "mxfp4")])
def test_new_model_aligns_a_stored_release_and_names_the_scales_read(family, weights, stored_example_release,
                                                                      tmp_path):
    pkg = tmp_path / "pkg"
    result = run_onboard("new-model", stored_example_release(family, weights), "--out", pkg)
    assert result.code == 0, result.err[-3000:]
    report = json.loads((pkg / "alignment" / "report.json").read_text())
    assert [t["tier"] for t in report["tiers"] if t["passed"]] == [0, 1, 2]
    checks = {t["tier"]: t["checks"] for t in report["tiers"]}
    decoding = [c for c in checks[0] if c["op"] == "moe_experts_stored"]
    assert decoding and all(c["scales"] == ["model.layers.0.mlp.experts.down_proj_scales",
                                            "model.layers.0.mlp.experts.gate_up_proj_scales"] for c in decoding)
    layer0 = [c for c in checks[1] if c["name"].startswith("layer0:")]
    assert layer0 and all(c["scales"] == ["model.layers.0.mlp.experts.down_proj_scales",
                                          "model.layers.0.mlp.experts.gate_up_proj_scales"] for c in layer0)
    assert {c["verdict"] for c in checks[1] if c["metric"] == "log10_gain"} == {"pass"}
    logits = next(c for c in checks[2] if c["name"] == "logits/float32")
    assert len(logits["scales"]) == 4
    assert "`model.layers.1.mlp.experts.gate_up_proj_scales`" in (pkg / "PR.md").read_text()
