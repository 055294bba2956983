"""The `onboard` command as a user runs it: real subprocesses, exit codes, one-line errors."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def onboard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onboard.cli", *args], capture_output=True, text=True, timeout=300)


def test_example_model_then_inspect(tmp_path):
    out = tmp_path / "demo-model"
    made = onboard("example-model", "qwen3_next", "--out", str(out), "--shards", "3")
    assert made.returncode == 0, made.stderr
    assert (out / "model.safetensors.index.json").exists()
    assert len(list(out.glob("*.safetensors"))) >= 3
    shown = onboard("inspect", str(out))
    assert shown.returncode == 0, shown.stderr
    assert "gated_delta" in shown.stdout and "covered" in shown.stdout
    md = onboard("inspect", str(out), "--markdown")
    assert md.stdout.startswith("# Gap report: Qwen3NextForCausalLM")


def _assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.stdout == ""


def test_unknown_family_is_bad_input(tmp_path):
    _assert_one_line_error(onboard("example-model", "llama_moe_9000", "--out", str(tmp_path / "x")), "FAMILY")
    assert not (tmp_path / "x").exists()


def test_tensors_contradicting_the_config(example_release, tmp_path):
    release = tmp_path / "release"
    shutil.copytree(example_release("qwen3_moe"), release)
    config = json.loads((release / "config.json").read_text())
    config["moe_intermediate_size"] = 48
    (release / "config.json").write_text(json.dumps(config))
    _assert_one_line_error(onboard("inspect", str(release), "--json"), "experts.0", "contradicts config.json")


def test_missing_experts_are_a_gap_not_a_crash(index_only_gap_release):
    """Index only (planning before download): an expert absent from the index is a gap, exit 3."""
    result = onboard("inspect", str(index_only_gap_release), "--json")
    assert result.returncode == 3, result.stderr
    report = json.loads(result.stdout)
    assert report["summary"]["gaps_remain"] and not report["weights"]["shapes_checked"]
    assert sorted(report["weights"]["missing"])[0] == "model.layers.0.block_sparse_moe.experts.3.w1.weight"


@pytest.mark.parametrize("args", [["inspect", "/nonexistent/model"], ["inspect", "."]], ids=["no-folder", "no-config"])
def test_missing_release(args):
    result = onboard(*args)
    _assert_one_line_error(result, "config.json")


def test_new_model_is_atomic_and_refuses_to_overwrite(example_release, tmp_path):
    bad = tmp_path / "bad-release"
    shutil.copytree(example_release("olmoe"), bad)
    config = json.loads((bad / "config.json").read_text())
    config["hidden_size"] = -64
    (bad / "config.json").write_text(json.dumps(config))
    _assert_one_line_error(onboard("new-model", str(bad), "--out", str(tmp_path / "pkg")), "hidden_size")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad-release"]  # no package, no partial folder

    made = onboard("new-model", str(example_release("olmoe")), "--out", str(tmp_path / "pkg"))
    assert made.returncode == 0, made.stderr
    assert {"package.yaml", "spec.json", "weight_map.json", "gap_report.json", "gap_report.md", "alignment"} <= {
        p.name for p in (tmp_path / "pkg").iterdir()}
    # an example-model family passes with registry ops only: no demotion ran
    assert json.loads((tmp_path / "pkg" / "agents" / "demotions.json").read_text()) == []
    _assert_one_line_error(onboard("new-model", str(example_release("olmoe")), "--out", str(tmp_path / "pkg")), "exists")


def test_align_a_prefix_of_a_deeper_release(tmp_path):
    """A 6-layer DeepSeek-V3 aligned on its first 2 layers (dense + MoE): both sides truncated alike."""
    release, pkg = tmp_path / "ds6", tmp_path / "pkg"
    assert onboard("example-model", "deepseek_v3", "--out", str(release), "--layers", "6").returncode == 0
    assert onboard("new-model", str(release), "--out", str(pkg)).returncode == 0
    result = onboard("align", str(pkg), "--tiers", "1,2", "--max-layers", "2")
    assert result.returncode == 0, result.stderr
    assert "aligning the first 2 of 6 layers" in result.stderr
    assert result.stdout.startswith("tier 1: pass") and "tier 2: pass" in result.stdout
    report = json.loads((pkg / "alignment" / "report.json").read_text())
    assert {c["layer"] for t in report["tiers"] for c in t["checks"] if c["layer"] is not None} <= {0, 1}


@pytest.mark.parametrize("args, needle", [(["align", "."], "package.yaml"), (["align", ".", "--tiers", "0,5"], "--tiers")],
                         ids=["not-a-package", "unknown-tier"])
def test_align_bad_input(args, needle):
    _assert_one_line_error(onboard(*args), needle)


def test_every_command_module_imports_first_in_a_fresh_interpreter():
    """Each command's module imported first thing, as `onboard CMD` does (an import cycle shows only so)."""
    for module in ("onboard.package.export", "onboard.commands.train", "onboard.package.writer", "onboard.plan.search", "onboard.align"):
        result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (module, result.stderr[-2000:])
