"""Hostile candidates are refused by the static rules or contained by the sandbox, with the reason reported;
the parent (this test) survives. The reference is the model's own activation (transformers' ACT2FN)."""
from __future__ import annotations

import pytest

from agents.candidates import CandidateAnswer, render
from agents.sandbox import Limits
from agents.state import Candidate, OpTask
from agents.validate import validate

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


def test_a_candidate_writing_outside_its_folder_crashes_contained(tmp_path):
    outside = tmp_path / "escaped.txt"
    code = (f"def op(x):\n    with torch.serialization._open_file_like({str(outside)!r}, 'wb') as f:\n"
            "        f.write(b'x')\n    return torch.relu(x) ** 2")
    verdict = validate(TASK, _free_form(code), tmp_path / "w", SALT)
    assert verdict.failures[0].check == "crash" and not outside.exists()
    assert "PermissionError" in verdict.failures[0].detail or "Read-only" in verdict.failures[0].detail

