"""Unrecognized config keys explained by the LLM (agents/explain.py, agents/nodes/explain.py).

DeepSeek-V3's tiny release with two keys our rules leave unread: `num_mtp_layers` (transformers' config reads
it as num_nextn_predict_layers, the multi-token-prediction head the causal LM does not run) and `ep_size` (a
deployment setting of DeepSeek's own release). Through the scripted server and the real openai client, the
right explanation of the first is accepted once tiers 0-1 pass with it applied; a wrong one of the second
(that it is the experts' top_k) is refused with the failing tier-1 metric, and the package keeps the spec
without it."""
from __future__ import annotations

import json
import shutil

import pytest

from agents.explain import apply, explanations_for
from agents.state import Failure, Proposal
from agents.tasks import final_report
from onboard import cli
from onboard.gap.report import analyze
from onboard.recognize.recognizer import recognize
from onboard.release.manifest import read_manifest
from runtime.spec import Unrecognized

RIGHT = {"op": "none", "meaning": "multi-token-prediction layers, an alias of num_nextn_predict_layers",
         "parameter": None, "value": None, "rationale": "the causal LM does not run the MTP head"}
WRONG = {"op": "moe_experts", "meaning": "experts per token", "parameter": "ffn.top_k", "value": None,
         "rationale": "scripted wrong answer"}


@pytest.fixture(scope="module")
def release(example_release, tmp_path_factory):
    out = tmp_path_factory.mktemp("releases") / "deepseek_v3_extra_keys"
    shutil.copytree(example_release("deepseek_v3"), out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_mtp_layers": 1, "ep_size": 1}, indent=2))
    return out


@pytest.fixture(scope="module")
def onboarded(release, tmp_path_factory):
    from tests.agents.llm_server import ScriptedLLM

    server = ScriptedLLM()
    server.script({"content": json.dumps(RIGHT)}, {"content": json.dumps(WRONG)})
    pkg = tmp_path_factory.mktemp("explained") / "pkg"
    code = cli.main(["new-model", str(release), "--out", str(pkg), "--llm-url", server.url, "--llm-model", "m"])
    server.close()
    return code, pkg, server.requests


def _item(pkg, name: str) -> dict:
    return next(u for u in json.loads((pkg / "gap_report.json").read_text())["unrecognized"] if u["item"] == name)


def test_the_right_explanation_is_accepted_after_validation(onboarded):
    code, pkg, requests = onboarded
    assert code == 0
    mtp = _item(pkg, "num_mtp_layers")
    assert mtp["needs"] == "llm" and mtp["explanation"]["status"] == "accepted"
    assert mtp["explanation"]["proposal"]["op"] == "none"
    tiers = mtp["explanation"]["evidence"]["tiers"]
    assert sorted(tiers) == ["0", "1"] and all(a == b for a, b in (t.split("/") for t in tiers.values()))
    # the prompt carries what transformers' config says about the key, and the spec's fields by path
    first = requests[0]["messages"][0]["content"]
    assert "reads 'num_mtp_layers' as 'num_nextn_predict_layers'" in first and "`ffn.top_k` = 2" in first


def test_a_wrong_explanation_is_refused_with_the_failing_metric(onboarded):
    _, pkg, _ = onboarded
    explanation = _item(pkg, "ep_size")["explanation"]
    assert explanation["status"] == "refused" and explanation["proposal"]["parameter"] == "ffn.top_k"
    failure = explanation["failures"][0]
    assert failure["check"].startswith("tier1:") and failure["metric"] == "rel_rms"
    assert failure["value"] > failure["tolerance"]
    spec = json.loads((pkg / "spec.json").read_text())
    assert [layer["ffn"]["top_k"] for layer in spec["layers"] if layer["ffn"]["kind"] == "moe"] == [2]
    recorded = json.loads((pkg / "agents" / "explanations.json").read_text())
    assert [(e["item"], e["status"]) for e in recorded] == [("num_mtp_layers", "accepted"), ("ep_size", "refused")]
    review = (pkg / "PR.md").read_text()
    assert "- `ep_size` (config.json:ep_size), needs llm: refused as moe_experts `ffn.top_k`" in review
    assert "- `num_mtp_layers` (config.json:num_mtp_layers), needs llm: accepted as none" in review


def test_without_an_llm_the_report_says_who_can_explain_each_item(release):
    manifest = read_manifest(release)
    report = analyze(recognize(manifest), manifest)
    weights_item = Unrecognized(source="weights:model.layers.N.mlp.extra.weight", item="model.layers.N.mlp.extra.weight")
    report = report.model_copy(update=dict(unrecognized=[*report.unrecognized, weights_item]))
    explanations = explanations_for(report, manifest.config, has_llm=False)
    by_source = {e.source: e for e in explanations}
    assert by_source["config.json:ep_size"].needs == "llm" and by_source["config.json:ep_size"].status == "open"
    assert "no LLM endpoint" in by_source["config.json:ep_size"].failures[0].detail
    assert by_source["weights:model.layers.N.mlp.extra.weight"].needs == "person"
    annotated = final_report(report, [], explanations).unrecognized
    assert {u.item: u.needs for u in annotated} == {"num_mtp_layers": "llm", "ep_size": "llm", weights_item.item: "person"}


def test_a_proposal_is_applied_to_the_fields_it_names_or_refused(release):
    spec = recognize(read_manifest(release))
    applied = apply(spec, Proposal(op="moe_router", meaning="m", parameter="ffn.router.routed_scaling_factor"), 1.5)
    assert [layer.ffn.router.routed_scaling_factor for layer in applied.layers if layer.ffn.kind == "moe"] == [1.5]
    assert apply(spec, Proposal(op="none", meaning="m"), 1) is spec
    refusals = [apply(spec, Proposal(op="none", meaning="m", parameter="ffn.top_k"), 1),
                apply(spec, Proposal(op="attention_sinks", meaning="m", parameter="ffn.top_k"), 1),
                apply(spec, Proposal(op="moe_router", meaning="m", parameter="ffn.router.nonesuch"), 1),
                apply(spec, Proposal(op="moe_router", meaning="m", parameter="ffn.top_k"), "many")]
    assert all(isinstance(f, Failure) and f.check == "proposal" for f in refusals)
