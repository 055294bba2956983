"""The reports on the Kimi K3-shaped example release (a custom-code release of a design the runtime does not
compute yet): honest and precise, and the four renderings (gap report, terminal summary, plan.yaml, PR.md) agree.

tests/data/kimi_k3/gap_report.md is the gap report on the example before any K3 op existed, kept as a fixture:
what a new user saw then, naming every new component."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from onboard.gap.render import print_gap_report
from onboard.gap.report import GapReport

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "kimi_k3"
# K3's new components, as a reader searches the report for them
COMPONENTS = {"SiTU": r"\bsitu\b", "latent MoE": r"latent MoE", "attention residuals": r"attention residuals",
              "MLA output gate": r"MLA with a sigmoid output gate", "KDA safe gate": r"KDA with a lower-bounded"}


@pytest.fixture(scope="module")
def k3_package(kimi_k3_release, tmp_path_factory, onboard_cli):
    """`onboard new-model` on the example, as a user runs it: (package, exit code)."""
    pkg = tmp_path_factory.mktemp("k3pkg") / "pkg"
    done = onboard_cli("new-model", str(kimi_k3_release("bf16")), "--out", str(pkg))
    assert "Traceback" not in done.err, done.err[-2000:]
    return pkg, done.code


def _summary(report: GapReport) -> str:
    console = Console(file=io.StringIO(), width=400, highlight=False)
    print_gap_report(report, console)
    return console.file.getvalue()


@pytest.mark.parametrize("weights", ["bf16", "mxfp4"])
def test_the_fixture_names_k3s_new_components(weights):
    text = (FIXTURES / ("gap_report.md" if weights == "bf16" else "gap_report_mxfp4.md")).read_text()
    for name, pattern in COMPONENTS.items():
        assert re.search(pattern, text, re.IGNORECASE), name
    assert ("mxfp4-pack-quantized" in text) == (weights == "mxfp4")


def test_the_mxfp4_variant_counts_values_not_bytes(kimi_k3_release, onboard_cli):
    """The packed experts hold as many parameters as the bf16 variant's (two per byte; scales are none), and the
    stored format is named with the tensors holding its codes and scales."""
    reports = {}
    for weights in ("bf16", "mxfp4"):
        done = onboard_cli("inspect", str(kimi_k3_release(weights)), "--json")
        assert done.code == 3, done.err[-2000:]
        reports[weights] = json.loads(done.out)
    for key in ("params_total", "manifest_params", "num_experts", "moe_layers"):
        assert reports["bf16"]["model"][key] == reports["mxfp4"]["model"][key], key
    stored = [u for u in reports["mxfp4"]["unrecognized"] if u["source"] == "config.json:quantization_config"]
    assert len(stored) == 1 and "mxfp4-pack-quantized" in stored[0]["item"]
    assert "experts.N.w1.weight_packed" in stored[0]["detail"] and "experts.N.w1.weight_scale" in stored[0]["detail"]
    assert not any(u["source"] == "config.json:quantization_config" for u in reports["bf16"]["unrecognized"])


def test_new_model_is_an_honest_gap(k3_package):
    pkg, code = k3_package
    report = GapReport.model_validate_json((pkg / "gap_report.json").read_text())
    assert code == 3 and report.summary["gaps_remain"] and report.summary["ops"]["missing"] == 1
    text = (pkg / "gap_report.md").read_text()
    for name, pattern in COMPONENTS.items():
        assert re.search(pattern, text, re.IGNORECASE), name
    # the activation named with its parameters; generation settings apart from the architecture keys
    assert "activation_situ_beta=4.0" in text and "activation_situ_linear_beta=25.0" in text
    not_recognized = text.split("## Not recognized")[1]
    assert not re.search(r"do_sample|temperature|top_p|\btop_k\b", not_recognized)
    assert {"text_config.do_sample", "text_config.top_k", "text_config.temperature"} <= set(report.model["generation_keys"])
    # the head under the text model's prefix is the head: nothing missing beside an unexpected language_model.lm_head
    assert report.weights.missing == [] and "language_model.lm_head.weight" not in report.weights.unexpected
    # every unexpected tensor is the attention residuals' model-level pseudo-query, named as such
    assert report.weights.unexpected == ["language_model.model.output_attn_res_norm.weight",
                                         "language_model.model.output_attn_res_proj.weight"]
    # the vision tower and projector: not counted as text tensors, and reported as not supported, with its depth
    assert report.weights.vision_tensors == 34 and report.model["vision"] is None
    assert "2 blocks" in report.model["vision_not_supported"] and "image inputs not supported" in text


def _counts_in(text: str) -> dict:
    found = {}
    for key, pattern in {"experts": r"(\d+) routed,? top-(\d+), (\d+) shared,? (\d+) MoE layers",
                         "attention": r"attention: (\d+) linear, (\d+) full"}.items():
        match = re.search(pattern, text)
        found[key] = match.groups() if match else None
    return found


def test_the_four_renderings_agree(k3_package):
    pkg, _ = k3_package
    report = GapReport.model_validate_json((pkg / "gap_report.json").read_text())
    m = report.model
    assert (m["num_experts"], m["top_k"], m["num_shared_experts"], m["moe_layers"]) == (8, 2, 2, 4)
    assert m["attention_kinds"] == {"linear": 3, "sparse": 0, "full": 2, "sliding": 0}
    expected = {"experts": ("8", "2", "2", "4"), "attention": ("3", "2")}
    for name, text in {"gap_report.md": (pkg / "gap_report.md").read_text(), "summary": _summary(report),
                       "PR.md": (pkg / "PR.md").read_text()}.items():
        assert _counts_in(text) == expected, name
        assert "not supported" in text, name
    pr = (pkg / "PR.md").read_text()
    # own layers nothing can run: listed, never "None: every component runs the runtime's registry ops"
    assert "every component runs the runtime's registry ops" not in pr and "`own:decoder_layer` in 5 layer(s)" in pr
    assert "generation settings" in pr and "do_sample" in pr
    plan = yaml.safe_load((pkg / "plan.yaml").read_text())
    reasons = [a["reason"] for a in plan["alternatives"] if a["mesh"].endswith(("ep2", "ep4", "ep8"))]
    assert reasons and all("4 MoE layers (8 routed experts each) run as own modules" in r for r in reasons)
    assert not any("has none" in r for r in reasons)
    gap_json = json.loads((pkg / "gap_report.json").read_text())
    assert gap_json["model"]["params_total"] == report.model["params_total"]
    assert f"{report.model['params_total']:,}" in pr
