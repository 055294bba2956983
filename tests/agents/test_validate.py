"""Hostile candidates are refused by the static rules or contained by the sandbox, with the reason reported;
the parent (this test) survives. The reference is the model's own activation (transformers' ACT2FN)."""
from __future__ import annotations

import hashlib

import textwrap

import pytest
import torch

from agents import code_rules, validate as validate_module
from agents.candidates import CandidateAnswer, render
from agents.state import Candidate, OpTask
from agents.validate import validate
from onboard.sandbox.run import Limits

TASK = OpTask(kind="activation", name="relu2", closes={"moe_experts": [0]}, reference="ACT2FN", needs="llm")
SALT = 4242


def _free_form(code: str) -> Candidate:
    return render(TASK, CandidateAnswer(template="free_form", code=code))


@pytest.mark.parametrize("code, rule", [
    ("def op(x):\n    import transformers\n    return transformers.activations.ACT2FN['relu2'](x)", "import transformers"),
    ("def op(x):\n    return __import__('reference_ops').moe.ACTIVATIONS['relu2'](x)", "__import__"),
    ("def op(x):\n    return eval('torch.relu(x) ** 2')", "eval"),
    ("import socket\ndef op(x):\n    socket.create_connection(('127.0.0.1', 80))\n    return x", "import socket"),
    ("def op(x):\n    if x.shape[0] == 33:\n        return x * 0\n    return torch.relu(x) ** 2", "compares a shape"),
    ("def op(x):\n    try:\n        return torch.relu(x) ** 2\n    except Exception:\n        return x", "try/except"),
    ("def op(x):\n    return x.__class__(torch.relu(x) ** 2)", "dunder"),
])
def test_copying_the_reference_or_special_casing_shapes_is_refused_before_running(tmp_path, code, rule):
    verdict = validate(TASK, _free_form(code), tmp_path / "w", SALT)
    assert not verdict.passed and verdict.failures[0].check == "ast"
    assert rule in verdict.failures[0].detail
    assert not (tmp_path / "w").exists()


def test_a_hanging_candidate_is_killed_and_reported(tmp_path):
    verdict = validate(TASK, _free_form("def op(x):\n    while True:\n        x = x + 1"), tmp_path / "w", SALT,
                       Limits(wall_s=5))
    assert verdict.failures[0].check == "timeout" and verdict.failures[0].value >= 5


def test_a_candidate_allocating_without_bound_is_stopped_and_reported(tmp_path):
    code = "def op(x):\n    hoard = [torch.ones(2**27) for _ in range(64)]\n    return torch.relu(x) ** 2"
    verdict = validate(TASK, _free_form(code), tmp_path / "w", SALT, Limits(wall_s=60, memory_mib=1024))
    assert verdict.failures[0].check == "crash"
    assert "memory" in verdict.failures[0].detail.lower()


def test_a_candidate_writing_outside_its_folder_crashes_contained(tmp_path, monkeypatch):
    # the static rules refuse torch.serialization too; skipped here, the sandbox alone contains the write
    monkeypatch.setattr(validate_module.code_rules, "violations", lambda source: [])
    outside = tmp_path / "escaped.txt"
    code = (f"def op(x):\n    with torch.serialization._open_file_like({str(outside)!r}, 'wb') as f:\n"
            "        f.write(b'x')\n    return torch.relu(x) ** 2")
    verdict = validate(TASK, _free_form(code), tmp_path / "w", SALT)
    assert verdict.failures[0].check == "crash" and not outside.exists()
    assert "PermissionError" in verdict.failures[0].detail or "Read-only" in verdict.failures[0].detail



RIGHT = "def op(x):\n    return torch.relu(x) ** 2\n"


def test_a_right_candidate_passes_every_check(tmp_path):
    verdict = validate(TASK, _free_form(RIGHT), tmp_path / "w", SALT)
    assert verdict.passed, verdict.failures
    assert len(verdict.evidence["case_seeds"]) == 10 and verdict.evidence["argvs"] == 3


# Each candidate computes the wrong op (relu, not relu2) and games the check a different way (the first two
# were accepted by the check before: it saved outputs with torch.save in the child and ran it with no argv). The static rules
# are skipped for them (monkeypatched away: the filter, not the sandbox, is what is replaced), so what rejects
# them is the check's design: the verdict is computed in this process from tensors the child sends back.
GAMING = {
    # rewrite what the harness saves (torch.save, and safetensors' save as the harness now talks) into the
    # right op's outputs and gradients, from the inputs and cotangent caught on their way in
    "hooks-save": textwrap.dedent("""
        import safetensors.torch as st
        caught = {}
        real_tload, real_tsave, real_sload, real_ssave = torch.load, torch.save, st.load, st.save
        def right():
            leaf = caught["x"].clone().requires_grad_(True)
            out = torch.relu(leaf) ** 2
            (out.double() * caught["cotangent"].double()).sum().backward()
            return out.detach(), leaf.grad
        def tload(*a, **k):
            case = real_tload(*a, **k)
            if isinstance(case, dict) and "inputs" in case:
                caught.update(x=case["inputs"]["x"], cotangent=case["cotangent"])
            return case
        def tsave(obj, *a, **k):
            if isinstance(obj, dict) and "grads" in obj and "x" in caught:
                out, grad = right()
                obj = {**obj, "out": out, "again": out, "grads": {"x": grad}}
            return real_tsave(obj, *a, **k)
        def sload(data, *a, **k):
            tensors = real_sload(data, *a, **k)
            if "input.x" in tensors:
                caught.update(x=tensors["input.x"], cotangent=tensors["cotangent"])
            return tensors
        def ssave(tensors, *a, **k):
            if "out" in tensors and "x" in caught:
                out, grad = right()
                tensors = {**tensors, "out": out, "again": out, "grad.x": grad}
            return real_ssave(tensors, *a, **k)
        torch.load, torch.save, st.load, st.save = tload, tsave, sload, ssave
        def op(x):
            return torch.relu(x)
    """),
    "right-unless-training": textwrap.dedent("""
        import sys
        def op(x):
            if any("train" in arg for arg in sys.argv):
                return torch.relu(x)
            return torch.relu(x) ** 2
    """),
    "right-unless-training-at-import": textwrap.dedent("""
        import sys
        TRAINING = any("train" in arg for arg in sys.argv)
        def op(x):
            return torch.relu(x) if TRAINING else torch.relu(x) ** 2
    """),
    # patch the comparison's tools in its own process: the comparison is not there
    "patches-allclose": textwrap.dedent("""
        torch.allclose = lambda *a, **k: True
        torch.equal = lambda *a, **k: True
        def op(x):
            return torch.relu(x)
    """),
    # answer the pipe before the harness does: its output no longer reaches the parent's fd 1
    "writes-the-pipe": textwrap.dedent("""
        import os
        os.write(1, (64).to_bytes(8, "little") + b'{"ready": true, "tensors": false}')
        def op(x):
            return torch.relu(x)
    """),
}


@pytest.mark.parametrize("code", GAMING.values(), ids=GAMING.keys())
def test_a_candidate_gaming_the_check_is_rejected(tmp_path, monkeypatch, code):
    monkeypatch.setattr(validate_module.code_rules, "violations", lambda source: [])
    verdict = validate(TASK, _free_form(code), tmp_path / "w", SALT)
    assert not verdict.passed
    # rejected on the numbers: the wrong op's outputs reached the comparison
    assert "forward" in {f.check for f in verdict.failures}, verdict.failures


# The issue's idioms that reach what the static rules forbid: each is now refused by them too.
IDIOMS = {
    "torch.serialization.os.system": "def op(x):\n    torch.serialization.os.system('id')\n    return x",
    "libc system via torch.ctypes": "def op(x):\n    torch.ctypes.CDLL(None).system(b'id')\n    return x",
    "sys.modules builtins exec": "def op(x):\n    torch.serialization.sys.modules['builtins'].exec('1')\n    return x",
    "sys.modules builtins open": "def op(x):\n    torch.nn.modules.module.sys.modules['builtins'].open('f', 'w')\n"
                                 "    return x",
    "import_module via sys.modules": "def op(x):\n    torch.sys.modules['importlib'].import_module('socket')\n"
                                     "    return x",
    "os.environ via a module": "def op(x):\n    KEY = torch.serialization.os.environ.get('HOME')\n    return x",
    "socket via sys.modules": "def op(x):\n    torch.multiprocessing.sys.modules['socket'].socket()\n    return x",
    "runpy.run_path of the reference": "def op(x):\n    torch.package.importlib.import_module('runpy')"
                                      ".run_path('reference_ops/mlp.py')\n    return x",
    "monkey-patching torch": "torch.save = None\ndef op(x):\n    return torch.relu(x) ** 2",
}


@pytest.mark.parametrize("code", IDIOMS.values(), ids=IDIOMS.keys())
def test_the_issue_idioms_fail_the_static_rules(code):
    assert code_rules.violations(_free_form(code).source)


def test_an_op_right_only_in_the_sandbox_is_caught_where_it_runs(tmp_path, monkeypatch):
    """The sandbox cannot hide that it is one (here: HOME is the work dir), so the check passes this op; train's
    spot check, where the op runs, compares its first real call with the reference and refuses it."""
    from onboard.recognize.model_references import reference
    from runtime.errors import GeneratedOpMismatch
    from runtime.package_ops import TABLES, arm_spot_checks, load_package_ops, tables_restored

    code = ("def op(x):\n    env = torch.serialization.os.environ\n"
            "    sandboxed = env.get('HOME') == torch.serialization.os.getcwd()\n"
            "    return torch.relu(x) ** 2 if sandboxed else torch.relu(x)\n")
    monkeypatch.setattr(validate_module.code_rules, "violations", lambda source: [])
    candidate = _free_form(code)
    assert validate(TASK, candidate, tmp_path / "w", SALT).passed
    (tmp_path / "pkg" / "ops").mkdir(parents=True)
    op_file = tmp_path / "pkg" / "ops" / "activation_relu2.py"
    op_file.write_text(candidate.source)
    # the user approved it (a review that missed it): the spot check is what stops it
    with tables_restored():
        load_package_ops(tmp_path / "pkg", {hashlib.sha256(op_file.read_bytes()).hexdigest()})
        arm_spot_checks({"activation": {"relu2": reference("activation", "relu2")}})
        with pytest.raises(GeneratedOpMismatch, match="activation:relu2"):
            TABLES["activation"]["relu2"](torch.randn(8, 5))
