"""Valid releases we do not understand are gaps (exit 3) naming what was not understood, never bad input;
what transformers knows runs through its own modules (status own), trainable, and aligns.

"acme_moe" releases are real tiny releases with model_type renamed, so transformers (the oracle)
does not know them: only our own recognition rules judge them, and they must fail into gaps.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from onboard.cli import main


def _inspect(release) -> tuple[int, dict | None, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["inspect", str(release), "--json"])
    return code, json.loads(out.getvalue()) if out.getvalue() else None, err.getvalue()


def _renamed(example_release, family: str, tmp_path, **changes) -> str:
    """A copy of the family's release as an unknown family, config keys changed (None removes a key)."""
    release = tmp_path / "acme"
    shutil.copytree(example_release(family), release)
    config = json.loads((release / "config.json").read_text())
    config["model_type"] = "acme_moe"
    for key, value in changes.items():
        config.pop(key, None) if value is None else config.__setitem__(key, value)
    (release / "config.json").write_text(json.dumps(config))
    return release


def _own(report: dict) -> dict[str, dict]:
    return {o["op"]: o for o in report["ops"] if o["op"].startswith("own:")}


def test_unknown_layer_type_is_a_gap_naming_it(example_release, tmp_path):
    release = _renamed(example_release, "qwen3_moe", tmp_path, layer_types=["hyper_attention", "full_attention"])
    code, report, _ = _inspect(release)
    assert code == 3
    assert _own(report)["own:attention"]["status"] == "missing" and _own(report)["own:attention"]["layers"] == [0]
    assert "hyper_attention" in _own(report)["own:attention"]["detail"]
    assert any(u["item"] == "layer_types" and "hyper_attention" in u["detail"] for u in report["unrecognized"])


def test_width_key_we_do_not_know_is_a_gap_naming_the_tensors(example_release, tmp_path):
    """The expert width under a key name we do not read: the expert tensors say it, the FFN is not understood."""
    width = json.loads((example_release("qwen3_moe") / "config.json").read_text())["moe_intermediate_size"]
    release = _renamed(example_release, "qwen3_moe", tmp_path, moe_intermediate_size=None, expert_width=width)
    code, report, _ = _inspect(release)
    assert code == 3
    ffn = _own(report)["own:ffn"]
    assert ffn["status"] == "missing" and ffn["layers"] == [0, 1] and "stored as" in ffn["detail"]
    assert any(u["item"] == "expert_width" for u in report["unrecognized"])


def test_zero_rope_width_is_a_gap_not_bad_input(example_release, tmp_path):
    """qk_rope_head_dim 0 (a MLA without rotary channels) breaks our rule that it is positive: a gap."""
    code, report, err = _inspect(_renamed(example_release, "deepseek_v3", tmp_path, qk_rope_head_dim=0))
    assert code == 3, err
    assert "qk_rope_head_dim" in _own(report)["own:attention"]["detail"]


def _with_extra_tensor(example_release, tmp_path, name: str) -> str:
    """qwen3_moe's release plus one tensor its transformers model does not read (random, so using it would show)."""
    release = tmp_path / "extra"
    shutil.copytree(example_release("qwen3_moe"), release)
    index = json.loads((release / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.0.mlp.gate.weight"]
    tensors = load_file(release / shard)
    tensors[name] = torch.randn(8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    save_file(tensors, release / shard, metadata={"format": "pt"})
    index["weight_map"][name] = shard
    (release / "model.safetensors.index.json").write_text(json.dumps(index))
    return release


def test_a_tensor_nobody_recognizes_keeps_its_component_out_of_covered(example_release, tmp_path):
    release = _with_extra_tensor(example_release, tmp_path, "model.layers.0.mlp.gate.e_score_correction_bias")
    code, report, _ = _inspect(release)
    ffn = _own(report)["own:ffn"]
    assert ffn["status"] == "own" and ffn["layers"] == [0] and "e_score_correction_bias" in ffn["detail"]
    experts = next(o for o in report["ops"] if o["op"] == "moe_experts")
    assert experts["status"] == "covered" and experts["layers"] == [1]
    assert code == 0  # the own module runs on day 0; new-model still has to pass alignment


def test_a_gap_report_written_before_own_had_its_word_still_reads(example_release, tmp_path):
    """gap_report.json files written before said `fallback` for status `own` (in ops[] and in the summary's counts):
    they read as own."""
    from onboard.gap.report import GapReport

    _, report, _ = _inspect(_with_extra_tensor(example_release, tmp_path, "model.layers.0.mlp.gate.e_score_correction_bias"))
    assert report["summary"]["ops"]["own"] == 1
    old = json.loads(json.dumps(report).replace('"status": "own"', '"status": "fallback"'))
    old["summary"]["ops"] = {("fallback" if status == "own" else status): n for status, n in old["summary"]["ops"].items()}
    assert _own(old)["own:ffn"]["status"] == "fallback" and "own" not in old["summary"]["ops"]
    assert GapReport.model_validate(old) == GapReport.model_validate(report)


def test_own_module_aligns_and_trains(example_release, tmp_path):
    """new-model: layer 0's FFN through transformers' own module, layer 1 through registry ops; tiers 0-2
    pass (exit 0); the own module's parameters get gradients from the loss like the rest."""
    from onboard.align.reference import load_runtime
    from onboard.package.reader import read_package
    from runtime.model.decoder import causal_lm_loss

    release = _with_extra_tensor(example_release, tmp_path, "model.layers.0.mlp.gate.e_score_correction_bias")
    pkg = tmp_path / "pkg"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["new-model", str(release), "--out", str(pkg)]) == 0
    report = json.loads((pkg / "alignment" / "report.json").read_text())
    assert report["passed"] and [t["tier"] for t in report["tiers"]] == [0, 1, 2]
    inputs = read_package(pkg)
    model = load_runtime(inputs.spec, inputs.weight_map, inputs.source, torch.float32).train()
    ids = torch.randint(0, inputs.spec["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    causal_lm_loss(model(ids), ids).backward()
    own = model.layers[0].ffn.module
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in own.parameters() if p.requires_grad)
    assert model.layers[1].ffn.experts.w_gate_up.grad is not None
