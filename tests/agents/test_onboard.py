"""End to end: a known family whose config asks for an activation the registry lacks (relu2), onboarded by
`new-model` through the graph. Without an LLM: exit 3 and a gap report naming the op. With the scripted
LLM server: a wrong candidate refused with its metric in the repair prompt, the fixed one generated,
tiers 0-2 green, and a few training steps through the generated op. A real `new-model` process SIGKILLed
mid-run resumes without re-running finished nodes and writes the same package."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from onboard import cli
from tests.agents.llm_server import answer

REPO = Path(__file__).resolve().parents[2]


def _gap(pkg: Path, op: str) -> dict:
    return next(o for o in json.loads((pkg / "gap_report.json").read_text())["ops"] if o["op"] == op)


def test_without_an_llm_the_op_is_a_gap_needing_one(relu2_release, tmp_path):
    pkg = tmp_path / "pkg"
    assert cli.main(["new-model", str(relu2_release), "--out", str(pkg)]) == 3
    gap = _gap(pkg, "moe_experts")
    assert gap["status"] == "missing" and gap["needs"] == "llm" and "relu2" in gap["detail"]
    assert "no LLM endpoint" in gap["evidence"]["failures"][0]["detail"]
    assert not (pkg / "ops").exists() and not (pkg / "alignment" / "report.json").exists()


def test_a_router_scoring_the_models_own_router_ignores_is_refused_at_tier_1(example_release, llm_server, tmp_path):
    """DeepSeek-V3 asking for sqrt(softplus) scoring: the runtime's router slot takes the generated scoring and the
    candidate matches transformers' ACT2FN["sqrtsoftplus"] (what DeepSeek-V4's router calls), but transformers'
    DeepseekV3TopkRouter scores with sigmoid whatever the config says, so tier 1 (the layer vs the model's own
    module) refuses it: no transformers family this runtime covers reads `scoring_func`, so no router scoring
    can be onboarded to exit 0 here."""
    release = tmp_path / "release"
    shutil.copytree(example_release("deepseek_v3"), release)
    config = json.loads((release / "config.json").read_text())
    (release / "config.json").write_text(json.dumps({**config, "scoring_func": "sqrtsoftplus"}))
    llm_server.script({"content": json.dumps({"template": "router_scoring", "expression": "torch.sqrt(F.softplus(logits_TE))",
                                              "constants": [], "code": None, "rationale": "scripted"})})
    pkg = tmp_path / "pkg"
    assert cli.main(["new-model", str(release), "--out", str(pkg), "--llm-url", llm_server.url, "--llm-model", "m",
                     "--max-attempts", "1"]) == 3
    prompt = llm_server.requests[0]["messages"][0]["content"]
    assert "class SqrtSoftplusActivation" in prompt and "class DeepseekV3TopkRouter" in prompt
    gap = _gap(pkg, "moe_router")
    assert gap["status"] == "missing" and gap["needs"] == "llm" and "sqrtsoftplus" in gap["detail"]
    failure = gap["evidence"]["failures"][0]
    assert failure["check"].startswith("tier1:") and failure["value"] > failure["tolerance"]


@pytest.fixture(scope="module")
def onboarded(relu2_release, tmp_path_factory):
    """The relu2 release onboarded through the scripted LLM: a wrong answer (plain relu), then the right one."""
    from tests.agents.llm_server import ScriptedLLM

    server = ScriptedLLM()
    server.script(answer("torch.relu(x)"), answer("torch.relu(x) ** 2"))
    pkg = tmp_path_factory.mktemp("onboarded") / "pkg"
    code = cli.main(["new-model", str(relu2_release), "--out", str(pkg), "--llm-url", server.url,
                     "--llm-model", "scripted"])
    server.close()
    return code, pkg, server.requests


def test_the_wrong_candidate_is_refused_with_its_metric_and_the_fixed_one_lands(onboarded):
    code, pkg, requests = onboarded
    assert code == 0
    first, repair = (r["messages"][0]["content"] for r in requests)
    assert "class ReLUSquaredActivation" in first  # the model's own code for the op
    assert "rejected" in repair and "forward (float32): rel_rms" in repair
    assert (pkg / "ops" / "activation_relu2.py").read_text().rstrip().endswith("return torch.relu(x) ** 2")
    gap = _gap(pkg, "moe_experts")
    assert gap["status"] == "generated" and gap["evidence"]["attempts"] == 2
    assert gap["evidence"]["seeds"] == 5 and gap["evidence"]["worst"]["out/float32"] < 1e-6
    tiers = gap["evidence"]["tiers"]
    assert sorted(tiers) == ["0", "1"] and all(passed == total for passed, total in (t.split("/") for t in tiers.values()))
    package = yaml.safe_load((pkg / "package.yaml").read_text())
    assert package["generated_ops"][0]["name"] == "relu2" and package["status"] == "trainable"
    report = json.loads((pkg / "alignment" / "report.json").read_text())
    assert report["passed"] and [t["tier"] for t in report["tiers"]] == [0, 1, 2]
    assert len((pkg / "agents" / "llm.jsonl").read_text().splitlines()) == 2


def test_pr_md_shows_the_generated_op_its_evidence_and_its_diff(onboarded):
    _, pkg, _ = onboarded
    text = (pkg / "PR.md").read_text()
    section = text[text.index("### activation `relu2` (`ops/activation_relu2.py`)"):text.index("## Alignment")]
    assert "5 seeds x float32, bfloat16" in section and "2 attempt(s)" in section and "0: " in section
    assert "the closest registry op, `swiglu_mlp` (its torch form `runtime.ops.mlp.torch_form:swiglu_mlp`" in section
    diff = section[section.index("```diff\n"):]
    assert "--- runtime.ops.mlp.torch_form:swiglu_mlp\n+++ ops/activation_relu2.py\n" in diff
    assert "+    return torch.relu(x) ** 2\n" in diff and "-def swiglu_mlp(\n" in diff


def test_the_generated_op_unit_test_passes(onboarded):
    _, pkg, _ = onboarded
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(pkg / "ops")],
                            capture_output=True, text=True, timeout=300, cwd=pkg)
    assert result.returncode == 0, result.stdout[-2000:]


def test_training_steps_run_through_the_generated_op(onboarded):
    from onboard.align.reference import load_runtime
    from onboard.package.approved_ops import approved_hashes
    from onboard.package.reader import read_package
    from runtime.model.decoder import causal_lm_loss
    from runtime.package_ops import load_package_ops

    _, pkg, _ = onboarded
    # new-model approved the op it generated (in this session's store)
    assert load_package_ops(pkg, approved_hashes()) == ["activation:relu2"]
    inputs = read_package(pkg)
    model = load_runtime(inputs.spec, inputs.weight_map, inputs.source, torch.float32).train()
    ids = torch.randint(0, inputs.spec["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = causal_lm_loss(model(ids), ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and losses[-1] < losses[0]


def test_onboard_train_loads_the_generated_op(onboarded, tmp_path):
    """A real `onboard train` process on the package: it registers PKG/ops/ itself (relu2 is in no runtime table)."""
    _, pkg, _ = onboarded
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"The mill {i} stands by the river and the stone bridge."}) + "\n"
                            for i in range(8)))
    result = subprocess.run([sys.executable, "-m", "onboard.cli", "train", str(pkg), "--data", str(data), "--steps", "2",
                             "--seq-len", "16", "--out", str(tmp_path / "run"), "--no-progress"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 2 steps" in result.stdout


def test_an_unapproved_edit_of_the_generated_op_is_aligned_confined_and_fails_the_check(onboarded, tmp_path):
    """A pull request changing the generated op (relu2 off by 1e-3 relative): nobody approved the new bytes, so
    `align --check` (what the CI workflow runs) aligns the package in the confined child; its verdict fails the
    check against the baseline new-model wrote, naming the checks and their numbers."""
    _, built, _ = onboarded
    pkg = shutil.copytree(built, tmp_path / "pkg")
    op = pkg / "ops" / "activation_relu2.py"
    op.write_text(op.read_text().replace("return torch.relu(x) ** 2", "return torch.relu(x) ** 2 * 1.001"))
    broken = subprocess.run([sys.executable, "-m", "onboard.cli", "align", str(pkg), "--tiers", "0", "--check"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert broken.returncode == 3, broken.stderr[-3000:]
    assert f"{op} is not approved: aligning in a confined process" in broken.stderr
    lines = [line for line in broken.stderr.splitlines() if line.startswith("regression vs alignment/baseline.json: ")]
    assert any("moe_experts" in line and "pass -> fail, rel_rms " in line for line in lines), broken.stderr[-3000:]


def test_onboard_train_stops_at_a_generated_op_right_only_in_the_sandbox(onboarded, relu2_release, tmp_path):
    """The op edited to be right only where HOME is the work dir (the sandbox, where it was validated) and plain
    relu elsewhere: `onboard train` spot-checks it against the model's own relu2 on the first step's real inputs
    and stops with exit 3 naming the op, before any step is taken."""
    _, pkg, _ = onboarded
    tampered = tmp_path / "pkg"
    shutil.copytree(pkg, tampered)
    op_file = tampered / "ops" / "activation_relu2.py"
    sandboxed = "torch.serialization.os.environ.get('HOME') == torch.serialization.os.getcwd()"
    op_file.write_text(op_file.read_text().replace(
        "return torch.relu(x) ** 2", f"return torch.relu(x) ** 2 if {sandboxed} else torch.relu(x)"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # the user approves the edited file (as after a review that missed it): the spot check is what stops it
    approved = subprocess.run([sys.executable, "-m", "onboard.cli", "approve", str(tampered)], capture_output=True,
                              text=True, timeout=120, env=env)
    assert approved.returncode == 0, approved.stderr
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"The mill {i} stands by the river."}) + "\n" for i in range(8)))
    result = subprocess.run([sys.executable, "-m", "onboard.cli", "train", str(tampered), "--data", str(data),
                             "--steps", "2", "--seq-len", "16", "--out", str(tmp_path / "run"), "--no-progress",
                             "--model-dir", str(relu2_release)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 3, result.stderr[-3000:]
    assert "generated op activation:relu2 disagrees with its reference" in result.stderr
    assert "Traceback" not in result.stderr and "trained" not in result.stdout


def test_a_killed_run_resumes_without_redoing_finished_nodes(relu2_release, onboarded, llm_server, tmp_path):
    pkg = tmp_path / "pkg"
    argv = [sys.executable, "-m", "onboard.cli", "new-model", str(relu2_release), "--out", str(pkg),
            "--llm-url", llm_server.url, "--llm-model", "scripted"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    llm_server.script(answer("torch.relu(x) ** 2"), answer("torch.relu(x) ** 2"))
    first = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    # SIGKILL while the generate node waits for its answer
    llm_server.on_request = lambda body: first.kill() if len(llm_server.requests) == 1 else None
    first.wait(timeout=300)
    assert first.returncode == -9 and "node analyze: done" in first.stderr.read()
    resumed = subprocess.run(argv + ["--resume"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "node analyze: done" not in resumed.stderr and "node generate: done" in resumed.stderr
    _, reference_pkg, _ = onboarded
    for name in ("spec.json", "weight_map.json", "ops/activation_relu2.py"):
        assert (pkg / name).read_text() == (reference_pkg / name).read_text(), name
    assert _gap(pkg, "moe_experts")["status"] == "generated"
