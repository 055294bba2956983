"""`onboard align PKG --check`: every check of the tiers run now against alignment/baseline.json.

A regression is a baseline check that passed and now does not pass (or is gone), or one whose metric moved
toward its tolerance by more than HEADROOM_SHARE of the room the baseline left (tolerance minus baseline
value): with a baseline of 1e-7 under a 1e-5 bar, a value above about 5e-6 is a regression while it still
passes. Half the headroom is far above run-to-run noise of a fixed-seed run (thread counts, BLAS) and
still catches a change that has eaten half the margin before it turns into a failure. A move of less than
NOISE_SHARE of the tolerance is never a regression while the check passes (metrics where lower is better): a
bf16 check that sits at 92% of its bar has 4% of the bar as half its headroom, which another machine's BLAS or
thread count can move it by. `info` and `skip`
checks carry no verdict and are not judged; checks the baseline lacks (a new kernel on a GPU) neither.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from onboard import package_io
from onboard.align.report import AlignmentReport, Check
from onboard.errors import BadInput
from onboard.package.files import require_package_folder

HEADROOM_SHARE = 0.5
NOISE_SHARE = 0.05
# metrics where a larger value is better (the share of the reference's selected keys found)
HIGHER_IS_BETTER = {"selection_overlap"}


@dataclass(frozen=True)
class Regression:
    name: str
    detail: str  # what changed, with the numbers

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


def read_baseline(pkg: Path) -> AlignmentReport:
    """alignment/baseline.json; a regression check without one cannot fail, so its absence is bad input."""
    require_package_folder(Path(pkg))
    path = Path(pkg) / "alignment" / "baseline.json"
    if not os.path.lexists(path):
        raise BadInput(path, None, "missing: --check needs a baseline; run `onboard align` once without --check "
                                       "and commit alignment/baseline.json")
    try:
        return AlignmentReport.model_validate_json(package_io.read_text(Path(pkg), path))
    except ValueError as err:
        raise BadInput(path, None, f"not a valid alignment report: {str(err).splitlines()[0]}")


def regressions(baseline: AlignmentReport, report: AlignmentReport) -> list[Regression]:
    """The baseline's passing checks, of the tiers `report` ran, that regressed (see the module docstring)."""
    now = {c.name: c for t in report.tiers for c in t.checks}
    tiers_run = {t.tier for t in report.tiers}
    found = []
    for before in (c for t in baseline.tiers if t.tier in tiers_run for c in t.checks if c.verdict == "pass"):
        after = now.get(before.name)
        regression = _compare(before, after)
        if regression is not None:
            found.append(regression)
    return found


def _compare(before: Check, after: Check | None) -> Regression | None:
    if after is None:
        return Regression(before.name, "passed in the baseline, not run now")
    numbers = f"{before.metric} {before.value:.3e} -> {after.value:.3e} (tolerance {before.tolerance:.1e})"
    if after.verdict != "pass":
        return Regression(before.name, f"pass -> {after.verdict}, {numbers}")
    used = headroom_used(before, after)
    if used > HEADROOM_SHARE and not _within_noise(before, after):
        return Regression(before.name, f"{numbers}: {used:.0%} of the baseline's headroom to the tolerance used "
                                       f"(limit {HEADROOM_SHARE:.0%})")
    return None


def _within_noise(before: Check, after: Check) -> bool:
    if before.metric in HIGHER_IS_BETTER:
        return False
    return after.value - before.value <= NOISE_SHARE * before.tolerance


def headroom_used(before: Check, after: Check) -> float:
    """How far the value moved toward the tolerance, as a share of the baseline's distance to it (<= 0: better)."""
    sign = -1.0 if before.metric in HIGHER_IS_BETTER else 1.0
    worse = sign * (after.value - before.value)
    room = sign * (before.tolerance - before.value)
    if not math.isfinite(worse):
        return math.inf
    if room <= 0:
        # the baseline sat on its tolerance: any worsening uses more than all of the room
        return math.inf if worse > 0 else 0.0
    return worse / room
