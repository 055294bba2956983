"""Figures in the reports a reviewer reads (PR.md): no `None` in a table, no estimate a tiny model cannot reach, and
words that say what happened (issue 55 item 7)."""
from __future__ import annotations

import re

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
