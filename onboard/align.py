"""`onboard align PKG`: run the alignment tiers in order, each only when the one below passed, and
write PKG/alignment/report.json (plus baseline.json on the first passing run; --check compares)."""
from __future__ import annotations

import traceback
from pathlib import Path

import torch

from onboard.align_model import distinct_layers, tier1, tier2
from onboard.align_ops import tier0
from onboard.align_reference import read_package
from onboard.align_report import AlignmentReport, Check, tier_result
from onboard.align_vision import vision_checks
from onboard.errors import OnboardError

# Alignment of large releases runs a prefix of the model (both sides) holding every distinct layer kind.
MAX_ALIGN_LAYERS = 8


def layers_to_run(spec: dict, max_layers: int = MAX_ALIGN_LAYERS) -> int:
    """At most max_layers, but never fewer than the prefix that holds every distinct layer kind."""
    kinds = distinct_layers(spec, spec["num_layers"])
    return max(max(kinds.values()) + 1, min(spec["num_layers"], max_layers))


def run(pkg: Path, tiers: list[int], tamper=None, progress=print, max_layers: int = MAX_ALIGN_LAYERS) -> AlignmentReport:
    pkg = Path(pkg)
    if not (pkg / "package.yaml").exists():
        raise OnboardError(pkg, "package.yaml", "not a package written by `onboard new-model`")
    spec, weight_map, source = read_package(pkg)
    num_layers = layers_to_run(spec, max_layers)
    if num_layers < spec["num_layers"]:
        progress(f"aligning the first {num_layers} of {spec['num_layers']} layers (every distinct layer kind is among them)")
    torch.manual_seed(0)
    results, divergence = [], None
    for tier in sorted(tiers):
        if results and not results[-1].passed:
            progress(f"tier {tier}: skipped (tier {results[-1].tier} failed)")
            break
        progress(f"tier {tier}: running")
        try:
            checks, found = _run_tier(tier, spec, weight_map, source, pkg, num_layers, tamper)
            divergence = divergence or found
        except Exception as err:  # a load or run failure is a failed check, never a traceback
            checks = [failure_check(tier, err)]
        results.append(tier_result(tier, checks))
        progress(f"tier {tier}: {'pass' if results[-1].passed else 'FAIL'} ({results[-1].num_failed} of {len(checks)} checks failed)")
    report = AlignmentReport(package=str(pkg.resolve()), source=str(source), spec_hash=spec_hash(pkg), tiers=results,
                             first_divergence=divergence, passed=all(t.passed for t in results) and len(results) == len(tiers))
    _write(pkg, report)
    return report


def _run_tier(tier: int, spec, weight_map, source, pkg, num_layers, tamper):
    if tier == 0:
        return tier0(spec), None
    if tier == 1:
        return tier1(spec, weight_map, source, num_layers), None
    if tier == 2:
        checks, divergence = tier2(spec, weight_map, source, num_layers, tamper=tamper)
        if spec.get("vision"):
            checks += vision_checks(spec, weight_map, source, pkg, num_layers)
        return checks, divergence
    raise OnboardError(None, "--tiers", f"tier {tier} is not available here (0, 1, 2)")


def failure_check(tier: int, err: Exception) -> Check:
    """What failed and where: the message (naming the tensor or module) and the innermost frame."""
    frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    at = f" at {Path(frame.filename).name}:{frame.lineno} ({frame.name})" if frame else ""
    return Check(tier=tier, name=f"tier{tier}/run", metric="-", value=float("inf"), tolerance=0.0, verdict="fail",
                 detail=f"{type(err).__name__}: {str(err)[:300]}{at}")


def spec_hash(pkg: Path) -> str:
    import yaml

    return yaml.safe_load((pkg / "package.yaml").read_text())["spec_hash"]


def _write(pkg: Path, report: AlignmentReport) -> None:
    folder = pkg / "alignment"
    folder.mkdir(exist_ok=True)
    (folder / "report.json").write_text(report.model_dump_json(indent=2))
    for tier in report.tiers:
        (folder / f"tier{tier.tier}.json").write_text(tier.model_dump_json(indent=2))
    if report.passed and not (folder / "baseline.json").exists():
        (folder / "baseline.json").write_text(report.model_dump_json(indent=2))


def regressions(pkg: Path, report: AlignmentReport) -> list[str]:
    """Checks that passed in baseline.json and do not pass now (or are gone)."""
    baseline_path = Path(pkg) / "alignment" / "baseline.json"
    if not baseline_path.exists():
        raise OnboardError(baseline_path, None, "no baseline to check against: run `onboard align` once without --check")
    baseline = AlignmentReport.model_validate_json(baseline_path.read_text())
    now = {c.name: c for t in report.tiers for c in t.checks}
    return [c.name for t in baseline.tiers for c in t.checks
            if c.verdict == "pass" and (c.name not in now or now[c.name].verdict != "pass")]
