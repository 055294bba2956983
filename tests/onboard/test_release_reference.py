"""A release that ships its own code is aligned against ITS code, run only in the sandbox (onboard/align/release_code.py).

Real releases: the qwen3_moe example with configuration and modeling files of its own named by `auto_map`, its
`model_type` kept. One copy's code is transformers' class unchanged (tiers 1-2 pass against it); another's router
scores with a sigmoid (renormalized top-k), a change our runtime, which recognizes a qwen3_moe, does not make:
tier 2 must fail against that code, where transformers' built-in class would have passed it. Each modeling file
writes a marker into the temporary folder of whatever process imports it: after align the marker is in the
sandbox's private work folder only, never in this process's temporary folder. Real bubblewrap throughout.
"""
from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from onboard.align import run_alignment
from onboard.align.release_code import ReferenceFailed, SandboxedReference, ships_code, whole_model_truth
from onboard.package.writer import write_package
from onboard.sandbox.run import Limits, available_mode

ROOT = Path(__file__).resolve().parents[2]
FAMILY = "qwen3_moe"
MARKER = f"onboard-release-marker-{uuid.uuid4().hex}"

pytestmark = pytest.mark.skipif(available_mode() != "bwrap", reason="the release's code runs only under bubblewrap")

CONFIGURATION = """from transformers import Qwen3MoeConfig


class AcmeConfig(Qwen3MoeConfig):
    model_type = "qwen3_moe"
"""
# each file writes its own marker, named after it
MARKER_LINES = (f"import pathlib, tempfile\n\n"
                f"pathlib.Path(tempfile.gettempdir(), {MARKER!r} + '-' + __name__.rsplit('.', 1)[-1]).write_text('')\n")
FILES = ("configuration_acme", "modeling_acme")
MODELING = """import torch
from torch.nn import functional as F
from transformers import Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from .configuration_acme import AcmeConfig


class SigmoidRouter(Qwen3MoeTopKRouter):
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        scores = torch.sigmoid(logits.float())
        top, indices = torch.topk(scores, self.top_k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        return logits, top.to(logits.dtype), indices


class AcmeForCausalLM(Qwen3MoeForCausalLM):
    config_class = AcmeConfig

    def __init__(self, config):
        super().__init__(config)
        if ROUTER == "sigmoid":
            for layer in self.model.layers:
                layer.mlp.gate = SigmoidRouter(config)
"""
AUTO_MAP = {"AutoConfig": "configuration_acme.AcmeConfig", "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}


def _with_code(release: Path, router: str, modeling_head: str = "") -> Path:
    (release / "configuration_acme.py").write_text(MARKER_LINES + CONFIGURATION)
    (release / "modeling_acme.py").write_text(MARKER_LINES + modeling_head + f"ROUTER = {router!r}\n" + MODELING)
    config = json.loads((release / "config.json").read_text())
    (release / "config.json").write_text(json.dumps({**config, "auto_map": AUTO_MAP}, indent=2))
    return release


@pytest.fixture(scope="module")
def code_package(example_release, tmp_path_factory):
    """router ("softmax": transformers' own, or "sigmoid": changed) -> (release, package), built once each."""
    cache = {}

    def make(router: str, modeling_head: str = ""):
        key = (router, modeling_head)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"code-{router}")
            release = _with_code(Path(shutil.copytree(example_release(FAMILY), root / "release")), router, modeling_head)
            cache[key] = release, write_package(release, root / "pkg")[0]
        return cache[key]

    return make


def _user_markers() -> list[Path]:
    return sorted(Path(tempfile.gettempdir()).glob(f"{MARKER}*"))


def _failed(report) -> list[str]:
    return [c.name for t in report.tiers for c in t.checks if c.verdict == "fail"]


def test_tiers_1_2_pass_against_the_release_code_run_confined(code_package):
    release, pkg = code_package("softmax")
    assert ships_code(release)
    report = run_alignment(pkg, [1, 2])
    assert report.passed, _failed(report)
    names = {c.name for t in report.tiers for c in t.checks}
    assert {"logits/float32", "logits/bfloat16", "loss/float32"} <= names
    assert any("/grad:" in n and "q_proj" in n for n in names) and any(n.endswith("/grad:input") for n in names)
    # nothing of the release's code was imported here
    assert not _user_markers()
    assert not any(name.startswith("transformers_modules") for name in sys.modules)


def test_the_marker_is_left_only_in_the_sandbox_work_folder(code_package, tmp_path):
    """The release's modules were imported, in the sandbox: their marker is in its private work folder."""
    release, _ = code_package("softmax")
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    truth, recorder, bf16 = whole_model_truth(release, 2, ids, SandboxedReference(release, 2, work_root=tmp_path))
    assert truth.shape[:2] == ids.shape and bf16.dtype == torch.float32 and recorder.input("layer", 1).shape[:2] == ids.shape
    assert sorted(m.name for m in tmp_path.glob(f"*/{MARKER}*")) == [f"{MARKER}-{f}" for f in FILES]
    assert not _user_markers()


def test_a_changed_router_fails_against_its_own_code(code_package):
    """model_type qwen3_moe, sigmoid router in its code: transformers' class would agree with our runtime, the
    release's code does not, and it is the reference."""
    _, pkg = code_package("sigmoid")
    report = run_alignment(pkg, [2])
    assert not report.passed
    assert "logits/float32" in _failed(report), _failed(report)
    assert not _user_markers()


def test_a_release_code_that_fails_is_a_failed_check_with_its_reason(code_package, env_with_path):
    """Its modeling file raises when imported: `align` exits 3 naming the error, no traceback."""
    _, pkg = code_package("softmax", "raise RuntimeError('the release refuses to load')\n")
    done = subprocess.run([sys.executable, "-m", "onboard.cli", "align", str(pkg), "--tiers", "1"], env=env_with_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 3 and "Traceback" not in done.stdout + done.stderr, done.stderr[-2000:]
    report = json.loads((pkg / "alignment" / "report.json").read_text())
    details = [c["detail"] for t in report["tiers"] for c in t["checks"] if c["verdict"] == "fail"]
    assert any("the release refuses to load" in d for d in details), details


def test_a_release_code_that_hangs_is_stopped(code_package):
    release, _ = code_package("softmax", "import time\ntime.sleep(3600)\n")
    reference = SandboxedReference(release, 2, limits=Limits(wall_s=20, memory_mib=8192, cpu_s=60, processes=256))
    with pytest.raises(ReferenceFailed, match="timed out"):
        whole_model_truth(release, 2, torch.zeros(1, 3, dtype=torch.long), reference)


@pytest.fixture
def env_with_path():
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_only_the_sandboxed_worker_trusts_release_code():
    """`trust_remote_code=True` is passed in one module, the worker the sandbox runs."""
    trusting = []
    for folder in ("onboard", "runtime", "agents", "bench", "reference_ops"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.keyword) and node.arg == "trust_remote_code" and \
                        not (isinstance(node.value, ast.Constant) and node.value.value is False):
                    trusting.append(str(path.relative_to(ROOT)))
    assert set(trusting) == {"onboard/align/release_worker.py"}, trusting


def test_the_gap_report_says_which_parts_need_trust(kimi_k3_release):
    """The K3-shaped release: its layers run only as its own code's modules, which runs here only confined; the gap
    names the file and the flag that running it in the user's process needs."""
    from onboard.gap.report import analyze
    from onboard.recognize.recognizer import recognize
    from onboard.release.manifest import read_manifest

    manifest = read_manifest(kimi_k3_release("bf16"))
    own = [o for o in analyze(recognize(manifest), manifest).ops if o.covers.endswith(":own_module")]
    assert own and all(o.status == "missing" for o in own)
    assert all("modeling_kimi_k3.py" in o.detail and "--trust-remote-code" in o.detail for o in own), own


def test_a_quantized_release_with_plain_code_is_decoded_for_it(stored_example_release, tmp_path):
    """gpt-oss in MXFP4 shipping code of plain weights (transformers' classes, unchanged): the worker builds its
    class without the quantizer and loads the stored weights decoded by our fp64 decoders; tier 2 passes."""
    release = Path(shutil.copytree(stored_example_release("gpt_oss", "mxfp4"), tmp_path / "release"))
    (release / "configuration_acme.py").write_text("from transformers import GptOssConfig\n\n\n"
                                                   "class AcmeConfig(GptOssConfig):\n    model_type = 'gpt_oss'\n")
    (release / "modeling_acme.py").write_text("from transformers import GptOssForCausalLM\n\n"
                                              "from .configuration_acme import AcmeConfig\n\n\n"
                                              "class AcmeForCausalLM(GptOssForCausalLM):\n    config_class = AcmeConfig\n")
    config = json.loads((release / "config.json").read_text())
    (release / "config.json").write_text(json.dumps({**config, "auto_map": AUTO_MAP}))
    report = run_alignment(write_package(release, tmp_path / "pkg")[0], [2])
    assert report.passed, _failed(report)
    assert any(c.name == "training/not-aligned" for t in report.tiers for c in t.checks)
