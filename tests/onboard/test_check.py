"""`onboard align PKG --check` against alignment/baseline.json: an op in PKG/ops/ that would replace a built-in is
refused in a real `onboard` process (exit 3, naming the file and the name: a package adds ops, it does not change
the runtime's); removed again, the check passes (a wrong generated op failing the check, naming the checks and
their numbers, is tests/agents/test_onboard.py's). The half-headroom rule on real Check values: a metric that
still passes but ate more than half of the room to its tolerance is a regression, noise is not."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import yaml

from onboard.align.regression import regressions
from onboard.align.report import AlignmentReport, Check, tier_result
from onboard.cli import main

# silu off by 1e-3 relative: far inside bf16's bars, far outside fp32's
WRONG_SILU = '''import torch

KIND = "activation"
NAME = "silu"


def op(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x) * 1.001
'''


@pytest.fixture
def pkg(onboarded_package, tmp_path):
    code, built = onboarded_package
    assert code == 0
    return shutil.copytree(built, tmp_path / "pkg")


def test_an_op_replacing_a_builtin_is_refused_and_its_removal_passes(pkg, capsys):
    assert main(["align", str(pkg), "--tiers", "0", "--check"]) == 0
    (pkg / "ops").mkdir()
    (pkg / "ops" / "activation_silu.py").write_text(WRONG_SILU)
    # listed in package.yaml as a pull request adding it would (an unlisted file is refused before it runs at all)
    package = yaml.safe_load((pkg / "package.yaml").read_text())
    package["generated_ops"] = [{"kind": "activation", "name": "silu", "file": "ops/activation_silu.py"}]
    (pkg / "package.yaml").write_text(yaml.safe_dump(package, sort_keys=False))
    for approved in (False, True):
        # unapproved it runs only in align's confined child, approved in the process: refused by name either way
        if approved:
            assert main(["approve", str(pkg)]) == 0
        broken = subprocess.run([sys.executable, "-m", "onboard.cli", "align", str(pkg), "--tiers", "0", "--check"],
                                capture_output=True, text=True, timeout=600)
        last = broken.stderr.strip().splitlines()[-1]
        assert broken.returncode == 3 and "Traceback" not in broken.stderr, broken.stderr[-2000:]
        assert last == (f"onboard: refused: {pkg}/ops/activation_silu.py declares NAME 'silu', a built-in activation: "
                        "a package may add ops, not replace the runtime's")
    shutil.rmtree(pkg / "ops")
    capsys.readouterr()
    assert main(["align", str(pkg), "--tiers", "0", "--check"]) == 0
    assert "regression" not in capsys.readouterr().err


def test_a_baseline_written_before_the_torch_form_had_its_word_still_compares(pkg, capsys):
    """Baselines written before named tier 0's torch-form checks <op>/fallback/...: read as <op>/torch_form/..., they
    compare with the checks run now (unread, every one of them would be "passed in the baseline, not run now")."""
    baseline = pkg / "alignment" / "baseline.json"
    text = baseline.read_text()
    assert '/torch_form/' in text and '/fallback/' not in text
    baseline.write_text(text.replace("/torch_form/", "/fallback/"))
    old = AlignmentReport.model_validate_json(baseline.read_text())
    assert [c.name for c in old.tiers[0].checks] == [c.name for c in AlignmentReport.model_validate_json(text).tiers[0].checks]
    capsys.readouterr()
    assert main(["align", str(pkg), "--tiers", "0", "--check"]) == 0
    assert "regression" not in capsys.readouterr().err


def _report(*checks: Check) -> AlignmentReport:
    return AlignmentReport(package="p", source="s", spec_hash="0" * 16, tiers=[tier_result(0, list(checks))],
                           passed=True)


def _check(name: str, value: float, tolerance: float = 1e-5, metric: str = "rel_rms", verdict: str = "pass") -> Check:
    return Check(tier=0, name=name, metric=metric, value=value, tolerance=tolerance, verdict=verdict)


def test_half_the_headroom_is_the_line():
    baseline = _report(_check("a", 1e-7), _check("b", 1e-7), _check("overlap", 1.0, 0.99, "selection_overlap"),
                       _check("flips", 0, 0, "routing_flips", "info"), _check("gone", 1e-7))
    now = _report(_check("a", 5.2e-6), _check("b", 4.8e-6), _check("overlap", 0.994, 0.99, "selection_overlap"),
                  _check("flips", 7, 0, "routing_flips", "info"))
    found = {r.name: r.detail for r in regressions(baseline, now)}
    assert sorted(found) == ["a", "gone", "overlap"]
    assert found["a"].startswith("rel_rms 1.000e-07 -> 5.200e-06 (tolerance 1.0e-05): 52% of the baseline's headroom")
    assert found["overlap"].startswith("selection_overlap 1.000e+00 -> 9.940e-01") and "60%" in found["overlap"]
    assert found["gone"] == "passed in the baseline, not run now"


def test_a_move_within_noise_of_the_bar_is_not_a_regression():
    # a bf16 check at 92% of its bar: half its headroom is 4% of the bar, within what another machine moves it
    baseline = _report(_check("near", 0.92e-2, 1e-2), _check("far", 0.92e-2, 1e-2))
    now = _report(_check("near", 0.965e-2, 1e-2), _check("far", 1.01e-2, 1e-2, verdict="fail"))
    found = {r.name: r.detail for r in regressions(baseline, now)}
    assert sorted(found) == ["far"] and found["far"].startswith("pass -> fail")


def test_only_the_tiers_run_now_are_compared():
    baseline = AlignmentReport(package="p", source="s", spec_hash="0" * 16, passed=True,
                               tiers=[tier_result(0, [_check("a", 1e-7)]), tier_result(1, [_check("b", 1e-7)])])
    assert regressions(baseline, _report(_check("a", 1e-7))) == []
