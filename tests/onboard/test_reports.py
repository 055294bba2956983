"""Figures in the reports a reviewer reads (PR.md): no `None` in a table, no estimate a tiny model cannot reach, and
words that say what happened (issue 55 item 7)."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from onboard.package.writer import write_package
from onboard.plan.cost import KERNELS_PER_LAYER_PASS, LAUNCH_S
from onboard.review.pr import render_pr
from runtime.spec import ModelSpec
from tests.package_status import record_alignment_passed


def test_pr_md_of_a_tiny_model_on_16_gpus(example_release, tmp_path):
    """qwen3_next's tiny release (8 experts, 4 layers) planned for 16 GPUs: ep 16 cannot hold 8 experts, a rejected
    mesh with no memory or time (its row read "| no | None | None | None |"); the step estimates of a 64-wide model
    came out in microseconds (1.1 billion tokens/s); with no gap, no operator was attempted ("None accepted.")."""
    pkg, report = write_package(example_release("qwen3_next"), tmp_path / "pkg", gpus=16)
    # the status and reasons the graph records before it renders PR.md
    record_alignment_passed(pkg)
    spec = ModelSpec.model_validate_json((pkg / "spec.json").read_text())
    text = render_pr(pkg, spec, report, [], 0)
    rows = [line for line in text.splitlines() if re.match(r"\| dp\d+xep\d+ \|", line)]
    rejected = next(row for row in rows if row.startswith("| dp1xep16 |"))
    assert "| no | - | - | - |" in rejected and "None" not in rejected, rejected
    assert not [row for row in rows if "None" in row], rows
    assert "None accepted." not in text and "None: no gap called for one." in text
    plan = yaml.safe_load((pkg / "plan.yaml").read_text())
    floor = spec.num_layers * 2 * KERNELS_PER_LAYER_PASS * LAUNCH_S
    # plan.yaml keeps 4 significant digits
    assert plan["chosen"]["step_s"]["step"] >= floor * (1 - 1e-3)
    per_gpu = plan["chosen"]["tokens_per_s"] / 16
    assert per_gpu < 1e7, per_gpu


def test_an_expert_load_collapse_is_named(capsys):
    """The demo's own run (30 steps at seq 128): layer 3's routing ended with expert 1 taking about half of the
    routed pairs and 5 of 8 experts nearly idle while its plot showed it and nothing said so. These lines carry
    the shares that run logged (per step, 256 routed pairs per layer); layer 0 stays even."""
    even = [32, 33, 31, 32, 32, 32, 32, 32]
    collapsed = [3, 124, 82, 2, 2, 38, 3, 2]
    train = [{"step": s, "expert_counts": {"0": even, "3": even if s <= 10 else collapsed}} for s in range(1, 31)]
    from onboard.commands.demo import _print_collapses
    from runtime.train.metrics import load_collapses

    found = load_collapses(train)
    assert [(c["layer"], c["expert"], c["idle"], c["first_step"], c["last_step"]) for c in found] == [(3, 1, 5, 21, 30)]
    _print_collapses(train, Path("run/expert_load.png"))
    out = capsys.readouterr().out
    assert out.startswith("expert load collapsed in layer 3: expert 1 took 48% of the routed pairs over steps 21-30 "
                          "(3.9x the mean; 5 of 8 experts under a quarter of an even share)\n"), out
    assert "run/expert_load.png" in out
