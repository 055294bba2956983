"""`onboard align` checks its package before running: real packages from example releases, each broken
by the test in one way; every break is exit 2 with one line naming the file and the key."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from onboard.cli import main


@pytest.fixture
def pkg(example_package, tmp_path):
    """A fresh copy of the mixtral package (no alignment results yet), safe to break."""
    copy = tmp_path / "pkg"
    shutil.copytree(example_package("mixtral"), copy)
    shutil.rmtree(copy / "alignment")
    (copy / "alignment").mkdir()
    return copy


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _edit_yaml(path, edit):
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data))


def _drop_layers(spec):
    spec["num_layers"] = 100


def _retype_width(spec):
    spec["layers"][1]["attention"]["num_heads"] = "four"


def _bad_expert(weight_map):
    next(iter(weight_map.values()))["expert"] = -3


BREAKS = {
    "yaml-missing": (lambda p: (p / "package.yaml").unlink(), ["package.yaml", "missing"]),
    "yaml-corrupt": (lambda p: (p / "package.yaml").write_text("source: [unclosed\n"), ["package.yaml: not valid YAML at line 2"]),
    "yaml-no-spec-hash": (lambda p: _edit_yaml(p / "package.yaml", lambda d: d.pop("spec_hash")), ["package.yaml: spec_hash"]),
    "yaml-not-a-mapping": (lambda p: (p / "package.yaml").write_text("- a list\n"), ["package.yaml", "mapping"]),
    "spec-missing": (lambda p: (p / "spec.json").unlink(), ["spec.json", "missing"]),
    "spec-truncated": (lambda p: (p / "spec.json").write_text((p / "spec.json").read_text()[:200]), ["spec.json", "not valid JSON"]),
    "spec-wrong-type": (lambda p: _edit_json(p / "spec.json", _retype_width), ["spec.json: layers.1.attention", "num_heads"]),
    "spec-fewer-layers": (lambda p: _edit_json(p / "spec.json", _drop_layers), ["spec.json: layers", "lists 2 layers", "100"]),
    "spec-edited": (lambda p: _edit_json(p / "spec.json", lambda s: s.update(vocab_size=512)), ["spec.json: hashes to", "package.yaml spec_hash"]),
    "weight-map-missing": (lambda p: (p / "weight_map.json").unlink(), ["weight_map.json", "missing"]),
    "weight-map-bad-entry": (lambda p: _edit_json(p / "weight_map.json", _bad_expert),
                             ["weight_map.json: model.embed_tokens.weight.expert"]),
    "weight-map-empty": (lambda p: (p / "weight_map.json").write_text("{}"), ["weight_map.json", "at least 1 item"]),
    "model-folder-gone": (lambda p: _edit_yaml(p / "package.yaml", lambda d: d["source"].update(path="/nonexistent/release",
                                                                                       absolute="/nonexistent/too")),
                          ["package.yaml: source.path", "--model-dir"]),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_a_broken_package_is_one_line_exit_2(name, pkg, capsys):
    breaks, needles = BREAKS[name]
    breaks(pkg)
    assert main(["align", str(pkg), "--tiers", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    assert not (pkg / "alignment" / "report.json").exists()  # refused before any tier ran


def test_a_changed_release_is_refused(pkg, example_release, tmp_path, capsys):
    release = tmp_path / "release"
    shutil.copytree(example_release("mixtral"), release)
    _edit_json(release / "config.json", lambda c: c.update(rms_norm_eps=1e-5))
    assert main(["align", str(pkg), "--model-dir", str(release)]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "source.config_sha256" in err, err


def test_a_weight_map_that_does_not_fit_the_release(pkg, capsys):
    """Schema-valid, but one tensor lands nowhere the runtime has: refused before any tier, against the map
    new-model derives from the release."""
    _edit_json(pkg / "weight_map.json", lambda m: m["model.norm.weight"].update(target="norm.weigh"))
    assert main(["align", str(pkg), "--tiers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"onboard: error: {pkg / 'weight_map.json'}: model.norm.weight.target: 'norm.weigh' where the "
                   "weight map `onboard new-model` derives from the release has 'norm.weight': the file changed "
                   "after `onboard new-model`, or this onboard derives another (run `onboard new-model` again, or "
                   "restore the file)"]
    assert not any("Traceback" in line for line in err)


def test_check_without_a_baseline_is_refused_and_writes_none(pkg, capsys):
    assert main(["align", str(pkg), "--tiers", "0", "--check"]) == 2
    assert "baseline.json: missing" in capsys.readouterr().err
    assert list((pkg / "alignment").iterdir()) == []


def test_a_corrupt_baseline_is_refused(pkg, capsys):
    (pkg / "alignment" / "baseline.json").write_text('{"package": 1}')
    assert main(["align", str(pkg), "--check"]) == 2
    assert "baseline.json: not a valid alignment report" in capsys.readouterr().err


def test_a_path_that_does_not_exist(tmp_path):
    result = subprocess.run([sys.executable, "-m", "onboard.cli", "align", str(tmp_path / "nowhere")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().endswith("nowhere: does not exist"), result.stderr
    assert "Traceback" not in result.stderr


def test_model_dir_points_a_moved_package_at_its_release(pkg, example_release, tmp_path):
    """The package on another machine: the recorded release path is gone, --model-dir says where it is now.
    Tier 2 loads both models from there; the summary counts each verdict on its own, and stderr (a pipe
    here) gets one plain progress line per check group."""
    moved = tmp_path / "elsewhere" / "mixtral"
    shutil.copytree(example_release("mixtral"), moved)
    _edit_yaml(pkg / "package.yaml", lambda d: d["source"].update(path=str(tmp_path / "was-here")))
    result = subprocess.run([sys.executable, "-m", "onboard.cli", "align", str(pkg), "--tiers", "2", "--model-dir", str(moved)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads((pkg / "alignment" / "report.json").read_text())
    # recorded relative to the package (a committed report names no machine's paths)
    assert (pkg / report["source"]).resolve() == moved.resolve() and report["passed"]
    info = sum(c["verdict"] == "info" for c in report["tiers"][0]["checks"])
    assert info > 0 and result.stdout.startswith("tier 2: pass (") and f"{info} info" in result.stdout
    assert "tier 2 [1/3]: float32 logits and loss" in result.stderr.splitlines()
