"""bench/bench_plan_memory.py --tiny: the CPU run of the memory-estimate check (the H200 run compares peaks)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_trains_every_case_and_writes_the_estimates(example_release, example_package, tmp_path):
    """Both seq lens x both policies train a step on the CPU; the JSON has each case's estimate and its breakdown,
    and no measured peak (the CPU has none to compare)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "release").symlink_to(example_release("qwen3_next"))
    (work / "pkg").symlink_to(example_package("qwen3_next"))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_plan_memory.py"), "--tiny", "--work", str(work),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "plan-memory.json").read_text())
    cases = {(c["seq_len"], c["policy"]): c for c in result["cases"]}
    assert set(cases) == {(64, "none"), (64, "recompute"), (128, "none"), (128, "recompute")}
    for case in cases.values():
        parts = sum(v for k, v in case["estimate"].items() if k not in ("total", "capacity", "experts", "workspace"))
        assert case["trainable"] > 0 and abs(case["estimate_gib"] - parts) < 1e-9
        assert case["estimate_total_gib"] == case["estimate"]["total"]
        assert case["measured_gib"] is None and case["rel_err"] is None
    assert cases[(128, "none")]["estimate"]["activations"] > cases[(128, "recompute")]["estimate"]["activations"]
    assert "estimate GiB" in done.stdout and result["command"].endswith("--tiny")
