"""`onboard new-model` writes the whole package of DESIGN.md, for a trainable release (exit 0) and for one
with gaps (exit 3, status and reasons in package.yaml); PR.md carries what a reviewer needs; the package and
its release moved together to another tree still align and train, the release found relative to PKG."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from onboard.cli import main
from onboard.package.reader import read_package
from onboard.package.workflow import WORKFLOW, model_slug, workflow_yaml
from onboard.review.pr import cell

EVERY_PACKAGE_FILE = ["package.yaml", "spec.json", "gap_report.json", "gap_report.md", "plan.yaml", "lora.yaml",
                      "weight_map.json", "PR.md", ".github/workflows/alignment.yml", "agents/tasks.json"]
ALIGNED = ["alignment/report.json", "alignment/baseline.json", "alignment/tier0.json", "alignment/tier1.json",
           "alignment/tier2.json"]


def test_a_trainable_package_has_every_file(onboarded_package):
    code, pkg = onboarded_package
    assert code == 0
    for name in EVERY_PACKAGE_FILE + ALIGNED:
        assert (pkg / name).is_file(), name
    package = yaml.safe_load((pkg / "package.yaml").read_text())
    assert package["status"] == "trainable" and package["reasons"] == []
    # tier 4 when asked (--tiers 0,1,2,4): the plan's cluster, on paper
    report = json.loads((pkg / "alignment" / "report.json").read_text())
    assert [t["tier"] for t in report["tiers"]] == [0, 1, 2, 4] and report["passed"]
    assert (pkg / "alignment" / "tier4.json").is_file()
    # recorded relative to PKG, so the two can move together
    assert not Path(package["source"]["path"]).is_absolute()
    assert (pkg / package["source"]["path"]).resolve() == Path(package["source"]["absolute"])
    # the workflow test_workflow.py lints, for this release
    assert (pkg / WORKFLOW).read_text() == workflow_yaml(model_slug(Path(package["source"]["absolute"])))


def test_a_package_with_gaps_has_every_file_and_says_why(index_only_gap_release, onboard_cli, tmp_path):
    pkg = tmp_path / "pkg"
    result = onboard_cli("new-model", index_only_gap_release, "--out", pkg)
    assert result.code == 3, result.err
    for name in EVERY_PACKAGE_FILE:
        assert (pkg / name).is_file(), name
    assert not (pkg / "alignment" / "report.json").exists()  # gaps remain: alignment does not run
    package = yaml.safe_load((pkg / "package.yaml").read_text())
    assert package["status"] == "gaps" and any(r.startswith("weights: ") and "missing" in r for r in package["reasons"])
    text = (pkg / "PR.md").read_text()
    assert "**Status: gaps** (`onboard new-model` exit 3)" in text and "not run: gaps remain." in text


def test_pr_md_has_every_section_a_reviewer_needs(onboarded_package):
    _, pkg = onboarded_package
    text = (pkg / "PR.md").read_text()
    report = json.loads((pkg / "alignment" / "report.json").read_text())
    for heading in ("## Model", "## Gap report", "## Generated operators", "## Alignment", "## Parallel plan",
                    "## Own modules", "## Reviewer checklist"):
        assert heading in text, heading
    for op in json.loads((pkg / "gap_report.json").read_text())["ops"]:
        assert f"| {op['op']} | {op['covers']} | {op['status']} |" in text
    for tier in report["tiers"]:
        counts = {v: sum(c["verdict"] == v for c in tier["checks"]) for v in ("pass", "fail", "skip", "info")}
        assert f"| {tier['tier']} | pass | {counts['pass']} | 0 | {counts['skip']} | {counts['info']} | `" in text
    flips = [c for c in report["tiers"][2]["checks"] if c["metric"] == "routing_flips"]
    assert flips and all(f"- layer {c['layer']}: {int(c['value'])} of " in text for c in flips)
    for alternative in yaml.safe_load((pkg / "plan.yaml").read_text())["alternatives"]:
        assert f"| {alternative['mesh']} | {alternative['experts_per_rank']} |" in text
    assert text.count("- [ ] ") == 6


def test_release_strings_cannot_break_the_markdown():
    assert cell("a|b\n<script>`x`") == "a\\|b\\n&lt;script&gt;'x'"


def test_package_and_release_moved_together_align_and_train(onboarded_package, tmp_path):
    """Another machine: the same relative layout under another root, the original absolute path not used."""
    _, pkg = onboarded_package
    recorded = yaml.safe_load((pkg / "package.yaml").read_text())["source"]
    moved = tmp_path / "machine2" / "work" / "pkg"
    shutil.copytree(pkg, moved)
    shutil.copytree(recorded["absolute"], (moved / recorded["path"]).resolve())
    assert read_package(moved).source == (moved / recorded["path"]).resolve() != Path(recorded["absolute"])
    assert main(["align", str(moved), "--tiers", "1"]) == 0
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"The mill number {i} turns by the river."}) + "\n" for i in range(8)))
    run = tmp_path / "run"
    # --no-cuda-graph rides along: run.json records the TrainConfig the run trained with
    assert main(["train", str(moved), "--data", str(data), "--steps", "2", "--seq-len", "16", "--out", str(run),
                 "--no-progress", "--no-cuda-graph"]) == 0
    run_json = json.loads((run / "run.json").read_text())
    assert run_json["release"] == str((moved / recorded["path"]).resolve())
    assert run_json["train"]["cuda_graph"] is False
