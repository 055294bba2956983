"""What `align` shows while and after it runs: per-check-group progress (rich bars on a terminal, plain
lines otherwise) and a summary that counts pass, fail, skip and info apart."""
from __future__ import annotations

import io
import os
import pty
import sys

from rich.console import Console

from onboard.align.progress import Progress, RichProgress, progress_on_stderr
from onboard.align.report import AlignmentReport, Check, tier_result
from onboard.align.tiers.tier0_ops import tier0


def _check(name: str, verdict: str) -> Check:
    return Check(tier=0, name=name, metric="rel_rms", value=0.0, tolerance=1e-4, verdict=verdict)


def test_the_summary_counts_each_verdict_apart():
    tier = tier_result(0, [_check("a", "pass"), _check("b", "pass"), _check("c", "skip"), _check("d", "info")])
    report = AlignmentReport(package="p", source="s", spec_hash="0" * 16, tiers=[tier], passed=True)
    assert report.summary_line() == "tier 0: pass (2 pass, 0 fail, 1 skip, 1 info)"
    failing = tier_result(1, [_check("a", "fail"), _check("b", "skip")])
    assert failing.summary() == "tier 1: FAIL (0 pass, 1 fail, 1 skip, 0 info)"


def test_plain_lines_name_every_op_group_of_tier0(example_package):
    """Tier 0 of a real spec announces its groups up front and names each as it starts."""
    from runtime.spec import ModelSpec

    spec = ModelSpec.model_validate_json((example_package("mixtral") / "spec.json").read_text())
    lines = []
    progress = Progress(lines.append)
    progress.start_tier(0)
    tier0(spec, T=9, progress=progress)
    groups = [line for line in lines if line.startswith("tier 0 [")]
    assert groups == [f"tier 0 [{i}/5]: {op}" for i, op in
                      enumerate(["rms_norm", "softmax_attention", "rope", "moe_router", "moe_experts"], 1)]


def test_rich_bars_on_a_terminal_show_the_group():
    out = io.StringIO()
    progress = RichProgress(Console(file=out, force_terminal=True, width=100))
    progress.start_tier(1)
    progress.plan(2)
    progress.group("layer 0 ([softmax]+moe)")  # brackets are shown, not read as markup
    progress.group("layer 1 (softmax+moe)")
    progress.end_tier("tier 1: pass (4 pass, 0 fail, 0 skip, 0 info)")
    text = out.getvalue()
    assert "tier 1: layer 0 ([softmax]+moe)" in text and "tier 1: layer 1" in text
    assert "1/2" in text and text.rstrip().endswith("tier 1: pass (4 pass, 0 fail, 0 skip, 0 info)")


def test_rich_on_a_terminal_plain_lines_on_a_pipe(monkeypatch):
    """stderr a real pseudo-terminal, then a real pipe."""
    main_fd, child_fd = pty.openpty()
    with os.fdopen(child_fd, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        assert isinstance(progress_on_stderr(), RichProgress)
    os.close(main_fd)
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "w") as pipe:
        monkeypatch.setattr(sys, "stderr", pipe)
        chosen = progress_on_stderr()
        chosen.note("aligning")
    with os.fdopen(read_fd) as pipe:
        assert type(chosen) is Progress and pipe.read() == "aligning\n"
