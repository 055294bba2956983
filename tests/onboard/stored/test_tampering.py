"""A tampered stored-format release is never a silent pass (issue 50): `onboard new-model` on a tampered copy of an
example release (the CLI's main, in this process).

- a scale tensor removed, transposed, or a block size in quantization_config the scale grids disagree with: the
  files contradict themselves, exit 2 with one line naming the codes and the scale tensor;
- a scale tensor replaced by ones: a valid file, read alike by our model and the reference (tiers 0-2 compare the
  same bytes both ways), caught by tier 1's gain check on the weight it decodes to (onboard/align/tiers/
  stored_gain.py): exit 3, and the alignment report names the weight and the scale tensor.
A transposed scale grid that is square (a [2, 2] grid) fits its tensor either way: no reading of the files can tell
it from a release quantized so, and nothing here claims to.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from onboard.align.tiers.stored_gain import gain_checks
from onboard.release.manifest import read_manifest
from tests.onboard.conftest import run_onboard
from tests.onboard.formats.stored_release import edit_config, edit_tensors, fp8_release, mxfp4_release

KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # 40 rows: 3 scale rows of 16, the last one partial
Q_B = "model.layers.0.self_attn.q_b_proj.weight"  # [96, 32]: a [6, 2] scale grid


def new_model(release: Path, out: Path):
    return run_onboard("new-model", release, "--out", out)


def _one_line_exit_2(result, *names: str) -> None:
    """Exit 2 with one error line naming every name (the progress lines before it go to stderr too)."""
    assert result.code == 2, (result.code, result.err[-2000:])
    errors = [line for line in result.err.strip().splitlines() if line.startswith("onboard: error:")]
    assert len(errors) == 1 and "Traceback" not in result.err, result.err[-2000:]
    for name in names:
        assert name in errors[0], errors[0]


@pytest.fixture(scope="module")
def fp8_deepseek(example_release, tmp_path_factory):
    return fp8_release(example_release("deepseek_v3"), tmp_path_factory.mktemp("fp8") / "deepseek_v3")


def _copy(release: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(release, tmp_path / "tampered"))


def test_a_removed_scale_is_exit_2_naming_both_tensors(fp8_deepseek, tmp_path):
    release = _copy(fp8_deepseek, tmp_path)
    edit_tensors(release, lambda t: t.pop(KV_A + "_scale_inv"))
    _one_line_exit_2(new_model(release, tmp_path / "pkg"), KV_A, KV_A + "_scale_inv")
    assert not (tmp_path / "pkg").exists()


def test_a_transposed_scale_grid_is_exit_2_naming_both_tensors(fp8_deepseek, tmp_path):
    release = _copy(fp8_deepseek, tmp_path)
    edit_tensors(release, lambda t: t.update({Q_B + "_scale_inv": t[Q_B + "_scale_inv"].T.contiguous()}))
    _one_line_exit_2(new_model(release, tmp_path / "pkg"), Q_B, Q_B + "_scale_inv")


def test_a_block_size_the_scale_grids_disagree_with_is_exit_2(fp8_deepseek, tmp_path):
    release = _copy(fp8_deepseek, tmp_path)
    edit_config(release, lambda c: c["quantization_config"].update(weight_block_size=[32, 32]))
    _one_line_exit_2(new_model(release, tmp_path / "pkg"), "_scale_inv", "weight_block_size", "32x32")


def _report(pkg: Path) -> dict:
    return json.loads((pkg / "alignment" / "report.json").read_text())


def _failed_gain_check(pkg: Path) -> dict:
    tier1 = next(t for t in _report(pkg)["tiers"] if t["tier"] == 1)
    failed = [c for c in tier1["checks"] if c["verdict"] == "fail"]
    assert failed and all(c["metric"] == "log10_gain" for c in failed), failed
    return failed


def test_a_scale_replaced_by_ones_fails_tier_1_naming_the_weight_and_its_scale(fp8_deepseek, tmp_path):
    """FP8: under a scale of 1 the weight is its codes (up to 448)."""
    release = _copy(fp8_deepseek, tmp_path)
    scale = KV_A + "_scale_inv"
    edit_tensors(release, lambda t: t.update({scale: torch.ones_like(t[scale])}))
    result = new_model(release, tmp_path / "pkg")
    assert result.code == 3, (result.code, result.err[-2000:])
    assert "tier 1: FAIL" in result.err
    # no own-module rung: a wrong scale is no code to replace
    assert "fall back" not in result.err
    failed = _failed_gain_check(tmp_path / "pkg")
    assert [c["name"] for c in failed] == [f"stored/{KV_A}/gain"]
    assert failed[0]["scales"] == [scale] and failed[0]["value"] > 2
    assert f"`{scale}`" in (tmp_path / "pkg" / "PR.md").read_text()


def test_mxfp4_scales_replaced_by_ones_fail_the_gain_check(example_release, tmp_path):
    """MXFP4: the byte 1 scales every group by 2^(1 - 127); the check names the stacked experts' weight (the same check
    as above, without the pipeline around it)."""
    release = mxfp4_release(example_release("gpt_oss"), tmp_path / "release")
    weight, scale = "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.down_proj_scales"
    assert all(c.verdict == "pass" for c in gain_checks(read_manifest(release), None))
    edit_tensors(release, lambda t: t.update({scale: torch.ones_like(t[scale])}))
    failed = [c for c in gain_checks(read_manifest(release), None) if c.verdict == "fail"]
    assert [(c.name, c.scales) for c in failed] == [(f"stored/{weight}/gain", [scale])]
