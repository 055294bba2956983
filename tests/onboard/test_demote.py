"""The demotion after a failed alignment: which rung a failed alignment calls for, and the spec re-planned from the
failing checks, on a real tiny release (mellum: every component recognized as registry ops, yet its layers
disagree with transformers' at tier 1), then new-model reaching exit 0 through the retry."""
from __future__ import annotations

import json

import pytest
import yaml

from onboard import cli
from onboard.align.report import Check
from onboard.gap.report import op_gaps
from onboard.package.derivation import OwnStep
from onboard.package.writer import write_package
from onboard.recognize.recognizer import recognize
from onboard.release.manifest import read_manifest
from onboard.review.demotion import next_rung, replan

FAMILY = "mellum"


def _check(name: str, tier: int = 1, layer: int | None = 0, value: float = 0.17) -> Check:
    return Check(tier=tier, name=name, metric="rel_rms", value=value, tolerance=1e-4, verdict="fail",
                 layer=layer, detail="max_abs_rel=1.510e-01 (tol 1e-03)")


@pytest.fixture(scope="module")
def release(tiny_family):
    path, _ = tiny_family(FAMILY)
    return path, read_manifest(path)


@pytest.fixture(scope="module")
def spec(release):
    return recognize(release[1])


def test_the_release_is_recognized_as_registry_ops_only(spec):
    assert {g.status for g in op_gaps(spec)} == {"covered"}


def test_the_rungs_in_order_each_once(spec):
    layer_fail = [_check("layer0:softmax+moe/out")]
    assert next_rung(spec, None, [], []) is None
    assert next_rung(spec, 1, layer_fail, []) == "layers"
    # a layer rung done (or a failure naming no layer): the whole model is the next and last rung
    assert next_rung(spec, 1, layer_fail, ["layers"]) == "model"
    assert next_rung(spec, 1, [_check("tier1/run", layer=None)], []) == "model"
    assert next_rung(spec, 1, layer_fail, ["layers", "model"]) is None
    assert next_rung(spec, 2, [_check("logits/float32", tier=2, layer=None)], ["layers"]) == "model"
    # a tier-2 failure outside the model-level checks, or a tier-0 op failure: no rung of this ladder
    assert next_rung(spec, 2, [_check("training/lora_loss", tier=2, layer=None)], []) is None
    assert next_rung(spec, 0, [_check("tier0/rope", tier=0, layer=None)], []) is None


def test_the_failing_layer_kind_runs_as_the_releases_decoder_layer(spec, release):
    replanned = replan(spec, release[1], "layers", [_check("layer0:softmax+moe/out")])
    assert all(layer.own_layer for layer in replanned.layers)
    reason = replanned.layers[3].own_layer
    assert reason.startswith("softmax_attention, rope, moe_router, moe_experts disagreed with the release's decoder layer")
    assert "layer0:softmax+moe/out rel_rms 1.7e-01 over its bar 1e-04" in reason
    # the layer's released tensors move into its own module, by their names inside transformers' layer
    own = replanned.layers[0]
    released = {n for n in release[1].tensors if n.startswith("model.layers.0.")}
    assert set(own.attention.tensors) | set(own.ffn.tensors) == released
    assert {"self_attn.q_proj.weight", "input_layernorm.weight"} <= set(own.attention.inner.values())
    gaps = {g.op: g for g in op_gaps(replanned)}
    assert gaps["own:decoder_layer"].status == "own" and gaps["own:decoder_layer"].layers == [0, 1, 2, 3]
    assert replanned.params.total == spec.params.total


def test_the_last_rung_is_the_whole_model(spec, release):
    replanned = replan(spec, release[1], "model", [_check("layer0:own_layer/out"),
                                                     _check("logits/float32", tier=2, layer=None, value=15.0)])
    assert replanned.own_model.startswith("the model's glue disagreed with the release's model: logits/float32 rel_rms 1.5e+01")
    assert [g.op for g in op_gaps(replanned)] == ["own:model"]
    assert next_rung(replanned, 2, [_check("logits/float32", tier=2, layer=None)], ["layers"]) is None


@pytest.mark.slow
def test_new_model_reaches_exit_0_through_the_layer_demotion(release, tmp_path):
    pkg = tmp_path / "pkg"
    assert cli.main(["new-model", str(release[0]), "--out", str(pkg)]) == 0
    steps = json.loads((pkg / "agents" / "demotions.json").read_text())
    assert [s["rung"] for s in steps] == ["layers"] and steps[0]["failed"][0]["name"].startswith("layer0:")
    package = yaml.safe_load((pkg / "package.yaml").read_text())
    assert package["status"] == "trainable" and package["reasons"][0].startswith("demoted (layers): tier 1 check layer0:")
    report = json.loads((pkg / "alignment" / "report.json").read_text())
    assert report["passed"] and [t["tier"] for t in report["tiers"]] == [0, 1, 2]
    gap = next(g for g in json.loads((pkg / "gap_report.json").read_text())["ops"] if g["op"] == "own:decoder_layer")
    assert gap["status"] == "own" and "(slow)" in gap["detail"] and "disagreed" in gap["detail"]
    assert "own:decoder_layer" in (pkg / "PR.md").read_text()
    _same_as_written_outside_the_graph(pkg, release[0], package["spec_steps"], tmp_path / "direct")


def _same_as_written_outside_the_graph(pkg, release, spec_steps: list[dict], out) -> None:
    """The graph writes what its state holds (the spec after the demotion, the plan made again from it);
    write_package computes those from the release and the recorded steps: the same files, byte for byte
    (the gap report's ops too; its unrecognized items carry the graph's explanations, which only it has)."""
    direct, _ = write_package(release, out, spec_steps=[OwnStep(**step) for step in spec_steps])
    for name in ("spec.json", "weight_map.json", "plan.yaml", "lora.yaml", ".github/workflows/alignment.yml"):
        assert (pkg / name).read_bytes() == (direct / name).read_bytes(), name
    ops = [json.loads((folder / "gap_report.json").read_text())["ops"] for folder in (pkg, direct)]
    assert ops[0] == ops[1]
