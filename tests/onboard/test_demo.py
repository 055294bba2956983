"""`onboard demo`, the README's first command, end to end in its own process as a user runs it (fewer
training steps than the default 30 to keep the suite short; the full-length run is timed in docs/cli.md)."""
from __future__ import annotations

import json
import subprocess
import sys

from onboard.commands.demo import MARKER


def test_demo_runs_the_whole_loop(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "onboard.cli", "demo", "--out", str(out), "--steps", "4"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "transformers + peft with the exported adapter vs our runtime" in result.stdout
    assert ": pass;" in result.stdout, result.stdout
    for path in ("package/PR.md", "package/gap_report.md", "package/alignment/report.json", "run/loss.png",
                 "run/expert_load.png", "adapter/adapter_config.json", "adapter/adapter_model.safetensors"):
        assert (out / path).exists(), path
    for printed in ("package/PR.md", "package/gap_report.md", "run/loss.png", "adapter"):
        assert str(out / printed) in result.stdout, printed
    steps = [line for line in map(json.loads, (out / "run" / "metrics.jsonl").read_text().splitlines())
             if line["kind"] == "train"]
    assert len(steps) == 4


def test_demo_refuses_a_folder_it_did_not_write(tmp_path, onboard_cli):
    (tmp_path / "notes.txt").write_text("mine")
    for flags in ((), ("--force",)):
        refused = onboard_cli("demo", "--out", tmp_path, *flags)
        assert refused.code == 2 and "not written by a demo" in refused.err and len(refused.err.splitlines()) == 1
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_demo_asks_for_force_to_replace_an_earlier_demo(tmp_path, onboard_cli):
    (tmp_path / MARKER).write_text("")
    (tmp_path / "release").mkdir()
    refused = onboard_cli("demo", "--out", tmp_path)
    assert refused.code == 2 and "--force" in refused.err
